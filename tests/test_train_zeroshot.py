"""Zero-shot classification of the user's own ImageFolder during training: `train --zeroshot-data DIR
--zeroshot-frequency N` logs `zeroshot/<folder name>/top1` and `top5` before training, every N epochs and at the
end, to every sink, the summary table and the plot; the values are `eval --zero-shot-data`'s on the checkpoint;
bad input stops the run before it starts, naming the flag."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from naflexclip.cli import main
from naflexclip.evaluation.zero_shot import zero_shot_classify
from naflexclip.families.factory import create_model
from naflexclip.train.evaluator import folder_zero_shot_metrics
from naflexclip.train.report import summary_table

COLOURS = {"blue": (20, 40, 230), "green": (30, 200, 40), "purple": (150, 40, 180), "red": (230, 30, 30),
           "white": (245, 245, 245), "yellow": (240, 230, 30)}
FLAGS = ["--model", "tiny", "--warmup", "2", "--device", "cpu", "--synthetic-train-size", "96",
         "--synthetic-val-size", "24", "--naflex-seq-lens", "16", "32", "--naflex-max-tokens-per-batch", "256",
         "--workers", "0", "--zero-shot-samples", "16"]


def colour_folder(root: Path, per_class: int = 2) -> Path:
    """An ImageFolder of flat coloured images (with a little noise), one sub-folder per colour."""
    rng = np.random.default_rng(0)
    for name, rgb in COLOURS.items():
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            size = (int(rng.integers(24, 64)), int(rng.integers(24, 64)))
            pixels = np.clip(np.array(rgb) + rng.normal(0, 8, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{index}.png")
    return root


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _zeroshot_evals(run_dir: Path, name: str) -> list[dict]:
    return [r for r in _records(run_dir) if r["kind"] == "eval" and f"zeroshot/{name}/top1" in r]


@pytest.mark.parametrize("classes", [6, 3])
def test_folder_task_reports_eval_s_classification(tmp_path: Path, classes: int) -> None:
    """The task's top1 / top5 are `zero_shot_classify`'s (what `eval --zero-shot-data` prints) under the folder's
    name; with fewer than 5 classes top-5 counts them all; undecodable files are handed back as skip records."""
    folder = colour_folder(tmp_path / "my colours")
    for name in sorted(COLOURS)[classes:]:
        for path in (folder / name).iterdir():
            path.unlink()
        (folder / name).rmdir()
    (folder / "blue" / "broken.png").write_bytes(b"not a png")
    model = create_model("tiny")
    skips: list[dict] = []
    metrics = folder_zero_shot_metrics(model, str(folder), seq_len=32, hf_processor=None, classnames=None,
                                       templates=["a {} picture."], device="cpu", autocast=nullcontext,
                                       skip_records=skips)
    expected = zero_shot_classify(model, folder, seq_len=32, templates=["a {} picture."])
    assert metrics == {"zeroshot/my colours/top1": expected["top1"],
                       "zeroshot/my colours/top5": expected["top5"] if classes >= 5 else 1.0,
                       "zeroshot/my colours/chance": 1 / classes}
    assert [Path(record["key"]).name for record in skips] == ["broken.png"]


def test_summary_table_has_each_folder_s_zeroshot_before_and_after() -> None:
    first = {"zeroshot/pets/top1": 0.25, "zeroshot/pets/top5": 0.5, "zeroshot/pets/chance": 0.1}
    last = {"zeroshot/pets/top1": 0.75, "zeroshot/pets/top5": 1.0, "zeroshot/pets/chance": 0.1}
    rows = [line.split() for line in summary_table(first, last, {}).splitlines()]
    assert ["zeroshot/pets/top1", "0.250", "0.750", "0.100"] in rows
    assert ["zeroshot/pets/top5", "0.500", "1.000", "0.500"] in rows
    assert not any(row[0] == "zeroshot/pets/chance" for row in rows)


@pytest.mark.slow
def test_zeroshot_every_epoch_in_every_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--zeroshot-frequency 1, 2 epochs: before training and after each epoch, in metrics.jsonl, TensorBoard, the
    summary table and curves.png; the last equals `eval --zero-shot-data` on the final checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = colour_folder(tmp_path / "colours")
    (tmp_path / "names.txt").write_text("\n".join(f"{c} thing" for c in sorted(COLOURS)) + "\n")
    (tmp_path / "templates.txt").write_text("a {}.\na photo of a {}.\n")
    files = ["--zeroshot-classnames", str(tmp_path / "names.txt"), "--zeroshot-templates",
             str(tmp_path / "templates.txt")]
    assert main(["train", *FLAGS, "--epochs", "2", "--logs", str(tmp_path / "logs"), "--name", "run",
                 "--zeroshot-data", str(folder), "--zeroshot-frequency", "1", *files,
                 "--report-to", "tensorboard"]) == 0
    run = tmp_path / "logs" / "run"
    evals = _zeroshot_evals(run, "colours")
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    for record in evals:
        assert 0 <= record["zeroshot/colours/top1"] <= record["zeroshot/colours/top5"] <= 1
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("zeroshot/colours/")}
    for metric in ("top1", "top5"):
        key = f"zeroshot/colours/{metric}"
        assert table[key][:2] == [f"{evals[0][key]:.3f}", f"{evals[-1][key]:.3f}"]
    assert table["zeroshot/colours/top1"][2] == f"{1 / 6:.3f}" and table["zeroshot/colours/top5"][2] == f"{5 / 6:.3f}"
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("zeroshot/colours/top1")] == pytest.approx(
        [r["zeroshot/colours/top1"] for r in evals])

    # the same images, class names, templates and patch budget through `naflexclip eval`
    result = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run / "checkpoints" / "epoch_2"), "--zero-shot-data", str(folder),
                 "--zero-shot-classnames", str(tmp_path / "names.txt"), "--zero-shot-templates",
                 str(tmp_path / "templates.txt"), "--output", str(result), "--device", "cpu"]) == 0
    evaluated = json.loads(result.read_text())
    assert evaluated["top1"] == evals[-1]["zeroshot/colours/top1"]
    assert evaluated["top5"] == evals[-1]["zeroshot/colours/top5"]


@pytest.mark.slow
def test_zeroshot_frequency_2_runs_every_second_epoch_and_at_the_end(tmp_path: Path) -> None:
    """OpenCLIP's --zeroshot-frequency: after epochs that are a multiple of N, and after the last; the retrieval
    evaluation keeps its own --val-frequency."""
    folder = colour_folder(tmp_path / "colours", per_class=1)
    assert main(["train", *FLAGS, "--epochs", "3", "--logs", str(tmp_path / "logs"), "--name", "run", "--no-plot",
                 "--zeroshot-data", str(folder), "--zeroshot-frequency", "2", "--synthetic-train-size", "32",
                 "--synthetic-val-size", "8"]) == 0
    run = tmp_path / "logs" / "run"
    assert [r["epoch"] for r in _zeroshot_evals(run, "colours")] == [0, 2, 3]
    assert [r["epoch"] for r in _records(run) if r["kind"] == "eval" and "val/image_to_text_R@1" in r] == [0, 1, 2, 3]


def test_zeroshot_frequency_0_never_classifies(tmp_path: Path) -> None:
    folder = colour_folder(tmp_path / "colours", per_class=1)
    assert main(["train", *FLAGS, "--epochs", "1", "--logs", str(tmp_path / "logs"), "--name", "run", "--no-plot",
                 "--zeroshot-data", str(folder), "--zeroshot-frequency", "0", "--synthetic-train-size", "32"]) == 0
    run = tmp_path / "logs" / "run"
    evals = [r for r in _records(run) if r["kind"] == "eval"]
    assert len(evals) == 2 and all("val/image_to_text_R@1" in r for r in evals)
    assert not _zeroshot_evals(run, "colours")
    # 0 means never, as in OpenCLIP: the built-in data's zero-shot shape/colour tasks too, before training and after
    assert not [key for r in evals for key in r if key.startswith("zeroshot/")]


@pytest.mark.slow
def test_resume_keeps_the_zeroshot_history(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run stopped and resumed: its summary's "before" column is the evaluation before the first step."""
    folder = colour_folder(tmp_path / "colours", per_class=1)
    flags = [*FLAGS, "--epochs", "2", "--logs", str(tmp_path / "logs"), "--name", "run", "--no-plot",
             "--zeroshot-data", str(folder), "--zeroshot-frequency", "1"]
    assert main(["train", *flags, "--stop-after-steps", "3"]) == 0
    capsys.readouterr()
    assert main(["train", *flags, "--resume", "latest"]) == 0
    evals = _zeroshot_evals(tmp_path / "logs" / "run", "colours")
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    table = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()
             if line.startswith("zeroshot/colours/")}
    key = "zeroshot/colours/top1"
    assert table[key] == [f"{evals[0][key]:.3f}", f"{evals[-1][key]:.3f}"]


def test_an_empty_class_folder_is_reported_before_training(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """As `eval --zero-shot-data` reports it: one line naming the flag and the folder, before the first step."""
    folder = colour_folder(tmp_path / "colours", per_class=1)
    (folder / "black").mkdir()
    (folder / "grey").mkdir()
    assert main(["train", *FLAGS, "--epochs", "1", "--logs", str(tmp_path / "logs"), "--name", "run", "--no-plot",
                 "--zeroshot-data", str(folder), "--zeroshot-frequency", "1", "--synthetic-train-size", "32",
                 "--stop-after-steps", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [i for i, line in enumerate(err) if "empty class folders" in line]
    assert len(lines) == 1, err
    assert err[lines[0]] == (f"--zeroshot-data {str(folder)!r}: empty class folders (no images; not candidate "
                             "classes): black, grey")
    assert lines[0] < min(i for i, line in enumerate(err) if line.startswith("eval after step"))
    [first] = _zeroshot_evals(tmp_path / "logs" / "run", "colours")[:1]
    assert first["zeroshot/colours/chance"] == 1 / len(COLOURS)  # the empty ones are no candidates


@pytest.mark.parametrize(("setup", "flags", "message"), [
    (None, ["--zeroshot-data", "MISSING"], "--zeroshot-data"),
    ("no_classes", ["--zeroshot-data", "FOLDER"], "--zeroshot-data"),
    ("folder", ["--zeroshot-data", "FOLDER", "--zeroshot-classnames", "NAMES"], "--zeroshot-classnames"),
    ("folder", ["--zeroshot-data", "FOLDER", "--zeroshot-classnames", "MISSING"], "--zeroshot-classnames"),
    ("folder", ["--zeroshot-data", "FOLDER", "--zeroshot-templates", "TEMPLATES"], "--zeroshot-templates"),
    (None, ["--zeroshot-classnames", "NAMES"], "--zeroshot-classnames goes with --zeroshot-data"),
    ("folder", ["--zeroshot-data", "FOLDER", "--zeroshot-frequency", "-1"], "--zeroshot-frequency"),
])
def test_bad_zeroshot_input_is_one_line_before_training(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        setup: str | None, flags: list[str], message: str) -> None:
    folder = tmp_path / "folder"
    if setup == "folder":
        colour_folder(folder, per_class=1)
    elif setup == "no_classes":
        folder.mkdir()
        Image.new("RGB", (8, 8)).save(folder / "loose.png")
    (tmp_path / "names.txt").write_text("only one\n")
    (tmp_path / "templates.txt").write_text("no placeholder\n")
    paths = {"FOLDER": folder, "NAMES": tmp_path / "names.txt", "TEMPLATES": tmp_path / "templates.txt",
             "MISSING": tmp_path / "missing"}
    flags = [str(paths.get(flag, flag)) for flag in flags]
    assert main(["train", *FLAGS, "--logs", str(tmp_path / "logs"), "--name", "run", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("naflexclip train: error: ") and message in err[0], err
    assert not (tmp_path / "logs").exists()  # nothing started


@pytest.mark.slow
def test_two_processes_classify_on_the_main_rank(tmp_path: Path) -> None:
    """Under torchrun (gloo) the run finishes, with the zero-shot metrics logged once per evaluation."""
    from test_train_torchrun import torchrun

    folder = colour_folder(tmp_path / "colours", per_class=1)
    torchrun(tmp_path, "run", "--zeroshot-data", str(folder), "--zeroshot-frequency", "1", "--synthetic-train-size",
             "32")
    assert [r["epoch"] for r in _zeroshot_evals(tmp_path / "run", "colours")] == [0, 1]


def _imagenet_layout(root: Path, names: list[str], with_images: dict[int, tuple[int, int, int]]) -> Path:
    """An ImageNet-layout folder: one class folder per name (sorted = class index order for the val set), images
    in the classes of `with_images` only (class index -> colour)."""
    for i, name in enumerate(names):
        (root / name).mkdir(parents=True)
        if i in with_images:
            Image.fromarray(np.full((32, 40, 3), with_images[i], np.uint8)).save(root / name / "0.JPEG")
    return root


def test_imagenet_val_and_v2_classify_with_openclip_s_class_names_and_templates(tmp_path: Path) -> None:
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    from naflexclip.train.config.train_config import TrainConfig
    from naflexclip.train.evaluator import folder_zero_shot_tasks

    colours = {1: (230, 30, 30), 2: (20, 40, 230), 10: (30, 200, 40)}  # goldfish, great white shark, brambling
    val = _imagenet_layout(tmp_path / "val", [f"n{i:08d}" for i in range(1000)], colours)
    # imagenetv2_pytorch's layout: folders named by class index, under ImageNetV2-matched-frequency/
    v2 = _imagenet_layout(tmp_path / "v2" / "ImageNetV2-matched-frequency", [str(i) for i in range(1000)], colours)
    cfg = TrainConfig(model="tiny", imagenet_val=str(val), imagenet_v2=str(tmp_path / "v2"), zeroshot_frequency=1)
    model = create_model("tiny")
    tasks = folder_zero_shot_tasks(cfg, "cpu", nullcontext, print)
    assert [t.name for t in tasks] == ["zeroshot/imagenet-val", "zeroshot/imagenet-v2"]
    metrics = {k: v for t in tasks for k, v in t.run(model, []).items()}
    templates = [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]
    names = {i: IMAGENET_CLASSNAMES[i] for i in colours}  # class index -> OpenCLIP's name, in both layouts
    expected = zero_shot_classify(model, val, seq_len=max(cfg.data.naflex_seq_lens), templates=templates,
                                  classnames=list(IMAGENET_CLASSNAMES))
    assert sorted(expected["per_class_top1"]) == sorted(names.values())
    assert metrics["zeroshot/imagenet-val/top1"] == expected["top1"] == metrics["zeroshot/imagenet-v2/top1"]
    assert metrics["zeroshot/imagenet-val/chance"] == 1 / 3  # the classes with images are the candidates
    # v2's folders sort as strings (0, 1, 10, 100, ...) but are class indices
    from naflexclip.evaluation.zero_shot import imagenet_set

    v2_set = imagenet_set(tmp_path / "v2", "imagenet_v2")
    assert v2_set.root == v2 and v2_set.classnames[2] == IMAGENET_CLASSNAMES[10] == "brambling"
    assert imagenet_set(val, "imagenet_val").classnames[2] == IMAGENET_CLASSNAMES[2] == "great white shark"


@pytest.mark.parametrize(("flag", "layout", "message"), [
    ("imagenet_val", [f"n{i}" for i in range(5)], "has 5 class folders; ImageNet has 1000"),
    ("imagenet_v2", [f"c{i}" for i in range(1000)], "named 0..999"),
])
def test_imagenet_folders_are_checked_before_the_run(tmp_path: Path, flag, layout, message) -> None:
    from naflexclip.train.config.train_config import TrainConfig

    root = _imagenet_layout(tmp_path / "in", layout, {0: (1, 2, 3), 1: (4, 5, 6)})
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} .*{message}"):
        TrainConfig(model="tiny", **{flag: str(root)})


@pytest.mark.parametrize("frequency", ["1", "2"])  # OpenCLIP README's value, and its default given
def test_zeroshot_frequency_without_anything_to_classify_is_accepted_with_one_line(frequency: str) -> None:
    """OpenCLIP's README drops --imagenet-val to skip ImageNet zero-shot and keeps --zeroshot-frequency; OpenCLIP then
    classifies nothing. Here too: the flag is saved as given and the run's first lines say zero-shot does not run."""
    from naflexclip.cli import build_parser
    from naflexclip.train.config.flags import config_from_args
    from naflexclip.train.config.openclip_flags import first_lines

    args = build_parser().parse_args(["train", "--model", "tiny", "--zeroshot-frequency", frequency])
    cfg = config_from_args(args)
    assert cfg.zeroshot_frequency == int(frequency)
    notes = [line for line in first_lines(cfg.to_dict()) if line.startswith("--zeroshot-frequency")]
    assert notes == [f"--zeroshot-frequency {frequency}: OpenCLIP's flag is accepted; nothing to classify (no "
                     "--zeroshot-data / --imagenet-val / --imagenet-v2), so zero-shot does not run"]
    for flags in ([], ["--zeroshot-frequency", "0"]):  # not given, or never: nothing to say
        quiet = config_from_args(build_parser().parse_args(["train", "--model", "tiny", *flags]))
        assert not [line for line in first_lines(quiet.to_dict()) if line.startswith("--zeroshot-frequency")]


def test_zeroshot_frequency_0_without_zeroshot_data_is_accepted() -> None:
    """Turning zero-shot off is consistent with having no zero-shot data (an OpenCLIP command may say it)."""
    from naflexclip.cli import build_parser
    from naflexclip.train.config.flags import config_from_args

    args = build_parser().parse_args(["train", "--model", "tiny", "--zeroshot-frequency", "0"])
    assert config_from_args(args).zeroshot_frequency == 0

"""End to end: fine-tune a tiny random SigLIP 2 checkpoint with `train --pretrained` on the built-in data, audit the
result with `verify --checkpoint`, export it and reload it in transformers, and classify an ImageFolder zero-shot
with the run and with the imported directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from siglip2_cases import hf_features, make_checkpoint

from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.cli import main
from naflexclip.data.synthetic import SHAPES, zero_shot_sample
from naflexclip.evaluation.zero_shot import zero_shot_classify
from naflexclip.families import data_processing, siglip2
from naflexclip.models.run_weights import load_checkpoint_model

transformers = pytest.importorskip("transformers")

TRAIN_FLAGS = ["--epochs", "3", "--lr", "3e-4", "--warmup", "1", "--synthetic-train-size", "96",
               "--synthetic-val-size", "24", "--naflex-seq-lens", "16", "36", "--naflex-max-tokens-per-batch", "288",
               "--workers", "0", "--zero-shot-samples", "16", "--device", "cpu", "--no-plot"]


def _image_folder(root: Path, num_images: int = 21) -> Path:
    """The built-in single-object images, one sub-folder per shape (an ImageFolder)."""
    for index in range(num_images):
        image, _, labels = zero_shot_sample(0, index)
        folder = root / SHAPES[labels["shape"]]
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{index}.png")
    return root


@pytest.mark.slow
def test_fine_tune_verify_export_and_zero_shot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = make_checkpoint(tmp_path / "siglip2", seed=5)
    assert main(["train", "--pretrained", str(source), "--logs", str(tmp_path / "logs"), "--name", "run",
                 *TRAIN_FLAGS, "--val-frequency", "0"]) == 0  # evaluated before and after training only
    run = tmp_path / "logs" / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if r["kind"] == "train"]
    assert len(losses) >= 8
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses  # it learns (from ~5.8)
    capsys.readouterr()

    assert main(["verify", "--checkpoint", str(run / "checkpoints"), "--splits", "1"]) == 0  # (3 by default)
    assert "PASS" in capsys.readouterr().out

    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--format", "transformers", "--out",
                 str(out)]) == 0
    model, config = load_checkpoint_model(run / "checkpoints")
    assert config["data"]["hf_processor"] == str(source.resolve())
    hf = transformers.Siglip2Model.from_pretrained(out).eval()
    batch = random_naflex_batch(5, patch_size=4, context_length=model.context_length, seq_lens=(4, 12, 30),
                                dtype=torch.float32, vocab_size=model.vocab_size)
    with torch.no_grad():
        ours = model(image=batch["image"], text=batch["text"])
    theirs = hf_features(hf, batch["image"], batch["text"])
    assert max(float((ours[k].detach() - theirs[k]).abs().max()) for k in theirs) <= 1e-5
    # the exported processor gives the training behaviour: no text mask (tests/test_siglip2_text_mask.py)
    processor = transformers.AutoProcessor.from_pretrained(out, local_files_only=True)
    text = processor(text=["a red circle", "x"], padding="max_length", truncation=True,
                     max_length=model.context_length, return_tensors="pt")
    assert set(text) == {"input_ids"}
    with torch.no_grad():
        theirs_text = F.normalize(hf.get_text_features(**text).pooler_output, dim=-1)
        assert float((model.encode_text(text["input_ids"]) - theirs_text).abs().max()) <= 1e-5
    assert not torch.equal(siglip2.load(source).visual.embeds.proj.weight, model.visual.embeds.proj.weight)

    folder = _image_folder(tmp_path / "folder")
    for checkpoint, name in ((run / "checkpoints", "run"), (source, "imported")):
        results_path = tmp_path / f"zeroshot-{name}.json"
        assert main(["eval", "--checkpoint", str(checkpoint), "--zero-shot-data", str(folder),
                     "--zero-shot-output", str(results_path), "--device", "cpu"]) == 0
        results = json.loads(results_path.read_text())
        assert results["num_samples"] == 21 and set(results["per_class_top1"]) <= set(SHAPES)
        assert 0 <= results["top1"] <= results["top5"] <= 1
        assert "top-1" in capsys.readouterr().out


def test_zero_shot_accuracy_is_nearest_class_prompt(tmp_path: Path) -> None:
    """Top-1 equals argmax cosine against each class's single-template prompt, computed here directly;
    class names and templates come from files."""
    source = make_checkpoint(tmp_path / "siglip2", seed=2)
    model = siglip2.load(source).eval()
    folder = _image_folder(tmp_path / "folder", 14)
    classes = sorted(p.name for p in folder.iterdir())
    names = [f"{c}s" for c in classes]  # short: the tiny text tower reads 12 characters
    (tmp_path / "names.txt").write_text("\n".join(names) + "\n")
    (tmp_path / "templates.txt").write_text("{}\n")
    assert main(["eval", "--checkpoint", str(source), "--zero-shot-data", str(folder), "--zero-shot-classnames",
                 str(tmp_path / "names.txt"), "--zero-shot-templates", str(tmp_path / "templates.txt"),
                 "--zero-shot-seq-len", "36", "--zero-shot-output", str(tmp_path / "zs.json"), "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "zs.json").read_text())
    processing = data_processing(str(source), 4)
    from naflexclip.data.samples import decode_image, read_image_file

    paths = [(path, label) for label, c in enumerate(classes) for path in sorted((folder / c).iterdir())]
    pixels = [processing.transform(decode_image(read_image_file(str(p))), 36) for p, _ in paths]
    with torch.no_grad():
        images = model.encode_image(processing.collate(pixels, 36, 4))
        texts = model.encode_text(processing.tokenize(names, model.context_length))
    similarity = F.normalize(images, dim=-1) @ F.normalize(texts, dim=-1).T
    assert float(similarity.topk(2, dim=1).values.diff(dim=1).abs().min()) > 1e-4  # no near-ties to flip
    predicted = similarity.argmax(dim=1)
    expected = float((predicted == torch.tensor([label for _, label in paths])).float().mean())
    assert results["top1"] == pytest.approx(expected)
    assert list(results["per_class_top1"]) == names


@pytest.mark.parametrize(("flags", "message"), [
    (["--zero-shot-classnames", "NAMES"], "has 1 names for"),
    (["--zero-shot-templates", "TEMPLATES"], "needs exactly one '{}'"),
])
def test_zero_shot_bad_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                                 message: str) -> None:
    source = make_checkpoint(tmp_path / "siglip2")
    folder = _image_folder(tmp_path / "folder", 6)
    (tmp_path / "names.txt").write_text("only one\n")
    (tmp_path / "templates.txt").write_text("no placeholder\n")
    flags = [f.replace("NAMES", str(tmp_path / "names.txt")).replace("TEMPLATES", str(tmp_path / "templates.txt"))
             for f in flags]
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(source), "--zero-shot-data", str(folder), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_train_pretrained_that_is_not_siglip2_is_a_flag_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--pretrained", str(tmp_path), "--logs", str(tmp_path / "logs"), *TRAIN_FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pretrained" in err[0] and "no config.json" in err[0]


def test_pretrained_trains_with_its_own_loss(tmp_path: Path) -> None:
    from naflexclip.train.config.train_config import TrainConfig

    source = make_checkpoint(tmp_path / "siglip2")
    assert TrainConfig(pretrained=str(source)).loss == "siglip"
    with pytest.raises(ValueError, match="--loss clip: the --pretrained model is trained with --loss siglip"):
        TrainConfig(pretrained=str(source), loss="clip")


def test_zero_shot_helper_runs_on_our_presets(tmp_path: Path) -> None:
    """The default pipeline (timm transform, open_clip tokenizer) serves a naflexclip preset."""
    from naflexclip import create_model

    folder = _image_folder(tmp_path / "folder", 6)
    results = zero_shot_classify(create_model("tiny"), folder, seq_len=16)
    assert results["num_samples"] == 6 and 0 <= results["top1"] <= 1


@pytest.mark.parametrize(("broken", "message"), [("tokenizer", "has no tokenizer"),
                                                 ("weights", "no model.safetensors")])
def test_train_pretrained_broken_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, broken: str,
                                                       message: str) -> None:
    source = make_checkpoint(tmp_path / "siglip2", tokenizer=broken != "tokenizer")
    if broken == "weights":
        (source / "model.safetensors").unlink()
    capsys.readouterr()
    assert main(["train", "--pretrained", str(source), "--logs", str(tmp_path / "logs"), *TRAIN_FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def _truncate(file: Path) -> Path:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return file


def test_truncated_weights_are_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = make_checkpoint(tmp_path / "siglip2")
    weights = _truncate(source / "model.safetensors")
    capsys.readouterr()
    for argv in (["train", "--pretrained", str(source), "--logs", str(tmp_path / "logs"), *TRAIN_FLAGS],
                 ["eval", "--checkpoint", str(source), "--device", "cpu"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(weights) in err[0] and "truncated or damaged" in err[0], err
    assert not (tmp_path / "logs").exists()  # refused before the run starts


def test_export_of_a_preset_run_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from naflexclip import create_model
    from naflexclip.checkpoints.storage import save_checkpoint
    from naflexclip.models.naflex_clip import config_to_dict
    from naflexclip.train.config.train_config import TrainConfig

    model = create_model("small", loss="siglip")
    config = TrainConfig(model="small", loss="siglip", logs=str(tmp_path), name="run")
    run = {"config": config.to_dict(), "model_config": config_to_dict(model.config), "world_size": 1}
    save_checkpoint(tmp_path / "checkpoints", "epoch_1", {"model": model.state_dict(), "run": run}, step=1, epoch=1)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "checkpoints"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot export to transformers Siglip2Model: image pooling 'max'" in err[0], err


@pytest.mark.slow
def test_resume_needs_the_same_pretrained_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = make_checkpoint(tmp_path / "siglip2")
    flags = ["--logs", str(tmp_path / "logs"), "--name", "run", *TRAIN_FLAGS, "--val-frequency", "0"]
    assert main(["train", "--pretrained", str(source), "--stop-after-steps", "1", *flags]) == 0
    capsys.readouterr()
    # a resume starts from the run's saved settings: without --pretrained it continues from the run's own (one
    # more step shows it: the rest of the 3 epochs adds nothing to what is tested)
    assert main(["train", "--resume", "latest", "--stop-after-steps", "2", *flags]) == 0
    records = [json.loads(line) for line in (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    other = make_checkpoint(tmp_path / "other")
    capsys.readouterr()
    assert main(["train", "--pretrained", str(other), "--resume", "latest", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pretrained: the checkpoint has" in err[0], err

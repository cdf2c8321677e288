"""`naflexclip benchmark`: CLIP_benchmark's own evaluation on local datasets in its own formats (its `wds/`
webdataset layout, an ImageFolder-based dataset), made here from tiny images, on random checkpoints; scored as
`naflexclip eval` scores the same images, class names and templates. Nothing is downloaded.

CLIP_benchmark is the optional `benchmark` extra: without it these tests skip, except under CI (CI=true), which
installs the extra and must run them."""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
from conftest_data import image_bytes, write_tar
from siglip2_cases import make_checkpoint

from naflexclip.cli import main

# candidate class names, short: the tiny SigLIP 2 text tower reads 12 characters
NAMES = ["ant", "bee", "cat", "cow", "dog", "eel", "elk", "fox", "hen", "owl", "pig", "rat"]
TEMPLATES = ["{c}", "a {c}"]
SEQ_LEN = 36  # the patch budget the images are labelled at


@pytest.fixture(scope="module")
def clip_benchmark():
    return importlib.import_module("clip_benchmark") if os.environ.get("CI") else pytest.importorskip("clip_benchmark")


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_checkpoint(tmp_path_factory.mktemp("siglip2") / "ckpt", seed=4)


def _labelled_by_the_model(checkpoint: Path, seq_len: int, per_class: int = 3
                           ) -> tuple[list[str], list[tuple[bytes, int]]]:
    """(class names, [(PNG, label)]): tiny PNGs of several sizes, each labelled with the class name the model
    puts first by a margin at `seq_len` patches, `per_class` of each; names the model puts first for fewer images
    are left out (which cannot change the first choice among the others). A correct scorer gets top-1 1.0, and any
    image it scores differently from `eval` lowers it."""
    import torch
    import torch.nn.functional as F

    from naflexclip import create_model
    from naflexclip.data.samples import decode_image
    from naflexclip.families import data_processing

    model = create_model(str(checkpoint)).eval()
    processing = data_processing(str(checkpoint), model.image_patch_size)
    pngs = [image_bytes(8 + (seed * 7) % 20, 8 + (seed * 11) % 24, "PNG", seed=seed) for seed in range(80)]
    pixels = [processing.transform(decode_image(png), seq_len) for png in pngs]
    with torch.no_grad():
        classes = torch.stack([F.normalize(model.encode_text(processing.tokenize(
            [t.format(c=name) for t in TEMPLATES], model.context_length)).mean(dim=0), dim=-1) for name in NAMES])
        top2 = (model.encode_image(processing.collate(pixels, seq_len, model.image_patch_size)) @ classes.T).topk(2)
    chosen: dict[str, list[bytes]] = {name: [] for name in NAMES}
    for png, (first, second), label in zip(pngs, top2.values.tolist(), top2.indices[:, 0].tolist(), strict=True):
        if first - second > 1e-3 and len(chosen[NAMES[label]]) < per_class:
            chosen[NAMES[label]].append(png)
    names = sorted(name for name, images in chosen.items() if len(images) == per_class)  # the ImageFolder order
    assert len(names) >= 3, {name: len(images) for name, images in chosen.items()}
    return names, [(png, label) for label, name in enumerate(names) for png in chosen[name]]


@pytest.fixture(scope="module")
def data(siglip2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder (`folder/<class>/`), the same images in CLIP_benchmark's `wds/` layout (`wds/test/0.tar`,
    nshards.txt, classnames.txt, zeroshot_classification_templates.txt) and the class names and templates as
    `eval` reads them (`names.txt`, `templates.txt`) and as CLIP_benchmark reads them (JSON). The images are
    labelled by the SigLIP 2 checkpoint at SEQ_LEN patches."""
    root = tmp_path_factory.mktemp("data")
    members = []
    classes, images = _labelled_by_the_model(siglip2, SEQ_LEN)
    for i, (png, label) in enumerate(images):
        (root / "folder" / classes[label]).mkdir(parents=True, exist_ok=True)
        (root / "folder" / classes[label] / f"{i}.png").write_bytes(png)
        members += [(f"s{i:03d}.png", png), (f"s{i:03d}.cls", str(label).encode())]
    (root / "wds" / "test").mkdir(parents=True)
    write_tar(str(root / "wds" / "test" / "0.tar"), members)
    (root / "wds" / "test" / "nshards.txt").write_text("1\n")
    (root / "wds" / "classnames.txt").write_text("\n".join(classes) + "\n")
    (root / "wds" / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    (root / "names.txt").write_text("\n".join(classes) + "\n")
    (root / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    (root / "names.json").write_text(json.dumps({"imagenet_sketch": classes}))
    (root / "templates.json").write_text(json.dumps({"imagenet_sketch": TEMPLATES}))
    # CLIP_benchmark's retrieval layout (captions in .txt), with and without the dataset_type.txt that says so
    captioned = [(name.replace(".cls", ".txt"), f"a {classes[int(data)]}".encode() if name.endswith(".cls") else data)
                 for name, data in members]
    for name in ("captions", "captions_untyped"):
        (root / name / "test").mkdir(parents=True)
        write_tar(str(root / name / "test" / "0.tar"), captioned)
        (root / name / "test" / "nshards.txt").write_text("1\n")
    (root / "captions" / "dataset_type.txt").write_text("retrieval\n")
    return root


def _benchmark(checkpoint: Path, *flags: str) -> int:
    return main(["benchmark", "--pretrained", str(checkpoint), "--batch_size", "4", "--num_workers", "0",
                 "--no_amp", "--device", "cpu", *flags])


def _eval(checkpoint: Path, data: Path, seq_len: int, output: Path) -> dict:
    assert main(["eval", "--checkpoint", str(checkpoint), "--zero-shot-data", str(data / "folder"),
                 "--zero-shot-classnames", str(data / "names.txt"), "--zero-shot-templates",
                 str(data / "templates.txt"), "--zero-shot-seq-len", str(seq_len), "--output", str(output),
                 "--device", "cpu"]) == 0
    return json.loads(output.read_text())


def _assert_same_scores(result: dict, evaluated: dict, labelled: bool = False) -> None:
    metrics = result["metrics"]
    if labelled:  # the labels are the model's own first choices at this budget
        assert evaluated["top1"] == 1.0
    assert metrics["acc1"] == pytest.approx(evaluated["top1"], abs=1e-6)
    if evaluated["num_classes"] >= 5:
        assert metrics["acc5"] == pytest.approx(evaluated["top5"], abs=1e-6)
    else:  # CLIP_benchmark reports no top-5 below 5 classes
        assert math.isnan(metrics["acc5"])
    # balanced accuracy: the mean of the per-class top-1, so each class's count has to agree too
    per_class = evaluated["per_class_top1"]
    assert metrics["mean_per_class_recall"] == pytest.approx(sum(per_class.values()) / len(per_class), abs=1e-6)


def test_wds_zero_shot_equals_eval(clip_benchmark, siglip2: Path, data: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "wds.json"
    assert _benchmark(siglip2, "--dataset", "wds/mine", "--dataset_root", str(data / "wds"), "--task",
                      "zeroshot_classification", "--seq-len", str(SEQ_LEN), "--output", str(out)) == 0
    result = json.loads(out.read_text())
    assert result["dataset"] == "wds/mine" and result["task"] == "zeroshot_classification"
    assert result["model"] == "siglip2" and result["pretrained"] == str(siglip2)
    assert result["seq_len"] == SEQ_LEN and result["language"] == "en"
    assert "acc1" in capsys.readouterr().out
    _assert_same_scores(result, _eval(siglip2, data, SEQ_LEN, tmp_path / "eval.json"), labelled=True)


def test_imagefolder_dataset_with_custom_files_equals_eval(clip_benchmark, siglip2: Path, data: Path,
                                                           tmp_path: Path) -> None:
    """imagenet_sketch is an ImageFolder in CLIP_benchmark; its class names and templates come from the JSON files
    CLIP_benchmark users pass."""
    assert _benchmark(siglip2, "--dataset", "imagenet_sketch", "--dataset_root", str(data / "folder"),
                      "--custom_classname_file", str(data / "names.json"), "--custom_template_file",
                      str(data / "templates.json"), "--seq-len", "16", str(SEQ_LEN), "--output",
                      str(tmp_path / "{dataset}_{task}_{seq_len}.json")) == 0
    for seq_len in (16, SEQ_LEN):
        result = json.loads((tmp_path / f"imagenet_sketch_zeroshot_classification_{seq_len}.json").read_text())
        _assert_same_scores(result, _eval(siglip2, data, seq_len, tmp_path / "eval.json"), labelled=seq_len == SEQ_LEN)


def test_seq_len_sweep_writes_one_json_per_length(clip_benchmark, data: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    """A naflexclip run's checkpoint (our preset, open_clip's tokenizer), scored at two patch budgets."""
    assert main(["train", "--model", "tiny", "--epochs", "1", "--stop-after-steps", "1", "--synthetic-train-size",
                 "16", "--synthetic-val-size", "8", "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "128",
                 "--workers", "0", "--zero-shot-samples", "4", "--device", "cpu", "--no-plot", "--logs",
                 str(tmp_path / "logs"), "--name", "run"]) == 0
    checkpoint = tmp_path / "logs" / "run" / "checkpoints"
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # the default --output is relative, as in CLIP_benchmark
    assert _benchmark(checkpoint, "--dataset", "wds/mine", "--dataset_root", str(data / "wds"), "--seq-len", "4",
                      "16") == 0
    outputs = [tmp_path / f"mine_checkpoints_tiny_en_zeroshot_classification_seq{n}.json" for n in (4, 16)]
    for seq_len, out in zip((4, 16), outputs, strict=True):
        result = json.loads(out.read_text())
        assert result["seq_len"] == seq_len and result["model"] == "tiny"
        _assert_same_scores(result, _eval(checkpoint, data, seq_len, tmp_path / "eval.json"))
    # CLIP_benchmark's own table of results reads them, one row per sequence length
    from clip_benchmark.cli import main_build

    main_build(argparse.Namespace(files=[str(out) for out in outputs], output=str(tmp_path / "table.csv")))
    with open(tmp_path / "table.csv") as f:
        assert sorted(int(row["seq_len"]) for row in csv.DictReader(f)) == [4, 16]


@pytest.fixture(scope="module")
def near_ties(siglip2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`data`'s layout (without `names.json`) for 6 classes, whose images each have their 5th and 6th class within
    a hair at SEQ_LEN patches (the closest 24 of 200 images), labelled with the 5th: eval's top-5 counts each one,
    and any scorer at a lower precision than eval's loses some. A class no such image has gets one other image."""
    import torch
    import torch.nn.functional as F

    from naflexclip import create_model
    from naflexclip.data.samples import decode_image
    from naflexclip.families import data_processing

    names = NAMES[:6]
    model = create_model(str(siglip2)).eval()
    processing = data_processing(str(siglip2), model.image_patch_size)
    pngs = [image_bytes(8 + (seed * 7) % 20, 8 + (seed * 11) % 24, "PNG", seed=seed) for seed in range(200)]
    pixels = [processing.transform(decode_image(png), SEQ_LEN) for png in pngs]
    with torch.no_grad():  # as eval computes them
        classes = torch.stack([F.normalize(F.normalize(model.encode_text(processing.tokenize(
            [t.format(c=name) for t in TEMPLATES], model.context_length)), dim=-1).mean(dim=0), dim=-1)
            for name in names])
        scores = F.normalize(model.encode_image(processing.collate(pixels, SEQ_LEN, model.image_patch_size)),
                             dim=-1) @ classes.T
    ranked = scores.sort(dim=1, descending=True)
    fifth, margin = ranked.indices[:, 4].tolist(), (ranked.values[:, 4] - ranked.values[:, 5]).tolist()
    closest = sorted(range(len(pngs)), key=margin.__getitem__)[:24]
    images = [(i, fifth[i]) for i in closest]
    others = iter(i for i in range(len(pngs)) if i not in closest)
    images += [(next(others), label) for label in range(len(names)) if label not in {lab for _, lab in images}]
    root = tmp_path_factory.mktemp("near_ties")
    members = []
    for i, label in images:
        (root / "folder" / names[label]).mkdir(parents=True, exist_ok=True)
        (root / "folder" / names[label] / f"{i}.png").write_bytes(pngs[i])
        members += [(f"s{i:03d}.png", pngs[i]), (f"s{i:03d}.cls", str(label).encode())]
    (root / "wds" / "test").mkdir(parents=True)
    write_tar(str(root / "wds" / "test" / "0.tar"), members)
    (root / "wds" / "test" / "nshards.txt").write_text("1\n")
    for path in (root / "wds" / "classnames.txt", root / "names.txt"):
        path.write_text("\n".join(names) + "\n")
    for path in (root / "wds" / "zeroshot_classification_templates.txt", root / "templates.txt"):
        path.write_text("\n".join(TEMPLATES) + "\n")
    return root


def test_default_precision_scores_as_eval(clip_benchmark, siglip2: Path, near_ties: Path, tmp_path: Path) -> None:
    """Without --no_amp or --precision: the checkpoint's precision, as `eval` takes it (a SigLIP 2 directory:
    fp32), so both score near ties alike (CLIP_benchmark's own default, autocast, lost some of top-5)."""
    out = tmp_path / "default.json"
    assert main(["benchmark", "--pretrained", str(siglip2), "--batch_size", "4", "--num_workers", "0", "--device",
                 "cpu", "--dataset", "wds/mine", "--dataset_root", str(near_ties / "wds"), "--seq-len", str(SEQ_LEN),
                 "--output", str(out)]) == 0
    evaluated = _eval(siglip2, near_ties, SEQ_LEN, tmp_path / "eval.json")
    assert evaluated["num_classes"] == 6 and evaluated["top5"] >= 24 / evaluated["num_samples"]
    _assert_same_scores(json.loads(out.read_text()), evaluated)


def test_auto_task_of_a_wds_dataset_follows_its_dataset_type(clip_benchmark, siglip2: Path, data: Path,
                                                             tmp_path: Path) -> None:
    """`--task auto` on a `wds/` dataset whose dataset_type.txt says retrieval: zero-shot retrieval."""
    out = tmp_path / "auto.json"
    assert _benchmark(siglip2, "--dataset", "wds/captions", "--dataset_root", str(data / "captions"), "--seq-len",
                      "16", "--output", str(out)) == 0
    result = json.loads(out.read_text())
    assert result["task"] == "zeroshot_retrieval" and "image_retrieval_recall@5" in result["metrics"]


def test_wds_retrieval_equals_eval_recall(clip_benchmark, siglip2: Path, tmp_path: Path) -> None:
    """CLIP_benchmark's retrieval layout (dataset_type.txt 'retrieval', one caption per image) against `eval
    --val-data` on a folder of the same images and captions, at the checkpoint's own budget (64 patches)."""
    captions = ["a red cat", "a blue dog", "an old owl", "two foxes", "bees", "one elk", "cats", "dogs"]
    members = []
    (tmp_path / "val").mkdir()
    for i, caption in enumerate(captions):
        png = image_bytes(12 + 4 * (i % 3), 14 + 3 * i, "PNG", seed=50 + i)
        members += [(f"s{i}.png", png), (f"s{i}.txt", caption.encode())]
        (tmp_path / "val" / f"{i}.png").write_bytes(png)
        (tmp_path / "val" / f"{i}.txt").write_text(caption)
    (tmp_path / "wds" / "test").mkdir(parents=True)
    write_tar(str(tmp_path / "wds" / "test" / "0.tar"), members)
    (tmp_path / "wds" / "test" / "nshards.txt").write_text("1\n")
    (tmp_path / "wds" / "dataset_type.txt").write_text("retrieval\n")
    out = tmp_path / "r.json"
    assert _benchmark(siglip2, "--dataset", "wds/pairs", "--dataset_root", str(tmp_path / "wds"), "--task",
                      "zeroshot_retrieval", "--recall_k", "1", "5", "--seq-len", "64", "--output", str(out),
                      "--num_workers", "4") == 0  # more workers than shards, as CLIP_benchmark's default is
    metrics = json.loads(out.read_text())["metrics"]
    assert main(["eval", "--checkpoint", str(siglip2), "--val-data", str(tmp_path / "val"), "--output",
                 str(tmp_path / "e.json"), "--device", "cpu"]) == 0
    evaluated = json.loads((tmp_path / "e.json").read_text())
    for k in (1, 5):
        assert metrics[f"text_retrieval_recall@{k}"] == pytest.approx(evaluated[f"val/image_to_text_R@{k}"])
        assert metrics[f"image_retrieval_recall@{k}"] == pytest.approx(evaluated[f"val/text_to_image_R@{k}"])


@pytest.mark.gpu
def test_linear_probe_on_wds(clip_benchmark, siglip2: Path, data: Path, tmp_path: Path) -> None:
    """CLIP_benchmark's linear probe (CUDA only): features of the train split at one patch budget, a logistic
    regression on them, scored on the test split."""
    import shutil

    shutil.copytree(data / "wds" / "test", data / "wds" / "train", dirs_exist_ok=True)
    out = tmp_path / "lp.json"
    assert main(["benchmark", "--pretrained", str(siglip2), "--dataset", "wds/mine", "--dataset_root",
                 str(data / "wds"), "--task", "linear_probe", "--seq-len", "16", "--batch_size", "4",
                 "--num_workers", "0", "--fewshot_epochs", "2", "--feature_root", str(tmp_path / "features"),
                 "--device", "cuda", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["task"] == "linear_probe" and result["seq_len"] == 16
    assert 0 <= result["metrics"]["lp_acc1"] <= 1 and not math.isnan(result["metrics"]["lp_acc1"])


@pytest.mark.parametrize(("flags", "message"), [
    (["--dataset", "no_such_set", "--dataset_root", "DATA"], "--dataset 'no_such_set': not a dataset"),
    (["--dataset", "cifar10", "--dataset_root", "DATA/missing"], "--dataset_root 'DATA/missing' does not exist"),
    (["--dataset", "cifar10", "--dataset_root", "DATA"], "--dataset cifar10 at --dataset_root"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/folder"], "--dataset wds/mine at --dataset_root"),
    (["--dataset", "mscoco_captions", "--dataset_root", "DATA", "--task", "zeroshot_retrieval"],
     "is not complete there (CLIP_benchmark would run 'wget'"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--output", "DATA/names.txt/out.json"],
     "--output 'DATA/names.txt/out.json'"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--output", "DATA"], "--output 'DATA' is a directory"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--seq-len", "4", "16", "--output", "DATA/one.json"],
     "--output 'DATA/one.json' names one file for several runs"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--output", "DATA/{nope}.json"],
     "--output 'DATA/{nope}.json': unknown placeholder"),
    (["--dataset", "imagenet_sketch", "--dataset_root", "DATA/folder", "--custom_classname_file", "DATA/none.json"],
     "--custom_classname_file 'DATA/none.json' does not exist"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--task", "linear_probe"],
     "--task linear_probe: CLIP_benchmark's linear probe runs on CUDA only"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--batch_size", "0"], "--batch_size 0"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--num_workers", "-1"], "--num_workers -1"),
    (["--dataset", "wds/mine", "--dataset_root", "DATA/wds", "--task", "zeroshot_retrieval"],
     "--task zeroshot_retrieval: --dataset wds/mine at --dataset_root 'DATA/wds' is a classification dataset"),
    (["--dataset", "imagenet_sketch", "--dataset_root", "DATA/folder", "--task", "zeroshot_retrieval"],
     "--task zeroshot_retrieval: --dataset imagenet_sketch is a classification dataset"),
    (["--dataset", "wds/captions_untyped", "--dataset_root", "DATA/captions_untyped", "--task", "zeroshot_retrieval"],
     "no dataset_type.txt"),
    (["--dataset", "wds/captions", "--dataset_root", "DATA/captions", "--task", "zeroshot_classification"],
     "--task zeroshot_classification: --dataset wds/captions at --dataset_root 'DATA/captions' is a retrieval"),
])
def test_bad_input_is_one_line_naming_the_flag(clip_benchmark, siglip2: Path, data: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture, flags: list[str], message: str) -> None:
    flags = [f.replace("DATA", str(data)) for f in flags]
    if "--seq-len" not in flags:
        flags += ["--seq-len", "16"]
    if "--output" not in flags:
        flags += ["--output", str(tmp_path / "out.json")]
    capsys.readouterr()
    assert _benchmark(siglip2, *flags) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("naflexclip benchmark: error: ")
    assert message.replace("DATA", str(data)) in err[0], err[0]
    assert "wrote" not in captured.out and not (tmp_path / "out.json").exists()


def test_without_clip_benchmark_it_says_which_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "clip_benchmark", None)  # import fails as if not installed
    assert main(["benchmark", "--pretrained", str(tmp_path), "--dataset", "wds/x", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'naflexclip[benchmark]'" in err[0]

"""`naflexclip eval --zero-shot-data DIR` reads its ImageFolder as training reads a folder: symlinked class folders
(and folders inside them) are followed, each real folder once; broken files are skipped and named in a JSONL;
class folders without images are reported and left out of the candidates; `--output` names the results file
and a bad one stops the command before anything is evaluated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest_data import image_bytes
from siglip2_cases import make_checkpoint

from naflexclip.cli import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("siglip2") / "ckpt", seed=3)


def _images(folder: Path, count: int, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i}.png").write_bytes(image_bytes(12 + 4 * (i % 3), 16, "PNG", seed=seed + i))


def _eval(checkpoint: Path, folder: Path, output: Path, *extra: str) -> int:
    return main(["eval", "--checkpoint", str(checkpoint), "--zero-shot-data", str(folder), "--output", str(output),
                 "--zero-shot-seq-len", "16", "--device", "cpu", *extra])


def test_symlinked_class_folders_and_subfolders_are_followed_once(checkpoint: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    root, outside = tmp_path / "folder", tmp_path / "outside"
    _images(root / "cat", 3)
    _images(outside / "dogs", 2, seed=10)
    _images(outside / "more_cats", 4, seed=20)
    os.symlink(outside / "dogs", root / "dog")  # a class folder that is a link
    os.symlink(outside / "more_cats", root / "cat" / "more")  # a link inside a class folder
    os.symlink(root, root / "cat" / "loop")  # a loop back to the top: followed once, not forever
    assert _eval(checkpoint, root, tmp_path / "zs.json") == 0
    results = json.loads((tmp_path / "zs.json").read_text())
    assert results["num_samples"] == 3 + 4 + 2
    assert results["num_classes"] == 2 and list(results["per_class_top1"]) == ["cat", "dog"]
    assert results["num_skipped"] == 0 and results["skipped_samples_file"] is None
    assert not list(tmp_path.glob("*.jsonl"))


def test_broken_files_are_skipped_and_named_in_a_jsonl(checkpoint: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "folder"
    _images(root / "a", 2)
    _images(root / "b", 2, seed=5)
    (root / "a" / "broken.png").write_bytes(b"not an image")
    (root / "b" / "empty.jpg").write_bytes(b"")
    output = tmp_path / "out" / "zs.json"
    assert _eval(checkpoint, root, output) == 0
    results = json.loads(output.read_text())
    assert results["num_samples"] == 4 and results["num_skipped"] == 2
    log = Path(results["skipped_samples_file"])
    assert log.parent == output.parent
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {(r["key"], r["reason"]) for r in records} == {(str(root / "a" / "broken.png"), "not_an_image"),
                                                          (str(root / "b" / "empty.jpg"), "empty_image")}
    assert all(r["source"] == str(root) and r["split"] == "zeroshot" for r in records)
    out = capsys.readouterr().out
    assert "skipped (not_an_image)" in out and str(root / "a" / "broken.png") in out and str(log) in out


def test_empty_class_folders_are_reported_not_candidates(checkpoint: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "folder"
    _images(root / "a", 2)
    (root / "b").mkdir()
    (root / "b" / "notes.txt").write_text("no images here")
    _images(root / "c", 3, seed=7)
    (tmp_path / "names.txt").write_text("alpha\nbeta\ngamma\n")  # one line per folder, empty ones included
    assert _eval(checkpoint, root, tmp_path / "zs.json", "--zero-shot-classnames", str(tmp_path / "names.txt")) == 0
    results = json.loads((tmp_path / "zs.json").read_text())
    assert results["num_classes"] == 2 and results["chance"] == 0.5
    assert list(results["per_class_top1"]) == ["alpha", "gamma"]
    assert results["empty_classes"] == ["b"]
    out = capsys.readouterr().out
    assert "empty class folder" in out and "b" in out


def test_one_non_empty_class_is_a_flag_error(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "folder"
    _images(root / "a", 2)
    (root / "b").mkdir()
    assert _eval(checkpoint, root, tmp_path / "zs.json") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--zeroshot-data" in err[0] and "'b'" in err[0]


def test_zero_shot_output_keeps_its_old_name(checkpoint: Path, tmp_path: Path) -> None:
    root = tmp_path / "folder"
    _images(root / "a", 2)
    _images(root / "b", 2, seed=5)
    assert main(["eval", "--checkpoint", str(checkpoint), "--zero-shot-data", str(root), "--zero-shot-output",
                 str(tmp_path / "old.json"), "--zero-shot-seq-len", "16", "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "old.json").read_text())["num_samples"] == 4


@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_bad_output_fails_before_the_evaluation(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                where: str) -> None:
    root = tmp_path / "folder"
    _images(root / "a", 2)
    _images(root / "b", 2, seed=5)
    (tmp_path / "file.txt").write_text("a file")
    (tmp_path / "results").mkdir()
    output = tmp_path / "file.txt" / "zs.json" if where == "under_a_file" else tmp_path / "results"
    capsys.readouterr()
    assert _eval(checkpoint, root, output) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("naflexclip eval: error: --output") and str(output) in err[0]
    assert "top-1" not in captured.out  # nothing was evaluated


def test_output_also_takes_the_retrieval_metrics(checkpoint: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    val = tmp_path / "val"
    val.mkdir()
    for i in range(4):
        (val / f"{i}.png").write_bytes(image_bytes(16, 20, seed=i))
        (val / f"{i}.txt").write_text(f"caption {i}")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(checkpoint), "--val-data", str(val), "--output",
                 str(tmp_path / "m.json"), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "m.json").read_text()) == printed and printed["val/num_samples"] == 4


@pytest.mark.parametrize("spelling", ["zeroshot", "zero-shot"])
def test_eval_takes_trains_zeroshot_flags_and_their_first_spelling(checkpoint: Path, tmp_path: Path,
                                                                   spelling: str) -> None:
    """`eval --zeroshot-data` as `train` spells it (one declaration); eval's first spelling `--zero-shot-data` (and
    its `-classnames`, `-templates`) still works."""
    root = tmp_path / "folder"
    _images(root / "a", 2)
    _images(root / "b", 2, seed=5)
    (tmp_path / "names.txt").write_text("alpha\nbeta\n")
    (tmp_path / "templates.txt").write_text("a photo of {}.\n")
    assert main(["eval", "--checkpoint", str(checkpoint), f"--{spelling}-data", str(root), f"--{spelling}-classnames",
                 str(tmp_path / "names.txt"), f"--{spelling}-templates", str(tmp_path / "templates.txt"),
                 "--output", str(tmp_path / "zs.json"), "--zero-shot-seq-len", "16", "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "zs.json").read_text())
    assert results["num_samples"] == 4 and list(results["per_class_top1"]) == ["alpha", "beta"]

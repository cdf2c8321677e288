"""OpenCLIP's evaluation-only command (`--val-data` and a model, no `--train-data`): `naflexclip train` evaluates
the starting model once and exits, as `open_clip_train.main` does; nothing is trained or saved."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from naflexclip.cli import build_parser, main
from naflexclip.train.components import create_run_model
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.evaluate_only import evaluation_only
from naflexclip.train.evaluator import evaluate

FLAGS = ["--model", "tiny", "--device", "cpu", "--precision", "fp32", "--naflex-seq-lens", "16",
         "--naflex-max-tokens-per-batch", "64", "--workers", "0", "--seed", "5"]


def _val_csv(tmp_path) -> str:
    rng = np.random.default_rng(0)
    rows = ["filepath\ttitle"]
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (20 + 4 * i, 24, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(f"{tmp_path / f'{i}.png'}\ta picture number {i}")
    (tmp_path / "val.tsv").write_text("\n".join(rows) + "\n")
    return str(tmp_path / "val.tsv")


def test_val_data_without_train_data_evaluates_the_starting_model_once_and_exits(
        tmp_path, capsys: pytest.CaptureFixture) -> None:
    val = _val_csv(tmp_path)
    assert main(["train", *FLAGS, "--val-data", val, "--logs", str(tmp_path / "logs")]) == 0
    out, err = capsys.readouterr()
    metrics = json.loads(out)
    assert "no --train-data: evaluating --val-data once, as OpenCLIP does" in err
    assert not (tmp_path / "logs").exists()  # nothing trained, nothing saved
    # the metrics are those of the model a run with these flags starts from (its seeded init), on the val data
    cfg = config_from_args(build_parser().parse_args(["train", *FLAGS, "--val-data", val]))
    expected = evaluate(create_run_model(cfg), cfg.data, torch.device("cpu"),
                        lambda: torch.autocast("cpu", enabled=False))
    assert metrics == expected and metrics["val/num_samples"] == 6.0


def test_only_val_data_without_train_data_is_evaluation_only() -> None:
    def cfg(*flags: str):
        return config_from_args(build_parser().parse_args(["train", "--model", "tiny", *flags]))

    assert evaluation_only(cfg("--val-data", "v.tsv"))
    assert not evaluation_only(cfg())  # the built-in demo
    assert not evaluation_only(cfg("--train-data", "t.tsv", "--val-data", "v.tsv"))
    assert not evaluation_only(cfg("--dataset-type", "synthetic"))

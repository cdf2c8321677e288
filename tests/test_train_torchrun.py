"""`torchrun --nproc-per-node 2 -m naflexclip train` on CPU (gloo): trains, stops, resumes — and the
resumed DDP run ends with the same weights as the uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from naflexclip.train.checkpoint import find_latest, load_checkpoint

RUN_FLAGS = [
    "--model", "tiny", "--epochs", "1", "--accum-freq", "2", "--warmup", "1", "--device", "cpu",
    "--synthetic-train-size", "128", "--synthetic-val-size", "16", "--naflex-seq-lens", "16", "32",
    "--naflex-max-tokens-per-batch", "128", "--workers", "0", "--zero-shot-samples", "8", "--no-plot",
    "--naflex-loss-scale", "linear", "--batch-size", "4", "--dist-timeout", "120",
]


def torchrun(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "naflexclip", "train", *RUN_FLAGS, "--logs-dir", str(tmp_path), "--name", name, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_two_process_run_resumes_to_the_same_weights(tmp_path: Path) -> None:
    torchrun(tmp_path, "straight")
    torchrun(tmp_path, "resumed", "--stop-after-steps", "2")
    stopped = find_latest(tmp_path / "resumed" / "checkpoints")
    assert stopped is not None and stopped.name == "step_00000002"
    torchrun(tmp_path, "resumed", "--resume", "latest")

    straight, straight_state = load_checkpoint(find_latest(tmp_path / "straight" / "checkpoints"))
    resumed, resumed_state = load_checkpoint(find_latest(tmp_path / "resumed" / "checkpoints"))
    assert straight_state["world_size"] == resumed_state["world_size"] == 2
    assert straight_state["progress"]["step"] == resumed_state["progress"]["step"] > 2
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    # the window spans both ranks: every step's scale comes from all 2·n microbatch sizes
    assert all(r["train/num_microbatches"] in (2, 4) for r in train_records)

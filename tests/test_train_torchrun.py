"""`torchrun --nproc-per-node 2 naflexclip train` on CPU (gloo): trains, stops, resumes — and the resumed DDP
run, with dropout, drop-path and patch dropout on and a different random stream on each rank, ends with the
same weights as the uninterrupted one (each rank restores its own generator state)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from naflexclip.checkpoints.storage import find_latest, load_checkpoint

RUN_FLAGS = [
    "--model", "tiny", "--epochs", "1", "--accum-freq", "2", "--warmup", "1", "--device", "cpu",
    "--synthetic-train-size", "128", "--synthetic-val-size", "16", "--naflex-seq-lens", "16", "32",
    "--naflex-max-tokens-per-batch", "128", "--workers", "0", "--zero-shot-samples", "8", "--no-plot",
    "--naflex-loss-scale", "linear", "--batch-size", "4", "--dist-timeout", "120",
]

# `naflexclip train` with stochastic layers in the tiny preset (each rank draws its own stream, so a rank that
# continued with another rank's generator state would draw other masks); a resume must not broadcast pickled
# objects (every rank reads the checkpoint itself). The dense probe as small as tests/conftest.py's small_dense_probe
# makes it.
LAUNCHER = textwrap.dedent(
    """
    import dataclasses, sys
    import torch.distributed as dist
    from naflexclip.cli import main
    from naflexclip.models.naflex_clip import PRESETS
    from naflexclip.evaluation import dense_probe as probe

    probe.PROBE_SCENES.update(train=12, val=6)

    tiny = PRESETS["tiny"]
    PRESETS["tiny"] = dataclasses.replace(tiny, image=dataclasses.replace(
        tiny.image, drop_path_rate=0.2, proj_drop_rate=0.2, patch_drop_rate=0.25))
    if "--resume" in sys.argv:
        def no_pickle_broadcast(*args, **kwargs):
            raise AssertionError("the resume broadcast a pickled object")
        dist.broadcast_object_list = no_pickle_broadcast
    sys.exit(main(sys.argv[1:]))
    """
)


def torchrun(tmp_path: Path, name: str, *extra: str, source: str = LAUNCHER) -> subprocess.CompletedProcess:
    launcher = tmp_path / "launch.py"
    launcher.write_text(source)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(launcher), "train", *RUN_FLAGS, "--logs-dir", str(tmp_path), "--name", name, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def stopped_at_step_2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process run stopped (and saved) at step 2; each test resumes its own copy of it (one torchrun fewer)."""
    logs = tmp_path_factory.mktemp("torchrun")
    torchrun(logs, "run", "--stop-after-steps", "2")
    return logs / "run"


def copy_run(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / run.name)
    (tmp_path / "launch.py").write_text(LAUNCHER)
    return tmp_path


@pytest.mark.slow
def test_two_process_run_resumes_to_the_same_weights(stopped_at_step_2: Path, tmp_path: Path) -> None:
    torchrun(tmp_path, "straight")
    logs = copy_run(stopped_at_step_2, tmp_path)
    stopped = find_latest(logs / "run" / "checkpoints")
    assert stopped is not None and stopped.name == "step_00000002"
    stopped_state = load_checkpoint(stopped).states
    rank_states = [state["torch"] for state in stopped_state["rng"]["ranks"]]
    assert len(rank_states) == 2 and not torch.equal(*rank_states)  # each rank's own stream is saved
    torchrun(logs, "run", "--resume", "latest")

    straight_state = load_checkpoint(find_latest(tmp_path / "straight" / "checkpoints")).states
    resumed_state = load_checkpoint(find_latest(logs / "run" / "checkpoints")).states
    straight, resumed = straight_state["model"], resumed_state["model"]
    assert straight_state["run"]["world_size"] == resumed_state["run"]["world_size"] == 2
    assert straight_state["progress"]["step"] == resumed_state["progress"]["step"] > 2
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    # the window spans both ranks: every step's scale comes from all 2·n microbatch sizes (9 per rank: windows of
    # 2, 2, 2 and 3, the odd one joining the last)
    assert [r["train/num_microbatches"] for r in train_records] == [4, 4, 4, 6]
    resumed_steps = [json.loads(line)["step"] for line in (logs / "run" / "metrics.jsonl").read_text()
                     .splitlines() if json.loads(line)["kind"] == "train"]
    assert resumed_steps == list(range(1, len(resumed_steps) + 1))


@pytest.mark.slow
def test_a_two_process_run_resumed_on_one_re_plans_the_lr_schedule_over_the_steps_left(stopped_at_step_2: Path,
                                                                                     tmp_path: Path) -> None:
    """Stopped at step 2 by 2 processes, resumed by 1: each step now covers half the samples, so the rest of the
    epoch takes more steps than the saved schedule has left. The schedule is re-planned over the steps actually
    left (none at lr 0), and the epoch's samples are trained once over both parts."""
    logs = copy_run(stopped_at_step_2, tmp_path)
    cmd = [sys.executable, str(logs / "launch.py"), "train", *RUN_FLAGS, "--logs-dir", str(logs), "--name", "run",
           "--resume", "latest"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    final = load_checkpoint(find_latest(logs / "run" / "checkpoints")).states
    assert final["run"]["world_size"] == 1 and final["progress"]["epoch"] == 1
    records = [json.loads(line) for line in (logs / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    steps = [r["step"] for r in train_records]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 4  # more steps than the 2-process epoch's 4
    assert all(r["train/lr"] > 0 for r in train_records), [(r["step"], r["train/lr"]) for r in train_records]
    assert final["lr_schedule"]["total_steps"] == len(steps)
    assert sum(r["train/window_examples"] for r in train_records) == 128  # every sample once, none twice
    (notice,) = [line for line in result.stderr.splitlines() if "changed flags" in line]
    assert "world size 2 -> 1" in notice and f"lr schedule 4 -> {len(steps)} steps" in notice
    done, total = re.findall(r"(\d+)/(\d+) \[", result.stderr)[-1]  # the bar's last state: full, not past its end
    assert done == total


@pytest.mark.slow
def test_sigterm_to_torchrun_with_loader_workers_stops_cleanly(tmp_path: Path) -> None:
    """SIGTERM to the torchrun agent reaches the whole process group, DataLoader workers included: the run
    still finishes its step, saves it and ends with one line (a killed worker used to end it in a traceback)."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    flags = list(RUN_FLAGS)
    flags[flags.index("--workers") + 1] = "2"
    flags[flags.index("--epochs") + 1] = "50"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(launcher),
           "train", *flags, "--logs-dir", str(tmp_path), "--name", "run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
        time.sleep(0.5)
    agent.send_signal(signal.SIGTERM)
    _, stderr = agent.communicate(timeout=120)
    assert "stopped by SIGTERM after step" in stderr, stderr[-3000:]
    assert "DataLoader worker" not in stderr, stderr[-3000:]
    saved = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert saved, stderr[-3000:]

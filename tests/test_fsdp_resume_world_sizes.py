"""An FSDP2 resume at another world size, from every kind of checkpoint: a 1-process run's (full or sharded), one
resumed on one process from a 2-process run's, full or sharded. The optimizer state (moments, step counts) loads
into FSDP2's shards, the resumed run saves again, and it ends where the same resume under DDP ends (to float
tolerance: the two reduce gradients in another order)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_checkpoint_sharded import SHARDED_LAUNCHER, _assert_same, _one_process, _states, _torchrun
from test_train_loop import TINY_DATA_FLAGS
from test_train_resume import _edit_state
from test_train_torchrun import RUN_FLAGS

from naflexclip.checkpoints import storage
from naflexclip.cli import main

ONE_PROCESS_FLAGS = ["--model", "tiny", "--epochs", "1", "--device", "cpu", "--val-frequency", "0",
                     "--zero-shot-samples", "8", "--no-plot", *TINY_DATA_FLAGS]


def _assert_close(first: dict, second: dict, where: str = "") -> None:
    """Two state dicts, nested, equal to float tolerance (step counts and other integers exactly)."""
    assert first.keys() == second.keys(), where
    for key, value in first.items():
        if isinstance(value, dict):
            _assert_close(value, second[key], f"{where}.{key}")
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
            torch.testing.assert_close(value, second[key], rtol=1e-4, atol=1e-6, msg=f"{where}.{key}")
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, second[key]), f"{where}.{key}"


def _in_order(optimizer: dict) -> list[dict]:
    """An optimizer state's per-parameter states in the optimizer's order (its param groups'), whether keyed by
    position (DDP's and one process's full form) or by name (FSDP2's, a sharded checkpoint's)."""
    return [optimizer["state"][key] for group in optimizer["param_groups"] for key in group["params"]
            if key in optimizer["state"]]


def _assert_resumes_alike(logs: Path, reference: str, *names: str) -> None:
    """Each run of `names` ends where the run `reference` ends: the same step, weights and optimizer state."""
    ddp, ddp_model, ddp_optimizer = _states(logs / reference / "checkpoints")
    assert ddp.epoch == 1 and ddp.states["run"]["world_size"] == 2
    for name in names:
        fsdp, fsdp_model, fsdp_optimizer = _states(logs / name / "checkpoints")
        assert fsdp.step == ddp.step and fsdp.states["run"]["config"]["fsdp"]
        _assert_close(ddp_model, fsdp_model, name)
        assert len(ddp_optimizer["state"]) == len(fsdp_optimizer["state"]) > 0
        for ddp_state, fsdp_state in zip(_in_order(ddp_optimizer), _in_order(fsdp_optimizer), strict=True):
            _assert_close(ddp_state, fsdp_state, name)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_fsdp2_as_under_ddp(tmp_path: Path) -> None:
    _one_process(tmp_path, "one", "--stop-after-steps", "2")
    source = tmp_path / "one" / "checkpoints" / "step_00000002"
    _torchrun(tmp_path, "ddp", "--resume", str(source))
    fsdp = _torchrun(tmp_path, "fsdp", "--fsdp", "--resume", str(source))
    assert "world size 1 -> 2" in fsdp.stderr
    _assert_resumes_alike(tmp_path, "ddp", "fsdp")


@pytest.mark.slow
def test_two_to_one_to_two_processes_resumes_under_fsdp2_as_under_ddp(tmp_path: Path) -> None:
    """A 2-process run cut at step 1, resumed on one process to step 3 (full, and sharded), then on 2 again."""
    _torchrun(tmp_path, "two", "--stop-after-steps", "1")
    two = tmp_path / "two" / "checkpoints" / "step_00000001"
    _one_process(tmp_path, "one_full", "--resume", str(two), "--stop-after-steps", "3")
    _one_process(tmp_path, "one_sharded", "--resume", str(two), "--stop-after-steps", "3",
                 "--fsdp-checkpoint", "sharded")
    full, sharded = (tmp_path / name / "checkpoints" / "step_00000003" for name in ("one_full", "one_sharded"))
    assert storage.load_checkpoint(sharded).sharded == ("model", "optimizer")
    _, full_model, full_optimizer = _states(full)
    _, sharded_model, sharded_optimizer = _states(sharded)
    _assert_same(full_model, sharded_model)  # one state in two forms: one DDP resume is the reference for both
    for one, other in zip(_in_order(full_optimizer), _in_order(sharded_optimizer), strict=True):
        _assert_same(one, other)

    _torchrun(tmp_path, "ddp", "--resume", str(full))
    _torchrun(tmp_path, "fsdp_full", "--fsdp", "--resume", str(full))
    _torchrun(tmp_path, "fsdp_sharded", "--fsdp", "--resume", str(sharded))
    _assert_resumes_alike(tmp_path, "ddp", "fsdp_full", "fsdp_sharded")


# ------------------------------------------------------------------------------ one process (fast)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, full saves, stopped at step 1."""
    logs = tmp_path_factory.mktemp("optimizer_state")
    assert main(["train", *ONE_PROCESS_FLAGS, "--logs", str(logs), "--name", "run", "--stop-after-steps", "1"]) == 0
    return logs / "run"


def _rewrite_optimizer_state(run: Path, change: Callable[[dict], None]) -> None:
    """Change the optimizer state of the run's latest checkpoint (the full form keeps it in its own file)."""
    _edit_state(storage.find_latest(run / "checkpoints"), change, file="optimizer.pt")


def _other_shape(optimizer: dict) -> None:
    first = next(iter(optimizer["state"].values()))
    first["exp_avg"] = torch.zeros(3, 5)


def _foreign_parameter(optimizer: dict) -> None:
    optimizer["state"][10_000] = next(iter(optimizer["state"].values()))


@pytest.mark.parametrize(("change", "said"), [(_other_shape, "has exp_avg of shape (3, 5)"),
                                              (_foreign_parameter, "parameter 10000, which none of")])
def test_an_optimizer_state_that_does_not_fit_is_refused_in_one_line(
        stopped_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, change: Callable[[dict], None],
        said: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    _rewrite_optimizer_state(run, change)
    capsys.readouterr()
    assert main(["train", *ONE_PROCESS_FLAGS, "--logs", str(tmp_path), "--name", "run", "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("naflexclip train: error: --resume ") and said in err and "cannot be loaded" in err, err


@pytest.fixture(scope="module")
def async_sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, sharded checkpoints written in the background, stopped at step 1."""
    logs = tmp_path_factory.mktemp("async_sharded")
    assert main(["train", *ONE_PROCESS_FLAGS, "--logs", str(logs), "--name", "run", "--fsdp-checkpoint", "sharded",
                 "--async-save", "--stop-after-steps", "1"]) == 0
    return logs / "run"


def _resume(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture, *flags: str) -> tuple[storage.Checkpoint, str]:
    shutil.copytree(run, tmp_path / "run")
    capsys.readouterr()
    assert main(["train", *ONE_PROCESS_FLAGS, "--logs", str(tmp_path), "--name", "run", "--resume", "latest",
                 *flags]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "changed flags" in line]
    final = storage.load_checkpoint(tmp_path / "run" / "checkpoints")
    assert final.epoch == 1
    return final, "\n".join(notices)


def test_a_resume_keeps_the_runs_sharded_asynchronous_checkpoints(async_sharded_run: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    final, notices = _resume(async_sharded_run, tmp_path, capsys)
    assert final.sharded == ("model", "optimizer") and not (final.path / storage.MODEL_FILE).exists()
    config = final.states["run"]["config"]
    assert config["fsdp_checkpoint"] == "sharded" and config["async_save"], config
    assert not notices, notices


def test_a_resume_switching_to_full_checkpoints_names_the_change(async_sharded_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """--async-save goes with sharded checkpoints only: switching to full ones turns it off, and says so."""
    final, notices = _resume(async_sharded_run, tmp_path, capsys, "--fsdp-checkpoint", "full")
    assert final.sharded == () and (final.path / storage.MODEL_FILE).is_file()
    assert not final.states["run"]["config"]["async_save"]
    assert "--fsdp-checkpoint sharded -> full" in notices and "--async-save on -> off" in notices, notices


# ------------------------------------------------------------------------------ a rank lost mid-save

# rank 1 dies while it writes its shards of step 2 (as kill -9 would end it)
DYING_WRITER = '''
import os
from torch.distributed.checkpoint import FileSystemWriter

_write_data = FileSystemWriter.write_data


def dying_write_data(self, plan, planner):
    if os.environ["RANK"] == "1" and "step_00000002" in str(self.path):
        os._exit(9)
    return _write_data(self, plan, planner)


FileSystemWriter.write_data = dying_write_data
'''


@pytest.mark.slow
def test_a_rank_lost_mid_sharded_save_is_one_line_naming_it_and_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "launch.py").write_text(SHARDED_LAUNCHER.replace("sys.exit(main(", DYING_WRITER + "sys.exit(main("))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "launch.py"), "train", *RUN_FLAGS, "--logs-dir", str(tmp_path), "--name", "run", "--fsdp",
           "--fsdp-checkpoint", "sharded", "--save-every-n-steps", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "[rank0]: Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("naflexclip train: rank 0 stopped")]
    assert ("while writing checkpoint step_00000002, left incomplete (latest: step_00000001): rank 1 died or "
            "stopped responding") in line, line
    assert storage.find_latest(tmp_path / "run" / "checkpoints").name == "step_00000001"

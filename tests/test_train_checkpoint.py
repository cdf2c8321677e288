"""Checkpoints survive a SIGKILL in the middle of a save: the previous one stays loadable and resumable."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.model import PRESETS
from naflexclip.train import checkpoint as ckpt
from naflexclip.train.loop import train

# The child trains 2 steps saving each one; during the second save it writes the weights file, says so, and
# hangs inside the save, where the parent kills it.
CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from naflexclip.train import checkpoint as ckpt
    from naflexclip.train.loop import train
    from test_train_loop import tiny_config

    real_save = ckpt.save_file
    calls = []

    def save_then_hang(tensors, path):
        real_save(tensors, path)
        calls.append(path)
        if len(calls) == 2:
            print("SAVING", flush=True)
            time.sleep(300)

    ckpt.save_file = save_then_hang
    train(tiny_config({tmp!r}, "killed", save_every_n_steps=1, val_frequency=0))
    """
)


def test_model_state_roundtrip_and_rng(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    train_state = {"config": {"model": "tiny", "siglip": False}, "rng": ckpt.rng_state()}
    path = ckpt.save_checkpoint(tmp_path, "step_1", state, train_state)
    expected = torch.rand(4)
    model_state, loaded = ckpt.load_checkpoint(path)  # weights_only=True inside
    assert all(torch.equal(model_state[k], state[k]) for k in state)
    ckpt.set_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(4), expected)
    assert ckpt.find_latest(tmp_path) == path and ckpt.resolve(tmp_path) == path


@pytest.mark.slow
def test_sigkill_during_save_leaves_previous_checkpoint_resumable(tmp_path: Path) -> None:
    script = CHILD.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "SAVING"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert any(p.name.startswith(".tmp-step_00000002") for p in checkpoints.iterdir())  # the torn write
    latest = ckpt.find_latest(checkpoints)
    assert latest is not None and latest.name == "step_00000001"
    _, state = ckpt.load_checkpoint(latest)
    assert state["progress"]["step"] == 1
    # and the run resumes from it
    from test_train_loop import tiny_config

    train(tiny_config(tmp_path, "killed", stop_after_steps=2, val_frequency=0, resume="latest"))
    resumed = ckpt.find_latest(checkpoints)
    assert resumed.name == "step_00000002"
    assert ckpt.load_checkpoint(resumed)[1]["progress"]["step"] == 2


def test_checkpoint_keeps_its_architecture_when_the_preset_changes(tmp_path: Path, monkeypatch) -> None:
    train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, stop_after_steps=1))
    checkpoints = tmp_path / "run" / "checkpoints"
    tiny = PRESETS["tiny"]
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(
        tiny, text=dataclasses.replace(tiny.text, pool_type="mean", ls_init_value=1e-4)))
    model, _ = ckpt.load_checkpoint_model(checkpoints)  # rebuilt from the architecture stored in it
    assert model.text_pool_type == "argmax"
    # resuming under the changed preset stops with one line that names the checkpoint and what changed
    with pytest.raises(ValueError, match=r"--resume .*step_00000001.*--model tiny: the preset's architecture "
                                         r"is not the checkpoint's .*pool_type: 'argmax' -> 'mean'"):
        train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, resume="latest"))
    # a checkpoint without a stored architecture (older runs, which had no checkpoint.json either) is rebuilt
    # from the preset: one line naming the checkpoint and a tensor
    state_file = ckpt.resolve(checkpoints) / ckpt.STATE_FILE
    state = torch.load(state_file, weights_only=True)
    del state["model_config"]
    torch.save(state, state_file)
    (state_file.parent / ckpt.META_FILE).unlink()
    with pytest.raises(ValueError, match=r"--resume .*step_00000001.*weights do not fit.*ls_1"):
        train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, resume="latest"))
    with pytest.raises(ValueError, match=r"checkpoint .*step_00000001.*weights do not fit"):
        ckpt.load_checkpoint_model(checkpoints)

"""Checkpoints survive a crash at any point of a save (SIGKILL, or a failure injected at every filesystem step):
`latest` resolves to the last complete one, by step; damaged files are reported in one line and skipped."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_train_loop import TINY_DATA_FLAGS, tiny_config

from naflexclip.checkpoints import storage as ckpt
from naflexclip.cli import main
from naflexclip.models.naflex_clip import PRESETS
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.train.components import rng_state, set_rng_state
from naflexclip.train.loop import train

# The child trains 2 steps saving each one; during the second save it writes the weights file, says so, and
# hangs inside the save, where the parent kills it.
CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from naflexclip.checkpoints import storage as ckpt
    from naflexclip.evaluation import dense_probe as probe
    from naflexclip.train.loop import train
    from test_train_loop import tiny_config

    probe.PROBE_SCENES.update(train=12, val=6)  # as tests/conftest.py's small_dense_probe
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


def test_named_states_roundtrip_and_rng(tmp_path: Path) -> None:
    weights = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    states = {"model": weights, "run": {"config": {"model": "tiny"}}, "rng": rng_state(), "empty": {}}
    path = ckpt.save_checkpoint(tmp_path, "step_1", states, step=1, epoch=0)
    expected = torch.rand(4)
    loaded = ckpt.load_checkpoint(path)  # weights_only=True inside
    assert (loaded.path, loaded.step, loaded.epoch) == (path, 1, 0)
    assert set(loaded.states) == set(states) and loaded.states["run"] == states["run"]
    assert all(torch.equal(loaded.states["model"][k], weights[k]) for k in weights)
    set_rng_state(loaded.states["rng"])
    assert torch.equal(torch.rand(4), expected)
    assert ckpt.find_latest(tmp_path) == path and ckpt.load_checkpoint(tmp_path).path == path
    assert ckpt.load_checkpoint(path / ckpt.MODEL_FILE).path == path  # a file inside names its checkpoint


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
    assert ckpt.load_checkpoint(latest).states["progress"]["step"] == 1
    # and the run resumes from it
    from test_train_loop import tiny_config

    train(tiny_config(tmp_path, "killed", stop_after_steps=2, val_frequency=0, resume="latest"))
    resumed = ckpt.find_latest(checkpoints)
    assert resumed.name == "step_00000002"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]  # the torn write is cleaned
    assert ckpt.load_checkpoint(resumed).states["progress"]["step"] == 2


def test_checkpoint_keeps_its_architecture_when_the_preset_changes(tmp_path: Path, monkeypatch) -> None:
    train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, stop_after_steps=1))
    checkpoints = tmp_path / "run" / "checkpoints"
    tiny = PRESETS["tiny"]
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(
        tiny, text=dataclasses.replace(tiny.text, pool_type="mean", ls_init_value=1e-4)))
    model, _ = load_checkpoint_model(checkpoints)  # rebuilt from the architecture stored in it
    assert model.text_pool_type == "argmax"
    # resuming under the changed preset stops with one line that names the checkpoint and what changed
    with pytest.raises(ValueError, match=r"--resume .*step_00000001.*--model tiny: the preset's architecture "
                                         r"is not the checkpoint's .*pool_type: 'argmax' -> 'mean'"):
        train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, resume="latest"))
    # weights that do not fit the stored architecture (a model whose tensors were renamed since): one line
    # naming the checkpoint and a tensor
    monkeypatch.setitem(PRESETS, "tiny", tiny)
    directory = ckpt.find_latest(checkpoints)
    states = ckpt.load_checkpoint(directory).states
    states["model"]["text.ln_final.scale"] = states["model"].pop("text.ln_final.weight")
    ckpt.save_checkpoint(checkpoints, directory.name, states, step=1, epoch=0)
    with pytest.raises(ValueError, match=r"--resume .*step_00000001.*weights do not fit.*text.ln_final"):
        train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, resume="latest"))
    with pytest.raises(ValueError, match=r"checkpoint .*step_00000001.*weights do not fit"):
        load_checkpoint_model(checkpoints)


# --------------------------------------------------------------------------------------- crash at step k


class Crash(OSError):
    """The process dies here: this filesystem step and every later one fail."""


def _states(value: float, step: int) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "progress": {"step": step}}


def _save(directory: Path, step: int, value: float) -> Path:
    return ckpt.save_checkpoint(directory, f"step_{step:08d}", _states(value, step), step=step, epoch=0)


def _crashing_at(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """From the k-th filesystem step of a save on (file write, rename, removal), every step raises Crash."""
    steps: list[str] = []

    def wrap(name, real):
        def step(*args, **kwargs):
            steps.append(name)
            if k and len(steps) >= k:
                raise Crash(f"crash at step {len(steps)} ({name})")
            return real(*args, **kwargs)
        return step

    monkeypatch.setattr(ckpt, "_write_fsynced", wrap("write", ckpt._write_fsynced))
    monkeypatch.setattr(ckpt.os, "replace", wrap("replace", os.replace))
    monkeypatch.setattr(ckpt.shutil, "rmtree", wrap("rmtree", shutil.rmtree))
    return steps


def _before_the_save(directory: Path, resave: bool) -> None:
    _save(directory, 1, 1.0)
    if resave:
        _save(directory, 2, 2.0)


@pytest.mark.parametrize("resave", [False, True], ids=["new name", "same name again"])
def test_crash_at_any_step_of_a_save_leaves_latest_on_a_complete_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resave: bool) -> None:
    """A save of step 2 (first time, or again after a resume) that dies at its k-th filesystem step, for every
    k: `latest` loads step 2 (old or new weights) or, on a first save, step 1 — never nothing, never a damaged
    one; the next save cleans up after it."""
    _before_the_save(tmp_path / "count", resave)
    with monkeypatch.context() as patch:
        steps = _crashing_at(patch, 0)
        _save(tmp_path / "count", 2, 3.0)
    for k in range(1, len(steps) + 2):  # the last k: no crash
        directory = tmp_path / f"crash_{k}"
        _before_the_save(directory, resave)
        with monkeypatch.context() as patch:
            _crashing_at(patch, k)
            try:
                _save(directory, 2, 3.0)
            except Crash:
                pass
        path = ckpt.find_latest(directory)
        assert path is not None, f"crash at step {k} of {steps}: no checkpoint left"
        found = ckpt.load_checkpoint(path)  # complete and undamaged
        value = float(found.states["model"]["w"][0])
        assert value in ({2.0, 3.0} if resave else {1.0, 3.0}), (k, path)
        assert found.step == found.states["progress"]["step"] == (1 if value == 1.0 else 2), (k, path)
        if k == len(steps) + 1:
            assert value == 3.0 and path.name == "step_00000002"
    for k in range(1, len(steps) + 2):  # the next save succeeds and leaves nothing of the crashed one behind
        directory = tmp_path / f"crash_{k}"
        _save(directory, 3, 4.0)
        leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".new")]
        assert leftovers == [], (k, leftovers)
        assert ckpt.find_latest(directory).name == "step_00000003"


def test_latest_falls_back_by_step_not_file_time(tmp_path: Path) -> None:
    for step in (3, 1):  # step 1 written last: its files are the newest
        _save(tmp_path, step, step)
    (tmp_path / ckpt.LATEST_FILE).write_text("step_00000009\n")  # a copied run, a hand edit: the pointer is broken
    assert ckpt.find_latest(tmp_path).name == "step_00000003"
    notes: list[str] = []
    assert ckpt.find_latest(tmp_path, notify=notes.append).name == "step_00000003"
    assert notes == [f"{tmp_path / 'latest'} names 'step_00000009', which is missing or incomplete; using "
                     f"step_00000003 (step 3, the highest complete one)"]


@pytest.mark.parametrize(
    ("file", "damage", "message"),
    [
        (ckpt.STATE_FILE, lambda data: data[:-200] + bytes(200), "RuntimeError: PytorchStreamReader failed"),
        (ckpt.MODEL_FILE, lambda data: data[:8] + b"garbage!" + data[16:], "SafetensorError: Error while deserial"),
        (ckpt.STATE_FILE, lambda data: data[: len(data) // 2], "bytes, written"),
        (ckpt.META_FILE, lambda data: data[:10], "cannot be read"),
    ],
    ids=["torch archive", "safetensors header", "truncated", "completion marker"],
)
def test_damaged_checkpoint_is_one_line_and_the_previous_one_is_used(tmp_path: Path, file: str, damage,
                                                                      message: str, caplog) -> None:
    for step in (1, 2):
        _save(tmp_path, step, step)
    target = tmp_path / "step_00000002" / file
    target.write_bytes(damage(target.read_bytes()))
    found = ckpt.load_checkpoint(tmp_path)  # a run's checkpoints/: its newest usable checkpoint
    assert found.step == 1 and float(found.states["model"]["w"][0]) == 1.0
    assert [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()] != []
    notes: list[str] = []
    ckpt.load_checkpoint(tmp_path, notify=notes.append)
    assert len(notes) == 1 and len(notes[0].splitlines()) == 1
    assert f"step_00000002' is damaged ({file}: " in notes[0] and message in notes[0]
    assert notes[0].endswith("using step_00000001 (step 1)")
    # named directly, the damaged checkpoint is a one-line error, not a traceback
    with pytest.raises(ckpt.CheckpointError, match=f"is damaged \\({file}: "):
        ckpt.load_checkpoint(tmp_path / "step_00000002")


def test_stale_temp_folders_are_cleaned_by_the_next_save(tmp_path: Path) -> None:
    for stale in (".tmp-step_00000007-4242", ".old-step_00000005-4242"):
        (tmp_path / stale).mkdir(parents=True)
        (tmp_path / stale / ckpt.MODEL_FILE).write_bytes(b"partial")
    _save(tmp_path, 8, 8.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.LATEST_FILE, "step_00000008"]
    assert json.loads((tmp_path / "step_00000008" / ckpt.META_FILE).read_text())["step"] == 8


def test_openclips_epoch_k_pt_names_the_epoch_k_checkpoint_folder(tmp_path: Path) -> None:
    """OpenCLIP's README resumes from `checkpoints/epoch_K.pt`; here that checkpoint is the folder `epoch_K`, said
    in one line. A name that is neither stays a one-line error naming it."""
    ckpt.save_checkpoint(tmp_path, "epoch_1", _states(1.0, 3), step=3, epoch=1)
    notes: list[str] = []
    found = ckpt.load_checkpoint(tmp_path / "epoch_1.pt", notify=notes.append)
    assert found.path == tmp_path / "epoch_1" and found.step == 3
    assert notes == [f"{tmp_path / 'epoch_1.pt'}: OpenCLIP's checkpoint file is the folder {tmp_path / 'epoch_1'} "
                     f"here; using it"]
    with pytest.raises(FileNotFoundError, match=r"no usable checkpoint .* at '.*epoch_2\.pt'"):
        ckpt.load_checkpoint(tmp_path / "epoch_2.pt")


# ------------------------------------------------------------------------- bytes changed at the same size


def flip_middle(path: Path) -> None:
    """Bytes flipped at the middle of a file, its size unchanged (a failing disk, a bad copy)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(byte ^ 0xFF for byte in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def _large_states(value: float, step: int) -> dict:
    """States whose files are mostly tensor bytes: a flip at a file's middle lands in a tensor's values."""
    return {"model": {"w": torch.full((4096,), value)}, "optimizer": {"m": torch.full((4096,), value)},
            "rng": {"state": torch.full((4096,), value)}, "progress": {"step": step}}


@pytest.mark.parametrize("file", [ckpt.MODEL_FILE, "optimizer.pt", ckpt.STATE_FILE])
def test_bytes_changed_at_the_same_size_are_named_and_the_previous_checkpoint_is_used(tmp_path: Path,
                                                                                        file: str) -> None:
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, f"step_{step:08d}", _large_states(step, step), step=step, epoch=0)
    flip_middle(tmp_path / "step_00000002" / file)
    notes: list[str] = []
    found = ckpt.load_checkpoint(tmp_path, notify=notes.append)
    assert found.step == 1 and float(found.states["model"]["w"][0]) == 1.0
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert f"step_00000002' is damaged ({file}: its checksum is not the one written" in notes[0], notes
    assert notes[0].endswith("using step_00000001 (step 1)")
    with pytest.raises(ckpt.CheckpointError, match=f"is damaged \\({file}: its checksum"):
        ckpt.load_checkpoint(tmp_path / "step_00000002")


def test_every_file_has_its_checksum_and_a_checkpoint_without_checksums_still_loads(tmp_path: Path) -> None:
    path = ckpt.save_checkpoint(tmp_path, "step_00000001", _large_states(1.0, 1), step=1, epoch=0)
    meta = json.loads((path / ckpt.META_FILE).read_text())
    assert set(meta["checksums"]) == set(meta["sizes"]) == {ckpt.MODEL_FILE, "optimizer.pt", ckpt.STATE_FILE}
    assert meta["checksums"][ckpt.MODEL_FILE] == ckpt.file_checksum(path / ckpt.MODEL_FILE)
    del meta["checksums"]  # written before checksums were recorded: not checked
    (path / ckpt.META_FILE).write_text(json.dumps(meta))
    flip_middle(path / ckpt.MODEL_FILE)
    assert ckpt.load_checkpoint(tmp_path).step == 1


def test_resume_and_eval_of_a_checkpoint_with_bytes_changed_name_the_file(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """`--resume latest` falls back to the previous complete checkpoint in one line naming the file; `eval
    --checkpoint` of the changed one is one line naming it."""
    flags = ["--model", "tiny", "--epochs", "1", "--device", "cpu", "--zero-shot-samples", "8", "--val-frequency",
             "0", "--no-plot", *TINY_DATA_FLAGS, "--logs", str(tmp_path), "--name", "run"]
    assert main(["train", *flags, "--save-every-n-steps", "1", "--stop-after-steps", "2"]) == 0
    damaged = tmp_path / "run" / "checkpoints" / "step_00000002"
    flip_middle(damaged / ckpt.MODEL_FILE)
    capsys.readouterr()
    assert main(["train", *flags, "--resume", "latest", "--stop-after-steps", "3"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "is damaged" in line]
    assert len(said) == 1 and f"step_00000002' is damaged ({ckpt.MODEL_FILE}: its checksum" in said[0], err
    assert "using step_00000001 (step 1)" in said[0] and "step_00000001 at epoch 1, step 1" in err
    assert "Traceback" not in err
    flip_middle(damaged / ckpt.MODEL_FILE)  # re-saved at step 2 by the resume: change the new copy
    assert main(["eval", "--checkpoint", str(damaged), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"is damaged ({ckpt.MODEL_FILE}: its checksum" in err, err


# --------------------------------------------------------------------------- one state under several names


def disk_use(root: Path) -> int:
    """Bytes the files under `root` take, a file with several names (hard links) counted once."""
    inodes = {(p.stat().st_dev, p.stat().st_ino): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    return sum(inodes.values())


def test_one_state_saved_under_several_names_is_written_once(tmp_path: Path) -> None:
    """At an epoch's last step `--save-every-n-steps` (step_N), the epoch's save (epoch_K) and
    `--save-most-recent` (epoch_latest) hold one model and optimizer state: it is on disk once, every name reads
    it, and removing one name (--delete-previous-checkpoint, by hand) leaves the others whole."""
    flags = ["--model", "tiny", "--epochs", "2", "--device", "cpu", "--zero-shot-samples", "8", "--val-frequency",
             "0", "--no-plot", *TINY_DATA_FLAGS, "--logs", str(tmp_path)]
    # the built-in plan's epochs have 3 and 4 steps: step 3 is epoch 1's last (epoch_1, removed by
    # --delete-previous-checkpoint once epoch_2 is saved), step 6 one inside epoch 2, step 7 its last
    assert main(["train", *flags, "--name", "run", "--save-every-n-steps", "3", "--save-most-recent",
                 "--delete-previous-checkpoint"]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    steps = {path.name: ckpt.checkpoint_step(path) for path in checkpoints.iterdir() if path.is_dir()}
    assert steps == {"step_00000003": 3, "step_00000006": 6, "epoch_2": 7, "epoch_latest": 7}
    one_state = disk_use(checkpoints / "step_00000006")
    assert disk_use(checkpoints) < 3.2 * one_state  # the states of steps 3, 6 and 7, each once
    weights = {}
    for name in steps:
        weights[name] = ckpt.load_checkpoint(checkpoints / name).states["model"]
        model, _ = load_checkpoint_model(checkpoints / name)  # eval, verify, --pretrained
        assert all(torch.equal(value, model.state_dict()[key]) for key, value in weights[name].items())
    assert all(torch.equal(weights["epoch_2"][key], weights["epoch_latest"][key]) for key in weights["epoch_2"])
    # step 3's other name (epoch_1) was removed by --delete-previous-checkpoint: step 3 resumes
    assert main(["train", *flags, "--name", "again", "--resume", str(checkpoints / "step_00000003"),
                 "--stop-after-steps", "4"]) == 0
    assert ckpt.load_checkpoint(tmp_path / "again" / "checkpoints").step == 4
    assert ckpt.remove_checkpoint(checkpoints, "epoch_2")  # and epoch_latest, its other name, stays whole
    assert ckpt.load_checkpoint(checkpoints).path.name == "epoch_latest"
    assert ckpt.load_checkpoint(checkpoints / "epoch_latest").step == 7


def test_every_file_of_a_checkpoint_gets_the_mode_a_new_file_gets(tmp_path: Path) -> None:
    """`model.safetensors` too (safetensors writes 0600 of its own)."""
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", "step_00000001", _large_states(1.0, 1), step=1, epoch=0)
    (tmp_path / "plain").write_text("")
    expected = (tmp_path / "plain").stat().st_mode & 0o777
    modes = {file.name: oct(file.stat().st_mode & 0o777) for file in path.iterdir()}
    assert set(modes.values()) == {oct(expected)}, modes

"""Sharded checkpoints (`--fsdp-checkpoint sharded`, torch.distributed.checkpoint): every rank writes its own shards;
a checkpoint resumes exactly under FSDP2 at the same world size, on one process (resharded: the same as its
consolidated full form), and a full checkpoint resumes under FSDP2 with sharded saves from then on; asynchronous
saves hold the state of their step; every reader takes them; damaged ones are refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_train_checkpoint import flip_middle
from test_train_loop import TINY_DATA_FLAGS
from test_train_torchrun import LAUNCHER, RUN_FLAGS, torchrun

from naflexclip.checkpoints import storage
from naflexclip.checkpoints.manager import CheckpointManager, Ranks
from naflexclip.checkpoints.sharded import DCP_METADATA, read_whole, write_shards
from naflexclip.cli import main
from naflexclip.families.factory import create_model
from naflexclip.models.naflex_clip import PRESETS, config_to_dict
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.parallel.process_group import DistributedEnv
from naflexclip.train.components import ModelState, OptimizerState, Progress
from naflexclip.train.remote_sync import RemoteSync, restore_from_backup

FSDP = ["--fsdp", "--fsdp-checkpoint", "sharded"]
# test_train_torchrun's launcher (stochastic layers on), without its check that a resume broadcasts no pickled
# object: DCP coordinates its plans with object collectives (the states themselves each rank reads from its files)
SHARDED_LAUNCHER = LAUNCHER[:LAUNCHER.index('if "--resume" in sys.argv:')] + "sys.exit(main(sys.argv[1:]))\n"


def _torchrun(logs: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return torchrun(logs, name, *extra, source=SHARDED_LAUNCHER)


def _states(path: Path) -> tuple[storage.Checkpoint, dict, dict]:
    found = storage.load_checkpoint(path)
    return found, found.full_state(storage.MODEL), found.full_state("optimizer")


def _assert_same(first: dict, second: dict) -> None:
    """Two state dicts, nested, equal bit for bit."""
    assert first.keys() == second.keys()
    for key, value in first.items():
        if isinstance(value, dict):
            _assert_same(value, second[key])
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, second[key]), key


def _one_process(logs: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    (logs / "launch.py").write_text(SHARDED_LAUNCHER)
    cmd = [sys.executable, str(logs / "launch.py"), "train", *RUN_FLAGS, "--logs-dir", str(logs), "--name", name,
           *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 on 2 ranks, uninterrupted, a sharded checkpoint saved asynchronously after every step (each save waits
    for the previous one), and the full form of its step 2 (`naflexclip checkpoint consolidate`)."""
    logs = tmp_path_factory.mktemp("sharded")
    _torchrun(logs, "run", *FSDP, "--async-save", "--save-every-n-steps", "1")
    assert main(["checkpoint", "consolidate", str(logs / "run" / "checkpoints" / "step_00000002"),
                 "--out", str(logs / "step_2_full")]) == 0
    return logs


@pytest.mark.slow
def test_async_sharded_saves_resume_under_fsdp2_to_the_same_weights(fsdp_run: Path, tmp_path: Path) -> None:
    checkpoints = fsdp_run / "run" / "checkpoints"
    assert storage.find_latest(checkpoints).name == "epoch_1"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "epoch_1", "latest", "step_00000001", "step_00000002", "step_00000003", "step_00000004"]
    step_2 = checkpoints / "step_00000002"
    assert {p.name for p in step_2.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt",
                                                  "checkpoint.json"}  # each rank's shards, no model.safetensors
    straight, straight_model, straight_optimizer = _states(checkpoints / "epoch_1")
    _, saved_model, _ = _states(step_2)
    assert straight.sharded == ("model", "optimizer") and straight.step == 4
    assert any(not torch.equal(value, straight_model[key]) for key, value in saved_model.items())

    (tmp_path / "run").mkdir()
    shutil.copytree(step_2, tmp_path / "run" / "step_00000002")
    _torchrun(tmp_path, "resumed", *FSDP, "--resume", str(tmp_path / "run" / "step_00000002"))
    resumed, resumed_model, resumed_optimizer = _states(tmp_path / "resumed" / "checkpoints")
    assert resumed.step == 4 and resumed.sharded == ("model", "optimizer")
    # the uninterrupted run's step 2 was written while steps 3 and 4 trained: it holds step 2's state
    _assert_same(straight_model, resumed_model)
    _assert_same(straight_optimizer["state"], resumed_optimizer["state"])


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_process_as_its_full_form_does(fsdp_run: Path, tmp_path: Path) -> None:
    """Resharded onto one process (no FSDP, full saves) it continues exactly as its consolidated full form."""
    step_2 = fsdp_run / "run" / "checkpoints" / "step_00000002"
    full, sharded = storage.load_checkpoint(fsdp_run / "step_2_full"), storage.load_checkpoint(step_2)
    assert full.sharded == () and (fsdp_run / "step_2_full" / storage.MODEL_FILE).is_file()
    _assert_same(full.states[storage.MODEL], sharded.full_state(storage.MODEL))

    full_saves = ["--fsdp-checkpoint", "full"]  # the run's are sharded and asynchronous
    from_shards = _one_process(tmp_path, "from_shards", "--resume", str(step_2), *full_saves)
    _one_process(tmp_path, "from_full", "--resume", str(fsdp_run / "step_2_full"), *full_saves)
    assert "world size 2 -> 1" in from_shards.stderr
    assert "--async-save on -> off" in from_shards.stderr and "--fsdp-checkpoint sharded -> full" in from_shards.stderr
    finals = [storage.load_checkpoint(tmp_path / name / "checkpoints") for name in ("from_shards", "from_full")]
    assert [f.sharded for f in finals] == [(), ()] and finals[0].step == finals[1].step > 4
    _assert_same(finals[0].states[storage.MODEL], finals[1].states[storage.MODEL])
    _assert_same(finals[0].states["optimizer"]["state"], finals[1].states["optimizer"]["state"])


@pytest.mark.slow
def test_a_full_checkpoint_resumes_under_fsdp2_with_sharded_saves(fsdp_run: Path, tmp_path: Path) -> None:
    _torchrun(tmp_path, "resumed", *FSDP, "--resume", str(fsdp_run / "step_2_full"))
    resumed, resumed_model, resumed_optimizer = _states(tmp_path / "resumed" / "checkpoints")
    assert resumed.sharded == ("model", "optimizer")  # sharded from then on
    _, straight_model, straight_optimizer = _states(fsdp_run / "run" / "checkpoints")
    _assert_same(straight_model, resumed_model)
    _assert_same(straight_optimizer["state"], resumed_optimizer["state"])


@pytest.mark.slow
def test_a_sharded_checkpoint_missing_a_shard_or_with_another_index_is_one_line(
        fsdp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def consolidate(folder: Path) -> str:
        assert main(["checkpoint", "consolidate", str(folder), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        return err

    source = fsdp_run / "run" / "checkpoints" / "step_00000002"
    missing = tmp_path / "missing"
    shutil.copytree(source, missing)
    (missing / "__1_0.distcp").unlink()
    assert "(__1_0.distcp: missing, written " in consolidate(missing)
    # a copy that lost the shard and its record: the index still points to it
    meta = json.loads((missing / storage.META_FILE).read_text())
    del meta["sizes"]["__1_0.distcp"]
    (missing / storage.META_FILE).write_text(json.dumps(meta))
    assert "(__1_0.distcp: missing; .metadata points to it)" in consolidate(missing)
    # the index of another save (one process's, of another size)
    other = tmp_path / "other"
    shutil.copytree(source, other)
    one_process = tmp_path / "one"
    assert main(["train", "--model", "tiny", "--epochs", "1", "--device", "cpu", "--val-frequency", "0",
                 "--zero-shot-samples", "8", "--no-plot", *TINY_DATA_FLAGS, "--logs", str(tmp_path), "--name", "one",
                 "--fsdp-checkpoint", "sharded", "--stop-after-steps", "1"]) == 0
    capsys.readouterr()
    shutil.copy(storage.find_latest(one_process / "checkpoints") / ".metadata", other / ".metadata")
    assert "(.metadata: " in consolidate(other) and "bytes, written" in consolidate(other)


# ------------------------------------------------------------------------------ one process (fast enough)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, sharded saves (DCP without a process group), stopped at step 2, backed up to `backup/run`."""
    logs = tmp_path_factory.mktemp("sharded_one")
    assert main(["train", "--model", "tiny", "--epochs", "1", "--device", "cpu", "--val-frequency", "0",
                 "--zero-shot-samples", "8", "--no-plot", *TINY_DATA_FLAGS, "--logs", str(logs), "--name", "run",
                 "--fsdp-checkpoint", "sharded", "--stop-after-steps", "2", "--remote-sync", str(logs / "backup"),
                 "--remote-sync-protocol", "fsspec"]) == 0
    return logs / "run" / "checkpoints"


def test_every_reader_takes_a_sharded_checkpoint(one_process_run: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    found = storage.load_checkpoint(one_process_run)
    assert found.sharded == ("model", "optimizer") and not (found.path / storage.MODEL_FILE).exists()
    weights = found.full_state(storage.MODEL)
    model, config = load_checkpoint_model(one_process_run)  # eval, verify, export, distillation teachers
    assert config["fsdp_checkpoint"] == "sharded"
    _assert_same(weights, model.state_dict())
    _assert_same(weights, create_model("tiny", pretrained=str(one_process_run)).state_dict())  # --pretrained
    out = tmp_path / "weights.safetensors"
    assert main(["checkpoint", "consolidate", str(one_process_run), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    from safetensors.torch import load_file

    _assert_same(weights, load_file(str(out)))


def test_a_resume_whose_model_has_other_shapes_names_the_parameter(one_process_run: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """The architecture the checkpoint records matches this run's, but its tensors do not (a preset changed in a
    way its config does not show): named with both shapes, before anything loads."""
    run = tmp_path / "run"
    shutil.copytree(one_process_run.parent, run)
    tiny = PRESETS["tiny"]
    wider = dataclasses.replace(tiny, embed_dim=tiny.embed_dim * 2)
    monkeypatch.setitem(PRESETS, "tiny", wider)
    for folder in (run / "checkpoints").iterdir():  # the saved architecture says `wider`; its tensors are tiny's
        if folder.is_dir():
            state = torch.load(folder / storage.STATE_FILE, weights_only=True)
            state["run"]["model_config"] = config_to_dict(wider)
            torch.save(state, folder / storage.STATE_FILE)
            meta = json.loads((folder / storage.META_FILE).read_text())
            meta["sizes"][storage.STATE_FILE] = (folder / storage.STATE_FILE).stat().st_size
            meta["checksums"][storage.STATE_FILE] = storage.file_checksum(folder / storage.STATE_FILE)
            (folder / storage.META_FILE).write_text(json.dumps(meta))
    assert main(["train", "--model", "tiny", "--epochs", "1", "--device", "cpu", "--val-frequency", "0",
                 "--zero-shot-samples", "8", "--no-plot", *TINY_DATA_FLAGS, "--logs", str(tmp_path), "--name", "run",
                 "--fsdp-checkpoint", "sharded", "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "weights do not fit the model" in err and "in the checkpoint," in err and "in the model" in err, err


def test_async_save_without_sharded_checkpoints_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--model", "tiny", "--device", "cpu", "--async-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--async-save" in err and "--fsdp-checkpoint sharded" in err, err


def test_a_sharded_checkpoint_is_backed_up_and_restored_whole(one_process_run: Path, tmp_path: Path) -> None:
    """--remote-sync copies DCP's `.metadata` (a dot file, but no save in progress) and restores the checkpoint."""
    backup = one_process_run.parent.parent / "backup"
    saved = storage.find_latest(one_process_run)
    assert (backup / "run" / "checkpoints" / saved.name / ".metadata").is_file()
    fresh = tmp_path / "run"
    fresh.mkdir()
    notes: list[str] = []
    assert restore_from_backup(fresh, str(backup), "fsspec", notes.append) == 2
    restored = storage.load_checkpoint(fresh / "checkpoints")
    assert restored.path.name == saved.name and restored.sharded == ("model", "optimizer")
    original = storage.load_checkpoint(saved).full_state("optimizer")["state"]
    _assert_same(restored.full_state("optimizer")["state"], original)


# -------------------------------------------------------------------- bytes changed at the same size (one process)

SHARDED_ONE_PROCESS = ["--model", "tiny", "--epochs", "1", "--device", "cpu", "--val-frequency", "0",
                       "--zero-shot-samples", "8", "--no-plot", *TINY_DATA_FLAGS, "--fsdp-checkpoint", "sharded"]


@pytest.fixture(scope="module", params=["sync", "async"])
def two_sharded_saves(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process saving sharded checkpoints at steps 1 and 2, synchronously or with --async-save."""
    logs = tmp_path_factory.mktemp(f"sharded_{request.param}")
    extra = ["--async-save"] if request.param == "async" else []
    assert main(["train", *SHARDED_ONE_PROCESS, *extra, "--logs", str(logs), "--name", "run",
                 "--save-every-n-steps", "1", "--stop-after-steps", "2"]) == 0
    return logs


@pytest.mark.parametrize("file", ["__0_0.distcp", DCP_METADATA, storage.STATE_FILE])
def test_a_sharded_file_with_bytes_changed_is_named_and_the_previous_checkpoint_is_used(
        two_sharded_saves: Path, tmp_path: Path, file: str) -> None:
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(two_sharded_saves / "run" / "checkpoints", checkpoints)
    meta = json.loads((checkpoints / "step_00000002" / storage.META_FILE).read_text())
    assert set(meta["checksums"]) == set(meta["sizes"]) and file in meta["checksums"]  # every file, every rank's
    flip_middle(checkpoints / "step_00000002" / file)
    notes: list[str] = []
    found = storage.load_checkpoint(checkpoints, notify=notes.append)
    assert found.step == 1 and len(notes) == 1 and "\n" not in notes[0], notes
    assert f"step_00000002' is damaged ({file}: " in notes[0] and notes[0].endswith("using step_00000001 (step 1)")


def test_resume_and_eval_of_a_sharded_checkpoint_with_bytes_changed_name_the_file(
        two_sharded_saves: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--resume latest` falls back past a `.distcp` changed at the same size in one line naming it; `eval
    --checkpoint` of it is one line naming it."""
    shutil.copytree(two_sharded_saves / "run", tmp_path / "run")
    damaged = tmp_path / "run" / "checkpoints" / "step_00000002"
    flip_middle(damaged / "__0_0.distcp")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(damaged), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is damaged (__0_0.distcp: its checksum is not the one written" in err, err
    assert main(["train", *SHARDED_ONE_PROCESS, "--logs", str(tmp_path), "--name", "run", "--resume", "latest",
                 "--stop-after-steps", "3"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "is damaged" in line]
    assert len(said) == 1 and "step_00000002' is damaged (__0_0.distcp: its checksum" in said[0], err
    assert "using step_00000001 (step 1)" in said[0] and "Traceback" not in err


# ------------------------------------------------------------------------------ the saver alone (one process)


def _saver(folder: Path, *, async_save: bool = False) -> tuple[CheckpointManager, torch.nn.Module, Progress]:
    env = DistributedEnv(0, 1, 0, torch.device("cpu"), None)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    progress = Progress(step=1)
    components = {"model": ModelState(model, env), "optimizer": OptimizerState(model, optimizer, env),
                  "progress": progress}
    saver = CheckpointManager(folder, components, {"world_size": 1}, progress, Ranks(), lambda line: None,
                              sharded=True, async_save=async_save)
    return saver, model, progress


def test_an_async_save_holds_its_steps_weights_while_training_goes_on(tmp_path: Path) -> None:
    saver, model, _ = _saver(tmp_path, async_save=True)
    before = model.weight.detach().clone()
    saver.save("step_1")
    with torch.no_grad():  # the next step changes the weights in place while the shards are written
        model.weight.add_(1.0)
    saver.wait()
    saved = storage.load_checkpoint(tmp_path)
    assert storage.find_latest(tmp_path).name == "step_1"
    assert torch.equal(saved.full_state(storage.MODEL)["weight"], before)


def test_a_sharded_save_that_fails_leaves_latest_on_the_previous_checkpoint(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    saver, _, progress = _saver(tmp_path)
    saver.save("step_1")
    progress.step = 2

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(storage, "write_meta", crash)  # every shard written, checkpoint.json not
    with pytest.raises(OSError, match="disk full"):
        saver.save("step_2")
    assert storage.find_latest(tmp_path).name == "step_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]  # no half-written folder left


def test_delete_previous_checkpoint_removes_the_previous_async_save_once_the_next_is_latest(tmp_path: Path) -> None:
    saver, _, progress = _saver(tmp_path, async_save=True)
    for epoch in (1, 2, 3):
        progress.epoch = epoch
        saver.save_epoch(epoch, last=epoch == 3, frequency=1, delete_previous=True)
    saver.wait()  # the run's end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_3", "latest"]
    assert storage.load_checkpoint(tmp_path).epoch == 3


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_second_name_at_the_same_step_links_the_shards(tmp_path: Path, async_save: bool) -> None:
    """`epoch_K` saved at `step_N`'s step holds the same shards: written once, read, consolidated, backed up and
    restored under either name, and whole when the other name is removed."""
    checkpoints = tmp_path / "run" / "checkpoints"
    saver, _, progress = _saver(checkpoints, async_save=async_save)
    saver.save_step()
    saver.save_epoch(1, last=True, frequency=1, most_recent=True)
    saver.wait()
    step, epoch = checkpoints / "step_00000001", checkpoints / "epoch_1"
    for file in ("__0_0.distcp", DCP_METADATA):
        assert (step / file).stat().st_ino == (epoch / file).stat().st_ino == (checkpoints / "epoch_latest" /
                                                                             file).stat().st_ino, file
    whole = storage.load_checkpoint(epoch).full_state(storage.MODEL)
    assert main(["checkpoint", "consolidate", str(epoch), "--out", str(tmp_path / "full")]) == 0
    _assert_same(storage.load_checkpoint(tmp_path / "full").states[storage.MODEL], whole)
    RemoteSync(tmp_path / "run", str(tmp_path / "backup"), 60, "fsspec", lambda line: None).sync()
    assert storage.remove_checkpoint(checkpoints, "step_00000001")
    _assert_same(storage.load_checkpoint(epoch).full_state(storage.MODEL), whole)
    fresh = tmp_path / "fresh" / "run"
    fresh.mkdir(parents=True)
    assert restore_from_backup(fresh, str(tmp_path / "backup"), "fsspec", lambda line: None) == 1
    _assert_same(storage.load_checkpoint(fresh / "checkpoints").full_state(storage.MODEL), whole)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_in_one_process_warns_of_nothing_and_leaves_the_warning_filters(tmp_path: Path,
                                                                              async_save: bool) -> None:
    """DCP's note that it assumes one process (also from its writer's thread) is not said, and the process's
    warning filters are the same after the save as before."""
    saver, _, _ = _saver(tmp_path, async_save=async_save)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        saver.save("step_1")
        saver.wait()
        assert warnings.filters == filters
        storage.load_checkpoint(tmp_path).full_state("optimizer")
        assert warnings.filters == filters
    assert not [str(w.message) for w in said if "torch.distributed is disabled" in str(w.message)]
    assert warnings.filters == before


def test_a_state_is_read_whole_as_it_was_nested(tmp_path: Path) -> None:
    """`read_whole` rebuilds a state's dicts (keys with dots too), lists and non-tensor values from DCP's index, as
    saved."""
    state = {"state": {"visual.proj": {"exp_avg": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.1, "params": ["visual.proj"], "betas": (0.9, 0.95)}],
             "tensors": [torch.ones(2), torch.zeros(1)], "name": "adamw"}
    write_shards({"optimizer": state, "other": {"x": torch.ones(1)}}, tmp_path / "shards")
    whole = read_whole(tmp_path / "shards", "optimizer")
    assert whole.keys() == state.keys() and whole["param_groups"] == state["param_groups"]
    moments = whole["state"]["visual.proj"]
    assert whole["name"] == "adamw" and torch.equal(moments["exp_avg"], state["state"]["visual.proj"]["exp_avg"])
    assert all(torch.equal(a, b) for a, b in zip(whole["tensors"], state["tensors"], strict=True))

"""Resumes that never silently lose or change a run: checks of the flags against the checkpoint, the lr schedule,
finished runs, metrics.jsonl after a resume, clean stops on SIGINT, and a bit-exact resume with dropout on."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_loop import TINY_DATA_FLAGS, tiny_config

from naflexclip.checkpoints import storage as ckpt
from naflexclip.cli import main
from naflexclip.data import DataConfig
from naflexclip.families.factory import create_model
from naflexclip.models.naflex_clip import PRESETS, config_to_dict
from naflexclip.parallel.process_group import init_distributed
from naflexclip.train import components
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.loop import Trainer, train
from naflexclip.train.resume import changed_flags

CLI_FLAGS = ["--model", "tiny", "--epochs", "2", "--warmup", "2", "--device", "cpu", "--zero-shot-samples", "16",
             "--val-frequency", "0", "--no-plot", *TINY_DATA_FLAGS]


def _cli(tmp_path: Path, name: str, *flags: str) -> int:
    return main(["train", *CLI_FLAGS, "--logs", str(tmp_path), "--name", name, *flags])


def _train_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _edit_state(directory: Path, edit, file: str = ckpt.STATE_FILE) -> None:
    """Rewrite one of a checkpoint's state files, train_state.pt by default (and the size and checksum its
    checkpoint.json records)."""
    path = directory / file
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    meta = json.loads((directory / ckpt.META_FILE).read_text())
    meta["sizes"][file] = path.stat().st_size
    meta["checksums"][file] = ckpt.file_checksum(path)
    (directory / ckpt.META_FILE).write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run stopped (and saved) at step 2 of epoch 0; tests copy it before resuming."""
    logs = tmp_path_factory.mktemp("logs")
    train(tiny_config(logs, "base", stop_after_steps=2, val_frequency=0))
    return logs / "base"


def _copy_run(stopped_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(stopped_run, tmp_path / "base")
    return tmp_path


# ------------------------------------------------------------------------------- flags vs checkpoint


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model": "small"}, r"--model: the checkpoint has 'tiny', this run 'small'"),
        ({"loss": "siglip"}, r"--loss: the checkpoint has 'clip', this run 'siglip'"),
        ({"data": dataclasses.replace(tiny_config(Path()).data, synthetic_train_size=64)},
         r"--synthetic-train-size: the checkpoint has 96, this run 64"),
        ({"data": dataclasses.replace(tiny_config(Path()).data, naflex_max_tokens_per_batch=128)},
         r"--naflex-max-tokens-per-batch: the checkpoint has 256, this run 128"),
    ],
)
def test_resume_refuses_a_change_of_model_loss_or_data(stopped_run: Path, tmp_path: Path, overrides: dict,
                                                       expected: str) -> None:
    logs = _copy_run(stopped_run, tmp_path)
    with pytest.raises(ValueError, match=expected) as raised:
        train(tiny_config(logs, "base", val_frequency=0, resume="latest", **overrides))
    assert len(str(raised.value).splitlines()) == 1


def _as_two_ranks(state: dict, *, inside_a_split: bool) -> None:
    """Make a 1-process checkpoint look saved by 2 ranks; optionally with rank 1 inside a split microbatch
    (the one data position that cannot be re-mapped to another world size)."""
    mine = state["data"]["ranks"][0]
    other = {**mine, "rank": 1, "piece": 1, "sample_position": None} if inside_a_split else {**mine, "rank": 1}
    state["run"]["world_size"] = 2
    state["data"]["ranks"] = [{**mine, "world_size": 2}, {**other, "world_size": 2}]


def test_resume_at_another_world_size_is_refused_naming_both(stopped_run: Path, tmp_path: Path) -> None:
    logs = _copy_run(stopped_run, tmp_path)
    _edit_state(ckpt.find_latest(logs / "base" / "checkpoints"), lambda state: _as_two_ranks(state,
                                                                                             inside_a_split=True))
    with pytest.raises(ValueError, match=r"world size: the checkpoint was saved by 2 process\(es\), this run has 1; "
                                         r"its per-rank data position cannot be re-mapped exactly"):
        train(tiny_config(logs, "base", val_frequency=0, resume="latest"))


def test_resume_at_another_world_size_re_plans_from_the_global_position(stopped_run: Path, tmp_path: Path) -> None:
    """A data position that is a place in the epoch's global order re-maps to any world size: here the
    "2-rank" checkpoint continues on 1 process exactly as the uninterrupted 1-process run."""
    logs = _copy_run(stopped_run, tmp_path)
    _edit_state(ckpt.find_latest(logs / "base" / "checkpoints"), lambda state: _as_two_ranks(state,
                                                                                             inside_a_split=False))
    train(tiny_config(logs, "base", val_frequency=0, resume="latest", stop_after_steps=4))
    train(tiny_config(logs, "straight", val_frequency=0, stop_after_steps=4))
    resumed = ckpt.load_checkpoint(logs / "base" / "checkpoints").states["model"]
    straight = ckpt.load_checkpoint(logs / "straight" / "checkpoints").states["model"]
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_harmless_changes_are_applied_and_listed_in_one_notice(stopped_run: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    logs = _copy_run(stopped_run, tmp_path)
    cfg = tiny_config(logs, "base", val_frequency=0, resume="latest", lr=2e-3, epochs=3, accum_freq=3,
                      precision="amp_bf16", wd=0.05)
    trainer = Trainer(cfg, init_distributed("cpu"))
    assert trainer.resume()
    notices = [line for line in capsys.readouterr().err.splitlines() if "changed flags" in line]
    assert len(notices) == 1
    for change in ("--accum-freq 2 -> 3", "--epochs 2 -> 3", "--lr 0.001 -> 0.002", "--precision fp32 -> amp_bf16",
                   "--wd 0.1 -> 0.05", "lr schedule"):
        assert change in notices[0], change
    # applied: the optimizer state does not bring back the saved hyperparameters
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.05
    assert trainer.optimizer.param_groups[0]["lr"] == trainer.schedule.lr_at(2)


def test_changed_flags_notice_reads_like_the_command_line(stopped_run: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """Values as typed: an unset flag says so (not Python's None), a path with a space is quoted, a list is
    space-separated; still one line."""
    logs = _copy_run(stopped_run, tmp_path)
    data = dataclasses.replace(tiny_config(Path()).data, shard_index_dir="my index, 2")
    cfg = tiny_config(logs, "base", val_frequency=0, resume="latest", save_every_n_steps=1, data=data)
    assert Trainer(cfg, init_distributed("cpu")).resume()
    (notice,) = [line for line in capsys.readouterr().err.splitlines() if "changed flags" in line]
    assert notice == ("resume applies changed flags: --save-every-n-steps unset -> 1, "
                      "--shard-index-dir unset -> 'my index, 2'")
    saved = {"grad_clip_norm": 1.0, "data": {"val_data": None, "val_num_samples": [16, 32]}}
    current = {"grad_clip_norm": None, "data": {"val_data": "v.tsv", "val_num_samples": (16, 64)}}
    assert changed_flags(saved, current) == [
        "--grad-clip-norm 1.0 -> unset", "--val-data unset -> v.tsv", "--val-num-samples 16 32 -> 16 64"]


def test_the_resume_policy_names_only_fields_the_config_has() -> None:
    """A renamed or removed flag must not leave the policy checking a field no run has (never refusing)."""
    from naflexclip.train.resume import POLICY

    fields = set(TrainConfig.__dataclass_fields__) | {f"data.{key}" for key in DataConfig.__dataclass_fields__}
    assert set(POLICY) <= fields, sorted(set(POLICY) - fields)


def test_lr_schedule_continues_as_saved(stopped_run: Path, tmp_path: Path) -> None:
    """The same flags continue the saved schedule even where this run would plan another length."""
    logs = _copy_run(stopped_run, tmp_path)
    directory = ckpt.find_latest(logs / "base" / "checkpoints")
    saved = torch.load(directory / ckpt.STATE_FILE, weights_only=True)["lr_schedule"]
    _edit_state(directory, lambda state: state["lr_schedule"].update(total_steps=saved["total_steps"] + 7))
    trainer = Trainer(tiny_config(logs, "base", val_frequency=0, resume="latest"), init_distributed("cpu"))
    assert trainer.schedule.total_steps == saved["total_steps"]
    trainer.resume()
    assert trainer.schedule.total_steps == saved["total_steps"] + 7 and trainer.schedule.last_step == 2


def test_resuming_a_finished_run_says_so_and_trains_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    small = ["--epochs", "1", "--synthetic-train-size", "32"]  # a finished run: its length does not matter
    assert _cli(tmp_path, "done", *small) == 0
    before = (tmp_path / "done" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _cli(tmp_path, "done", *small, "--resume", "latest") == 0
    err = capsys.readouterr().err
    assert "nothing to train: the run finished (epoch 1 of --epochs 1" in err
    assert (tmp_path / "done" / "metrics.jsonl").read_text() == before


def test_stop_after_steps_below_the_resumed_step_trains_nothing(stopped_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    logs = _copy_run(stopped_run, tmp_path)
    train(tiny_config(logs, "base", val_frequency=0, resume="latest", stop_after_steps=1))
    assert "nothing to train: the checkpoint is at step 2, --stop-after-steps is 1" in capsys.readouterr().err
    assert ckpt.find_latest(logs / "base" / "checkpoints").name == "step_00000002"
    assert _train_steps(logs / "base") == [1, 2]


# ------------------------------------------------------------------------------- no usable checkpoint


def test_resume_latest_of_a_run_without_usable_checkpoint_stops(stopped_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    logs = _copy_run(stopped_run, tmp_path)
    directory = ckpt.find_latest(logs / "base" / "checkpoints")
    (directory / ckpt.MODEL_FILE).write_bytes(b"\0" * 64)  # the only checkpoint is damaged
    capsys.readouterr()
    assert _cli(logs, "base", "--resume", "latest") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("is damaged (model.safetensors: 64 bytes" in line for line in err)
    assert err[-1].startswith("naflexclip train: error: --resume latest: run ") and "--resume-fresh" in err[-1]
    # asked for, a fresh start trains from step 1 and logs every step once
    assert _cli(logs, "base", "--resume", "latest", "--resume-fresh", "--stop-after-steps", "3") == 0
    assert _train_steps(logs / "base") == [1, 2, 3]


def test_resume_latest_without_a_name_is_one_line_naming_the_runs_to_continue(stopped_run: Path, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    """A run without --name gets a new dated name, so `--resume latest` alone never has anything to continue:
    before, it said "no checkpoint ...; starting fresh" and trained a new run. Now one line asks for --name and
    names the runs --logs holds."""
    logs = _copy_run(stopped_run, tmp_path)
    capsys.readouterr()
    assert main(["train", "--logs", str(logs), "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--resume latest" in err and "--name" in err and "'base'" in err, err
    assert [p.name for p in logs.iterdir() if p.is_dir()] == ["base"]  # no new run folder


def test_resume_fresh_needs_resume_latest(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--resume-fresh"]) == 2
    assert capsys.readouterr().err.strip() == ("naflexclip train: error: --resume-fresh goes with --resume latest, "
                                               "got --resume None")


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    assert _cli(tmp_path, "run", "--save-every-n-steps", "1", "--stop-after-steps", "2") == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    state_file = checkpoints / "step_00000002" / ckpt.STATE_FILE
    data = bytearray(state_file.read_bytes())
    data[-200:] = bytes(200)  # the zip directory at the end is gone; the size stays
    state_file.write_bytes(bytes(data))
    capsys.readouterr()
    assert _cli(tmp_path, "run", "--resume", "latest", "--stop-after-steps", "3") == 0
    err = capsys.readouterr().err
    damaged = [line for line in err.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and f"step_00000002' is damaged ({ckpt.STATE_FILE}: " in damaged[0]
    assert "using step_00000001 (step 1)" in damaged[0]
    assert "resumed from " in err and "step_00000001 at epoch 1, step 1" in err
    assert "Traceback" not in err
    # the damaged step 2 was trained again and re-saved; metrics.jsonl has each step once
    assert ckpt.load_checkpoint(checkpoints).step == 3
    assert _train_steps(tmp_path / "run") == [1, 2, 3]


def test_metrics_have_each_step_once_after_a_resume(stopped_run: Path, tmp_path: Path) -> None:
    """Steps logged after the checkpoint (the run died before its next save) are logged again by the resume, once."""
    logs = _copy_run(stopped_run, tmp_path)
    train(tiny_config(logs, "base", val_frequency=0, resume="latest", stop_after_steps=4, save_every_n_steps=10))
    # as if the process had died after logging steps 3 and 4 but before saving step 4
    shutil.rmtree(logs / "base" / "checkpoints" / "step_00000004")
    train(tiny_config(logs, "base", val_frequency=0, resume="latest", stop_after_steps=5))
    assert _train_steps(logs / "base") == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_summary_before_column_is_the_evaluation_before_the_first_step(tmp_path: Path) -> None:
    train(tiny_config(tmp_path, "run", epochs=2, stop_after_steps=4))
    trainer = Trainer(tiny_config(tmp_path, "run", epochs=2, resume="latest"), init_distributed("cpu"))
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "eval")
    assert first["step"] == 0
    assert trainer.evaluator.history[0] == {k: v for k, v in first.items() if k not in ("kind", "step", "epoch")}
    eval_steps = [r["step"] for r in records if r["kind"] == "eval"]
    assert len(eval_steps) == len(set(eval_steps)) == 3  # before, after epoch 1, after epoch 2: once each


# ------------------------------------------------------------------------------- stops and re-saves


def test_save_and_stop_at_the_same_step_write_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = []
    real = ckpt.save_checkpoint

    def counting(checkpoint_dir, name, *args, **kwargs):
        names.append(name)
        return real(checkpoint_dir, name, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", counting)
    train(tiny_config(tmp_path, "run", save_every_n_steps=2, stop_after_steps=2, val_frequency=0))
    assert names == ["step_00000002"]


def _dropout_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = PRESETS["tiny"]
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(tiny, image=dataclasses.replace(
        tiny.image, drop_path_rate=0.2, proj_drop_rate=0.2, patch_drop_rate=0.25)))


@pytest.mark.slow
def test_sigint_saves_the_step_and_the_resume_is_bit_exact_with_dropout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C at step 2: the step finishes, is saved, the run ends with one line (exit 130); the resume with
    dropout, drop-path and patch dropout on ends on the same weights as an uninterrupted run."""
    _dropout_preset(monkeypatch)
    assert _cli(tmp_path, "straight", "--stop-after-steps", "4") == 0
    real_step = Trainer.train_step

    def step_then_interrupt(self, microbatches):
        result = real_step(self, microbatches)
        if self.progress.step == 1:  # during the second step (progress counts it after this returns)
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_interrupt)
    capsys.readouterr()
    try:
        code = _cli(tmp_path, "split", "--stop-after-steps", "4")
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the training command")
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == (f"naflexclip train: stopped by SIGINT after step 2; saved "
                                            f"{tmp_path / 'split' / 'checkpoints' / 'step_00000002'} "
                                            f"(continue with --name split --resume latest)")
    checkpoints = tmp_path / "split" / "checkpoints"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]
    shutil.copytree(tmp_path / "split", tmp_path / "norng")  # the same step-2 checkpoint, for the teeth below
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert _cli(tmp_path, "split", "--stop-after-steps", "4", "--resume", "latest") == 0
    straight = ckpt.load_checkpoint(tmp_path / "straight" / "checkpoints").states["model"]
    split = ckpt.load_checkpoint(checkpoints).states["model"]
    assert all(torch.equal(straight[k], split[k]) for k in straight)
    assert _train_steps(tmp_path / "split") == [1, 2, 3, 4]
    # teeth: the same resume without restoring the random state draws other masks and ends elsewhere
    monkeypatch.setattr(components, "set_rng_state", lambda *args: None)
    assert _cli(tmp_path, "norng", "--stop-after-steps", "4", "--resume", "latest") == 0
    norng = ckpt.load_checkpoint(tmp_path / "norng" / "checkpoints").states["model"]
    assert not all(torch.equal(straight[k], norng[k]) for k in straight)


def test_second_interrupt_during_a_save_names_the_last_complete_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real_save = ckpt.save_file
    calls = []

    def save_interrupted(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second Ctrl-C lands inside the second save
        real_save(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", save_interrupted)
    try:
        code = _cli(tmp_path, "run", "--save-every-n-steps", "1", "--stop-after-steps", "3")
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the training command")
    err = capsys.readouterr().err.strip().splitlines()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert code == 130
    last = checkpoints / "step_00000001"
    assert err[-1] == f"naflexclip train: interrupted by SIGINT; last complete checkpoint: {last}"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000001"]  # no .tmp-* left


SIGTERM_CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
from naflexclip.cli import main
from naflexclip.evaluation import dense_probe as probe
from naflexclip.train.loop import Trainer
from test_train_resume import CLI_FLAGS

probe.PROBE_SCENES.update(train=12, val=6)  # as tests/conftest.py's small_dense_probe
real_step = Trainer.train_step

def step_and_report(self, microbatches):
    result = real_step(self, microbatches)
    if self.progress.step == 1:
        print("STEP", flush=True)
        time.sleep(2)  # the signal arrives while this step is still running
    return result

Trainer.train_step = step_and_report
sys.exit(main(["train", *CLI_FLAGS, "--logs", {logs!r}, "--name", "run"]))
"""


@pytest.mark.slow
def test_sigterm_to_a_training_process_saves_and_exits_with_one_line(tmp_path: Path) -> None:
    script = SIGTERM_CHILD.format(tests=str(Path(__file__).parent), logs=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert child.stdout.readline().strip() == "STEP"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    saved = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert err.strip().splitlines()[-1] == (f"naflexclip train: stopped by SIGTERM after step 2; saved {saved} "
                                            f"(continue with --name run --resume latest)")
    assert ckpt.find_latest(tmp_path / "run" / "checkpoints") == saved


# ------------------------------------------------------------------------------------- smaller items


def test_warmup_longer_than_the_run_is_warned(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trainer = Trainer(tiny_config(tmp_path, warmup=1000), init_distributed("cpu"))
    trainer.warn_long_warmup()
    total = trainer.schedule.total_steps
    assert f"warning: --warmup 1000 is longer than the run ({total} optimizer steps)" in capsys.readouterr().err


def test_warmup_warning_after_a_resume_counts_the_resumed_schedule(stopped_run: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Resumed at --accum-freq 1 (saved at 2): the warning counts the steps of the schedule the run follows, as the
    resume notice does, and comes after it (it counted a fresh plan at 1 before the resume: 14 vs 12)."""
    logs = _copy_run(stopped_run, tmp_path)
    trainer = Trainer(tiny_config(logs, "base", accum_freq=1, warmup=1000, resume="latest", stop_after_steps=3),
                      init_distributed("cpu"))
    with trainer.stop.installed():
        trainer.fit()
    err = capsys.readouterr().err
    total = re.search(r"lr schedule \d+ -> (\d+) steps", err).group(1)
    assert total == str(trainer.schedule.total_steps)
    warning = f"warning: --warmup 1000 is longer than the run ({total} optimizer steps)"
    assert warning in err and err.index("resumed from") < err.index(warning), err
    assert err.count("warning: --warmup") == 1


def test_eval_of_a_run_without_validation_data_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "train.tsv").write_text("filepath\ttitle\n")
    cfg = TrainConfig(model="tiny", name="x", data=DataConfig(train_data=str(tmp_path / "train.tsv")))
    model = create_model("tiny")
    run = {"config": cfg.to_dict(), "model_config": config_to_dict(model.config), "world_size": 1}
    ckpt.save_checkpoint(tmp_path, "step_00000001", {"model": model.state_dict(), "run": run}, step=1, epoch=0)
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().startswith("naflexclip eval: error: nothing to evaluate: the run of")
    assert len(captured.err.strip().splitlines()) == 1 and "--val-data" in captured.err


def test_tensorboard_has_each_step_once_after_a_resume(stopped_run: Path, tmp_path: Path) -> None:
    """As for metrics.jsonl: TensorBoard events logged after the checkpoint are discarded by the resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = _copy_run(stopped_run, tmp_path)
    flags = dict(val_frequency=0, resume="latest", report_to="tensorboard")
    train(tiny_config(logs, "base", stop_after_steps=4, save_every_n_steps=10, **flags))
    # as if the process had died after logging step 4 but before saving it: the resume starts at step 3
    shutil.rmtree(logs / "base" / "checkpoints" / "step_00000004")
    train(tiny_config(logs, "base", stop_after_steps=5, **flags))
    events = EventAccumulator(str(logs / "base" / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("train/loss")] == [3, 4, 5]
    for tag in tags:
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)


def test_resume_with_another_accum_freq_schedules_the_steps_actually_left(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """Stopped at step 5 of a 1-epoch run (33 microbatches, 2 per step: 16 steps), resumed with --accum-freq 3: the
    23 microbatches left make 7 more steps, so the schedule spans 12 steps (none at lr 0) and the bar ends full."""
    data = dataclasses.replace(tiny_config(Path()).data, naflex_max_tokens_per_batch=64)
    flags = dict(data=data, epochs=1, val_frequency=0, plot=False, zero_shot_samples=8)
    train(tiny_config(tmp_path, "run", stop_after_steps=5, **flags))
    capsys.readouterr()
    train(tiny_config(tmp_path, "run", accum_freq=3, resume="latest", **flags))
    err = capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["train/lr"] for r in records if r["kind"] == "train"}
    assert sorted(lrs) == list(range(1, 13))
    assert all(lr > 0 for lr in lrs.values()), lrs
    (notice,) = [line for line in err.splitlines() if "changed flags" in line]
    assert "lr schedule 16 -> 12 steps" in notice
    done, total = re.findall(r"(\d+)/(\d+) \[", err)[-1]  # the bar's last state: full, not past its end
    assert done == total


class _RecordingSink:
    """A sink as another logger would plug in: built from the run's context, saved and continued by name."""

    events: list[tuple] = []

    def __init__(self, context) -> None:
        self.context = context
        self.events.append(("open", context.name, context.config["report_to"]))

    def log(self, kind: str, step: int, epoch: float, metrics) -> None:
        self.events.append(("log", kind, step))

    def state_dict(self) -> dict:
        return {"run_id": f"id-of-{self.context.name}"}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.events.append(("continue", state, step))

    def close(self) -> None:
        self.events.append(("close",))


def test_a_registered_sink_logs_saves_and_continues_after_the_resumed_step(stopped_run: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from naflexclip.train.report import SINKS

    monkeypatch.setitem(SINKS, "recording", _RecordingSink)
    monkeypatch.setattr(_RecordingSink, "events", [])
    logs = _copy_run(stopped_run, tmp_path)
    flags = dict(val_frequency=0, resume="latest", report_to="recording, tensorboard")
    train(tiny_config(logs, "base", stop_after_steps=4, save_every_n_steps=3, **flags))
    state = torch.load(logs / "base" / "checkpoints" / "step_00000003" / ckpt.STATE_FILE, weights_only=True)
    assert state["reporter"]["recording"] == {"run_id": "id-of-base"} and "jsonl" in state["reporter"]
    events = _RecordingSink.events
    assert events[0] == ("open", "base", "recording, tensorboard")
    assert events[1] == ("continue", {}, 2)  # the stopped run did not use this sink: nothing of it to continue
    assert [e[2] for e in events if e[0] == "log" and e[1] == "train"] == [3, 4]
    events.clear()
    shutil.rmtree(logs / "base" / "checkpoints" / "step_00000004")  # as if it died after logging step 4
    train(tiny_config(logs, "base", stop_after_steps=5, **flags))
    assert events[1] == ("continue", {"run_id": "id-of-base"}, 3)
    assert [e[2] for e in events if e[0] == "log" and e[1] == "train"] == [4, 5]


def test_report_to_takes_a_comma_list_of_known_sinks(capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--report-to", "tensorboard,tensorbored"]) == 2
    assert capsys.readouterr().err.strip() == ("naflexclip train: error: --report-to: unknown 'tensorbored'; "
                                               "choose from jsonl, tensorboard, wandb (several comma-separated)")


def test_resume_from_a_path_without_a_checkpoint_names_the_flag(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "elsewhere" / "epoch_3.pt"
    assert _cli(tmp_path, "base", "--resume", str(missing)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"naflexclip train: error: --resume {str(missing)!r}: no usable checkpoint (model.safetensors, "
        f"train_state.pt, checkpoint.json) at {str(missing)!r}")


def test_a_resume_with_other_recipe_views_names_the_recipe_flags_not_the_preset() -> None:
    """--local-crops / --mask-ratio are part of the saved architecture (the self-distillation heads'); a resume that
    changes them names those flags (it blamed "the preset's architecture"); a changed preset still names --model."""
    import dataclasses

    from naflexclip.models.naflex_clip import PRESETS, config_to_dict
    from naflexclip.objectives.self_distillation import head_config
    from naflexclip.train.resume import architecture_error

    tiny = PRESETS["tiny"]
    saved = config_to_dict(dataclasses.replace(tiny, self_distill=head_config(tiny.image.width, 8, 0.5)))
    fewer_crops = config_to_dict(dataclasses.replace(tiny, self_distill=head_config(tiny.image.width, 4, 0.5)))
    error = architecture_error("tiny", saved, fewer_crops)
    assert error is not None and "--local-crops" in error and "preset" not in error
    assert "self_distill.local_crops: 8 -> 4" in error
    other_preset = dict(saved, text={**saved["text"], "pool_type": "mean"})
    assert "--model tiny: the preset's architecture" in architecture_error("tiny", saved, other_preset)
    assert architecture_error("tiny", saved, saved) is None


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_latest_starts_from_the_runs_saved_settings(stopped_run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """The README's `naflexclip train --name my_run --resume latest` on a run whose flags were not the defaults
    continues it (it was refused: `--model: the checkpoint has 'tiny', this run 'small'`); a resume that re-gives
    one flag keeps the rest, the teacher included (re-giving --lr without the --distill-* flags dropped it), and
    names the flag it changes in one line."""
    logs = _copy_run(stopped_run, tmp_path)
    assert main(["train", "--logs", str(logs), "--name", "base", "--resume", "latest", "--stop-after-steps", "3",
                 "--no-plot"]) == 0
    assert _train_steps(logs / "base") == [1, 2, 3]
    assert "changed flags" not in capsys.readouterr().err  # nothing given differs from the run's settings

    teacher = str(logs / "base" / "checkpoints")
    train(tiny_config(logs, "student", stop_after_steps=1, val_frequency=0, distill_model="tiny",
                      distill_pretrained=teacher))
    capsys.readouterr()
    assert main(["train", "--logs", str(logs), "--name", "student", "--resume", "latest", "--lr", "0.002",
                 "--stop-after-steps", "2", "--no-plot"]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "changed flags" in line]
    assert len(notices) == 1 and "--lr 0.001 -> 0.002" in notices[0] and "--distill" not in notices[0], notices
    after = [r for r in _records(logs / "student") if r["kind"] == "train" and r["step"] == 2]
    assert len(after) == 1 and after[0]["loss/distill"] > 0  # the teacher is still there


SWITCHES_ON = ["--multi-positive", "--lock-text", "--lock-text-freeze-layer-norm", "--skip-scheduler",
               "--save-most-recent"]


@pytest.fixture(scope="module")
def switched_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run started with switches on, stopped (and saved) at step 1; tests copy it before resuming."""
    logs = tmp_path_factory.mktemp("switched")
    assert _cli(logs, "base", "--stop-after-steps", "1", *SWITCHES_ON) == 0
    return logs / "base"


def test_a_resume_switches_off_a_flag_the_run_started_with(switched_run: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """`--no-<flag>` on `--resume latest` turns off what the run's saved settings had on, and the one notice names
    each change once; the data follows --multi-positive (one caption per image again)."""
    logs = _copy_run(switched_run, tmp_path)
    capsys.readouterr()
    assert main(["train", "--logs", str(logs), "--name", "base", "--resume", "latest", "--stop-after-steps", "2",
                 "--no-multi-positive", "--no-skip-scheduler", "--no-save-most-recent", "--no-plot"]) == 0
    (notice,) = [line for line in capsys.readouterr().err.splitlines() if "changed flags" in line]
    assert "--multi-positive on -> off" in notice and "--skip-scheduler on -> off" in notice, notice
    assert notice.count("--multi-positive") == 1, notice
    config = ckpt.read_run_state(logs / "base" / "checkpoints")["config"]
    assert (config["multi_positive"], config["data"]["multi_caption"]) == (False, False)
    assert (config["skip_scheduler"], config["save_most_recent"]) == (False, False)
    assert (config["lock_text"], config["lock_text_freeze_layer_norm"]) == (True, True)  # not given: as saved


def test_a_resume_refuses_switching_off_a_refused_flag_in_one_line(switched_run: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    logs = _copy_run(switched_run, tmp_path)
    capsys.readouterr()
    code = main(["train", "--logs", str(logs), "--name", "base", "--resume", "latest", "--no-plot",
                 "--no-lock-text-freeze-layer-norm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert "--lock-text-freeze-layer-norm: the checkpoint has on, this run off" in err[-1], err[-1]


def test_a_resume_without_train_data_on_its_command_line_keeps_the_runs_logging_defaults(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run on --train-data logs at OpenCLIP's defaults (every 100 / 10 steps); `--resume latest` alone took the
    built-in dataset's (every step), since its command line has no --train-data. A setting the resume takes from
    its command line but is not given there now has the default of the run's data."""
    from naflexclip.data.dataset_export import export_synthetic

    (csv,) = export_synthetic(str(tmp_path / "data"), fmt="csv", count=24)
    flags = ["--model", "tiny", "--device", "cpu", "--no-plot", "--val-frequency", "0", "--zeroshot-frequency", "0",
             "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "128", "--workers", "0"]
    assert main(["train", *flags, "--train-data", csv, "--logs", str(tmp_path), "--name", "r",
                 "--stop-after-steps", "1"]) == 0
    assert main(["train", "--logs", str(tmp_path), "--name", "r", "--resume", "latest", "--stop-after-steps", "2"]) == 0
    config = ckpt.read_run_state(tmp_path / "r" / "checkpoints")["config"]
    assert (config["log_every_n_steps"], config["log_metric_every_n_steps"]) == (100, 10)
    assert "--log-every-n-steps" not in capsys.readouterr().err

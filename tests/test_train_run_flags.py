"""OpenCLIP's run flags: --save-most-recent, --delete-previous-checkpoint, --remote-sync (fsspec, to a local
folder), --log-local, --debug; saved in the run config with a resume policy."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.checkpoints import storage as ckpt
from naflexclip.cli import build_parser
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.loop import train
from naflexclip.train.remote_sync import RemoteSync, restore_from_backup, sync_fsspec
from naflexclip.train.resume import POLICY
from naflexclip.train.sinks import read_metrics


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_fsspec_sync_copies_what_changed_and_never_a_save_in_progress(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "epoch_1").mkdir(parents=True)
    (run / "checkpoints" / "epoch_1" / "model.safetensors").write_bytes(b"w" * 10)
    (run / "checkpoints" / "latest").write_text("epoch_1")
    (run / "checkpoints" / ".tmp-epoch_2").mkdir()
    (run / "checkpoints" / ".tmp-epoch_2" / "model.safetensors").write_bytes(b"half")
    remote = tmp_path / "remote" / "run"
    versions: dict = {}
    assert sync_fsspec(run, str(remote), versions) == 2
    assert _files(remote) == {"checkpoints/epoch_1/model.safetensors": b"w" * 10, "checkpoints/latest": b"epoch_1"}
    (run / "checkpoints" / "latest").write_text("epoch_2")  # same size, other bytes
    assert sync_fsspec(run, str(remote), versions) == 1 and (remote / "checkpoints" / "latest").read_text() == "epoch_2"
    assert sync_fsspec(run, str(remote), versions) == 0
    weights = run / "checkpoints" / "epoch_1" / "model.safetensors"
    weights.write_bytes(b"v" * 10)  # rewritten at the same size
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert sync_fsspec(run, str(remote), versions) == 1
    assert _files(remote)["checkpoints/epoch_1/model.safetensors"] == b"v" * 10
    assert sync_fsspec(run, str(tmp_path / "fresh"), {}) == 2  # a fresh target: everything


def test_remote_sync_runs_in_the_background_and_once_more_at_close(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    lines: list[str] = []
    sync = RemoteSync(run, str(tmp_path / "remote"), frequency=0.05, protocol="fsspec", notify=lines.append)
    sync.start()
    assert (tmp_path / "remote" / "run" / "metrics.jsonl").read_text() == "{}\n"  # the first sync, before training
    (run / "more.txt").write_text("x")
    deadline = time.monotonic() + 20
    while not (tmp_path / "remote" / "run" / "more.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "remote" / "run" / "more.txt").exists()
    (run / "last.txt").write_text("y")
    sync._stop.set()  # no background sync from here: close() alone must bring last.txt
    sync._thread.join()
    sync.close()
    assert (tmp_path / "remote" / "run" / "last.txt").read_text() == "y"
    assert lines[-1].startswith("--remote-sync: final sync to")


def test_remote_sync_flags_are_checked_before_the_run() -> None:
    with pytest.raises(ValueError, match="--remote-sync-protocol: 'ftp' is not one of"):
        config_from_args(build_parser().parse_args(["train", "--remote-sync", "x", "--remote-sync-protocol", "ftp"]))
    with pytest.raises(ValueError, match="--remote-sync-frequency must be > 0"):
        config_from_args(build_parser().parse_args(["train", "--remote-sync", "x", "--remote-sync-frequency", "0"]))


@pytest.mark.slow
def test_a_run_keeps_the_most_recent_epoch_deletes_the_previous_and_syncs_its_folder(tmp_path: Path) -> None:
    """3 epochs, --save-frequency 1: epoch_latest always the newest, epoch_1 and epoch_2 deleted once the next one
    is saved; the remote copy equals the run folder at the end; --log-local writes out-0.log, --debug adds the
    optimizer's groups."""
    cfg = tiny_config(tmp_path / "logs", "run", epochs=3, save_most_recent=True, delete_previous_checkpoint=True,
                      remote_sync=str(tmp_path / "remote"), remote_sync_protocol="fsspec", remote_sync_frequency=0.5,
                      val_frequency=0, zero_shot_samples=8, plot=False, log_local=True, debug=True)
    train(cfg)
    run = tmp_path / "logs" / "run"
    log = (run / "out-0.log").read_text().splitlines()
    assert log[0].startswith("built-in dataset: the demo's settings") and log[1].startswith("AdamW, 2 parameter groups")
    assert f"removed {run / 'checkpoints' / 'epoch_1'} (--delete-previous-checkpoint)" in log
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["epoch_3", "epoch_latest", "latest"]
    latest = json.loads((run / "checkpoints" / "epoch_latest" / ckpt.META_FILE).read_text())
    assert latest["epoch"] == 3 and latest["step"] == json.loads(
        (run / "checkpoints" / "epoch_3" / ckpt.META_FILE).read_text())["step"]
    remote = _files(tmp_path / "remote" / "run")
    local = _files(run)
    assert set(local) <= set(remote), sorted(set(local) - set(remote))
    # out-0.log gets the final sync's own line after it
    assert [k for k, v in local.items() if remote[k] != v] == ["out-0.log"]
    assert local["out-0.log"].startswith(remote["out-0.log"])


def test_run_flags_are_saved_with_a_resume_policy() -> None:
    cfg = config_from_args(build_parser().parse_args([
        "train", "--save-most-recent", "--delete-previous-checkpoint", "--remote-sync", "s3://b/x",
        "--remote-sync-frequency", "60", "--remote-sync-protocol", "fsspec", "--log-local", "--debug"]))
    values = cfg.to_dict()
    assert (values["save_most_recent"], values["delete_previous_checkpoint"], values["remote_sync"],
            values["remote_sync_frequency"], values["remote_sync_protocol"], values["log_local"],
            values["debug"]) == (True, True, "s3://b/x", 60, "fsspec", True, True)
    for key in ("save_most_recent", "delete_previous_checkpoint", "remote_sync", "remote_sync_frequency",
                "remote_sync_protocol", "log_local", "debug"):
        assert POLICY[key][0] == "ignore"


def _train_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def _save(run: Path, name: str, step: int) -> None:
    ckpt.save_checkpoint(run / "checkpoints", name, {"model": {"w": torch.full((2,), float(step))}, "s": step},
                         step=step, epoch=0)


# the AWS CLI's `s3 ls`, `s3 cp` (file, `-`, --recursive with --exclude) and `s3 sync` over a local folder
# standing for S3 ($FAKE_S3/bucket/key), as OpenCLIP's --remote-sync-protocol s3 runs them
_FAKE_AWS = """#!PYTHON
import fnmatch, os, shutil, sys
from pathlib import Path
root = Path(os.environ["FAKE_S3"])
op, rest = sys.argv[2], sys.argv[3:]
excludes = [rest[i + 1] for i, a in enumerate(rest) if a == "--exclude"]
plain = [a for i, a in enumerate(rest) if a not in ("--exclude", "--recursive") and rest[i - 1] != "--exclude"]
local = lambda url: root / url[len("s3://"):] if url.startswith("s3://") else Path(url)
def line(p):
    return f"{'':27}PRE {p.name}/" if p.is_dir() else f"2026-01-01 00:00:00 {p.stat().st_size:>10} {p.name}"
def tree(src, dst):
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src).as_posix()
        if f.is_file() and not any(fnmatch.fnmatch(rel, e) for e in excludes):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst / rel)
if op == "ls":
    path = local(plain[0])
    folder, prefix = (path, "") if plain[0].endswith("/") else (path.parent, path.name)
    hits = sorted(c for c in folder.iterdir() if c.name.startswith(prefix)) if folder.is_dir() else []
    print("\\n".join(line(c) for c in hits))
    sys.exit(0 if hits else 1)
src, dst = local(plain[0]), plain[1]
if op == "sync" or "--recursive" in rest:
    tree(src, local(dst))
elif not src.is_file():
    sys.exit(f"fatal error: An error occurred (404) when calling the HeadObject operation: Key not found")
elif dst == "-":
    sys.stdout.buffer.write(src.read_bytes())
else:
    shutil.copyfile(src, local(dst))
"""


@pytest.fixture
def fake_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `aws` command on PATH whose S3 is the folder returned."""
    bin_dir, store = tmp_path / "bin", tmp_path / "s3"
    bin_dir.mkdir()
    store.mkdir()
    (bin_dir / "aws").write_text(_FAKE_AWS.replace("PYTHON", sys.executable, 1))
    (bin_dir / "aws").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_S3", str(store))
    return store


@pytest.mark.parametrize("protocol", ["fsspec", "s3"])
def test_the_backup_restores_a_missing_or_older_run_folder_and_leaves_a_newer_one(
        tmp_path: Path, protocol: str, fake_s3: Path) -> None:
    """The backup's latest complete checkpoint (and its logs) is copied into a run folder that lacks it or is
    behind it; a run folder as far as the backup is left alone; an incomplete copy in the backup is passed over.
    The backup is read as the protocol writes it (s3: the AWS CLI, as OpenCLIP; no s3fs)."""
    remote, lines = ("s3://bucket/remote" if protocol == "s3" else str(tmp_path / "remote")), []
    stored = fake_s3 / "bucket" / "remote" if protocol == "s3" else tmp_path / "remote"
    run = tmp_path / "a" / "run"
    _save(run, "step_2", 2)
    _save(run, "step_4", 4)
    (run / "metrics.jsonl").write_text("backup\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events").write_text("tb\n")
    sync_fsspec(run, str(stored / "run"))
    (stored / "run" / "checkpoints" / "step_6").mkdir()  # a copy that never completed
    new_node = tmp_path / "b" / "run"
    assert restore_from_backup(new_node, remote, protocol, lines.append) == 4
    assert ckpt.load_latest(new_node / "checkpoints").states["s"] == 4
    assert (new_node / "metrics.jsonl").read_text() == "backup\n" and "no checkpoint" in lines[-1]
    assert (new_node / "tensorboard" / "events").read_text() == "tb\n"
    assert sorted(p.name for p in (new_node / "checkpoints").iterdir()) == ["latest", "step_4"]
    older = tmp_path / "c" / "run"
    _save(older, "step_2", 2)
    (older / "metrics.jsonl").write_text("older\n")
    assert restore_from_backup(older, remote, protocol, lines.append) == 4
    assert ckpt.load_latest(older / "checkpoints").step == 4 and (older / "metrics.jsonl").read_text() == "backup\n"
    assert "its latest is step 2" in lines[-1]
    assert restore_from_backup(run, remote, protocol, lines.append) is None
    nothing = "s3://bucket/none" if protocol == "s3" else str(tmp_path / "none")
    assert restore_from_backup(tmp_path / "d" / "run", nothing, protocol, lines.append) is None


@pytest.mark.slow
def test_resume_latest_with_remote_sync_continues_the_backup_when_the_local_folder_is_missing_or_older(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """OpenCLIP's --resume latest with --remote-sync looks for the latest checkpoint on the remote target: a new
    node (no local run folder) continues the backup's step 1 with its logs; a node whose folder stopped at step 1
    continues the backup's step 2, not its own."""
    remote = tmp_path / "remote"
    flags = dict(remote_sync=str(remote), remote_sync_protocol="fsspec", val_frequency=0, resume="latest",
                 zero_shot_samples=8)
    train(tiny_config(tmp_path / "node_a", "run", stop_after_steps=1, **flags))
    node_b = tmp_path / "node_b" / "run"
    capsys.readouterr()
    train(tiny_config(tmp_path / "node_b", "run", stop_after_steps=2, **flags))
    assert "at epoch 1, step 1" in capsys.readouterr().err
    assert _train_steps(node_b) == [1, 2] and _train_steps(remote / "run") == [1, 2]  # the backup's log, continued
    node_a = tmp_path / "node_a" / "run"
    train(tiny_config(tmp_path / "node_a", "run", stop_after_steps=3, **flags))
    assert "at epoch 1, step 2" in capsys.readouterr().err
    assert _train_steps(node_a) == [1, 2, 3] and _train_steps(remote / "run") == [1, 2, 3]


def _logs_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    from naflexclip.cli import main

    code = main(["train", "--model", "tiny", "--device", "cpu", "--epochs", "1", "--synthetic-train-size", "32",
                 "--synthetic-val-size", "8", "--workers", "0", "--no-plot", "--name", "run", *argv])
    captured = capsys.readouterr()
    assert code == 2 and not captured.out, captured
    (line,) = captured.err.strip().splitlines()  # nothing before it: no model built, no data read
    return line


def test_logs_under_a_regular_file_is_one_line_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Not a traceback of the reporter's mkdir once the model is built and the data read."""
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    logs = tmp_path / "notes.txt" / "logs"
    line = _logs_error(["--logs", str(logs)], capsys)
    assert line.startswith("naflexclip train: error: --logs") and str(logs) in line, line
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory" in line, line


def test_a_read_only_logs_directory_is_one_line_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o555)
    try:
        try:  # root (and some file systems) write regardless of the mode
            (logs / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("this user writes into a read-only directory (root): "
                        "test_logs_under_a_regular_file_is_one_line_before_any_work covers the check")
        line = _logs_error(["--logs", str(logs)], capsys)
        assert line.startswith("naflexclip train: error: --logs") and f"{logs} is not writable" in line, line
    finally:
        logs.chmod(0o755)


def test_save_every_n_steps_0_means_off(tmp_path: Path) -> None:
    """0 is off, as for --save-frequency and the other frequencies (it was refused: must be >= 1)."""
    cfg = config_from_args(build_parser().parse_args(["train", "--save-every-n-steps", "0"]))
    assert not cfg.save_every_n_steps
    train(tiny_config(tmp_path, "run", epochs=1, save_every_n_steps=0, val_frequency=0, plot=False))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir()) == ["epoch_1"]


def test_accum_method_with_accum_freq_1_is_said_to_change_nothing() -> None:
    """Each window is one microbatch: --accum-method has nothing to do, and the run's start says so."""
    from naflexclip.train.config.config_checks import unused_settings
    from naflexclip.train.config.train_config import TrainConfig

    (said,) = unused_settings(TrainConfig(accum_freq=1, accum_method="replay"))
    assert said.startswith("--accum-method replay: changes nothing with --accum-freq 1"), said
    assert unused_settings(TrainConfig(accum_freq=2, accum_method="replay")) == []
    assert unused_settings(TrainConfig(accum_freq=1)) == []

"""`--remote-sync REMOTE`: OpenCLIP's backup of the run folder to `REMOTE/<name>`, and its restore at `--resume latest`.

The main rank syncs once at the start (a target that cannot be written stops the run before training), every
`--remote-sync-frequency` seconds from a background thread, and once at the end; the loop only starts and closes
it. `s3` runs `aws s3 sync`, `fsspec` copies changed files itself (`sync_fsspec`), never a hidden `.tmp-*` save in
progress. `restore_from_backup` copies the backup's newer complete checkpoint into the run folder before a resume.
docs/training.md#checkpoints-backup-and-logs-openclips-flags.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from naflexclip.checkpoints import sharded
from naflexclip.checkpoints import storage as storage

PROTOCOLS = ("s3", "fsspec")
_COMPARE_BYTES = 1 << 20  # files up to this size are compared by content, larger ones by size


def _visible_files(root: Path) -> list[Path]:
    """Files under `root` outside hidden entries (a save in progress, a checkpoint swapped aside); a sharded
    checkpoint's DCP index `.metadata` is a file of its checkpoint, not hidden."""
    def hidden(parts: tuple[str, ...]) -> bool:
        return any(part.startswith(".") for part in parts[:-1]) or (
            parts[-1].startswith(".") and parts[-1] != sharded.DCP_METADATA)

    return sorted(path for path in root.rglob("*") if path.is_file() and not hidden(path.relative_to(root).parts))


def sync_fsspec(local_dir: Path, remote_dir: str, copied_versions: dict[str, tuple[int, int]] | None = None) -> int:
    """Copy what changed from `local_dir` to `remote_dir` (an fsspec URL or path); the number of files copied.

    `copied_versions` (relative path -> size and mtime of the version copied, kept between calls) finds a file
    rewritten at the same size (a re-saved `epoch_latest`); a file it does not know is copied when the remote lacks
    it, has another size, or (up to 1 MiB) other bytes."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(remote_dir)
    versions = copied_versions if copied_versions is not None else {}
    copied = 0
    for path in _visible_files(local_dir):
        relative = path.relative_to(local_dir).as_posix()
        target = f"{root.rstrip('/')}/{relative}"
        try:
            stat = path.stat()
            version = (stat.st_size, stat.st_mtime_ns)
            if relative in versions:
                if versions[relative] == version:
                    continue
            elif fs.exists(target) and fs.size(target) == stat.st_size:
                if stat.st_size > _COMPARE_BYTES or fs.cat_file(target) == path.read_bytes():
                    versions[relative] = version
                    continue
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), target)
            versions[relative] = version
            copied += 1
        except FileNotFoundError:  # removed while syncing (an older checkpoint): the next sync has the new state
            continue
    return copied


def sync_s3(local_dir: Path, remote_dir: str) -> None:
    """OpenCLIP's `aws s3 sync`; ValueError (one line) when it fails."""
    result = subprocess.run(["aws", "s3", "sync", str(local_dir), remote_dir], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise ValueError(f"--remote-sync {remote_dir}: aws s3 sync: {last}")


def backup_dir(local_dir: Path, remote: str) -> str:
    """Where `--remote-sync REMOTE` backs the run folder `local_dir` up: `REMOTE/<run name>` (OpenCLIP's)."""
    return f"{remote.rstrip('/')}/{local_dir.name}"


class _FsspecBackup:
    """A backup read through fsspec (`--remote-sync-protocol fsspec`); paths relative to the backup's root."""

    def __init__(self, remote_dir: str) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(remote_dir)
        self.root = root.rstrip("/")

    def folders(self, relative: str) -> list[str]:
        path = f"{self.root}/{relative}"
        if not self.fs.isdir(path):
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(path, detail=False)
                if self.fs.isdir(entry)]

    def read(self, relative: str) -> bytes:
        return self.fs.cat_file(f"{self.root}/{relative}")

    def size(self, relative: str) -> int:
        return int(self.fs.size(f"{self.root}/{relative}"))

    def copy_folder(self, relative: str, folder: Path) -> None:
        meta = json.loads(self.read(f"{relative}/{storage.META_FILE}"))
        for file in [*meta["sizes"], storage.META_FILE]:  # checkpoint.json last: it marks the copy complete
            self.fs.get_file(f"{self.root}/{relative}/{file}", str(folder / file))

    def copy_logs(self, local_dir: Path) -> None:
        """Every file outside `checkpoints/` and hidden entries, over the local ones."""
        for path in self.fs.find(self.root):
            relative = path[len(self.root) + 1:]
            parts = relative.split("/")
            if parts[0] != "checkpoints" and not any(part.startswith(".") for part in parts):
                (local_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(path, str(local_dir / relative))


class _AwsBackup:
    """A backup read with the AWS CLI (`--remote-sync-protocol s3`, as OpenCLIP lists it: no s3fs needed)."""

    def __init__(self, remote_dir: str) -> None:
        self.root = remote_dir.rstrip("/")

    def _aws(self, *args: str, missing_ok: bool = False) -> bytes:
        result = subprocess.run(["aws", "s3", *args], capture_output=True)
        if result.returncode != 0:
            if missing_ok and not result.stdout.strip() and not result.stderr.strip():  # `ls` of nothing
                return b""
            last = (result.stderr.decode(errors="replace").strip().splitlines() or ["failed"])[-1]
            raise OSError(f"aws s3 {' '.join(args[:3])}: {last}")
        return result.stdout

    def _listing(self, relative: str) -> list[list[str]]:
        out = self._aws("ls", f"{self.root}/{relative}", missing_ok=True).decode(errors="replace")
        return [line.split() for line in out.splitlines() if line.strip()]

    def folders(self, relative: str) -> list[str]:
        return [fields[1].rstrip("/") for fields in self._listing(relative.rstrip("/") + "/")
                if len(fields) == 2 and fields[0] == "PRE"]

    def read(self, relative: str) -> bytes:
        return self._aws("cp", f"{self.root}/{relative}", "-")

    def size(self, relative: str) -> int:
        name = relative.rsplit("/", 1)[-1]
        sizes = [int(fields[2]) for fields in self._listing(relative) if len(fields) == 4 and fields[3] == name]
        if not sizes:
            raise FileNotFoundError(f"{self.root}/{relative}")
        return sizes[0]

    def copy_folder(self, relative: str, folder: Path) -> None:
        self._aws("cp", "--recursive", f"{self.root}/{relative}", str(folder))

    def copy_logs(self, local_dir: Path) -> None:
        self._aws("cp", "--recursive", self.root, str(local_dir), "--exclude", "checkpoints/*", "--exclude", ".*",
                  "--exclude", "*/.*")


def _backup_checkpoints(backup: _FsspecBackup | _AwsBackup) -> list[tuple[int, str]]:
    """(step, name) of the backup's complete checkpoints (`checkpoint.json` readable, every file of the size it
    gives), the one its `latest` names first, then by step (highest first): the order `checkpoint.candidates`
    tries a local run's."""
    found = []
    for name in backup.folders("checkpoints"):
        if name.startswith("."):
            continue
        try:
            meta = json.loads(backup.read(f"checkpoints/{name}/{storage.META_FILE}"))
            written = meta["sizes"]  # the full form's two files, or a sharded one's shards, index and state file
            if storage.STATE_FILE in written and all(backup.size(f"checkpoints/{name}/{file}") == size
                                                     for file, size in written.items()):
                found.append((int(meta["step"]), name))
        except (OSError, ValueError, KeyError, TypeError):  # incomplete or unreadable: not a candidate
            continue
    found.sort(reverse=True)
    try:
        pointer = backup.read(f"checkpoints/{storage.LATEST_FILE}").decode().strip()
    except (OSError, UnicodeDecodeError):
        pointer = ""
    named = [entry for entry in found if entry[1] == pointer]
    return named + [entry for entry in found if entry[1] != pointer]


def restore_from_backup(local_dir: Path, remote: str, protocol: str, notify: Callable[[str], None]) -> int | None:
    """--resume latest with --remote-sync REMOTE: when the backup `REMOTE/<name>` holds a checkpoint ahead of the
    run folder's latest (or the run folder has none), copy that checkpoint into the run folder's `checkpoints/`
    (as `latest`) and every backed-up file outside `checkpoints/` (the logs it continues) over the local ones;
    the step restored, or None when the run folder is as far as its backup. The backup is read as
    `protocol` writes it (s3: the AWS CLI; fsspec). ValueError naming --remote-sync when it cannot be read."""
    remote_dir = backup_dir(local_dir, remote)
    try:
        backup = _AwsBackup(remote_dir) if protocol == "s3" else _FsspecBackup(remote_dir)
        checkpoints = _backup_checkpoints(backup)
        local = storage.find_latest(local_dir / "checkpoints")
        local_step = storage.checkpoint_step(local) if local is not None else -1
        if not checkpoints or checkpoints[0][0] <= local_step:
            return None
        step, name = checkpoints[0]
        storage.install_checkpoint(local_dir / "checkpoints", name,
                                   lambda folder: backup.copy_folder(f"checkpoints/{name}", folder))
        backup.copy_logs(local_dir)
    except Exception as error:  # noqa: BLE001 - any storage error: one line naming the flag
        raise ValueError(f"--remote-sync {remote_dir}: cannot restore from the backup: "
                         f"{type(error).__name__}: {error}") from None
    had = f"its latest is step {local_step}" if local_step >= 0 else "it has no checkpoint"
    notify(f"--resume latest: the --remote-sync backup {remote_dir} is ahead of {local_dir} ({had}); restored "
           f"its checkpoint {name} (step {step}) and its logs")
    return step


class RemoteSync:
    """The run folder's backup to `remote/<run name>` (main rank): `start()`, then every `frequency` seconds,
    and `close()` (the last sync)."""

    def __init__(self, local_dir: Path, remote: str, frequency: float, protocol: str,
                 notify: Callable[[str], None]) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"--remote-sync-protocol: {protocol!r} is not one of {list(PROTOCOLS)}")
        if protocol == "s3" and shutil.which("aws") is None:
            raise ValueError("--remote-sync-protocol s3 runs `aws s3 sync` (as OpenCLIP), but the AWS CLI is not "
                             "installed; install it or pass --remote-sync-protocol fsspec")
        self.local_dir, self.protocol, self.frequency, self.notify = local_dir, protocol, frequency, notify
        self.remote_dir = backup_dir(local_dir, remote)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sync at a time (the thread's and the last one)
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # the last background failure (reported at close)
        self._versions: dict[str, tuple[int, int]] = {}  # what the fsspec syncs copied (`sync_fsspec`)

    def sync(self) -> None:
        with self._lock:
            if self.protocol == "s3":
                sync_s3(self.local_dir, self.remote_dir)
            else:
                sync_fsspec(self.local_dir, self.remote_dir, self._versions)

    def start(self) -> None:
        """The first sync (ValueError naming --remote-sync if the target cannot be written), then the thread."""
        try:
            self.sync()
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - any storage error: one line naming the flag
            raise ValueError(f"--remote-sync {self.remote_dir}: {type(error).__name__}: {error}") from None
        self.notify(f"--remote-sync: {self.local_dir} -> {self.remote_dir} every {self.frequency:g} s "
                    f"({self.protocol})")
        self._thread = threading.Thread(target=self._run, name="remote-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.frequency):
            try:
                self.sync()
                self.failure = None
            except Exception as error:  # noqa: BLE001 - training goes on; the next sync tries again
                self.failure = f"{type(error).__name__}: {error}"

    def close(self) -> None:
        """Stop the thread and sync once more (a failure is one line, the run's outcome is unchanged)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sync()
            self.notify(f"--remote-sync: final sync to {self.remote_dir} done")
        except Exception as error:  # noqa: BLE001
            self.notify(f"--remote-sync: final sync to {self.remote_dir} failed: {type(error).__name__}: {error}")

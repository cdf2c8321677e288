"""Checkpoint storage: one directory per save holding a mapping of named states; this module never looks
inside a state. The state "model" goes to `model.safetensors`, every other to `train_state.pt` (read back
weights-only), then `checkpoint.json` (step, epoch, each file's size and checksum) marks the save complete and
`latest` names it.
It publishes, finds and checks full and sharded saves alike (the shards themselves: `checkpoints.sharded`; the format
field of `checkpoint.json` tells them apart), never losing the last complete one, and falls back by step past a
damaged or missing one. docs/checkpoints.md#layout and #crash-safety.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from naflexclip.checkpoints import sharded

MODEL = "model"  # the named state stored as safetensors
MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
# the large states besides the model, each in a file of its own (`{name}.pt`), so that a second name for the state
# of one step (`epoch_K` saved at `step_N`'s step, `epoch_latest`) links these files instead of writing them again
OWN_FILE_STATES = ("optimizer", "ema_teacher")
META_FILE = "checkpoint.json"
LATEST_FILE = "latest"
# hidden leftovers of an interrupted save: the temp directory, the old copy swapped out, the pointer's temp file
_STALE = re.compile(r"^\.(tmp|old)-")
_NEW_SUFFIX = ".new"
CHECKSUM = "blake2b-256"  # `checkpoint.json`'s checksums: "blake2b-256:<hex>"
_CHECKSUM_BLOCK = 1 << 20

Notify = Callable[[str], None]
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete or damaged); the message is one line."""


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint: where it is, its step and epoch, and its named states (`states["model"]`: the
    model's tensors)."""

    path: Path
    step: int
    epoch: int
    states: dict[str, Any]
    # the states a sharded checkpoint holds as shards (`checkpoints.sharded`), not in `states`: each is read by
    # resharding into a live object's state (a resume) or whole into this process (`full_state`)
    sharded: tuple[str, ...] = ()

    def full_state(self, name: str) -> Any:
        """The named state whole, in this process: from `states`, or gathered from a sharded checkpoint's shards."""
        if name not in self.sharded:
            return self.states[name]
        return sharded.read_whole(self.path, name)


# ---------------------------------------------------------------------------------------------- write


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fsynced(path: Path, write: Any) -> None:
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def discard(path: Path) -> None:
    """Remove a leftover directory or file (an interrupted save's); failing to is not worth failing a run over."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def clean_stale(checkpoint_dir: Path) -> None:
    """Remove the leftovers of interrupted saves (one writer per run: none is live): `.tmp-*` / `.old-*`, and
    a re-save's `{name}.new` copy unless `latest` still names it."""
    if checkpoint_dir.is_dir():
        target = _pointer_target(checkpoint_dir)
        for path in checkpoint_dir.iterdir():
            if _STALE.match(path.name) or (path.name.endswith(_NEW_SUFFIX) and path.name != target):
                discard(path)


def remove_checkpoint(checkpoint_dir: Path, name: str) -> bool:
    """Remove checkpoint `name` (OpenCLIP's --delete-previous-checkpoint) unless `latest` names it; True if it was
    there and is gone. It is renamed to a hidden `.old-*` first, so no reader ever sees half of it."""
    path = checkpoint_dir / name
    if not path.is_dir() or _pointer_target(checkpoint_dir) == name:
        return False
    aside = checkpoint_dir / f".old-{name}-{os.getpid()}"
    os.replace(path, aside)
    discard(aside)
    return True


def _point_latest(checkpoint_dir: Path, name: str) -> None:
    pointer = checkpoint_dir / f".tmp-{LATEST_FILE}-{os.getpid()}"
    _write_fsynced(pointer, lambda p: p.write_text(name + "\n"))
    os.replace(pointer, checkpoint_dir / LATEST_FILE)
    _fsync_dir(checkpoint_dir)


def save_checkpoint(checkpoint_dir: Path, name: str, states: Mapping[str, Any], *, step: int, epoch: int,
                    same_as: Path | None = None) -> Path:
    """Write `states` (name -> state; "model" a mapping of tensors) as `checkpoint_dir/name/` and point `latest`
    at it, never leaving `latest` without a complete checkpoint behind it (module docstring); returns its path.
    `same_as`: a checkpoint holding the same large states (`write_full`)."""
    return install_checkpoint(checkpoint_dir, name,
                              lambda tmp: write_full(tmp, states, step=step, epoch=epoch, same_as=same_as))


def write_full(folder: Path, states: Mapping[str, Any], *, step: int, epoch: int, same_as: Path | None = None
               ) -> None:
    """The full form's files of `states` into the existing `folder` (`checkpoint.json` last): `model.safetensors`,
    a `{name}.pt` for each of `OWN_FILE_STATES`, `train_state.pt` for the rest. `same_as`: a checkpoint whose
    model and `OWN_FILE_STATES` these states are (a second name for the state of one step): its files of them
    become this checkpoint's too (hard links: written once, and either name may be removed)."""
    reused: dict[str, str | None] = {}
    if same_as is not None:
        files = [MODEL_FILE, *(f"{key}.pt" for key in OWN_FILE_STATES if key in states)]
        reused = link_files(same_as, folder, files)
    if MODEL_FILE not in reused:
        # safetensors refuses shared or non-contiguous storage: save plain contiguous copies
        tensors = {key: value.detach().contiguous() for key, value in states[MODEL].items()}
        _write_fsynced(folder / MODEL_FILE, lambda p: write_safetensors(tensors, p))
    for key in OWN_FILE_STATES:
        if key in states and f"{key}.pt" not in reused:
            _write_fsynced(folder / f"{key}.pt", lambda p, state=states[key]: torch.save(state, p))
    write_state_file(folder, {key: value for key, value in states.items()
                              if key != MODEL and key not in OWN_FILE_STATES})
    write_meta(folder, step, epoch, known=reused)


def _new_file_mode() -> int:
    """The mode `open()` gives a new file here: 0o666 less the process's umask (read, not changed, where Linux
    says it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """`tensors` as a safetensors file with the mode of every other file written (safetensors makes it 0600)."""
    save_file(dict(tensors), str(path))
    os.chmod(path, _new_file_mode())


def link_files(source: Path, folder: Path, files: list[str]) -> dict[str, str | None]:
    """Hard-link `files` of the checkpoint `source` into `folder`: one copy on disk under both names, which
    outlives the removal of either (copied where the filesystem has no hard links). {file: its checksum recorded
    in `source` (None: not recorded)} of those linked; a file missing there is left out."""
    recorded = (_read_meta(source) or {}).get("checksums") or {}
    linked: dict[str, str | None] = {}
    for file in files:
        if not (source / file).is_file():
            continue
        try:
            os.link(source / file, folder / file)
        except OSError:
            _write_fsynced(folder / file, lambda p, file=file: shutil.copyfile(source / file, p))
        linked[file] = recorded.get(file)
    return linked


def write_state_file(folder: Path, states: Mapping[str, Any]) -> None:
    """`train_state.pt`: named states of tensors, numbers, strings and containers (read back weights-only)."""
    _write_fsynced(folder / STATE_FILE, lambda p: torch.save(dict(states), p))


def install_checkpoint(checkpoint_dir: Path, name: str, write: Callable[[Path], None]) -> Path:
    """`write(folder)` fills a hidden temporary folder with a checkpoint's files (`checkpoint.json` last), which
    then becomes `checkpoint_dir/name/` and `latest` (a save, or a copy from a --remote-sync backup); returns it."""
    tmp = staging_dir(checkpoint_dir, name, f"{os.getpid()}")
    try:
        tmp.mkdir()
        write(tmp)
    except BaseException:  # an interrupted write (Ctrl-C, full disk) leaves no temp directory behind
        discard(tmp)
        raise
    return publish(checkpoint_dir, name, tmp)


def staging_dir(checkpoint_dir: Path, name: str, tag: str) -> Path:
    """The hidden folder `.tmp-{name}-{tag}` a save writes before `publish` (not created here); the leftovers of
    interrupted saves are removed first (one writer per run: none is live)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(checkpoint_dir)
    return checkpoint_dir / f".tmp-{name}-{tag}"


def publish(checkpoint_dir: Path, name: str, tmp: Path) -> Path:
    """A complete hidden folder `tmp` (its `checkpoint.json` written last) becomes `checkpoint_dir/name/` and
    `latest`, never leaving `latest` without a complete checkpoint behind it (module docstring); returns it."""
    final = checkpoint_dir / name
    try:
        _fsync_dir(tmp)
    except BaseException:
        discard(tmp)
        raise
    if not final.exists():
        os.replace(tmp, final)
        _fsync_dir(checkpoint_dir)
        _point_latest(checkpoint_dir, name)
        clean_stale(checkpoint_dir)  # a `.new` copy the old pointer still named
        return final
    # re-saving a name in use: the old copy stays complete and reachable until the new one is pointed to
    staged = checkpoint_dir / f"{name}{_NEW_SUFFIX}"
    discard(staged)  # a complete leftover of an earlier crash: superseded by this save
    os.replace(tmp, staged)
    _fsync_dir(checkpoint_dir)
    _point_latest(checkpoint_dir, staged.name)
    old = checkpoint_dir / f".old-{name}-{os.getpid()}"
    os.replace(final, old)
    os.replace(staged, final)
    _fsync_dir(checkpoint_dir)
    _point_latest(checkpoint_dir, name)
    discard(old)
    return final


def publish_sharded(checkpoint_dir: Path, name: str, folder: Path, other_states: Mapping[str, Any], *, step: int,
                    epoch: int, shards: list[str], known: Mapping[str, str | None] | None = None) -> Path:
    """On rank 0 once every rank's shards of the states `shards` are in `folder` (`sharded.write_shards`):
    `train_state.pt` of `other_states`, `checkpoint.json`, publish. `known`: checksums recorded already (shards
    linked from a checkpoint of the same step)."""
    try:
        write_state_file(folder, other_states)
        write_meta(folder, step, epoch, known=known, format=sharded.FORMAT, sharded=sorted(shards))
    except BaseException:
        discard(folder)
        raise
    return publish(checkpoint_dir, name, folder)


def write_meta(folder: Path, step: int, epoch: int, *, known: Mapping[str, str | None] | None = None,
               **fields: Any) -> None:
    """`checkpoint.json`, the last file of a save: step, epoch, `fields`, and the size and checksum of every file
    in `folder` (a reader checks them: a truncated, missing or altered file is named). `known`: checksums already
    recorded for some of them (files linked from another checkpoint), not computed again."""
    files = [path for path in sorted(folder.iterdir()) if path.is_file()]
    sizes = {path.name: path.stat().st_size for path in files}
    known = {file: value for file, value in (known or {}).items() if value is not None}
    found = {**checksums([path for path in files if path.name not in known]), **known}
    meta = {"step": step, "epoch": epoch, **fields, "sizes": sizes, "checksums": dict(sorted(found.items()))}
    _write_fsynced(folder / META_FILE, lambda p: p.write_text(json.dumps(meta) + "\n"))


def file_checksum(path: Path) -> str:
    """`CHECKSUM:<hex>` of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(_CHECKSUM_BLOCK):
            digest.update(block)
    return f"{CHECKSUM}:{digest.hexdigest()}"


def checksums(files: list[Path]) -> dict[str, str]:
    """{name: `file_checksum`} of `files`, hashed side by side (hashlib releases the GIL: a sharded checkpoint's
    shards are read in parallel)."""
    if not files:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        return dict(zip([path.name for path in files], pool.map(file_checksum, files), strict=True))


# ----------------------------------------------------------------------------------------------- find


def is_complete(path: Path) -> bool:
    """`checkpoint.json` (written last, it marks a finished save) and the state files of its form are there: the
    full form's `model.safetensors`, or a sharded one's DCP `.metadata`, beside `train_state.pt`."""
    return (path.is_dir() and (path / META_FILE).is_file() and (path / STATE_FILE).is_file()
            and ((path / MODEL_FILE).is_file() or (path / sharded.DCP_METADATA).is_file()))


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def _order_key(path: Path) -> tuple[int, int, str]:
    """(step, epoch, name) of a checkpoint from its `checkpoint.json`; (-1, -1, name) when that cannot be read
    (tried last, reported when it is tried)."""
    try:
        meta = _read_meta(path) or {}
        return (int(meta["step"]), int(meta["epoch"]), path.name)
    except (KeyError, TypeError, ValueError):
        return (-1, -1, path.name)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder was saved at (its `checkpoint.json`); -1 when that cannot be read."""
    return _order_key(path)[0]


def _pointer_target(checkpoint_dir: Path) -> str | None:
    try:
        return (checkpoint_dir / LATEST_FILE).read_text().strip() or None
    except OSError:
        return None


def candidates(checkpoint_dir: Path, notify: Notify | None = None) -> list[Path]:
    """The complete checkpoints of a run, in the order `latest` tries them: the one the pointer names, then
    the others by step (highest first). When the pointer is missing or names nothing complete, `notify`
    hears which one is used instead."""
    if not checkpoint_dir.is_dir():
        return []
    complete = [p for p in checkpoint_dir.iterdir() if not p.name.startswith(".") and is_complete(p)]
    ordered = sorted(complete, key=_order_key, reverse=True)
    target = _pointer_target(checkpoint_dir)
    named = checkpoint_dir / target if target else None
    if target is not None and named is not None and named not in ordered and target.endswith(_NEW_SUFFIX):
        named = named.with_name(target[: -len(_NEW_SUFFIX)])  # a re-save stopped after moving the new copy in
    if named is not None and named in ordered:
        ordered.remove(named)
        return [named, *ordered]
    if ordered and notify is not None:
        said = f"names {target!r}, which is missing or incomplete" if target else "is missing"
        step = _order_key(ordered[0])[0]
        notify(f"{checkpoint_dir / LATEST_FILE} {said}; using {ordered[0].name} "
               f"(step {step}, the highest complete one)")
    return ordered


def find_latest(checkpoint_dir: Path, notify: Notify | None = None) -> Path | None:
    """The checkpoint `latest` names; else the complete one with the highest step; else None."""
    found = candidates(checkpoint_dir, notify)
    return found[0] if found else None


# ----------------------------------------------------------------------------------------------- read


def _read(directory: Path, device: str | torch.device) -> Checkpoint:
    """One checkpoint, or CheckpointError naming the file and what is wrong with it."""
    damaged = f"checkpoint {str(directory)!r} is damaged"
    meta = _read_meta(directory)
    if meta is None or _order_key(directory)[0] < 0:
        raise CheckpointError(f"{damaged} ({META_FILE}: cannot be read)")
    for file, expected in meta.get("sizes", {}).items():
        size = (directory / file).stat().st_size if (directory / file).is_file() else None
        if size is None:
            raise CheckpointError(f"{damaged} ({file}: missing, written {expected} bytes)")
        if size != expected:
            raise CheckpointError(f"{damaged} ({file}: {size} bytes, written {expected})")
    train_state: dict[str, Any] = {}
    # train_state.pt, and each of `OWN_FILE_STATES` in its own file (a checkpoint written before holds them in it)
    for file in [STATE_FILE, *(f"{key}.pt" for key in OWN_FILE_STATES if f"{key}.pt" in meta.get("sizes", {}))]:
        try:
            state = torch.load(directory / file, map_location=device, weights_only=True)
        except Exception as error:  # "PytorchStreamReader failed ...", UnpicklingError, EOFError
            raise CheckpointError(f"{damaged} ({file}: {_first_line(error)})") from None
        if file == STATE_FILE:
            train_state.update(state)
        else:
            train_state[file.removesuffix(".pt")] = state
    if meta.get("format") == sharded.FORMAT:
        names = tuple(meta.get("sharded", ()))
        problem = sharded.metadata_problem(directory, names)
        if problem is not None:
            raise CheckpointError(f"{damaged} ({problem})")
        _check_checksums(directory, meta, damaged)
        return Checkpoint(directory, int(meta["step"]), int(meta["epoch"]), train_state, names)
    try:
        model_state = load_file(str(directory / MODEL_FILE), device=str(device))
    except Exception as error:  # safetensors' SafetensorError, OSError: one line, not a traceback
        raise CheckpointError(f"{damaged} ({MODEL_FILE}: {_first_line(error)})") from None
    _check_checksums(directory, meta, damaged)
    return Checkpoint(directory, int(meta["step"]), int(meta["epoch"]), {MODEL: model_state, **train_state})


def _check_checksums(directory: Path, meta: dict[str, Any], damaged: str) -> None:
    """Every file's bytes are those written (bytes changed at the same size load without an error, or fail deep
    inside a reader); a checkpoint written before checksums were recorded is not checked."""
    recorded = meta.get("checksums") or {}
    files = [directory / file for file, value in recorded.items() if str(value).startswith(f"{CHECKSUM}:")]
    found = checksums(files)
    for file in sorted(found):
        if found[file] != recorded[file]:
            raise CheckpointError(f"{damaged} ({file}: its checksum is not the one written: the file changed "
                                  f"since it was saved)")


def _first_line(error: BaseException) -> str:
    """`Type: first sentence` of an error (torch's archive errors go on for a paragraph)."""
    text = str(error).strip()
    text = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def load_latest(checkpoint_dir: Path, device: str | torch.device = "cpu", notify: Notify | None = None
                ) -> Checkpoint | None:
    """The newest usable checkpoint of a run, or None when it has none.

    Tries `candidates` in order; each damaged one is reported through `notify` in one line, naming the one
    used instead."""
    notify = notify or _log.warning
    found = candidates(checkpoint_dir, notify)
    for index, directory in enumerate(found):
        try:
            return _read(directory, device)
        except CheckpointError as error:
            following = found[index + 1] if index + 1 < len(found) else None
            notify(f"{error}; " + (f"using {following.name} (step {_order_key(following)[0]})" if following
                                   else "no earlier complete checkpoint"))
    return None


def _openclip_name(path: Path, notify: Notify | None) -> Path:
    """OpenCLIP's README resumes from `checkpoints/epoch_K.pt`: its checkpoint of epoch K is the folder here."""
    folder = path.with_suffix("")
    if path.suffix == ".pt" and not path.exists() and is_complete(folder):
        (notify or _log.warning)(f"{path}: OpenCLIP's checkpoint file is the folder {folder} here; using it")
        return folder
    return path


def read_run_state(path: str | Path) -> dict[str, Any] | None:
    """The `run` state (the run config, architecture, world size) of the checkpoint `load_checkpoint(path)` would
    read, its tensors only memory-mapped, not read; None where there is none it can read (the resume then says
    why)."""
    path = _openclip_name(Path(path), notify=lambda line: None)
    if path.is_file():
        path = path.parent
    for directory in [path] if is_complete(path) else candidates(path):
        try:
            state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # damaged: the resume reads the checkpoints in order and names it
            continue
        if isinstance(state, dict) and isinstance(state.get("run"), dict):
            return state["run"]
    return None


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", notify: Notify | None = None
                    ) -> Checkpoint:
    """A checkpoint directory (a damaged one is a CheckpointError; OpenCLIP's name `epoch_K.pt` for `epoch_K`), a
    file inside one, or a run's `checkpoints/` folder (its newest usable checkpoint, falling back past damaged ones,
    said through `notify`)."""
    path = _openclip_name(Path(path), notify)
    given = path
    if path.is_file():
        path = path.parent
    if is_complete(path):
        return _read(path, device)
    found = load_latest(path, device, notify)
    if found is None and given.is_file():  # a weight file of another kind, a text file: say what it is not
        raise FileNotFoundError(f"{str(given)!r} is not a naflexclip checkpoint: a file outside any checkpoint "
                                f"directory (one holds {MODEL_FILE}, {STATE_FILE}, {META_FILE})")
    if found is None:
        raise FileNotFoundError(f"no usable checkpoint ({MODEL_FILE}, {STATE_FILE}, {META_FILE}) at {str(path)!r}")
    return found

"""Checkpoints: one directory per save, weights as safetensors, training state as a weights-only torch file.

Layout (`{--logs}/{--name}/checkpoints/`):

    epoch_3/            saved after epoch 3 (--save-frequency)
    step_00000200/      saved after optimizer step 200 (--save-every-n-steps, --stop-after-steps, a clean stop)
        model.safetensors   the full (unwrapped, gathered) model state
        train_state.pt      config, progress (epoch, step, next batch), optimizer, schedule, grad scaler,
                            every rank's RNG states
        checkpoint.json     step, epoch and the two files' sizes; written last, so it marks a complete save
    latest              the name of the newest complete checkpoint directory

A save never removes the last complete checkpoint before the new one is complete and pointed to: it
writes a hidden `.tmp-*` directory, fsyncs it, renames it to a name that is not in use, and only then
moves `latest` (temp file + `os.replace`). Re-saving a name that exists (a resumed run reaching the same
step) goes through `{name}.new`: pointer to it, old copy renamed aside, new copy renamed to `{name}`,
pointer back. A crash at any moment leaves `latest` naming a complete checkpoint or, at worst, naming one
that is gone while a complete copy of the same step is in place; `latest` then falls back to the
complete checkpoint with the highest step (not the newest file time) and says so. Damaged files
(truncated state, broken safetensors header, wrong size) are reported in one line and the next
checkpoint by step is used. Leftover `.tmp-*` / `.old-*` directories of a crashed save are removed by
the next save. Non-tensor state is read back with `torch.load(weights_only=True)`: no arbitrary pickle.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from naflexclip.data.loader import NaFlexLoader
from naflexclip.factory import create_model
from naflexclip.lock import Locks
from naflexclip.model import NaFlexClip, config_from_dict, load_weights

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
META_FILE = "checkpoint.json"
LATEST_FILE = "latest"
# hidden leftovers of an interrupted save: the temp directory, the old copy swapped out, the pointer's temp file
_STALE = re.compile(r"^\.(tmp|old)-")
_NEW_SUFFIX = ".new"

Notify = Callable[[str], None]
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete or damaged); the message is one line."""


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


def _discard(path: Path) -> None:
    """Remove a leftover directory or file; failing to is not worth failing a run over."""
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
                _discard(path)


def _point_latest(checkpoint_dir: Path, name: str) -> None:
    pointer = checkpoint_dir / f".tmp-{LATEST_FILE}-{os.getpid()}"
    _write_fsynced(pointer, lambda p: p.write_text(name + "\n"))
    os.replace(pointer, checkpoint_dir / LATEST_FILE)
    _fsync_dir(checkpoint_dir)


def save_checkpoint(checkpoint_dir: Path, name: str, model_state: dict[str, torch.Tensor],
                    train_state: dict[str, Any]) -> Path:
    """Write `checkpoint_dir/name/` and point `latest` at it, never leaving `latest` without a complete
    checkpoint behind it (module docstring); returns its path."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(checkpoint_dir)
    final = checkpoint_dir / name
    tmp = checkpoint_dir / f".tmp-{name}-{os.getpid()}"
    try:
        tmp.mkdir()
        # safetensors refuses shared or non-contiguous storage: save plain contiguous copies
        tensors = {key: value.detach().contiguous() for key, value in model_state.items()}
        _write_fsynced(tmp / MODEL_FILE, lambda p: save_file(tensors, str(p)))
        _write_fsynced(tmp / STATE_FILE, lambda p: torch.save(train_state, p))
        progress = train_state.get("progress", {})
        meta = {"step": progress.get("step"), "epoch": progress.get("epoch"),
                "sizes": {f: (tmp / f).stat().st_size for f in (MODEL_FILE, STATE_FILE)}}
        _write_fsynced(tmp / META_FILE, lambda p: p.write_text(json.dumps(meta) + "\n"))
        _fsync_dir(tmp)
    except BaseException:  # an interrupted write (Ctrl-C, full disk) leaves no temp directory behind
        _discard(tmp)
        raise
    if not final.exists():
        os.replace(tmp, final)
        _fsync_dir(checkpoint_dir)
        _point_latest(checkpoint_dir, name)
        clean_stale(checkpoint_dir)  # a `.new` copy the old pointer still named
        return final
    # re-saving a name in use: the old copy stays complete and reachable until the new one is pointed to
    staged = checkpoint_dir / f"{name}{_NEW_SUFFIX}"
    _discard(staged)  # a complete leftover of an earlier crash: superseded by this save
    os.replace(tmp, staged)
    _fsync_dir(checkpoint_dir)
    _point_latest(checkpoint_dir, staged.name)
    old = checkpoint_dir / f".old-{name}-{os.getpid()}"
    os.replace(final, old)
    os.replace(staged, final)
    _fsync_dir(checkpoint_dir)
    _point_latest(checkpoint_dir, name)
    _discard(old)
    return final


# ----------------------------------------------------------------------------------------------- find


def is_complete(path: Path) -> bool:
    """Both files are there (checkpoints written before `checkpoint.json` existed count as complete)."""
    return path.is_dir() and (path / MODEL_FILE).is_file() and (path / STATE_FILE).is_file()


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def _order_key(path: Path) -> tuple[int, int, str]:
    """(step, epoch, name) of a checkpoint, from `checkpoint.json` or else the state file; (-1, -1, name) when
    neither can be read (tried last)."""
    meta = _read_meta(path)
    if meta is None or meta.get("step") is None:
        try:
            progress = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)["progress"]
            meta = {"step": progress["step"], "epoch": progress["epoch"]}
        except Exception:  # a damaged state file: ordered last, reported when it is tried
            return (-1, -1, path.name)
    return (int(meta["step"]), int(meta.get("epoch") or 0), path.name)


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
    if named is not None and named not in ordered and target.endswith(_NEW_SUFFIX):
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


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from what a user passes: the directory, a file inside it, or a run's
    `checkpoints/` folder (its latest checkpoint)."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    if is_complete(path):
        return path
    latest = find_latest(path)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint (model.safetensors + train_state.pt) at {str(path)!r}")
    return latest


# ----------------------------------------------------------------------------------------------- read


def _read(directory: Path, device: str | torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    """Both files of one checkpoint, or CheckpointError naming the file and what is wrong with it."""
    damaged = f"checkpoint {str(directory)!r} is damaged"
    meta = _read_meta(directory)
    for file in (MODEL_FILE, STATE_FILE):
        expected = (meta or {}).get("sizes", {}).get(file)
        size = (directory / file).stat().st_size if (directory / file).is_file() else None
        if expected is not None and size != expected:
            raise CheckpointError(f"{damaged} ({file}: {size} bytes, written {expected})")
    try:
        model_state = load_file(str(directory / MODEL_FILE), device=str(device))
    except Exception as error:  # safetensors' SafetensorError, OSError: one line, not a traceback
        raise CheckpointError(f"{damaged} ({MODEL_FILE}: {_first_line(error)})") from None
    try:
        train_state = torch.load(directory / STATE_FILE, map_location=device, weights_only=True)
    except Exception as error:  # "PytorchStreamReader failed ...", UnpicklingError, EOFError
        raise CheckpointError(f"{damaged} ({STATE_FILE}: {_first_line(error)})") from None
    return model_state, train_state


def _first_line(error: BaseException) -> str:
    """`Type: first sentence` of an error (torch's archive errors go on for a paragraph)."""
    text = str(error).strip()
    text = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def load_latest(checkpoint_dir: Path, device: str | torch.device = "cpu", notify: Notify | None = None
                ) -> tuple[Path, dict[str, torch.Tensor], dict] | None:
    """(path, model state, training state) of the newest usable checkpoint of a run, or None when it has none.

    Tries `candidates` in order; each damaged one is reported through `notify` in one line, naming the one
    used instead."""
    notify = notify or _log.warning
    found = candidates(checkpoint_dir, notify)
    for index, directory in enumerate(found):
        try:
            model_state, train_state = _read(directory, device)
        except CheckpointError as error:
            following = found[index + 1] if index + 1 < len(found) else None
            notify(f"{error}; " + (f"using {following.name} (step {_order_key(following)[0]})" if following
                                   else "no earlier complete checkpoint"))
            continue
        return directory, model_state, train_state
    return None


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    notify: Notify | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, training state) of a checkpoint; the state is loaded weights-only.

    `path` is a checkpoint directory (a damaged one is a CheckpointError) or a run's `checkpoints/` folder
    (its newest usable checkpoint, falling back past damaged ones, said through `notify`)."""
    return load_checkpoint_from(path, device, notify)[1:]


def load_checkpoint_from(path: str | Path, device: str | torch.device = "cpu", notify: Notify | None = None
                         ) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """`load_checkpoint`, with the directory it read first."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    if is_complete(path):
        return (path, *_read(path, device))
    found = load_latest(path, device, notify)
    if found is None:
        raise FileNotFoundError(f"no usable checkpoint (model.safetensors + train_state.pt) at {str(path)!r}")
    return found


def load_checkpoint_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The trained model (eval mode, on `device`) and the run's config as a plain dict.

    The architecture comes from the checkpoint's own `model_config` (so a later change to a preset does
    not break it); checkpoints without one are rebuilt from the preset name."""
    directory, model_state, train_state = load_checkpoint_from(path, device)
    config = train_state["config"]
    if train_state.get("model_config") is not None:
        model = NaFlexClip(config_from_dict(train_state["model_config"]))
    else:
        model = create_model(config["model"], loss=config["loss"])
    load_weights(model, model_state, f"checkpoint {str(directory)!r}")
    return model.to(device).eval(), config


# --------------------------------------------------------------------------------------------- resume

# What a resume may not change, because the continued run would be another run: the model and its loss,
# and what the saved data position means (the sample order and the batch plan of every epoch). Any other
# flag is applied and listed; these are not compared at all (where a run writes, when it stops, devices).
BREAKING_TOP = {"model": "the model", "pretrained": "the model", "loss": "the loss",
                # the optimizer state holds the trainable parameters only (a run unlocking more is a new run)
                **dict.fromkeys(Locks().as_dict(), "which parameters train")}
BREAKING_DATA = ("train_data", "dataset_type", "csv_img_key", "csv_caption_key", "csv_separator", "seed",
                 "synthetic_seed", "synthetic_train_size", "synthetic_shape_group_size", "train_num_samples",
                 "shuffle_buffer", "naflex_seq_lens", "naflex_seq_len_probs", "naflex_max_tokens_per_batch",
                 "naflex_batch_divisor")
NOT_COMPARED = ("name", "logs", "resume", "resume_fresh", "stop_after_steps", "device", "dist_timeout", "plot",
                "report_to")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _shown(value: Any) -> str:
    """A flag's value as typed on the command line (`unset` for None, a list space-separated, a string quoted
    where it holds a space or comma), so the one-line notice of changed flags reads unambiguously."""
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return " ".join(_shown(v) for v in value)
    text = str(value)
    return shlex.quote(text) if isinstance(value, str) and (not text or re.search(r"[\s,']", text)) else text


def _plain(value: Any) -> Any:
    """Lists and tuples compare alike (a config may come back from a checkpoint with either)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def position_remaps(data_state: dict[str, Any]) -> bool:
    """True when the saved data position means the same samples at any world size: every rank's loader
    state names one place in the epoch's global sample order (`NaFlexLoader.can_remap`). Not so for
    checkpoints without per-rank states, streamed shards, or a rank caught inside a split microbatch."""
    return NaFlexLoader.can_remap(data_state.get("ranks") or [])


def resume_errors(saved: dict[str, Any], current: dict[str, Any], saved_world_size: int, world_size: int,
                  data_state: dict[str, Any]) -> str | None:
    """Why a run with config `current` cannot continue the checkpoint saved with `saved` (one line naming the
    flag and both values), or None. Configs are `TrainConfig.to_dict()` forms."""
    for key, what in BREAKING_TOP.items():
        if key in saved and _plain(saved[key]) != _plain(current.get(key)):
            return (f"{_flag(key)}: the checkpoint has {saved[key]!r}, this run {current.get(key)!r}; a resume cannot "
                    f"change {what} (keep {_flag(key)} as it was, or start a new --name)")
    old_data, new_data = saved.get("data", {}), current.get("data", {})
    for key in BREAKING_DATA:
        if key in old_data and _plain(old_data[key]) != _plain(new_data.get(key)):
            return (f"{_flag(key)}: the checkpoint has {old_data[key]!r}, this run {new_data.get(key)!r}; a resume "
                    f"cannot change the training data or its order (keep {_flag(key)} as it was, or start a new "
                    f"--name)")
    if saved_world_size != world_size and not position_remaps(data_state):
        return (f"world size: the checkpoint was saved by {saved_world_size} process(es), this run has {world_size}; "
                f"its per-rank data position cannot be re-mapped exactly (resume with {saved_world_size})")
    return None


def architecture_changes(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """The fields of two `config_to_dict` architectures that differ, as `name: old -> new`."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += architecture_changes(old, new, f"{prefix}{key}.")
        elif _plain(old) != _plain(new):
            changes.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changes


def resume_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The flags a resume applies although the checkpoint was saved with other values, as `--flag old -> new`."""
    changes = []
    for key in sorted(set(saved) & set(current)):
        if key == "data" or key in NOT_COMPARED:
            continue
        if _plain(saved[key]) != _plain(current[key]):
            changes.append(f"{_flag(key)} {_shown(saved[key])} -> {_shown(current[key])}")
    old_data, new_data = saved.get("data", {}), current.get("data", {})
    for key in sorted(set(old_data) & set(new_data)):
        if key not in BREAKING_DATA and _plain(old_data[key]) != _plain(new_data[key]):
            changes.append(f"{_flag(key)} {_shown(old_data[key])} -> {_shown(new_data[key])}")
    return changes


# ------------------------------------------------------------------------------------------------ RNG


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every generator this process draws from, in weights-only-loadable types (tensors, ints, tuples).

    `device`: the process's CUDA device, whose generator is saved (`cuda`: one state tensor); without one,
    no CUDA state is saved."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    cuda = device is not None and device.type == "cuda"
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else [],
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss),
                  float(np_gauss)),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore `rng_state()`; its CUDA state goes to `device` (checkpoints from before per-rank states hold a
    list of every visible device's state, restored as such)."""
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, torch.Tensor):
        if device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda, device)
    elif cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))

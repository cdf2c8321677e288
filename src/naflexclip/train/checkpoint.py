"""Checkpoints: one directory per save, weights as safetensors, training state as a weights-only torch file.

Layout (`{--logs}/{--name}/checkpoints/`):

    epoch_3/            saved after epoch 3 (--save-frequency)
    step_00000200/      saved after optimizer step 200 (--save-every-n-steps, --stop-after-steps)
        model.safetensors   the full (unwrapped, gathered) model state
        train_state.pt      config, progress (epoch, step, next batch), optimizer, schedule, grad scaler, RNG
    latest              the name of the newest complete checkpoint directory

A save writes a hidden temporary directory, fsyncs it, then renames it into place, and only then rewrites
`latest` (temp file + `os.replace`); a crash at any moment leaves the previous checkpoint and pointer
intact. Non-tensor state is read back with `torch.load(weights_only=True)`: no arbitrary pickle.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from naflexclip.model import NaFlexClip, config_from_dict, create_model, load_weights

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
LATEST_FILE = "latest"


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


def save_checkpoint(checkpoint_dir: Path, name: str, model_state: dict[str, torch.Tensor],
                    train_state: dict[str, Any]) -> Path:
    """Write `checkpoint_dir/name/` atomically and point `latest` at it; returns its path."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / name
    tmp = checkpoint_dir / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # safetensors refuses shared or non-contiguous storage: save plain contiguous copies
    tensors = {key: value.detach().contiguous() for key, value in model_state.items()}
    _write_fsynced(tmp / MODEL_FILE, lambda p: save_file(tensors, str(p)))
    _write_fsynced(tmp / STATE_FILE, lambda p: torch.save(train_state, p))
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same point (e.g. after a resume): swap the old one out first
        old = checkpoint_dir / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(checkpoint_dir)
    pointer = checkpoint_dir / f".tmp-{LATEST_FILE}-{os.getpid()}"
    _write_fsynced(pointer, lambda p: p.write_text(name + "\n"))
    os.replace(pointer, checkpoint_dir / LATEST_FILE)
    _fsync_dir(checkpoint_dir)
    return final


def is_complete(path: Path) -> bool:
    return (path / MODEL_FILE).is_file() and (path / STATE_FILE).is_file()


def find_latest(checkpoint_dir: Path) -> Path | None:
    """The checkpoint `latest` names; else the complete one with the newest state file; else None."""
    pointer = checkpoint_dir / LATEST_FILE
    if pointer.is_file():
        candidate = checkpoint_dir / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
    if not checkpoint_dir.is_dir():
        return None
    complete = [p for p in checkpoint_dir.iterdir() if not p.name.startswith(".") and is_complete(p)]
    return max(complete, key=lambda p: (p / STATE_FILE).stat().st_mtime, default=None)


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


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """(model state dict, training state) of a checkpoint; the state is loaded weights-only."""
    directory = resolve(path)
    model_state = load_file(str(directory / MODEL_FILE), device=str(device))
    train_state = torch.load(directory / STATE_FILE, map_location=device, weights_only=True)
    return model_state, train_state


def load_checkpoint_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The trained model (eval mode, on `device`) and the run's config as a plain dict.

    The architecture comes from the checkpoint's own `model_config` (so a later change to a preset does
    not break it); checkpoints without one are rebuilt from the preset name."""
    model_state, train_state = load_checkpoint(path, device)
    config = train_state["config"]
    if train_state.get("model_config") is not None:
        model = NaFlexClip(config_from_dict(train_state["model_config"]))
    else:
        model = create_model(config["model"], siglip=config["siglip"])
    load_weights(model, model_state, f"checkpoint {str(resolve(path))!r}")
    return model.to(device).eval(), config


# ------------------------------------------------------------------------------------------------ RNG


def rng_state() -> dict[str, Any]:
    """Every generator a run draws from, in weights-only-loadable types (tensors, ints, tuples)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss),
                  float(np_gauss)),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))

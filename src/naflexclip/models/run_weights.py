"""A naflexclip run's checkpoint as a model: its architecture (`model_config`) and weights, nothing else.

`train --pretrained logs/run/checkpoints`, `create_model(NAME, pretrained=...)`, `eval`, `verify`, `export` and
teachers read a run's weights here; the path is one `load_checkpoint` takes. Optimizer, schedule, data position,
step and random streams stay behind (that is `--resume`): docs/training.md#checkpoints-and-resume. Either form:
a sharded checkpoint's model is gathered whole in this process from its shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from naflexclip.checkpoints import storage as storage
from naflexclip.models.naflex_clip import (
    PRESETS,
    ModelConfig,
    NaFlexClip,
    config_from_dict,
    config_to_dict,
    load_weights,
    model_config,
)


def _plain(value: Any) -> Any:
    """Lists and tuples compare alike (a config may come back from a checkpoint with either)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


# regularisation rates of the architecture: they change no weight, so a resume may change them (OpenCLIP's
# --force-patch-dropout: fine-tune without patch dropout near the end)
_RATES = ("image.patch_drop_rate",)


def architecture_changes(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """The fields of two `config_to_dict` architectures that differ, as `name: old -> new`."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += architecture_changes(old, new, f"{prefix}{key}.")
        elif _plain(old) != _plain(new) and f"{prefix}{key}" not in _RATES:
            changes.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changes


def is_run_checkpoint(path: str | Path) -> bool:
    """True when `path` is a naflexclip checkpoint directory, a file inside one, or a folder holding complete
    ones (a run's `checkpoints/`); reads no weights."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    return storage.is_complete(path) or bool(storage.candidates(path))


@dataclasses.dataclass(frozen=True)
class RunWeights:
    """What a new run takes from a checkpoint: where it is, the step it was saved at, the architecture, the
    weights, and the run config it was trained with (its loss, its data processing)."""

    path: Path
    step: int
    config: ModelConfig
    weights: dict[str, Any]
    run_config: dict[str, Any]

    @property
    def model_name(self) -> str:
        """The --model of the run that wrote it (for a run started from a pretrained directory: that family's)."""
        return str(self.run_config.get("model") or "")


def read_run_weights(path: str | Path, notify: storage.Notify | None = None) -> RunWeights:
    """The model part of the checkpoint at `path` (see the module docstring); one-line ValueError/FileNotFoundError
    naming the path when there is none or it is damaged."""
    found = storage.load_checkpoint(path, notify=notify)
    run = found.states["run"]
    return RunWeights(found.path, found.step, config_from_dict(run["model_config"]), found.full_state(storage.MODEL),
                      run["config"])


def model_name_conflict(name: str | None, found: RunWeights) -> str | None:
    """Why model `name` (`--model`) cannot take the checkpoint's weights, in one line, or None: the checkpoint's own
    name, or a preset whose architecture is the checkpoint's, fits; any other is another architecture."""
    if name is None or name == found.model_name:
        return None
    if name in PRESETS:
        preset = model_config(name, loss=found.config.loss)
        changed = architecture_changes(config_to_dict(preset), config_to_dict(found.config))
        if not changed:
            return None
        shown = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
        detail = f"the preset's architecture is not the checkpoint's (preset -> checkpoint: {shown})"
    else:
        detail = "another model"
    return (f"--model {name}: the --pretrained checkpoint {str(found.path)!r} is a {found.model_name or 'other'} "
            f"model and {detail}; drop --model (the checkpoint's architecture is used)")


def with_overrides(config: ModelConfig, overrides: dict[str, Any], where: str) -> ModelConfig:
    """The checkpoint's architecture with tower fields that keep the weights (`drop_path_rate=0.1`, ...); `loss`
    may only repeat the checkpoint's (another would add or drop `logit_bias`)."""
    loss = overrides.get("loss")
    if loss is not None and loss != config.loss:
        raise ValueError(f"--loss {loss}: {where} is a model trained with --loss {config.loss}; drop --loss")
    image_fields = {f.name for f in dataclasses.fields(config.image)}
    text_fields = {f.name for f in dataclasses.fields(config.text)}
    image = {k: v for k, v in overrides.items() if k in image_fields}
    text = {k: v for k, v in overrides.items() if k in text_fields and k not in image_fields}
    unknown = sorted(set(overrides) - set(image) - set(text) - {"loss"})
    if unknown:
        raise ValueError(f"override {unknown[0]!r} does not apply to the model of {where}")
    return dataclasses.replace(config, image=dataclasses.replace(config.image, **image),
                               text=dataclasses.replace(config.text, **text))


def load_run_model(path: str | Path, name: str | None = None, **overrides: Any) -> NaFlexClip:
    """A new model with the architecture and weights of the checkpoint at `path` (nothing else of its run);
    `name`: a --model that must fit it (`model_name_conflict`); `overrides`: as `with_overrides`."""
    found = read_run_weights(path)
    conflict = model_name_conflict(name, found)
    if conflict is not None:
        raise ValueError(conflict)
    where = f"checkpoint {str(found.path)!r}"
    model = NaFlexClip(with_overrides(found.config, overrides, where))
    load_weights(model, found.weights, where)
    return model


def load_checkpoint_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[NaFlexClip, dict[str, Any]]:
    """The trained model of a checkpoint (eval mode, on `device`) and its run's config as a plain dict; the
    architecture is the checkpoint's own (a later change to a preset does not break it)."""
    found = storage.load_checkpoint(path, device)
    run = found.states["run"]
    model = NaFlexClip(config_from_dict(run["model_config"]))
    load_weights(model, found.full_state(storage.MODEL), f"checkpoint {str(found.path)!r}")
    return model.to(device).eval(), run["config"]


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of a model's weights (every tensor of its state dict: name, dtype, shape and bytes, in name order):
    which weights a run read, whatever path it read them from."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

"""The run's state, one owner per piece: each component saves and restores itself through `state_dict()` /
`load_state_dict()` (torchtitan's `Stateful`), and `checkpoints.manager.CheckpointManager` stores them by name.

`run` (config, architecture, world size) is saved beside them and loaded into nothing: `train.resume` compares it.
Every rank must call `state_dict()` (some states gather with collectives; the main rank writes), and every rank
loads the whole checkpoint and takes its own part. The named states: docs/checkpoints.md#the-named-states.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from naflexclip.checkpoints import sharded
from naflexclip.checkpoints.manager import Ranks
from naflexclip.families.factory import create_model
from naflexclip.parallel.process_group import (
    DistributedEnv,
    DistributedFault,
    gather_to_main,
    run_on_main,
    translate_faults,
)
from naflexclip.parallel.wrapping import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    load_sharded_optimizer_state_dict,
    load_sharded_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)
from naflexclip.train.config.train_config import TrainConfig


@dataclass
class Progress:
    """Where the run stands. `step`: windows processed, skipped ones included (the schedule's position);
    `next_batch`: microbatches of `epoch` consumed; `num_tokens_seen`: valid image patches trained, all ranks."""

    epoch: int = 0
    step: int = 0
    next_batch: int = 0
    num_skipped_steps: int = 0
    consecutive_skips: int = 0
    num_samples_seen: int = 0
    num_tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


class ModelState:
    """The model's full (unsharded) weights; every rank must call both methods (FSDP gathers and scatters)."""

    def __init__(self, model: nn.Module, env: DistributedEnv) -> None:
        self.model, self.env = model, env

    def state_dict(self) -> dict[str, Any]:
        return full_state_dict(self.model, self.env)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_full_state_dict(self.model, state, self.env)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards (FSDP2) or whole tensors, live (`parallel.sharded_state_dict`)."""
        return sharded_state_dict(self.model)

    def load_sharded(self, checkpoint: Path, name: str) -> None:
        """Fill this rank's part of the model from a sharded checkpoint's state `name`, at any world size."""
        state = sharded_state_dict(self.model)
        sharded.load_into(checkpoint, {name: state})
        load_sharded_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's full state. Loading keeps this run's hyperparameters (--lr, --wd, --beta1, ...), which
    the saved state would otherwise bring back."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistributedEnv) -> None:
        self.model, self.optimizer, self.env = model, optimizer, env

    def state_dict(self) -> dict[str, Any]:
        return full_optimizer_state_dict(self.model, self.optimizer, self.env)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        load_full_optimizer_state_dict(self.model, self.optimizer, state, self.env)
        self._keep_hyperparameters(hyper)

    def _keep_hyperparameters(self, hyper: list[dict[str, Any]]) -> None:
        for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
            group.update(values)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards (FSDP2) or whole state, keyed by parameter name."""
        return sharded_optimizer_state_dict(self.model, self.optimizer)

    def load_sharded(self, checkpoint: Path, name: str) -> None:
        """Fill this rank's part of the optimizer state from a sharded checkpoint's state `name`, at any world
        size."""
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        state = sharded_optimizer_state_dict(self.model, self.optimizer)
        held = sharded.saved_keys(checkpoint, name)
        saved = {param for param in state["state"] if any(key.startswith(f"state.{param}.") for key in held)}
        # a state for a parameter this optimizer does not have would be dropped: nothing trains on without it
        foreign = sorted(key for key in held if key.startswith("state.")
                         and not any(key.startswith(f"state.{param}.") for param in saved))
        if foreign:
            raise ValueError(f"the checkpoint's optimizer state holds {foreign[0]!r}, of a parameter this run's "
                             f"optimizer does not train; it cannot be loaded")
        sharded.load_into(checkpoint, {name: state}, partial=True)
        load_sharded_optimizer_state_dict(self.model, self.optimizer, state, saved)
        self._keep_hyperparameters(hyper)


class DataPosition:
    """Every rank's loader position (a rank may be covering a broken microbatch), gathered to the main rank.
    Loading hands the loader every rank's state: it takes its own, or re-plans the epoch from the global
    sample position at another world size (`remaps`)."""

    def __init__(self, loader: Any, env: DistributedEnv) -> None:
        self.loader, self.env = loader, env

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_to_main(self.env, self.loader.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["ranks"])

    def remaps(self, state: dict[str, Any]) -> bool:
        """True when the saved position means the same samples at any world size."""
        return self.loader.can_remap(state["ranks"])


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every generator this process draws from, in weights-only-loadable types (tensors, ints, tuples).

    `device`: the process's CUDA device, whose generator is saved (one state tensor); without one, no CUDA
    state is saved."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    cuda = device is not None and device.type == "cuda"
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else None,
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss),
                  float(np_gauss)),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore `rng_state()`; its CUDA state goes to `device`."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def create_run_model(cfg: TrainConfig) -> nn.Module:
    """The model a run starts from: --model with --pretrained weights, rebuilt with the --force-* overrides
    (seeded by --seed, so a random init is the same on every rank and in every build)."""
    seed_everything(cfg.seed)
    model = create_model(cfg.model, pretrained=cfg.pretrained, cache_dir=cfg.cache_dir, loss=cfg.loss)
    overrides = cfg.model_overrides(model.image_patch_size)
    if overrides:
        seed_everything(cfg.seed)  # the same initial weights as one build would draw
        model = create_model(cfg.model, pretrained=cfg.pretrained, cache_dir=cfg.cache_dir, loss=cfg.loss,
                             **overrides)
    return model


class RngStreams:
    """Every rank's random streams (dropout, drop-path and patch dropout draw a different one per rank). At
    another world size, rank r continues rank r's stream where there was one; a new rank keeps its own seed."""

    def __init__(self, env: DistributedEnv) -> None:
        self.env = env

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_to_main(self.env, rng_state(self.env.device))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.env.rank < len(state["ranks"]):
            set_rng_state(state["ranks"][self.env.rank], self.env.device)


def checkpoint_ranks(env: DistributedEnv) -> Ranks:
    """This process's part in the run's checkpoint saves, through its process group (the checkpoint manager, a
    layer below, imports none)."""
    return Ranks(is_main=env.is_main, distributed=env.distributed, run_on_main=partial(run_on_main, env),
                 translate_faults=partial(translate_faults, env), fault=DistributedFault)

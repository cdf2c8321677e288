"""The run's state, one owner per piece: each component saves and restores itself through `state_dict()` /
`load_state_dict()` (torchtitan's `Stateful`), and a `Checkpointer` stores them by name.

    model        the full model weights (gathered from every rank's shards; model.safetensors)
    optimizer    AdamW's full state (this run's hyperparameters are kept on load)
    lr_schedule  the lr schedule (`LrSchedule`)
    scaler       the fp16 grad scaler (`Precision`; empty without one)
    data         every rank's loader position
    rng          every rank's random streams
    progress     step, epoch, microbatch position, skipped steps, samples and image tokens seen
    reporter     each logging sink's position (`Reporter`)
    evaluation   the evaluations so far (`Evaluator`; the summary's "before" column)

`run` is saved beside them and loaded into nothing: the config, the architecture and the world size, which the
resume policy (`train.resume`) compares with the resuming run. Per-rank states are gathered to the main rank;
every rank must call `state_dict()` (some gather with collectives), and every rank loads the whole checkpoint
and takes its own part.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from naflexclip.checkpoints import storage as storage
from naflexclip.models.factory import create_model
from naflexclip.models.run_weights import load_checkpoint_model as load_checkpoint_model  # its old import path
from naflexclip.parallel.process_group import DistributedEnv, gather_to_main, run_on_main
from naflexclip.parallel.wrapping import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from naflexclip.train.train_config import TrainConfig


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
        for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
            group.update(values)


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


class Checkpointer:
    """The run's components by name, saved together as one checkpoint (`train.checkpoint` stores them) and
    restored by name. `run`: saved beside them for the resume policy (config, architecture, world size)."""

    def __init__(self, checkpoint_dir: Path, components: dict[str, Stateful], run: dict[str, Any],
                 progress: Progress, env: DistributedEnv, notify: Callable[[str], None]) -> None:
        self.checkpoint_dir, self.components, self.run = checkpoint_dir, components, run
        self.progress, self.env, self.notify = progress, env, notify
        self.last_step_saved: int | None = None

    def save(self, name: str) -> Path:
        """Gather every component's state (every rank) and write them (main rank); the checkpoint's path."""
        states = {"run": self.run, **{key: component.state_dict() for key, component in self.components.items()}}
        step, epoch = self.progress.step, self.progress.epoch

        def write() -> Path:
            written = storage.save_checkpoint(self.checkpoint_dir, name, states, step=step, epoch=epoch)
            self.notify(f"saved {written}")
            return written

        # the others wait without a collective timeout (a large checkpoint may take longer) and hear of an error
        return run_on_main(self.env, f"writing checkpoint {name}", write) or self.checkpoint_dir / name

    def save_step(self) -> Path:
        """Save `step_{step}` unless this step was saved already (--save-every-n-steps and --stop-after-steps
        or a stop signal at the same step write it once)."""
        path = self.checkpoint_dir / f"step_{self.progress.step:08d}"
        if self.last_step_saved != self.progress.step:
            path = self.save(path.name)
            self.last_step_saved = self.progress.step
        return path

    def save_epoch(self, epoch: int, last: bool, *, frequency: int, most_recent: bool = False,
                   delete_previous: bool = False) -> None:
        """The end of epoch `epoch`, as OpenCLIP saves it: `epoch_{epoch}` every `frequency` epochs and after the
        last (0: never); with `delete_previous` (--delete-previous-checkpoint) `epoch_{epoch - frequency}` is
        removed once it is saved; with `most_recent` (--save-most-recent) `epoch_latest` after every epoch."""
        if frequency and (epoch % frequency == 0 or last):
            self.save(f"epoch_{epoch}")
            previous = f"epoch_{epoch - frequency}"
            if delete_previous and epoch - frequency > 0:
                def remove() -> None:
                    if storage.remove_checkpoint(self.checkpoint_dir, previous):
                        self.notify(f"removed {self.checkpoint_dir / previous} (--delete-previous-checkpoint)")

                run_on_main(self.env, f"removing checkpoint {previous}", remove)
        if most_recent:
            self.save("epoch_latest")

    def load(self, states: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        """Restore every component from its named state (every rank), but those in `skip`."""
        for key, component in self.components.items():
            if key not in skip:
                component.load_state_dict(states[key])
        self.last_step_saved = self.progress.step

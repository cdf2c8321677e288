"""The run's state, one owner per piece: each component saves and restores itself through `state_dict()` /
`load_state_dict()` (torchtitan's `Stateful`), and a `Checkpointer` stores them by name.

`run` (config, architecture, world size) is saved beside them and loaded into nothing: `train.resume` compares it.
Every rank must call `state_dict()` (some states gather with collectives; the main rank writes), and every rank
loads the whole checkpoint and takes its own part. The named states: docs/checkpoints.md#the-named-states.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from naflexclip.checkpoints import sharded, storage
from naflexclip.models.factory import create_model
from naflexclip.models.run_weights import load_checkpoint_model as load_checkpoint_model  # its old import path
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


class Checkpointer:
    """The run's components by name, saved together as one checkpoint and restored by name. `run`: saved beside
    them for the resume policy (config, architecture, world size).

    Full form (`--fsdp-checkpoint full`): every state gathered to the main rank, which writes the folder
    (`checkpoints.storage`). Sharded (`sharded`): the components with a `sharded_state_dict()` (model, optimizer)
    are written by every rank, its own shards, through DCP, the others gathered to the main rank as before
    (`checkpoints.sharded`). `async_save` (sharded only): the shards are copied aside and written in the
    background while training continues; the main rank publishes the folder once every rank's are written; the next
    save, and the run's end (`wait`), wait for it."""

    def __init__(self, checkpoint_dir: Path, components: dict[str, Stateful], run: dict[str, Any],
                 progress: Progress, env: DistributedEnv, notify: Callable[[str], None], *, sharded: bool = False,
                 async_save: bool = False) -> None:
        self.checkpoint_dir, self.components, self.run = checkpoint_dir, components, run
        self.progress, self.env, self.notify = progress, env, notify
        self.sharded, self.async_save = sharded, async_save
        self.last_step_saved: int | None = None
        # (step, name) of this process's last save: a save at the same step (an epoch's end after its last step was
        # saved, epoch_latest) holds the same model, optimizer and EMA teacher, whose files it links, not writes
        self._last_save: tuple[int, str] | None = None
        self._pending: tuple[str, Future, threading.Event] | None = None
        self._failed: list[BaseException] = []
        self._after_pending: list[Callable[[], None]] = []
        # a background save's collectives run beside the training's: their own gloo group (torchtitan's way)
        self._group = dist.new_group(backend="gloo") if async_save and env.distributed else None

    def save(self, name: str) -> Path:
        """Gather every component's state (every rank) and write them (main rank), or, sharded, every rank its
        shards; the checkpoint's path (an asynchronous save: once published)."""
        if self.sharded:
            return self._save_sharded(name)
        states = {"run": self.run, **{key: component.state_dict() for key, component in self.components.items()}}
        step, epoch = self.progress.step, self.progress.epoch
        same_as = self._same_state_as()

        def write() -> Path:
            written = storage.save_checkpoint(self.checkpoint_dir, name, states, step=step, epoch=epoch,
                                              same_as=same_as)
            self.notify(f"saved {written}")
            return written

        self._last_save = (step, name)
        # the others wait without a collective timeout (a large checkpoint may take longer) and hear of an error
        return run_on_main(self.env, f"writing checkpoint {name}", write) or self.checkpoint_dir / name

    def _same_state_as(self) -> Path | None:
        """This process's last save when it was at this step (nothing trained since), else None."""
        if self._last_save is not None and self._last_save[0] == self.progress.step:
            return self.checkpoint_dir / self._last_save[1]
        return None

    def _save_sharded(self, name: str) -> Path:
        self.wait()  # one save in flight at a time
        same_as = self._same_state_as()  # its shards are this step's: linked, not written again
        shards: dict[str, Any] = {}
        others: dict[str, Any] = {"run": self.run}
        for key, component in self.components.items():  # every rank in the same order (some gather)
            if callable(getattr(component, "sharded_state_dict", None)):
                shards[key] = component.sharded_state_dict() if same_as is None else None  # type: ignore[attr-defined]
            else:
                others[key] = component.state_dict()
        # published later when asynchronous: a copy, not the live lists a component goes on appending to
        others = copy.deepcopy(others) if self.async_save else others
        step, epoch = self.progress.step, self.progress.epoch
        folder = self.checkpoint_dir / f".tmp-{name}-sharded"  # one writer per run: the same name on every rank

        linked: dict[str, str | None] = {}

        def prepare() -> None:
            storage.staging_dir(self.checkpoint_dir, name, "sharded")  # removes an interrupted save's leftovers
            folder.mkdir()
            if same_as is not None:
                files = [path.name for path in same_as.iterdir()
                         if path.name not in (storage.STATE_FILE, storage.META_FILE)]
                linked.update(storage.link_files(same_as, folder, files))

        def publish() -> Path:
            written = sharded.finish(self.checkpoint_dir, name, folder, others, step=step, epoch=epoch,
                                     sharded=list(shards), known=linked)
            self.notify(f"saved {written}")
            return written

        self._last_save = (step, name)
        run_on_main(self.env, f"preparing checkpoint {name}", prepare)
        if same_as is not None:
            return run_on_main(self.env, f"writing checkpoint {name}", publish) or self.checkpoint_dir / name
        try:
            future = sharded.write_shards(shards, folder, process_group=self._group, asynchronous=self.async_save)
        except Exception:
            with translate_faults(self.env, self._left_incomplete(name)):  # a rank lost mid-save: one line
                raise
        if future is None:
            return run_on_main(self.env, f"writing checkpoint {name}", publish) or self.checkpoint_dir / name
        published = threading.Event()
        if self.env.is_main:  # published from the writer's thread as soon as every rank's shards are written
            future.add_done_callback(lambda done: self._publish_when_written(done, publish, published))
        else:
            published.set()
        self._pending = (name, future, published)
        return self.checkpoint_dir / name

    def _left_incomplete(self, name: str) -> str:
        """What a rank was doing when another was lost during the save of `name`, and where that leaves the run."""
        latest = storage.find_latest(self.checkpoint_dir)
        return (f"writing checkpoint {name}, left incomplete (latest: "
                f"{latest.name if latest is not None else 'no complete checkpoint'})")

    def _publish_when_written(self, done: Future, publish: Callable[[], Path], published: threading.Event) -> None:
        try:
            done.result()
            publish()
        except BaseException as error:  # raised in the training's thread by `wait`
            self._failed.append(error)
        finally:
            published.set()

    def wait(self) -> None:
        """Until the asynchronous save in flight is written and published (every rank must call it); then what
        waited for it (--delete-previous-checkpoint's removal). Raises a failed save's error."""
        name = None
        if self._pending is not None:
            name, future, published = self._pending
            self._pending = None
            try:
                future.result()
            except BaseException as error:
                if not self.env.is_main:  # the main rank's callback records its own
                    self._failed.append(error)
            published.wait()  # the callback publishes after the future resolves, on the writer's thread
        if self._failed:
            error = self._failed.pop()
            self._failed.clear()
            if name is not None and isinstance(error, Exception):
                try:
                    with translate_faults(self.env, self._left_incomplete(name)):  # a rank lost mid-save: one line
                        raise error
                except DistributedFault:
                    raise
                except Exception:  # this rank's own error
                    pass
            raise RuntimeError(f"writing a checkpoint failed: {type(error).__name__}: {error}") from error
        after, self._after_pending = self._after_pending, []
        for work in after:
            work()

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

                def remove_on_main() -> None:
                    run_on_main(self.env, f"removing checkpoint {previous}", remove)

                if self._pending is not None:  # once `latest` names the new one (removing it before would fail)
                    self._after_pending.append(remove_on_main)
                else:
                    remove_on_main()
        if most_recent:
            self.save("epoch_latest")

    def load(self, states: dict[str, Any], skip: tuple[str, ...] = (), sharded_in: Path | None = None,
             sharded_states: tuple[str, ...] = ()) -> None:
        """Restore every component from its named state (every rank), but those in `skip`; those in
        `sharded_states` from the shards of the sharded checkpoint `sharded_in`, resharded to this run."""
        for key, component in self.components.items():
            if key in skip:
                continue
            if key in sharded_states:
                component.load_sharded(sharded_in, key)  # type: ignore[attr-defined]
            else:
                component.load_state_dict(states[key])
        self.last_step_saved = self.progress.step
        self._last_save = None  # a loaded optimizer keeps this run's hyperparameters: not the checkpoint's files

"""The run's checkpointing: `CheckpointManager` saves the run's named components together as one checkpoint (the
full form through `checkpoints.storage`, or sharded through `checkpoints.sharded`, written in the background with
--async-save) and restores them by name; torchtitan's `CheckpointManager` in its place.

Every rank calls `state_dict()` (some states gather with collectives; the main rank writes), and every rank loads
the whole checkpoint and takes its own part. This layer knows no process group: the trainer hands the manager its
part in one (`Ranks`). The named states: docs/checkpoints.md#the-named-states.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from naflexclip.checkpoints import sharded, storage


class Stateful(Protocol):
    """A piece of run state that saves and restores itself (torchtitan's `Stateful`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Position(Protocol):
    """Where the run stands: a save is named and dated by its step and epoch."""

    step: int
    epoch: int


@dataclass(frozen=True)
class Ranks:
    """This process's part in a job around a save, handed in by the trainer (`parallel.process_group`'s).

    `is_main`: it writes the folder; `distributed`: there are other processes; `run_on_main(what, work)`: `work()`
    on the main rank while the others wait (its result there, None elsewhere; an error reaches every rank);
    `translate_faults(what)`: a context in which a collective's failure (a rank lost) becomes the one-line `fault`
    naming it, any other error going on as it is. The defaults: one process."""

    is_main: bool = True
    distributed: bool = False
    run_on_main: Callable[[str, Callable[[], Any]], Any] = lambda what, work: work()
    translate_faults: Callable[[str], contextlib.AbstractContextManager[None]] = (
        lambda what: contextlib.nullcontext())
    fault: type[Exception] = type("NoFault", (Exception,), {})  # one process: no rank to lose


class CheckpointManager:
    """The run's components by name, saved together as one checkpoint and restored by name. `run`: saved beside
    them for the resume policy (config, architecture, world size).

    Full form (`--fsdp-checkpoint full`): every state gathered to the main rank, which writes the folder
    (`checkpoints.storage`). Sharded (`sharded`): the components with a `sharded_state_dict()` (model, optimizer)
    are written by every rank, its own shards, through DCP, the others gathered to the main rank as before
    (`checkpoints.sharded`). `async_save` (sharded only): the shards are copied aside and written in the
    background while training continues; the main rank publishes the folder once every rank's are written; the next
    save, and the run's end (`wait`), wait for it. `progress`: the run's position (its `step` and `epoch` name and
    date a save); `ranks`: how this process works with the job's others."""

    def __init__(self, checkpoint_dir: Path, components: dict[str, Stateful], run: dict[str, Any],
                 progress: Position, ranks: Ranks, notify: Callable[[str], None], *, sharded: bool = False,
                 async_save: bool = False) -> None:
        self.checkpoint_dir, self.components, self.run = checkpoint_dir, components, run
        self.progress, self.ranks, self.notify = progress, ranks, notify
        self.sharded, self.async_save = sharded, async_save
        self.last_step_saved: int | None = None
        # (step, name) of this process's last save: a save at the same step (an epoch's end after its last step was
        # saved, epoch_latest) holds the same model, optimizer and EMA teacher, whose files it links, not writes
        self._last_save: tuple[int, str] | None = None
        self._pending: tuple[str, Future, threading.Event] | None = None
        self._failed: list[BaseException] = []
        self._after_pending: list[Callable[[], None]] = []
        # a background save's collectives run beside the training's: their own gloo group (torchtitan's way)
        self._group: Any = dist.new_group(backend="gloo") if async_save and ranks.distributed else None

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
        return self.ranks.run_on_main(f"writing checkpoint {name}", write) or self.checkpoint_dir / name

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
            written = storage.publish_sharded(self.checkpoint_dir, name, folder, others, step=step, epoch=epoch,
                                              shards=list(shards), known=linked)
            self.notify(f"saved {written}")
            return written

        self._last_save = (step, name)
        self.ranks.run_on_main(f"preparing checkpoint {name}", prepare)
        if same_as is not None:
            return self.ranks.run_on_main(f"writing checkpoint {name}", publish) or self.checkpoint_dir / name
        try:
            future = sharded.write_shards(shards, folder, process_group=self._group, asynchronous=self.async_save)
        except Exception:
            with self.ranks.translate_faults(self._left_incomplete(name)):  # a rank lost mid-save: one line
                raise
        if future is None:
            return self.ranks.run_on_main(f"writing checkpoint {name}", publish) or self.checkpoint_dir / name
        published = threading.Event()
        if self.ranks.is_main:  # published from the writer's thread as soon as every rank's shards are written
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
            except BaseException as raised:
                if not self.ranks.is_main:  # the main rank's callback records its own
                    self._failed.append(raised)
            published.wait()  # the callback publishes after the future resolves, on the writer's thread
        if self._failed:
            error = self._failed.pop()
            self._failed.clear()
            if name is not None and isinstance(error, Exception):
                try:
                    with self.ranks.translate_faults(self._left_incomplete(name)):  # a rank lost mid-save: one line
                        raise error
                except self.ranks.fault:
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
                    self.ranks.run_on_main(f"removing checkpoint {previous}", remove)

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

"""The NaFlex loader: one rank's epoch of token-budget microbatches, built in DataLoader workers.

Workers build the planned microbatches round-robin and the DataLoader hands them back in plan order. This module
holds what its two kinds (`map_loader.MapLoader`, `stream_loader.StreamLoader`) share: the covering of a planned
microbatch whose samples all turned out broken (a neighbour on the same rank is split, so the rank yields as many
microbatches as planned), the skip log, the resume state and the DataLoader settings. A microbatch's `planned`
index and its `position` among those yielded ("batch_index", where `set_epoch(epoch, start_batch)` starts)
differ only around a covered one. docs/data.md#epochs and #skipped-samples.
"""

from __future__ import annotations

import abc
import atexit
import collections
import contextlib
import dataclasses
import logging
import multiprocessing.util  # noqa: F401 - registers its exit handler before `close_loaders`
import signal
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from naflexclip.data.microbatch import MicrobatchBuilder, split_rows
from naflexclip.data.samples import NOTE_REASONS, READ_NOTES, reasons_line
from naflexclip.data.schedule import Schedule, TokenBudget
from naflexclip.data.source import DataError

logger = logging.getLogger("naflexclip.data")
# a planned microbatch is emitted once the one this many places later has arrived, so an empty one can be
# covered by splitting a neighbour on either side of it (held host memory: this many microbatches)
HOLD_BACK = 2
# the epoch's last planned microbatches are all held until the end, so empty ones there are covered too
END_HOLD = 4


def _notes_apart(counts: Counter) -> tuple[Counter, str]:
    """The counts of samples not trained, and the notes (`NOTE_REASONS`, whose samples all trained) as
    `; noted: reason=n, ...; N reads retried; N reads throttled` (or "")."""
    skipped = Counter({reason: n for reason, n in counts.items() if reason not in NOTE_REASONS})
    noted = {reason: n for reason, n in counts.items() if reason in NOTE_REASONS and reason not in READ_NOTES}
    retried, throttled = counts.get("read_retry", 0), counts.get("read_throttled", 0)
    return skipped, ((f"; noted: {reasons_line(noted)}" if noted else "")
                     + (f"; {retried} reads retried" if retried else "")
                     + (f"; {throttled} reads throttled" if throttled else ""))


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where an epoch's iteration stands, enough to continue it exactly.

    `position`: microbatches yielded so far. `planned`: the planned microbatch to fetch first when continuing,
    of which `pieces` were already yielded; `owed`: empty planned microbatches not yet covered when `planned`
    is emitted (not counting those fetched again); `logged`: planned microbatches fetched so far, whose skips
    are logged (a continuation fetching them again logs nothing twice).
    """

    position: int
    planned: int
    pieces: int = 0
    owed: int = 0
    logged: int = 0

    @classmethod
    def at(cls, position: int) -> Cursor:
        """The start of the microbatch at `position` with nothing owed: where plan and positions agree."""
        return cls(position, position, 0, 0, position)


class _Emitted(NamedTuple):
    piece: dict[str, Any]
    records: list[dict[str, Any]]  # skips of the planned microbatch, with its first piece
    cursor: Cursor  # where to continue after this piece (its `position` is filled in by the loader)
    clean_at: int | None  # when every planned microbatch before this one is done and nothing after it is


class _Cover:
    """Turns the planned microbatches, arriving in plan order from `start.planned` on, into the yielded ones.

    A non-empty one is emitted once the one HOLD_BACK places later has arrived (the last END_HOLD: at the end),
    cut into min(owed + 1, rows) pieces, `owed` counting the empty ones not yet covered. The rule depends on
    plan positions only, so a continuation from a `Cursor` replays it exactly.
    """

    def __init__(self, start: Cursor, num_planned: int) -> None:
        self.start, self.num_planned = start, num_planned
        self.owed, self.fetched = start.owed, start.logged
        self.held: collections.deque = collections.deque()  # fetched non-empty microbatches, not yet emitted
        self.empties: list[int] = []  # planned indices of the fetched empty ones

    def add(self, item: dict[str, Any]) -> Iterator[_Emitted]:
        planned = item["planned"]
        self.fetched = max(self.fetched, planned + 1)
        if item.get("empty"):
            self.owed += 1
            self.empties.append(planned)
        else:
            self.held.append(item)
        while (self.held and self.held[0]["planned"] <= planned - HOLD_BACK
               and self.held[0]["planned"] < self.num_planned - END_HOLD):
            yield from self._emit(self.held.popleft())

    def drain(self) -> Iterator[_Emitted]:
        while self.held:
            yield from self._emit(self.held.popleft())

    def _emit(self, item: dict[str, Any]) -> Iterator[_Emitted]:
        planned, rows = item.pop("planned"), item["text"].shape[0]
        parts = min(self.owed + 1, rows)
        # a continuation fetches the empties from here on again and counts them again
        owed_here = self.owed - sum(1 for e in self.empties if e >= planned)
        done = self.start.pieces if planned == self.start.planned else 0
        skips = item.pop("skips")
        records = skips if done == 0 else []  # logged with the item's first piece, never twice
        self.owed -= parts - 1
        pieces = split_rows(item, parts) if parts > 1 else [item]
        for q in range(done, parts):
            ahead = self.held[0]["planned"] if self.held else self.fetched
            clean = self.owed == 0 and q + 1 == parts and all(e < ahead for e in self.empties)
            yield _Emitted(pieces[q], records if q == done else [],
                           Cursor(0, planned, q + 1, owed_here, self.fetched), ahead if clean else None)


class WorkerEpoch(IterableDataset, abc.ABC):
    """The planned microbatches from `first` on that each DataLoader worker builds (round-robin). A worker never
    raises: its error is an item, raised by the loader as one DataError naming the source."""

    def __init__(self, schedule: Schedule, first: int, workers: int, builder: MicrobatchBuilder,
                 seed_key: tuple[int, ...]) -> None:
        super().__init__()
        self.schedule, self.first, self.workers = schedule, first, max(1, workers)
        self.builder, self.seed_key = builder, seed_key

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        try:
            yield from self.batches(info.id if info is not None else 0)
        except Exception as exc:  # noqa: BLE001 - reported by the main process as one DataError
            yield {"error": f"{type(exc).__name__}: {exc}"}

    @abc.abstractmethod
    def batches(self, worker_id: int) -> Iterator[dict[str, Any]]:
        """The items of the planned microbatches worker `worker_id` builds, in plan order."""


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # workers parallelise across processes, not inside one
    # a SIGTERM to the process group (torchrun's agent, a scheduler) is the training process's to handle: it
    # finishes the step and saves; a worker that died of it first would end the run in a traceback instead.
    # The DataLoader still shuts its workers down itself (and they exit when the training process is gone)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # started blocked (_workers_start_unsignalled)


@contextlib.contextmanager
def _workers_start_unsignalled(workers: int) -> Iterator[None]:
    """Workers are forked with SIGTERM blocked, and unblock it once they ignore it (`_worker_init`): a SIGTERM
    before that (the process group's, while they start) would reach torch's worker handler, which exits, and the
    loader would fail with "worker exited unexpectedly". Here a SIGTERM waits until the workers are started."""
    if not workers or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def shut_down_workers(loader: DataLoader) -> None:
    """End the worker processes a persistent DataLoader keeps between iterations, now. Its workers ignore SIGTERM
    (`_worker_init`), so the `terminate()` that multiprocessing's exit handler sends them would be lost and its
    join would wait for ever: they are told to exit through their queues, as the DataLoader does when it is freed.
    Torch has no public call for this, so it is the one place that reaches into the DataLoader's iterator."""
    iterator = getattr(loader, "_iterator", None)
    loader._iterator = None
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


# the loaders whose workers outlive an iteration; `close_loaders` ends them at the latest when the process exits
_open_loaders: weakref.WeakSet[NaFlexLoader] = weakref.WeakSet()
_exit_hook: list[bool] = []


def close_loaders() -> None:
    """Shut down the workers of every loader still holding them (a run that ended by any path, the interpreter's
    exit). Registered with atexit after multiprocessing's own exit handler, so that it runs first (atexit runs
    last in, first out), before that handler joins the daemonic workers."""
    for loader in list(_open_loaders):
        loader.close()


def _keep_track(loader: NaFlexLoader) -> None:
    _open_loaders.add(loader)
    if not _exit_hook:
        atexit.register(close_loaders)
        _exit_hook.append(True)


@dataclasses.dataclass(frozen=True)
class _Resume:
    epoch: int
    cursor: Cursor
    sample_position: int | None
    remap: bool  # re-plan the rest of the epoch from `sample_position` (another world size)


class NaFlexLoader(abc.ABC):
    """Iterable over one epoch of NaFlex microbatches for one rank; `MapLoader` and `StreamLoader` are its kinds.

    Each item: {"image": {"patches": float32 [B, L, P*P*3], "patch_coord": long [B, L, 2] (row, col),
    "patch_valid": bool [B, L]}, "text": long [B, T], "seq_len": L, "num_tokens": int,
    "batch_index": int (its position in the epoch), "keys": list[str] (sample ids), and "labels" for the
    zero-shot loader}. B varies from batch to batch; L is the batch's scheduled sequence length.

    A sample found broken at decode time leaves its microbatch smaller; a microbatch left with no sample takes
    rows from its neighbour on the same rank (the microbatch before it, or the next one), so the rank still
    yields `len()` microbatches, none empty. Only a rank with fewer usable samples than microbatches cannot:
    in training that is a DataError; an evaluation split then yields fewer microbatches.

    Every skip is a record (source, key, line, reason, detail, split, epoch numbered from 1) in `skip_records`
    (drained by the caller) and counted by reason in `skip_counts` (the loader's lifetime).
    `state_dict()`/`load_state_dict()` continue an epoch exactly, with any number of workers.

    `name` names the data in messages; `samples_per_epoch` counts all ranks' samples; `budget` sizes the
    microbatches, `builder` makes them; `shuffle`: a new order every epoch (training); `workers`: DataLoader
    worker processes (0: build in this process).
    """

    indexed: ClassVar[bool]  # True: map-style, exactly-once epochs; False: streamed shards
    schedule: Schedule  # this rank's planned microbatches of the epoch

    def __init__(self, *, name: str, split: str, samples_per_epoch: int, budget: TokenBudget,
                 builder: MicrobatchBuilder, seed: int, shuffle: bool, workers: int, rank: int = 0,
                 world_size: int = 1, pin_memory: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.name, self.split, self.samples_per_epoch = name, split, samples_per_epoch
        self.budget, self.builder, self.seed, self.shuffle = budget, builder, seed, shuffle
        self.workers, self.rank, self.world_size = workers, rank, world_size
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.skip_counts: Counter = Counter()
        self.skip_records: list[dict[str, Any]] = []
        self._resume: _Resume | None = None
        self.set_epoch(0)

    # -- what each kind defines -------------------------------------------------------------------
    @abc.abstractmethod
    def _plan(self, epoch: int, sample_position: int | None, start_batch: int) -> None:
        """Plan `epoch` (set `schedule`); with `sample_position`: only its rest from there, at `start_batch`."""

    @property
    @abc.abstractmethod
    def num_batches(self) -> int:
        """Planned microbatches this epoch on this rank (the same on every rank)."""

    @abc.abstractmethod
    def _dataloader(self, first: int) -> DataLoader:
        """The DataLoader whose iteration gives the planned microbatches from `first` on, in plan order (made with
        `data_loader`); an item with "error" is raised as one DataError."""

    def _epoch_start_records(self) -> list[dict[str, Any]]:
        """Skips known before decoding, recorded once per epoch."""
        return []

    def _sample_position_at(self, planned: int) -> int | None:
        """The global sample position where planned microbatch `planned` starts, when there is one."""
        return None

    def _shard_versions(self) -> dict[str, str]:
        """The versions the data's remote shards are read at, by URL (kept in rank 0's state)."""
        return {}

    def _pin_shard_versions(self, saved: dict[str, str]) -> None:
        """Read the remote shards at the versions a checkpoint recorded (`_shard_versions`)."""
        return None

    # -- the epoch --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Plan `epoch` (plan and sample order from seed and epoch), starting at microbatch position `start_batch`.

        After `load_state_dict`, the call for the saved epoch and position continues at the saved place.
        """
        resume = self._resume
        if resume is not None and (resume.epoch, resume.cursor.position) == (epoch, start_batch):
            self._plan(epoch, resume.sample_position if resume.remap else None, start_batch)
            start, sample_position = resume.cursor, resume.sample_position
        else:
            self._resume = None
            self._plan(epoch, None, start_batch)
            start, sample_position = Cursor.at(start_batch), self._sample_position_at(start_batch)
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch must be in [0, {self.num_batches}], got {start_batch}")
        self.epoch = epoch
        self._start = start, sample_position  # where every iteration of this epoch starts
        self._cursor, self._sample_position = start, sample_position

    @property
    def position(self) -> int:
        """Microbatches yielded so far this epoch: the position of the next one."""
        return self._cursor.position

    @property
    def planned_sources(self) -> dict[str, int]:
        """Samples each `::` source contributes to this epoch, as planned; empty when there is one source."""
        return {}

    @property
    def num_samples(self) -> int:
        """Planned samples this epoch on this rank (sum of planned batch sizes)."""
        return self.schedule.total()

    def __len__(self) -> int:
        return self.num_batches

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands in the epoch; `load_state_dict` + `set_epoch(epoch, position)` continue there.

        `sample_position`: when not None, every microbatch before `position` is done and nothing after it is,
        on this rank, and the samples trained so far are exactly the epoch's global order up to that sample
        position, a place that does not depend on workers or world size. If it is not None on every rank, the
        epoch can continue at another world size (see `can_remap`).
        """
        cursor = self._cursor
        return {"epoch": self.epoch, "position": cursor.position, "planned": cursor.planned,
                "pieces": cursor.pieces, "owed": cursor.owed, "logged": cursor.logged,
                "sample_position": self._sample_position, "world_size": self.world_size, "rank": self.rank,
                "skip_counts": dict(self.skip_counts),
                **({"shard_versions": self._shard_versions()} if self.rank == 0 else {})}

    @staticmethod
    def can_remap(states: list[dict[str, Any]]) -> bool:
        """True when the ranks' saved states (one per rank) name one global sample position, so the epoch
        can continue exactly at any world size."""
        positions = {s["sample_position"] for s in states}
        return len(positions) == 1 and None not in positions and len({s["position"] for s in states}) == 1

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue where `state_dict()` was taken: one rank's state, or the list of every rank's states.
        It takes effect now and stays in force for `set_epoch(epoch, position)` until iterated.

        Same world size: this rank's own state (exact, also mid-split). Another world size: only when
        `can_remap(states)`; the rest of the epoch is re-planned from the global sample position.
        Any number of workers either way.
        """
        states = state if isinstance(state, list) else [state]
        saved_world = states[0]["world_size"]
        mine = next((s for s in states if s["rank"] == self.rank), None)
        if saved_world == self.world_size:
            if mine is None:
                raise ValueError(f"the data position has no state for rank {self.rank}")
            cursor = Cursor(*(int(mine[k]) for k in ("position", "planned", "pieces", "owed", "logged")))
            resume = _Resume(int(mine["epoch"]), cursor, mine["sample_position"], remap=False)
        elif self.can_remap(states):
            first = states[0]
            resume = _Resume(int(first["epoch"]), Cursor.at(int(first["position"])), first["sample_position"],
                             remap=True)
        else:
            raise ValueError(f"the data position was saved at world size {saved_world} mid-way through a "
                             f"microbatch split, so it cannot be re-mapped to world size {self.world_size}")
        self.skip_counts = Counter((mine or {}).get("skip_counts", {}))
        self._pin_shard_versions(next((s["shard_versions"] for s in states if s.get("shard_versions")), {}))
        self._resume = resume
        self.set_epoch(resume.epoch, resume.cursor.position)

    def summary(self) -> str:
        """One line: skipped samples by reason over the loader's lifetime, notes (retried reads) apart."""
        skipped, noted = _notes_apart(self.skip_counts)
        if not skipped:
            return f"data {self.split} ({self.name}): no samples skipped{noted}"
        return f"data {self.split} ({self.name}): skipped {sum(skipped.values())} ({reasons_line(skipped)}){noted}"

    # -- iteration --------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut down the worker processes kept between epochs (none for a streamed loader, whose workers end with
        each iteration). The loader can still be iterated: new workers start then. Also a context manager."""
        _open_loaders.discard(self)

    def __enter__(self) -> NaFlexLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def data_loader(self, dataset: Any, sampler: Any = None, persistent: bool = False) -> DataLoader:
        """A DataLoader of this loader's workers over `dataset` (items, not batches: each is a built microbatch).
        It draws its worker seed from its own generator, never from the process's global torch RNG. `persistent`:
        its workers are kept between iterations (each new one takes its tasks from `sampler` again)."""
        kwargs: dict[str, Any] = {"prefetch_factor": 2, "worker_init_fn": _worker_init} if self.workers else {}
        if persistent and self.workers:
            _keep_track(self)
        return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=self.workers,
                          pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self.seed),
                          persistent_workers=persistent and self.workers > 0, **kwargs)

    def _fetch(self, first: int) -> Iterator[dict[str, Any]]:
        """The planned microbatches from `first` on, in plan order, as the workers build them."""
        loader = self._dataloader(first)
        with _workers_start_unsignalled(self.workers):
            iterator = iter(loader)  # starts the workers (persistent ones: only the first time)
        try:
            for item in iterator:
                if "error" in item:
                    raise DataError(f"data source {self.name!r} ({self.split}): {item['error']}")
                yield item
        finally:
            # shuts non-persistent workers down, also when the consumer stops early; persistent ones drop what is
            # still queued when the next iteration starts
            del iterator

    def _covered(self, cover: _Cover, epoch_skips: Counter) -> Iterator[_Emitted]:
        fetched = self._fetch(cover.start.planned)
        try:
            for item in fetched:
                if "planned" not in item or (item.get("empty") and item["planned"] >= cover.start.logged):
                    self._record(item["skips"], epoch_skips)  # a stream's last records; an empty one's, once
                if "planned" in item:
                    yield from cover.add(item)
            yield from cover.drain()
        finally:
            fetched.close()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The epoch's microbatches from where `set_epoch` or `load_state_dict` placed the loader."""
        self._resume = None
        start, self._sample_position = self._start
        self._cursor = start
        epoch_skips: Counter = Counter()
        if start == Cursor.at(0):
            self._record(self._epoch_start_records(), epoch_skips)
        num_yielded = num_samples = 0
        cover = _Cover(start, self.num_batches)
        for out in self._covered(cover, epoch_skips):
            self._record(out.records, epoch_skips)
            self._cursor = dataclasses.replace(out.cursor, position=self.position + 1)
            self._sample_position = None if out.clean_at is None else self._sample_position_at(out.clean_at)
            out.piece["batch_index"] = self.position - 1
            num_yielded += 1
            num_samples += out.piece["text"].shape[0]
            yield out.piece
        self._log_epoch(num_yielded, num_samples, start.position, epoch_skips)
        if num_yielded == 0 and self.num_batches > start.position:
            raise DataError(f"no usable samples in data source {self.name!r} ({self.split}): "
                            f"{reasons_line(epoch_skips) or 'nothing read'}")
        # only training ranks must run equally many microbatches (they meet every window); an evaluation
        # runs on its own, so there the broken samples just make it shorter (counted and logged above)
        if cover.owed > 0 and self.split == "train":
            raise DataError(
                f"data source {self.name!r} ({self.split}) epoch {self.epoch + 1}: rank {self.rank} has "
                f"{cover.owed} microbatch(es) fewer usable samples than its {self.num_batches} planned microbatches "
                f"(skipped: {reasons_line(epoch_skips)}); raise --naflex-max-tokens-per-batch or fix the data")

    def _record(self, records: list[dict[str, Any]], epoch_skips: Counter) -> None:
        for record in records:
            record = {**record, "split": self.split, "epoch": self.epoch + 1}  # numbered from 1, as users read it
            self.skip_records.append(record)
            self.skip_counts[record["reason"]] += 1
            epoch_skips[record["reason"]] += 1

    def _log_epoch(self, num_batches: int, num_samples: int, start: int, skips: Counter) -> None:
        line = (f"data {self.split} epoch {self.epoch + 1} rank {self.rank}: {num_batches} batches, {num_samples} "
                f"samples (planned {self.num_batches - start} batches)")
        if skips:
            skipped, noted = _notes_apart(skips)
            reasons = f" ({reasons_line(skipped)})" if skipped else ""
            logger.warning("%s; skipped %d%s%s", line, sum(skipped.values()), reasons, noted)
        else:
            logger.info(line)


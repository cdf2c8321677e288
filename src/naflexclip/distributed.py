"""Multi-process plumbing on torch.distributed: process group, feature exchange, sync control, faults.

The window (naflexclip.window) holds the math; this module only hands it what it needs across ranks:

- `init_distributed` reads torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`) and starts one
  process group (NCCL on CUDA, gloo on CPU) whose collectives carry a timeout; without that
  environment it is a single process with no process group, and everything here is a no-op.
- `wrap_model` — DDP (default) or FSDP2 `fully_shard`; `no_sync_context` — the context the window
  enters around every backward but the window's last, so gradients are synchronised once per window.
- `window_exchange` → `ProcessGroupExchange`: every rank's microbatch sizes, and one no-grad
  all-gather of feature rows with uneven per-rank row counts (pad to the largest, then trim). The size
  exchange meets every rank every window, so it also checks that the ranks agree on the step and epoch
  and that every rank has data (`RanksDisagree` on every rank at once, never a wait until the timeout),
  and carries the error of a rank that failed between windows (`fail`: e.g. its loader raised);
  FSDP's equal microbatch counts are checked there too. The sharded loss's row gradients go back to
  their owners with `reduce_scatter_rows`, its per-rank values with `sum_over_ranks` (a few numbers).
- `run_on_main`: work only rank 0 does (evaluation, checkpoint writing) while the others wait on the
  rendezvous store, with no collective timeout, and learn of rank 0's error at once.
- `check_consistency` / `any_rank_true` / `sum_over_ranks`: ranks agree on step/window/schedule, skip
  the same steps, and sum the counters the logs show.
- `fault_guard`: a rank that raises records why in the rendezvous store; a rank whose collective fails
  or times out names the rank that raised, died or stopped answering, in one line.
- `full_state_dict` / `load_full_state_dict`: a gathered state dict on rank 0 for checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from naflexclip.window import LocalExchange

# rendezvous-store keys used to say which rank failed and which are still alive
_STORE_PREFIX = "naflexclip/fault"


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job. `backend` is None when there is no process group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    timeout_s: float = 600.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class DistributedFault(RuntimeError):
    """Another rank raised, died or stopped answering; the message names it."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


DEVICE_CHOICES = ("cpu", "cuda", "cuda:N")


def check_device(device: str | None) -> None:
    """A `--device` value: None (automatic), `cpu`, `cuda` or `cuda:N` (CUDA available); else ValueError naming it."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda") or (parsed.type == "cpu" and parsed.index):
        raise ValueError(f"--device: {device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but CUDA is not available")


def launched_world_size() -> int:
    """The number of processes torchrun started for this job (1 without torchrun)."""
    return _env_int("WORLD_SIZE", 1)


def _resolve_device(device: str | None, local_rank: int) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        # one process per GPU: torchrun's LOCAL_RANK picks this process's GPU
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but CUDA is not available")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible"
            )
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(device: str | None = None, timeout_s: float = 600.0) -> DistributedEnv:
    """Join torchrun's job (or run as one process) and return where this process sits.

    device: None → `cuda:{LOCAL_RANK}` when CUDA is available else `cpu`; `"cuda"` → `cuda:{LOCAL_RANK}`;
        anything else (`"cpu"`, `"cuda:1"`) is used as given.
    timeout_s: every collective of the process group fails after this many seconds instead of hanging.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world_size}")
    resolved = _resolve_device(device, local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    if world_size == 1:
        return DistributedEnv(0, 1, local_rank, resolved, None, timeout_s)
    backend = "nccl" if resolved.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            # binds the NCCL communicator to this GPU eagerly (and lets barrier() know the device)
            device_id=resolved if resolved.type == "cuda" else None,
        )
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"a process group is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
            f"but the environment says RANK={rank}, WORLD_SIZE={world_size}"
        )
    return DistributedEnv(rank, world_size, local_rank, resolved, dist.get_backend(), timeout_s)


def barrier(env: DistributedEnv) -> None:
    """Wait for every rank (no-op in one process)."""
    if env.distributed:
        with _translate_faults(env, "barrier"):
            if env.backend == "nccl":
                dist.barrier(device_ids=[env.device.index])
            else:
                dist.barrier()


def cleanup(env: DistributedEnv) -> None:
    """Tear down the process group, if this job has one."""
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- models


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks of both towers: each becomes one FSDP2 unit (one all-gather per block)."""
    units: list[nn.Module] = []
    visual_blocks = getattr(getattr(model, "visual", None), "blocks", None)
    text_blocks = getattr(getattr(getattr(model, "text", None), "transformer", None), "resblocks", None)
    for blocks in (visual_blocks, text_blocks):
        if isinstance(blocks, nn.Module):
            units.extend(blocks.children())
    return units


def wrap_model(model: nn.Module, env: DistributedEnv, fsdp: bool = False) -> nn.Module:
    """DDP (default) or FSDP2 `fully_shard` around a model already on `env.device`; identity in one process.

    Both average gradients over ranks; the window multiplies this rank's row gradients by
    `world_size`, so the average is the single-process gradient of the whole window.
    """
    if not env.distributed:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        # FSDP2 cannot shard 0-d parameters (logit_scale, logit_bias): keep them whole on every rank
        scalars = {param for param in model.parameters() if param.dim() == 0}
        for unit in _shard_units(model):
            fully_shard(unit)
        # the root unit holds embeddings and projections
        fully_shard(model, ignored_params=scalars or None)
        _average_replicated_grads(model, scalars, env)
        return model
    # the model's buffers are constants (attention masks), identical after DDP's initial broadcast:
    # re-broadcasting them before every forward would add one collective per microbatch
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        buffer_sync = {"forward_sync_buffers": False}  # torch ≥ 2.14's name; still syncs at init
    else:
        buffer_sync = {"broadcast_buffers": False}
    return DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None, **buffer_sync
    )


def _average_replicated_grads(model: nn.Module, params: set[nn.Parameter], env: DistributedEnv) -> None:
    """Average the gradients of parameters FSDP2 leaves alone, on the backwards that sync (as DDP would).

    The window gives `logit_scale`/`logit_bias` the same gradient on every rank, so this only keeps
    ranks bit-identical; it follows `no_sync_context` through `model._naflexclip_sync`.
    """
    model._naflexclip_sync = True  # type: ignore[assignment]

    def average(param: torch.Tensor) -> None:
        if param.grad is not None and getattr(model, "_naflexclip_sync", True):
            with _translate_faults(env, "averaging replicated gradients"):
                # SUM then divide: gloo has no AVG reduction
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(env.world_size)

    for param in sorted(params, key=lambda p: [n for n, q in model.named_parameters() if q is p][0]):
        param.register_post_accumulate_grad_hook(average)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (FSDP2 shards in place, so it is its own module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def no_sync_context(model: nn.Module) -> Callable[[], ContextManager[Any]]:
    """The context factory the window enters around every backward but the window's last.

    DDP: `model.no_sync`; FSDP2: `set_requires_gradient_sync(False)`, restored to True on exit;
    anything else: a null context.
    """
    if isinstance(model, DistributedDataParallel):
        return model.no_sync
    if _is_fsdp(model):

        @contextlib.contextmanager
        def fsdp_no_sync() -> Iterator[None]:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            model._naflexclip_sync = False  # the replicated scalars follow the sharded parameters
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]
                model._naflexclip_sync = True

        return fsdp_no_sync
    return contextlib.nullcontext


# ------------------------------------------------------------------------------------ feature exchange


class RanksDisagree(DistributedFault):
    """Ranks met at a window's size exchange with different steps or epochs, or some with no data left;
    every rank raises the same one-line message at once (no rank is left waiting in a collective)."""


class RankFailed(DistributedFault):
    """Another rank raised between windows (e.g. in its loader) and said so at the size exchange; the message
    names the rank and its error. The failing rank itself re-raises its own error."""


# the fixed-size header every rank contributes to a window's first all-gather:
# [microbatches, position set?, step, epoch]; microbatches is FAILED for a rank that raised (`fail`)
_HEADER_FIELDS = 4
FAILED = -1


class ProcessGroupExchange:
    """The window's view of the other ranks through the default process group (no autograd).

    The size exchange is where every rank meets every window, so it also carries what the ranks must
    agree on — the training loop's step and epoch (`set_position`, the window knows nothing of steps) and
    whether a rank has data at all (`end_of_data`) — in the same all-gather as the microbatch counts: a
    disagreement is a `RanksDisagree` on every rank at once, at no extra collective per window.

    equal_counts: every rank must hold the same number of microbatches (FSDP gathers parameters in every
        forward, so a rank with one forward more would wait for the others forever).
    """

    def __init__(self, env: DistributedEnv, equal_counts: bool = False) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.equal_counts = equal_counts
        self._position: tuple[int, int] | None = None

    def set_position(self, step: int, epoch: int) -> None:
        """The caller's step and epoch for the next exchanges; every rank must pass the same."""
        self._position = (int(step), int(epoch))

    def end_of_data(self) -> None:
        """This rank has no microbatch left for the next window: meet the other ranks' next size exchange.

        Returns when every rank's data ended at the same point (the end of an epoch, agreed); when another
        rank still has microbatches, every rank raises `RanksDisagree` naming them.
        """
        self._meet(0)

    def fail(self, error: BaseException, what: str) -> None:
        """This rank raised outside the window (`what`, e.g. "reading data for step 3"): meet the other ranks'
        next size exchange with the error instead of leaving them waiting there until the timeout. Every
        other rank raises `RankFailed` naming this rank and its error; this one returns, for the caller to
        re-raise its own error. Only on the failure path: one small extra all-gather of the reasons."""
        try:
            self._meet(FAILED, f"{_one_line(error)} (while {what})")
        except DistributedFault:
            pass  # its own error says more; a collective failure here leaves the others to the roll call

    def gather_sizes(self, local_sizes: Sequence[int]) -> list[list[int]]:
        """Every rank's microbatch sizes, indexed by rank; ranks may hold different numbers of microbatches."""
        env = self.env
        counts = self._meet(len(local_sizes))
        with _translate_faults(env, "exchanging microbatch sizes"):
            # the sizes, padded to the longest list (the counts came with the header)
            num_max = max(counts)
            padded = torch.zeros(num_max, dtype=torch.int64, device=env.device)
            padded[: len(local_sizes)] = torch.tensor(list(local_sizes), dtype=torch.int64)
            sizes = _all_gather_tensor(env, padded).view(self.world_size, num_max).tolist()
        return [row[:count] for row, count in zip(sizes, counts, strict=True)]

    def _meet(self, count: int, failure: str | None = None) -> list[int]:
        """One all-gather of every rank's header; the microbatch counts per rank, or `RanksDisagree`, or
        `RankFailed` when a rank came with an error (`failure`, its one-line reason)."""
        env = self.env
        step, epoch = self._position if self._position is not None else (0, 0)
        header = torch.tensor([count, self._position is not None, step, epoch], dtype=torch.int64)
        with _translate_faults(env, "exchanging microbatch sizes"):
            gathered = _all_gather_tensor(env, header.to(env.device)).view(self.world_size, _HEADER_FIELDS)
        rows = [tuple(int(v) for v in row) for row in gathered.tolist()]
        if any(row[0] == FAILED for row in rows):
            # every rank saw the flag, so every rank joins this gather of the failed ranks' reasons
            reasons: list[str | None] = [None] * self.world_size
            with _translate_faults(env, "gathering a failed rank's error"):
                dist.all_gather_object(reasons, failure)
            raise RankFailed("; ".join(f"rank {rank} raised {reason}" for rank, reason in enumerate(reasons)
                                       if rows[rank][0] == FAILED))
        problem = _disagreement(rows, self.equal_counts)
        if problem:
            raise RanksDisagree(f"ranks disagree at the window's size exchange: {problem}")
        return [row[0] for row in rows]

    def gather_rows(self, local_rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's `[rows_r, ...]` tensor in rank order (no autograd)."""
        if len(rows_per_rank) != self.world_size:
            raise ValueError(f"rows_per_rank has {len(rows_per_rank)} entries for world size {self.world_size}")
        if local_rows.shape[0] != rows_per_rank[self.rank]:
            raise ValueError(
                f"rank {self.rank} has {local_rows.shape[0]} rows but rows_per_rank says {rows_per_rank[self.rank]}"
            )
        num_max = max(rows_per_rank)
        with torch.no_grad(), _translate_faults(self.env, "gathering features"):
            padded = local_rows.detach()
            if padded.shape[0] < num_max:
                # all_gather wants equal shapes: pad this rank's rows with zeros, trim them after
                filler = padded.new_zeros((num_max - padded.shape[0], *padded.shape[1:]))
                padded = torch.cat([padded, filler])
            gathered = _all_gather_tensor(self.env, padded.contiguous())
            gathered = gathered.view(self.world_size, num_max, *local_rows.shape[1:])
            return torch.cat([gathered[r, :rows] for r, rows in enumerate(rows_per_rank)])


    def reduce_scatter_rows(self, rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Sum every rank's `[N, ...]` tensor, `N = Σ rows_per_rank`, and return this rank's rows of the sum
        (no autograd): each rank's block is padded to the largest, one reduce-scatter, then trimmed."""
        if len(rows_per_rank) != self.world_size or rows.shape[0] != sum(rows_per_rank):
            raise ValueError(
                f"reduce_scatter_rows: {rows.shape[0]} rows for rows_per_rank={list(rows_per_rank)} "
                f"in world size {self.world_size}"
            )
        num_max = max(rows_per_rank)
        with torch.no_grad(), _translate_faults(self.env, "returning feature gradients to their ranks"):
            padded = rows.new_zeros((self.world_size, num_max, *rows.shape[1:]))
            for rank, block in enumerate(rows.detach().split(list(rows_per_rank))):
                padded[rank, : block.shape[0]] = block
            out = rows.new_empty((num_max, *rows.shape[1:]))
            _REDUCE_SCATTER(out, padded.view(self.world_size * num_max, *rows.shape[1:]), op=dist.ReduceOp.SUM)
            return out[: rows_per_rank[self.rank]]

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's `values` (one all-reduce; no autograd)."""
        with torch.no_grad(), _translate_faults(self.env, "summing the loss over ranks"):
            summed = values.detach().clone()
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed


# torch ≥ 2.14 renames reduce_scatter_tensor (and warns on the old name). Bound once at import: this is the
# window's feature-gradient exchange, apart from the parameter-gradient reduce-scatters FSDP2 makes
# through `dist.reduce_scatter_single` (which tools wrap to count gradient syncs).
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_tensor(env: DistributedEnv, tensor: torch.Tensor) -> torch.Tensor:
    """`[world_size * rows, ...]`: every rank's equal-shaped tensor, in rank order."""
    out = tensor.new_empty((env.world_size * tensor.shape[0], *tensor.shape[1:]))
    # torch ≥ 2.14 renames all_gather_into_tensor (and warns on the old name)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, tensor)
    return out


class SingleProcessExchange(LocalExchange):
    """`LocalExchange` with the agreement calls of `ProcessGroupExchange`, which one process always meets."""

    def set_position(self, step: int, epoch: int) -> None:
        pass

    def end_of_data(self) -> None:
        pass

    def fail(self, error: BaseException, what: str) -> None:
        pass


def window_exchange(env: DistributedEnv, equal_counts: bool = False) -> ProcessGroupExchange | SingleProcessExchange:
    """`SingleProcessExchange` in one process, else the process-group exchange (see `ProcessGroupExchange`)."""
    return ProcessGroupExchange(env, equal_counts) if env.distributed else SingleProcessExchange()


def _rank_list(ranks: Sequence[int]) -> str:
    """`rank 3` / `ranks 0-2, 5`: consecutive runs collapsed, so 64 ranks still make one short line."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _disagreement(rows: Sequence[tuple[int, ...]], equal_counts: bool) -> str | None:
    """What the ranks' exchange headers (count, position set, step, epoch) disagree on, or None."""

    def where(row: tuple[int, ...]) -> str:
        return f"step {row[2]}, epoch {row[3]}" if row[1] else "no step given"

    def holds(count: int) -> str:
        return "no microbatches left" if count == 0 else f"{count} microbatch{'es' if count != 1 else ''}"

    def grouped(describe: Callable[[tuple[int, ...]], str]) -> str:
        groups: dict[str, list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(describe(row), []).append(rank)
        return "; ".join(f"{_rank_list(ranks)}: {text}" for text, ranks in groups.items())

    if len({row[1:] for row in rows}) > 1:
        return grouped(lambda row: f"{where(row)}, {holds(row[0])}")
    counts = [row[0] for row in rows]
    if 0 in counts and any(counts):
        # a rank whose loader ran out while others still train: the epoch's microbatch counts differ
        return grouped(lambda row: f"{where(row)}, {holds(row[0])}") + " (the ranks' data ended at different points)"
    if equal_counts and len(set(counts)) > 1:
        return grouped(lambda row: holds(row[0])) + " (FSDP needs the same number of microbatches on every rank)"
    return None


# -------------------------------------------------------------------------------------- agreement


def _digest(values: dict[str, Any]) -> int:
    """A signed 63-bit digest of the names, types and exact values (repr of floats is exact)."""
    text = repr(sorted((key, type(value).__name__, repr(value)) for key, value in values.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_consistency(env: DistributedEnv, **values: int | float | str) -> None:
    """All ranks must agree on `values` (step, epoch, window, schedule hash, ...), else RuntimeError.

    Cheap: one all-gather of an int64 digest; the values themselves are exchanged only on a mismatch,
    to say which rank differs and how. Every rank raises the same error (no rank is left in a collective).
    """
    if not env.distributed:
        return
    with _translate_faults(env, "checking cross-rank consistency"):
        digest = torch.tensor([_digest(values)], dtype=torch.int64, device=env.device)
        digests = _all_gather_tensor(env, digest).tolist()
        if len(set(digests)) == 1:
            return
        every: list[dict[str, Any] | None] = [None] * env.world_size
        dist.all_gather_object(every, dict(values))
    reference = every[0] or {}
    problems = []
    for rank, rank_values in enumerate(every[1:], start=1):
        rank_values = rank_values or {}
        for key in sorted(set(reference) | set(rank_values)):
            if key not in rank_values:
                problems.append(f"rank {rank} has no {key!r} (rank 0 has {reference[key]!r})")
            elif key not in reference:
                problems.append(f"rank {rank} has {key}={rank_values[key]!r} which rank 0 lacks")
            elif repr(rank_values[key]) != repr(reference[key]) or type(rank_values[key]) is not type(reference[key]):
                problems.append(f"rank {rank} has {key}={rank_values[key]!r} but rank 0 has {reference[key]!r}")
    raise RuntimeError("ranks disagree: " + "; ".join(problems))


def sum_over_ranks(env: DistributedEnv, values: Sequence[int]) -> list[int]:
    """Every rank's `values` summed elementwise; a collective: every rank must call it (never only the rank
    that logs), with the same number of values."""
    if not env.distributed:
        return [int(value) for value in values]
    with _translate_faults(env, "summing counters over ranks"):
        total = torch.tensor(list(values), dtype=torch.int64, device=env.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return [int(value) for value in total.tolist()]


def any_rank_true(env: DistributedEnv, flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (e.g. a non-finite loss → all skip the step)."""
    if not env.distributed:
        return bool(flag)
    with _translate_faults(env, "agreeing on a flag"):
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=env.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


# ------------------------------------------------------------------------------------------- faults


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store (e.g. a custom init): fall back to an anonymous message
        return None


def _one_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 500 characters: how another rank names this error."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]


def _record_failure(env: DistributedEnv, error: BaseException) -> None:
    """Leave this rank's error in the rendezvous store so the other ranks can name it."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"{_STORE_PREFIX}/failed/{env.rank}", _one_line(error))


T = TypeVar("T")
_MAIN_WORK_CALLS = itertools.count()  # every rank calls run_on_main in the same order: the same key
# the waiting ranks poll the store ever less often (many ranks polling one store), at most once a second
_POLL_FIRST_S, _POLL_MAX_S = 0.05, 1.0


def run_on_main(env: DistributedEnv, what: str, work: Callable[[], T]) -> T | None:
    """`work()` on rank 0 while the other ranks wait for it (every rank must call this); its result on rank 0,
    None on the others.

    The others poll a key rank 0 sets in the rendezvous store when it is done, instead of waiting in a
    barrier: no collective timeout applies, so an evaluation or a checkpoint write may take longer than
    `--dist-timeout`; an error in `work` reaches them at once as `RankFailed` naming it (`what`, e.g.
    "evaluating"), while rank 0 re-raises its own. Without a store it falls back to a barrier.
    """
    if not env.distributed:
        return work()
    store = _store()
    if store is None:
        result = work() if env.is_main else None
        barrier(env)
        return result
    key = f"{_STORE_PREFIX}/main_work/{next(_MAIN_WORK_CALLS)}"
    if env.is_main:
        try:
            result = work()
        except BaseException as error:
            with contextlib.suppress(Exception):
                store.set(key, "error " + _one_line(error))
            raise
        store.set(key, "ok")
        return result
    try:
        pause = _POLL_FIRST_S
        while not store.check([key]):
            time.sleep(pause)
            pause = min(_POLL_MAX_S, pause * 1.5)
        outcome = store.get(key).decode(errors="replace")
    except Exception as error:  # the store lives on rank 0 unless torchrun's agent hosts it
        raise DistributedFault(f"rank {env.rank} stopped while rank 0 was {what}: the rendezvous store is "
                               f"unreachable (rank 0 may have died): {_one_line(error)}") from error
    if outcome != "ok":
        raise RankFailed(f"rank 0 raised {outcome.removeprefix('error ')} (while {what})")
    return None


def _diagnose(env: DistributedEnv, what: str, error: BaseException) -> str:
    """One line: which ranks raised (with their error) or did not answer a roll call in the store."""
    cause = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    store = _store()
    if store is None:
        return f"rank {env.rank}: a collective failed while {what}: {cause}"
    others = [r for r in range(env.world_size) if r != env.rank]
    try:
        # roll call: the live ranks answer within a grace period; the rest died or hang
        store.set(f"{_STORE_PREFIX}/alive/{env.rank}", "1")
        failed: dict[int, str] = {}
        deadline = time.monotonic() + min(10.0, max(2.0, env.timeout_s / 4))
        while True:
            for r in others:
                if r not in failed and store.check([f"{_STORE_PREFIX}/failed/{r}"]):
                    failed[r] = store.get(f"{_STORE_PREFIX}/failed/{r}").decode(errors="replace")
            silent = [
                r for r in others if r not in failed and not store.check([f"{_STORE_PREFIX}/alive/{r}"])
            ]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:
        return (
            f"rank {env.rank}: a collective failed while {what} and the rendezvous store is unreachable "
            f"(it lives on rank 0 unless torchrun's agent hosts it; rank 0 may have died): {cause}"
        )
    parts = [f"rank {r} raised {message}" for r, message in sorted(failed.items())]
    parts += [f"rank {r} died or stopped responding" for r in silent]
    culprit = "; ".join(parts) if parts else "no rank reported a failure"
    return f"rank {env.rank} stopped while {what}: {culprit} (collective error: {cause})"


def _is_collective_error(error: BaseException) -> bool:
    # NCCL raises DistError; gloo a plain RuntimeError naming itself for closed connections and timeouts.
    # Any other error (a shape mismatch, CUDA out of memory) is this rank's own and says what it is.
    if isinstance(error, DistributedFault):
        return False
    return isinstance(error, dist.DistError) or _looks_like_collective_failure(error)


@contextlib.contextmanager
def _translate_faults(env: DistributedEnv, what: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        if not env.distributed or not _is_collective_error(error):
            raise
        raise DistributedFault(_diagnose(env, what, error)) from error


@contextlib.contextmanager
def fault_guard(env: DistributedEnv, what: str = "a training step") -> Iterator[None]:
    """Around a step: a collective failure (also inside DDP/FSDP backward) becomes a one-line
    `DistributedFault` naming the rank that raised, died or hung; any other error this rank raises is
    recorded for the other ranks to name, then re-raised. In one process it does nothing.

    Collectives give up after `timeout_s` of `init_distributed`, so a hung or dead peer surfaces within it.
    """
    if not env.distributed:
        yield
        return
    try:
        yield
    except DistributedFault:
        raise
    except Exception as error:
        if _is_collective_error(error):
            raise DistributedFault(_diagnose(env, what, error)) from error
        _record_failure(env, error)
        raise
    except BaseException as error:  # KeyboardInterrupt, SystemExit: still tell the others why
        _record_failure(env, error)
        raise


def _looks_like_collective_failure(error: BaseException) -> bool:
    """gloo reports a lost peer or a timeout as a plain RuntimeError raised from the reducer/backward."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        marker in text
        for marker in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe", "socket")
    )


# -------------------------------------------------------------------------------------- checkpoints


def full_state_dict(model: nn.Module, env: DistributedEnv) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, on rank 0 (other ranks get `{}`); every rank must call it.

    DDP: the module's state dict; FSDP2: gathered with `get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`. The tensors are copies: saving them later is safe.
    """
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        with _translate_faults(env, "gathering the FSDP state dict"):
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not env.is_main:
            return {}
        # gathered shards are fresh tensors, but the tensors FSDP2 leaves whole (0-d logit_scale/logit_bias)
        # come back as the live CPU parameters themselves: copy those
        unmanaged = {key for key, value in model.state_dict().items() if not isinstance(value, DTensor)}
        return {key: value.detach().to("cpu", copy=True) if key in unmanaged else value for key, value in state.items()}
    if not env.is_main:
        return {}
    return _cpu_copy(dict(unwrap_model(model).state_dict()))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], env: DistributedEnv) -> None:
    """Load a full state dict read on rank 0 (other ranks may pass `{}`) into every rank's model.

    DDP: rank 0 loads it, then broadcasts every parameter and buffer; FSDP2: `set_model_state_dict`
    with `broadcast_from_rank0=True`, each rank keeping its shard. Every rank must call it.
    """
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor

        with _translate_faults(env, "loading the FSDP state dict"), torch.no_grad():
            set_model_state_dict(
                model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
            # tensors FSDP2 does not manage (the 0-d logit_scale/logit_bias it cannot shard, buffers)
            # are not reliably loaded by it: copy them on rank 0 and broadcast
            for key, tensor in model.state_dict().items():
                if isinstance(tensor, DTensor):
                    continue
                if env.is_main:
                    tensor.copy_(state[key])
                dist.broadcast(tensor, src=0)
        return
    module = unwrap_model(model)
    if env.is_main or not env.distributed:
        module.load_state_dict(state)
    if env.distributed:
        with _translate_faults(env, "broadcasting the loaded state"), torch.no_grad():
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0)


def full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, env: DistributedEnv
) -> dict[str, Any]:
    """The optimizer's whole state on rank 0 (other ranks get `{}`), keyed as `optimizer.state_dict()` is
    for the unwrapped model; every rank must call it. FSDP2: gathered with `get_optimizer_state_dict`."""
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        with _translate_faults(env, "gathering the FSDP optimizer state"):
            state = get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if not env.is_main:
            return {}
        # gathered shards are fresh tensors; CPU tensors that needed no gather (`step`, the states of the
        # 0-d parameters) come back as the live ones, which the next step updates in place: copy those
        live = {
            value.data_ptr()
            for param_state in optimizer.state.values()
            for value in param_state.values()
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        }
        return _copy_if(state, lambda t: t.data_ptr() in live)
    # DDP: every rank holds the same optimizer state (same averaged gradients, same steps); copy it,
    # since optimizer.state_dict() aliases the live tensors that the next step updates in place
    return _cpu_copy(optimizer.state_dict()) if env.is_main else {}


def gather_to_main(env: DistributedEnv, value: Any) -> list[Any] | None:
    """Every rank's `value` (small picklable objects, e.g. RNG states), in rank order, on rank 0; None on the
    other ranks. Every rank must call it."""
    if not env.distributed:
        return [value]
    gathered: list[Any] | None = [None] * env.world_size if env.is_main else None
    with _translate_faults(env, "gathering per-rank state"):
        dist.gather_object(value, gathered, dst=0)
    return gathered


def _cpu_copy(value: Any) -> Any:
    return _copy_if(value, lambda _: True)


def _copy_if(value: Any, should_copy: Callable[[torch.Tensor], bool]) -> Any:
    """`value` (nested dicts/lists of tensors) with the tensors `should_copy` picks copied to CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if should_copy(value) else value
    if isinstance(value, dict):
        return {key: _copy_if(item, should_copy) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_if(item, should_copy) for item in value)
    return value


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], env: DistributedEnv
) -> None:
    """Load a full optimizer state on every rank; all must call it.

    DDP: every rank passes the state it read from the checkpoint itself (the optimizer state is ~2× the
    model: reading the file is cheaper than pickling it through a broadcast). FSDP2: rank 0's state is
    broadcast and sharded (`broadcast_from_rank0`); other ranks may pass `{}`.
    """
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        with _translate_faults(env, "loading the FSDP optimizer state"):
            set_optimizer_state_dict(
                model, optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
        return
    if not state:
        raise ValueError(f"rank {env.rank}: empty optimizer state; under DDP every rank loads the checkpoint's")
    optimizer.load_state_dict(state)

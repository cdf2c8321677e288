"""The window's view of the other ranks: `window_exchange` → `ProcessGroupExchange` (or one process's).

Every window it exchanges the ranks' microbatch sizes, which also checks that they agree on step, epoch and data
(`RanksDisagree` on every rank at once), carries the error of a rank that failed between windows (`fail`) and,
under FSDP, equal microbatch counts; it all-gathers feature rows without gradient (uneven counts: pad, then trim),
returns the sharded loss's row gradients to their owners (`reduce_scatter_rows`) and sums its per-rank values
(`sum_over_ranks`). docs/accumulation.md#across-ranks and docs/training.md#several-processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from naflexclip.parallel.process_group import (
    DistributedEnv,
    DistributedFault,
    RankFailed,
    all_gather_tensor,
    one_line,
    translate_faults,
)
from naflexclip.parallel.wrapping import is_fsdp
from naflexclip.window import LocalExchange


class RanksDisagree(DistributedFault):
    """Ranks met at a window's size exchange with different steps or epochs, or some with no data left;
    every rank raises the same one-line message at once (no rank is left waiting in a collective)."""


# the fixed-size header every rank contributes to a window's first all-gather: [microbatches, position set?,
# step, epoch, stop?, valid tokens, token slots]; microbatches is FAILED for a rank that raised (`fail`)
_HEADER_FIELDS = 7
_POSITION = slice(1, 4)
FAILED = -1


@dataclass(frozen=True)
class Agreement:
    """What the last size exchange told every rank, besides the sizes (the same on every rank).

    stop: some rank was asked to stop (`set_position(stop=True)` before that exchange).
    tokens: (valid image tokens, padded token slots) of the window, summed over ranks.
    """

    stop: bool = False
    tokens: tuple[int, int] = (0, 0)


class ProcessGroupExchange:
    """The window's view of the other ranks through the default process group (no autograd).

    The size exchange is where every rank meets every window, so it also carries what the ranks must
    agree on — the training loop's step and epoch (`set_position`, the window knows nothing of steps) and
    whether a rank has data at all (`end_of_data`) — in the same all-gather as the microbatch counts: a
    disagreement is a `RanksDisagree` on every rank at once, at no extra collective per window. What the
    loop needs from every rank each step rides along too (`set_position`'s `stop` and `tokens`, read back
    from `agreed`), so the loop makes no collective of its own.

    equal_counts: every rank must hold the same number of microbatches (FSDP gathers parameters in every
        forward, so a rank with one forward more would wait for the others forever); `window_exchange` sets
        it from the model.
    """

    def __init__(self, env: DistributedEnv, equal_counts: bool = False) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.equal_counts = equal_counts
        self._position: tuple[int, int] | None = None
        self._note: tuple[bool, tuple[int, int]] = (False, (0, 0))
        self.agreed = Agreement()

    def set_position(self, step: int, epoch: int, *, stop: bool = False, tokens: tuple[int, int] = (0, 0)) -> None:
        """The caller's step and epoch for the next exchanges (every rank must pass the same), with this rank's
        part of what every rank learns there (`agreed`): `stop`, it was asked to stop; `tokens`, its window's
        (valid image tokens, padded token slots)."""
        self._position = (int(step), int(epoch))
        self._note = (bool(stop), (int(tokens[0]), int(tokens[1])))

    def should_stop(self, requested: bool) -> bool:
        """Whether every rank stops after the last window: when some rank's stop request came with its size
        exchange (the same answer on every rank); a request made since (`requested`) travels with the next."""
        return self.agreed.stop

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
            self._meet(FAILED, f"{one_line(error)} (while {what})")
        except DistributedFault:
            pass  # its own error says more; a collective failure here leaves the others to the roll call

    def gather_sizes(self, local_sizes: Sequence[int]) -> list[list[int]]:
        """Every rank's microbatch sizes, indexed by rank; ranks may hold different numbers of microbatches."""
        env = self.env
        counts = self._meet(len(local_sizes))
        with translate_faults(env, "exchanging microbatch sizes"):
            # the sizes, padded to the longest list (the counts came with the header)
            num_max = max(counts)
            padded = torch.zeros(num_max, dtype=torch.int64, device=env.device)
            padded[: len(local_sizes)] = torch.tensor(list(local_sizes), dtype=torch.int64)
            sizes = all_gather_tensor(env, padded).view(self.world_size, num_max).tolist()
        return [row[:count] for row, count in zip(sizes, counts, strict=True)]

    def _meet(self, count: int, failure: str | None = None) -> list[int]:
        """One all-gather of every rank's header; the microbatch counts per rank, or `RanksDisagree`, or
        `RankFailed` when a rank came with an error (`failure`, its one-line reason)."""
        env = self.env
        step, epoch = self._position if self._position is not None else (0, 0)
        stop, (valid, slots) = self._note
        header = torch.tensor([count, self._position is not None, step, epoch, stop, valid, slots], dtype=torch.int64)
        with translate_faults(env, "exchanging microbatch sizes"):
            gathered = all_gather_tensor(env, header.to(env.device)).view(self.world_size, _HEADER_FIELDS)
        rows = [tuple(int(v) for v in row) for row in gathered.tolist()]
        if any(row[0] == FAILED for row in rows):
            # every rank saw the flag, so every rank joins this gather of the failed ranks' reasons
            reasons: list[str | None] = [None] * self.world_size
            with translate_faults(env, "gathering a failed rank's error"):
                dist.all_gather_object(reasons, failure)
            raise RankFailed("; ".join(f"rank {rank} raised {reason}" for rank, reason in enumerate(reasons)
                                       if rows[rank][0] == FAILED))
        problem = _disagreement(rows, self.equal_counts)
        if problem:
            raise RanksDisagree(f"ranks disagree at the window's size exchange: {problem}")
        self.agreed = Agreement(stop=any(row[4] for row in rows),
                                tokens=(sum(row[5] for row in rows), sum(row[6] for row in rows)))
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
        with torch.no_grad(), translate_faults(self.env, "gathering features"):
            padded = local_rows.detach()
            if padded.shape[0] < num_max:
                # all_gather wants equal shapes: pad this rank's rows with zeros, trim them after
                filler = padded.new_zeros((num_max - padded.shape[0], *padded.shape[1:]))
                padded = torch.cat([padded, filler])
            gathered = all_gather_tensor(self.env, padded.contiguous())
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
        with torch.no_grad(), translate_faults(self.env, "returning feature gradients to their ranks"):
            padded = rows.new_zeros((self.world_size, num_max, *rows.shape[1:]))
            for rank, block in enumerate(rows.detach().split(list(rows_per_rank))):
                padded[rank, : block.shape[0]] = block
            out = rows.new_empty((num_max, *rows.shape[1:]))
            _REDUCE_SCATTER(out, padded.view(self.world_size * num_max, *rows.shape[1:]), op=dist.ReduceOp.SUM)
            return out[: rows_per_rank[self.rank]]

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's `values` (one all-reduce; no autograd)."""
        with torch.no_grad(), translate_faults(self.env, "summing the loss over ranks"):
            summed = values.detach().clone()
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed


# torch ≥ 2.14 renames reduce_scatter_tensor (and warns on the old name). Bound once at import: this is the
# window's feature-gradient exchange, apart from the parameter-gradient reduce-scatters FSDP2 makes
# through `dist.reduce_scatter_single` (which tools wrap to count gradient syncs).
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class SingleProcessExchange(LocalExchange):
    """`LocalExchange` with the agreement calls of `ProcessGroupExchange`, which one process always meets."""

    def __init__(self) -> None:
        self.agreed = Agreement()

    def set_position(self, step: int, epoch: int, *, stop: bool = False, tokens: tuple[int, int] = (0, 0)) -> None:
        self.agreed = Agreement(stop=bool(stop), tokens=(int(tokens[0]), int(tokens[1])))

    def should_stop(self, requested: bool) -> bool:
        """One process has no one to agree with: its request as it stands now."""
        return requested

    def end_of_data(self) -> None:
        pass

    def fail(self, error: BaseException, what: str) -> None:
        pass


def window_exchange(env: DistributedEnv, model: nn.Module) -> ProcessGroupExchange | SingleProcessExchange:
    """The exchange of the windows `model` (as wrapped by `parallel.wrap_model`) runs in: `SingleProcessExchange`
    in one process, else the process-group exchange, which requires equal microbatch counts on every rank
    when the model is FSDP-sharded (see `ProcessGroupExchange`)."""
    return ProcessGroupExchange(env, equal_counts=is_fsdp(model)) if env.distributed else SingleProcessExchange()


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
    """What the ranks' exchange headers (count, position set, step, epoch, ...) disagree on, or None."""

    def where(row: tuple[int, ...]) -> str:
        return f"step {row[2]}, epoch {row[3] + 1}" if row[1] else "no step given"  # epochs numbered from 1

    def holds(count: int) -> str:
        return "no microbatches left" if count == 0 else f"{count} microbatch{'es' if count != 1 else ''}"

    def grouped(describe: Callable[[tuple[int, ...]], str]) -> str:
        groups: dict[str, list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(describe(row), []).append(rank)
        return "; ".join(f"{_rank_list(ranks)}: {text}" for text, ranks in groups.items())

    if len({row[_POSITION] for row in rows}) > 1:
        return grouped(lambda row: f"{where(row)}, {holds(row[0])}")
    counts = [row[0] for row in rows]
    if 0 in counts and any(counts):
        # a rank whose loader ran out while others still train: the epoch's microbatch counts differ
        return grouped(lambda row: f"{where(row)}, {holds(row[0])}") + " (the ranks' data ended at different points)"
    if equal_counts and len(set(counts)) > 1:
        return grouped(lambda row: holds(row[0])) + " (FSDP needs the same number of microbatches on every rank)"
    return None

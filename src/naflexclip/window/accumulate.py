"""`accumulate_gradients`: one window's checks, its scale `s(W)`, its terms' coefficients and the method that runs
it; `WindowStats`, what the window did."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from naflexclip.batch import GROUP_KEYS, batch_size, is_grouped, is_naflex, text_rows
from naflexclip.loss import ShardedLoss
from naflexclip.window.cache_method import run_cache
from naflexclip.window.outputs import FEATURE_KEYS, TOWER_FEATURES, feature_sources
from naflexclip.window.replay_method import run_replay
from naflexclip.window.scale import window_loss_scale
from naflexclip.window.state import LocalExchange, Window, WindowExchange, total
from naflexclip.window.terms import Term, TermCoefficients

METHODS = ("cache", "replay")
PAIR_TERM = "contrastive"  # the name of a pair loss of one term among the objective's terms (OpenCLIP's)


@dataclass(frozen=True)
class WindowStats:
    """What one window did. `loss` is L(W) (unscaled); the backward used `scale · L(W)`."""

    loss: float
    scale: float
    num_examples: int  # N: pairs in the whole window, all ranks (= negatives per example)
    num_microbatches: int  # R·n
    batch_sizes: tuple[int, ...]  # every microbatch in the window, rank-major
    terms: dict[str, float] | None = None  # a loss of several terms: each one's value (they sum to `loss`)
    example_terms: dict[str, float] | None = None  # each per-example part's value (1/Z(W)) Σ ℓ(i), before its weight
    example_weights: dict[str, float] | None = None  # each per-example part's λ_k

    @property
    def objective_terms(self) -> dict[str, float]:
        """Every term's share of the window objective before `s(W)`: the pair loss's (its terms, or `contrastive`),
        each per-example part's `λ_k/Z_k Σ ℓ_k` — they sum to `objective`."""
        pair = self.terms or {PAIR_TERM: self.loss}
        weights = self.example_weights or {}
        return {**pair, **{name: weights[name] * value for name, value in (self.example_terms or {}).items()}}

    @property
    def objective(self) -> float:
        """The window objective the step optimises, before `s(W)`: `L(W) + Σ_k λ_k/Z_k(W) Σ ℓ_k`."""
        return self.loss + sum(value for name, value in self.objective_terms.items()
                               if name in (self.example_terms or {}))


def _check_window(microbatches: Sequence[dict[str, Any]]) -> bool:
    """Validate the local microbatches; return True for a NaFlex window, False for dense."""
    if len(microbatches) == 0:
        raise ValueError("empty window: no microbatches given")
    kinds = [is_naflex(mb["image"]) for mb in microbatches]
    if any(kinds) and not all(kinds):
        raise ValueError(
            "window mixes dense and NaFlex microbatches: "
            f"kinds {['naflex' if k else 'dense' for k in kinds]}"
        )
    for index, mb in enumerate(microbatches):
        if batch_size(mb) < 1:
            raise ValueError(f"microbatch {index} is empty (batch size {batch_size(mb)})")
    return kinds[0]


def _exchange_groups(window: Window) -> None:
    """A grouped window: every rank's text counts (one small all-gather) and the whole window's group ids."""
    exchange, microbatches = window.exchange, window.microbatches
    local_texts = sum(text_rows(mb) for mb in microbatches)
    device = microbatches[0]["text"].device
    counts = exchange.gather_rows(torch.tensor([local_texts], device=device), [1] * exchange.world_size)
    window.text_rows_per_rank = [int(count) for count in counts.tolist()]
    window.groups = {
        key: window.gather(torch.cat([mb[key] for mb in microbatches]).to(torch.int64), feature)
        for key, feature in zip(GROUP_KEYS, FEATURE_KEYS, strict=True)
    }


def accumulate_gradients(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    microbatches: Sequence[dict[str, Any]],
    *,
    terms: Sequence[Term] = (),
    loss_scale: str = "none",
    reference_batch_size: int | None = None,
    method: str = "cache",
    exchange: WindowExchange | None = None,
    no_sync: Callable[[], ContextManager[Any]] | None = None,
    autocast: Callable[[], ContextManager[Any]] | None = None,
    grad_scaler: Any = None,
) -> WindowStats:
    """Add `s(W)·∇θ J(W)` for this window to the parameters' `.grad` (no optimizer step), `J(W)` the pair loss over
    the window's rows plus its terms (docs/accumulation.md).

    model: any module whose `forward(image=, text=)` returns OpenCLIP's output dict, or open_clip's tuple
        (`output_dict=False`: image_features, text_features, logit_scale[, logit_bias], read by position); for
        either input alone, that tower's features. One with `locked_towers()` (NaFlexClip) has its fully locked
        towers forwarded once.
    loss_fn: `loss(image_features, text_features, logit_scale, logit_bias=None)` over `[N, D]` rows; one
        that also has the per-rank form (`naflexclip.loss.ShardedLoss`: `ClipLoss`, `SigLipLoss`) is split
        over ranks in the `cache` method; any other is computed whole on every rank.
    microbatches: this rank's microbatches of the window, in order (sizes may differ).
    terms: the objectives' terms (`naflexclip.window.Term`): a distillation teacher's features for the loss
        (`TeacherFeatures`, with a `naflexclip.loss.DistillLoss`), per-example terms (a decoder's, self-distillation's),
        each weighted `s(W)·λ_k/Z_k(W)`; per-example terms need a trainable image tower.
    loss_scale / reference_batch_size: `--naflex-loss-scale` / `--batch-size`; dense windows scale 1.
    method: `cache` (gradient caching, default) or `replay` (OpenCLIP's scheme); both exact.
    exchange: the other ranks (default: this process is the whole window).
    no_sync: context factory that suppresses DDP/FSDP gradient sync, entered around the grad forward
        and backward of every microbatch but the window's last, so gradients sync once per window.
    autocast: context factory for the tower forwards (mixed precision); the loss runs in ≥ fp32.
    grad_scaler: a `torch.amp.GradScaler` for fp16; it scales the backward, not `s(W)`.
    """
    terms = tuple(terms)
    if method not in METHODS:
        raise ValueError(f"unknown accumulation method {method!r}; choose one of {METHODS}")
    takes_teacher = bool(getattr(loss_fn, "takes_teacher", False))
    given = [type(term).__name__ for term in terms if term.loss_inputs]
    if takes_teacher != bool(given):
        raise ValueError("a distillation loss needs a teacher and a teacher needs a distillation loss: got terms "
                         f"with loss inputs {given} with {type(loss_fn).__name__}")
    naflex = _check_window(microbatches)
    for term in terms:
        term.check(microbatches)
    grouped = [is_grouped(mb) for mb in microbatches]
    takes_groups = bool(getattr(loss_fn, "takes_groups", False))
    if any(grouped) != takes_groups or any(grouped) != all(grouped):
        raise ValueError(f"group ids (several captions per image) go with a multi-positive loss: microbatches "
                         f"{'with' if any(grouped) else 'without'} image_group/text_group "
                         f"({sum(grouped)} of {len(grouped)}) and {type(loss_fn).__name__}")
    exchange = exchange or LocalExchange()
    local_sizes = [batch_size(mb) for mb in microbatches]
    sizes_per_rank = exchange.gather_sizes(local_sizes)
    all_sizes = [size for rank_sizes in sizes_per_rank for size in rank_sizes]
    # the window's one coefficient, from every rank's microbatch sizes, before any replay
    scale = window_loss_scale(all_sizes, reference_batch_size, loss_scale if naflex else "none")
    window = Window(
        model=model,
        loss_fn=loss_fn,
        microbatches=microbatches,
        scale=scale,
        exchange=exchange,
        no_sync=no_sync or contextlib.nullcontext,
        autocast=autocast or contextlib.nullcontext,
        grad_scaler=grad_scaler,
        rows_per_rank=[sum(rank_sizes) for rank_sizes in sizes_per_rank],
        sharded=exchange.world_size > 1 and isinstance(loss_fn, ShardedLoss),
        live=tuple(name for name in TOWER_FEATURES if name not in feature_sources(model)),
        terms=terms,
    )
    if takes_groups:
        _exchange_groups(window)
    parts = [name for term in terms for name in term.parts]
    if parts:
        if "image" not in window.live:
            raise ValueError(f"per-example terms {parts} need the image tower's tokens, but the image tower is locked")
        # Z_k(W) summed over ranks (one small collective) and s(W)·λ_k/Z_k(W), all before the first forward
        window.coefficients = TermCoefficients(terms, microbatches, scale, exchange.sum_over_ranks)
    value = run_cache(window) if method == "cache" else run_replay(window)
    example_values = window.coefficients.values(exchange.sum_over_ranks) if window.coefficients else None
    names = getattr(loss_fn, "term_names", None)
    pair_terms = ({name: float(term) for name, term in zip(names, value.reshape(-1).tolist(), strict=True)}
                  if value.dim() > 0 and names else None)
    return WindowStats(
        loss=float(total(value)),
        scale=scale,
        num_examples=sum(all_sizes),
        num_microbatches=len(all_sizes),
        batch_sizes=tuple(all_sizes),
        terms=pair_terms,
        example_terms=example_values,
        example_weights=dict(window.coefficients.weights) if window.coefficients else None,
    )

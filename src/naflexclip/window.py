"""The accumulation window: one scale per optimizer step, and two exact ways to accumulate.

A window is every microbatch behind one optimizer step (all ranks). After
`accumulate_gradients`, the parameters' `.grad` holds (after DDP/FSDP averaging)

    s(W) · ∇θ L(W)

where `L(W)` is the contrastive loss of all `N` pairs as one batch and `s(W)` is
`window_loss_scale` over every microbatch size in the window — however the same ordered examples are
split into microbatches and ranks. See docs/accumulation.md for the math.

Phases (GradCache, Gao et al. 2021, https://arxiv.org/abs/2101.06983):
  cache  — forward every microbatch without grad, recording its RNG state;
  loss   — `s · L(W)` once over the cached features; backward gives every feature row's gradient and
           the gradient of `logit_scale`/`logit_bias` (counted here, once). With R ranks and a
           `ShardedLoss` (the default losses) each rank computes only its own rows' block of the loss
           (~N²/R work); the text-row gradients it gives other ranks go to them in one reduce-scatter;
  replay — per microbatch: restore RNG, forward with grad, backward the cached row gradients.
The `replay` method (OpenCLIP's scheme) instead differentiates `s · L(W)` once per microbatch with
that microbatch's rows live and the others cached; `logit_scale`/`logit_bias` are live in one replay.

A tower the model reports fully locked (`model.locked_towers()`, LiT) is a feature source: its features are
constants of the window, computed in the cache phase (before the RNG state is recorded) and never replayed,
so a locked image tower costs one forward per microbatch instead of a forward, a replay and its backward.
A teacher (distillation) is a feature source the same way: frozen, in eval mode, one no-grad forward per
microbatch; its features go through the same exchange as the student's and enter the loss as constants. It reads
the microbatch's `teacher_inputs` where the data carries them (its own patches and tokens of the same samples), else
the student's `image` and `text`.
A loss may return several terms (`DistillLoss`: `[contrastive, distill]`); L(W) is their sum, `s(W)` multiplies
it as a whole, and `WindowStats.terms` reports each.
Grouped microbatches (several captions per image: `image_group`, `text_group`, `naflexclip.batch`) may hold
different numbers of images and texts; the window exchanges both counts and every rank's group ids, so a
`MultiPositiveLoss` sees the ids of the whole window; a microbatch's size, and so `s(W)`, counts its images.
Per-example terms (`ExampleTerm`: a decoder's caption tokens, SigLIP 2's local-crop and masked-patch terms) need
the towers' un-pooled tokens, so the model computes them in each microbatch's grad forward, as each example's loss
sum; the window weighs them by `s(W)·λ_k / Z_k(W)`, with `Z_k(W)` (the window's examples or target tokens, all
ranks) counted from the microbatches' data before any forward — never a microbatch's own count.
An example teacher (SigLIP 2's EMA teacher, `naflexclip.objectives.self_distillation.EmaTeacher`) feeds per-example
terms: frozen, one
no-grad forward per microbatch in the cache phase (never replayed), its output dict handed to that microbatch's grad
forward as `teacher_targets=`.

This module knows nothing of loaders, optimizers, logging or process groups: distributed feature
exchange comes in as a `WindowExchange`, gradient-sync suppression as a `no_sync` context factory.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from naflexclip.batch import (
    EXAMPLE_INPUTS,
    GROUP_KEYS,
    TEACHER_INPUTS,
    batch_size,
    is_grouped,
    is_naflex,
    num_images,
    teacher_inputs,
    text_rows,
)
from naflexclip.loss import ShardedLoss
from naflexclip.rng import RngState

SCALE_MODES = ("none", "linear", "sqrt")
METHODS = ("cache", "replay")
FEATURE_KEYS = ("image_features", "text_features")
TOWER_FEATURES = {"image": "image_features", "text": "text_features"}  # the input each tower encodes → its output
SCALAR_KEYS = ("logit_scale", "logit_bias")
TEACHER = "teacher_"  # prefix of the teacher's features and scalars in a window's feature dict
# open_clip's `CLIP` / `CustomTextCLIP` with `output_dict=False` (their default) return a tuple in this order
TUPLE_OUTPUT_KEYS = ("image_features", "text_features", "logit_scale", "logit_bias")


EXAMPLE_TERMS = "example_terms"  # model output entry: {term name: each example's loss sum [B]}


@dataclass(frozen=True)
class ExampleTerm:
    """A per-example term `λ · (1/Z(W)) · Σ_{i∈W} ℓ(i)` of the window objective (docs/accumulation.md).

    The model's forward, given the microbatch's `example_inputs`, returns `out["example_terms"][name]`: `ℓ(i)` for
    each of its examples (a sum over the example's tokens, crops or patches). `count(microbatch)` is the
    microbatch's share of `Z(W)` (its examples, or its target tokens), read from its data."""

    name: str
    weight: float
    count: Callable[[dict[str, Any]], int]


def output_dict(out: Any) -> dict[str, Any]:
    """A model's output as OpenCLIP's output dict: a mapping as it is; open_clip's tuple
    `(image_features, text_features, logit_scale[, logit_bias])` by position; anything else a one-line error."""
    if isinstance(out, Mapping):
        return dict(out)
    if isinstance(out, (tuple, list)) and 3 <= len(out) <= len(TUPLE_OUTPUT_KEYS):
        return {key: value for key, value in zip(TUPLE_OUTPUT_KEYS, out, strict=False) if value is not None}
    kind = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}"
    raise ValueError(f"model output is {kind}; expected OpenCLIP's output dict (image_features, text_features, "
                     f"logit_scale[, logit_bias]) or open_clip's tuple of those (build it with output_dict=True)")


def window_loss_scale(
    batch_sizes: Sequence[int], reference_batch_size: int | None, mode: str
) -> float:
    """The one loss multiplier `s(W)` of a window, from the sizes of *every* microbatch in it.

    batch_sizes: all ranks' microbatch sizes (length `R·n`); reference_batch_size: `B_ref`
    (`--batch-size`); mode: `none` → 1, `linear` → mean size / B_ref, `sqrt` → its square root.
    """
    if mode not in SCALE_MODES:
        raise ValueError(f"unknown loss scale mode {mode!r}; choose one of {SCALE_MODES}")
    if len(batch_sizes) == 0:
        raise ValueError("empty window: batch_sizes=[] has no microbatches")
    for size in batch_sizes:
        if size < 1:
            raise ValueError(f"microbatch size {size} < 1 in window batch_sizes={list(batch_sizes)}")
    if mode == "none":
        return 1.0
    if reference_batch_size is None or reference_batch_size <= 0:
        raise ValueError(
            f"loss scale mode {mode!r} needs a positive reference batch size (--batch-size), "
            f"got {reference_batch_size!r}"
        )
    # mean microbatch size over the whole window / B_ref: one number for every microbatch in it
    linear = sum(batch_sizes) / (len(batch_sizes) * reference_batch_size)
    return linear if mode == "linear" else math.sqrt(linear)


@dataclass(frozen=True)
class WindowStats:
    """What one window did. `loss` is L(W) (unscaled); the backward used `scale · L(W)`."""

    loss: float
    scale: float
    num_examples: int  # N: pairs in the whole window, all ranks (= negatives per example)
    num_microbatches: int  # R·n
    batch_sizes: tuple[int, ...]  # every microbatch in the window, rank-major
    terms: dict[str, float] | None = None  # a loss of several terms: each one's value (they sum to `loss`)
    example_terms: dict[str, float] | None = None  # each ExampleTerm's value (1/Z(W)) Σ ℓ(i), before its weight


class WindowExchange(Protocol):
    """How a window sees the other ranks' microbatches (see naflexclip.parallel.feature_exchange)."""

    rank: int
    world_size: int

    def gather_sizes(self, local_sizes: Sequence[int]) -> list[list[int]]:
        """Every rank's microbatch sizes, indexed by rank."""
        ...

    def gather_rows(self, local_rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Concatenate every rank's `[rows_r, ...]` tensor in rank order (no autograd)."""
        ...

    def reduce_scatter_rows(self, rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        """Sum every rank's `[N, ...]` tensor and return this rank's rows of the sum (no autograd)."""
        ...

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's `values` (no autograd)."""
        ...


class LocalExchange:
    """The single-process exchange: this process is the whole window."""

    rank = 0
    world_size = 1

    def gather_sizes(self, local_sizes: Sequence[int]) -> list[list[int]]:
        return [list(local_sizes)]

    def gather_rows(self, local_rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        return local_rows

    def reduce_scatter_rows(self, rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        return rows

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by a constant."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def feature_sources(model: nn.Module) -> tuple[str, ...]:
    """The inputs (`image`, `text`) whose tower has no trainable parameter, as the model reports them through
    `locked_towers()` (a DDP wrapper's through its `.module`); a model without that method has none."""
    locked = getattr(getattr(model, "module", model), "locked_towers", None)
    names = locked() if locked is not None else ()
    return tuple(name for name in TOWER_FEATURES if name in names)


def _tensors(microbatch: dict[str, Any]) -> list[torch.Tensor]:
    """The microbatch's input tensors; other entries of a NaFlex dict (OpenCLIP's collator adds an int
    `seq_len`) are not inputs the RNG devices depend on."""
    image = microbatch["image"]
    images = list(image.values()) if isinstance(image, dict) else [image]
    return [t for t in (*images, microbatch["text"]) if isinstance(t, torch.Tensor)]


def _loss_precision(t: torch.Tensor) -> torch.Tensor:
    # the loss is computed in at least float32 even when the towers ran in bf16/fp16
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


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
        own = mb.get(TEACHER_INPUTS)
        if own is not None and (num_images(own["image"]), text_rows(own)) != (batch_size(mb), text_rows(mb)):
            raise ValueError(f"microbatch {index} has {batch_size(mb)} images / {text_rows(mb)} texts but its "
                             f"teacher_inputs {num_images(own['image'])} / {text_rows(own)}: the teacher's inputs "
                             f"are the same rows")
    return kinds[0]


@dataclass
class _Window:
    """The state shared by the phases of one window."""

    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    microbatches: Sequence[dict[str, Any]]
    scale: float
    exchange: WindowExchange
    no_sync: Callable[[], ContextManager[Any]]
    autocast: Callable[[], ContextManager[Any]]
    grad_scaler: Any
    rows_per_rank: list[int]  # image rows (examples) of every rank
    sharded: bool  # each rank computes only its own rows' block of the loss
    live: tuple[str, ...]  # inputs whose tower trains; a fully locked one's features are computed once, never replayed
    teacher: nn.Module | None = None  # frozen, eval: its features are computed once per microbatch, never replayed
    text_rows_per_rank: list[int] | None = None  # grouped windows: every rank's texts (else as rows_per_rank)
    groups: dict[str, torch.Tensor] | None = None  # grouped windows: the whole window's image and text group ids

    def counts(self, key: str) -> list[int]:
        """Every rank's rows of the feature `key` (texts may differ from images in a grouped window)."""
        texts = "text" in key and self.text_rows_per_rank is not None
        return self.text_rows_per_rank if texts else self.rows_per_rank  # type: ignore[return-value]

    def offset(self, key: str) -> int:
        return sum(self.counts(key)[: self.exchange.rank])

    def rows_of(self, microbatch: dict[str, Any], key: str) -> int:
        """Rows of the feature `key` in one microbatch."""
        return text_rows(microbatch) if "text" in key else batch_size(microbatch)
    example_terms: tuple[ExampleTerm, ...] = ()
    # s(W)·λ_k/Z_k(W) of each per-example term, known before the first grad forward
    term_coefficients: dict[str, float] | None = None
    term_counts: dict[str, float] | None = None  # Z_k(W): the window's examples or target tokens, all ranks
    term_sums: dict[str, torch.Tensor] | None = None  # this rank's Σ ℓ_k(i), accumulated over its grad forwards
    # frozen, eval: run once per microbatch in the cache phase; its outputs go to the grad forward of that microbatch
    example_teacher: Callable[..., dict[str, Any]] | None = None
    example_targets: list[dict[str, Any]] | None = None

    @property
    def live_keys(self) -> tuple[str, ...]:
        return tuple(TOWER_FEATURES[name] for name in self.live)

    def forward(self, microbatch: dict[str, Any], inputs: Sequence[str]) -> dict[str, torch.Tensor]:
        """The model on `inputs` of the microbatch (`image`, `text`, both, or neither for the scalars alone)."""
        with self.autocast():
            out = output_dict(self.model(**{name: microbatch[name] for name in inputs}))
        for key in (*(TOWER_FEATURES[name] for name in inputs), "logit_scale"):
            if key not in out:
                raise ValueError(f"model output has no {key!r}; it returned keys {sorted(out)}")
        return out

    def grad_forward(self, microbatch: dict[str, Any], index: int) -> dict[str, torch.Tensor]:
        """A microbatch's forward with grad (under its replayed RNG state): the live towers, and with per-example
        terms the model reads the microbatch's `example_inputs` too (and the example teacher's targets of microbatch
        `index`, as `teacher_targets`) and returns each example's term sums."""
        if not self.example_terms:
            return self.forward(microbatch, self.live)
        inputs: dict[str, Any] = {name: microbatch[name] for name in self.live}
        if self.example_targets is not None:
            inputs["teacher_targets"] = self.example_targets[index]
        with self.autocast():
            out = output_dict(self.model(**inputs, **microbatch.get(EXAMPLE_INPUTS, {})))
        terms = out.get(EXAMPLE_TERMS) or {}
        missing = [term.name for term in self.example_terms if term.name not in terms]
        if missing:
            raise ValueError(f"model output has no per-example term {missing[0]!r} under {EXAMPLE_TERMS!r}; "
                             f"it returned {sorted(terms)}")
        return out

    def term_part(self, out: dict[str, Any]) -> torch.Tensor | int:
        """The per-example terms' share of the backward of one grad forward: Σ_k s·λ_k/Z_k · Σ_i ℓ_k(i), × R
        (DDP/FSDP average the towers' gradients over ranks) and × the fp16 scaler's factor, if any."""
        if not self.example_terms:
            return 0
        assert self.term_coefficients is not None and self.term_sums is not None
        part: torch.Tensor | int = 0
        for term in self.example_terms:
            sums = _loss_precision(out[EXAMPLE_TERMS][term.name]).sum()
            self.term_sums[term.name] = self.term_sums[term.name] + sums.detach().double()
            part = part + sums * (self.term_coefficients[term.name] * self.exchange.world_size)
        if self.grad_scaler is not None and isinstance(part, torch.Tensor):
            part = self.grad_scaler.scale(part)
        return part

    def gather(self, local_rows: torch.Tensor, key: str = "image_features") -> torch.Tensor:
        return self.exchange.gather_rows(local_rows, self.counts(key))

    @property
    def local_offset(self) -> int:
        return self.offset("image_features")

    def scaled_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """`s·L` times the fp16 gradient scaler's factor, if any (the scaler is undone at unscale_)."""
        scaled = self.scale * loss
        return self.grad_scaler.scale(scaled) if self.grad_scaler is not None else scaled

    def sync(self, last: bool) -> ContextManager[Any]:
        """Around a microbatch's grad forward *and* its backward: gradients are synchronised once per
        window, on its last backward. DDP decides at forward time whether the next backward syncs
        (its `no_sync` must wrap the forward too); FSDP2 decides at backward time."""
        return contextlib.nullcontext() if last else self.no_sync()

    def cache(self) -> tuple[list[RngState], dict[str, torch.Tensor]]:
        """Phase 1: no-grad forwards; returns the RNG states of the trainable towers' forwards and the local
        features/scalars. A fully locked tower runs here only, before the RNG state is recorded."""
        states, outputs = [], []
        # where any of the window's forwards may draw: looked up once per window, not per microbatch
        devices = RngState.devices_of(self.model, [t for mb in self.microbatches for t in _tensors(mb)])
        sources = [name for name in TOWER_FEATURES if name not in self.live]
        with torch.no_grad():
            for mb in self.microbatches:
                out = self.forward(mb, sources) if sources else {}
                if self.teacher is not None:
                    out.update(self.teacher_forward(mb))
                if self.example_teacher is not None:  # constants of the window: computed here once, never replayed
                    with self.autocast():
                        targets = self.example_teacher(image=mb["image"])
                    self.example_targets.append({key: value.detach() for key, value in targets.items()})
                states.append(RngState(devices))
                if self.live:
                    out.update(self.forward(mb, self.live))
                outputs.append(out)
        prefixes = ("", TEACHER) if self.teacher is not None else ("",)
        cached = {prefix + key: torch.cat([out[prefix + key] for out in outputs])
                  for prefix in prefixes for key in FEATURE_KEYS}
        for key in (prefix + key for prefix in prefixes for key in SCALAR_KEYS):
            if outputs[0].get(key) is not None:
                cached[key] = outputs[0][key]
        return states, cached

    def teacher_forward(self, microbatch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The teacher's features and scalars of one microbatch (no grad, under the towers' autocast)."""
        assert self.teacher is not None
        with self.autocast():
            out = output_dict(self.teacher(**teacher_inputs(microbatch)))
        missing = [key for key in (*FEATURE_KEYS, "logit_scale") if key not in out]
        if missing:
            raise ValueError(f"the teacher's output has no {missing[0]!r}; it returned keys {sorted(out)}")
        return {TEACHER + key: out[key].detach() for key in (*FEATURE_KEYS, *SCALAR_KEYS) if out.get(key) is not None}

    def window_loss(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss's value over the whole window (all ranks' rows) — unscaled: L(W), or its terms."""
        return self.loss_fn(*_loss_inputs(features))

    def reduce_column_lse(self, partial: torch.Tensor) -> torch.Tensor:
        """`[N]` column log-sum-exps over this rank's rows → over every rank's rows (N numbers per rank)."""
        return self.exchange.gather_rows(partial[None], [1] * self.exchange.world_size).logsumexp(dim=0)


def _loss_inputs(features: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """The loss's positional inputs: the student's rows and scalars, then the teacher's where there is one."""
    prefixes = ("", TEACHER) if TEACHER + "image_features" in features else ("",)
    keys = [prefix + key for prefix in prefixes for key in (*FEATURE_KEYS, *SCALAR_KEYS)]
    keys += [key for key in GROUP_KEYS if key in features]  # a grouped window: the whole window's group ids
    return tuple(_loss_precision(features[key]) if features.get(key) is not None else None for key in keys)


def _total(value: torch.Tensor) -> torch.Tensor:
    """L(W) from a loss's value: the value, or the sum of its terms."""
    return value.sum() if value.dim() > 0 else value


def _teacher_leaves(window: _Window, local: dict[str, torch.Tensor], gather_images: bool) -> dict[str, torch.Tensor]:
    """The teacher's features as the loss phase sees them: its texts from every rank (and its images too when
    the whole loss is computed here), its scalars; constants."""
    if window.teacher is None:
        return {}
    leaves = {TEACHER + "text_features": window.gather(local[TEACHER + "text_features"], "text_features")}
    image = local[TEACHER + "image_features"]
    leaves[TEACHER + "image_features"] = window.gather(image) if gather_images else image
    leaves.update({TEACHER + key: local[TEACHER + key] for key in SCALAR_KEYS if TEACHER + key in local})
    return leaves


def _scalar_leaves(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: local[key].detach().requires_grad_() for key in SCALAR_KEYS if key in local}


def _whole_loss(window: _Window, local: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """Phase 2 with every rank computing all of L(W) (one process, or a loss that cannot be sharded):
    returns L(W), this rank's row gradients and the scalar gradients."""
    # a locked tower's rows are constants: no gradient is taken for them
    leaves = {key: window.gather(local[key], key).detach().requires_grad_(key in window.live_keys)
              for key in FEATURE_KEYS}
    leaves.update(_scalar_leaves(local))
    leaves.update(_teacher_leaves(window, local, gather_images=True))
    leaves.update(window.groups or {})
    value = window.window_loss(leaves)
    loss = _total(value)
    # the leaves are detached from the towers: this backward touches no parameter
    window.scaled_for_backward(loss).backward()
    # DDP/FSDP average gradients over ranks; the rows of this rank carry all of their gradient,
    # so multiply by R here and the average becomes the sum over ranks.
    rank, world = window.exchange.rank, window.exchange.world_size
    row_grads = {
        key: leaves[key].grad[window.offset(key) : window.offset(key) + window.counts(key)[rank]] * world
        for key in window.live_keys
    }
    # every rank computed the same scalar gradients: the average over ranks is that value, once
    scalar_grads = {key: leaves[key].grad for key in SCALAR_KEYS if key in leaves}
    return value.detach(), row_grads, scalar_grads


def _sharded_loss(window: _Window, local: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """Phase 2 split over ranks: this rank's block of logit rows (its images against every text).

    Its backward gives the gradient of the whole L(W) through the block: complete for this rank's
    image rows, a partial sum for every text row and for `logit_scale`/`logit_bias`. The text-row
    partials go to their owners summed (one reduce-scatter), the scalar partials and the per-rank loss
    values are summed over ranks (one all-reduce of a few numbers), so every rank ends with the same
    L(W) and scalar gradients as in the unsharded phase."""
    exchange, world = window.exchange, window.exchange.world_size
    leaves = {
        # only the texts are gathered: this rank's rows of the logit matrix need only its own images
        "image_features": local["image_features"].detach(),
        "text_features": window.gather(local["text_features"], "text_features").detach(),
    }
    for key in window.live_keys:  # a locked tower's rows are constants: no gradient is taken for them
        leaves[key].requires_grad_()
    leaves.update(_scalar_leaves(local))
    leaves.update(_teacher_leaves(window, local, gather_images=False))
    leaves.update(window.groups or {})
    assert isinstance(window.loss_fn, ShardedLoss)
    # a grouped window's texts are cut over ranks otherwise than its images: the loss learns which are this rank's
    texts = {} if window.groups is None else {"text_rows": (
        window.offset("text_features"), window.offset("text_features") + window.counts("text_features")[exchange.rank])}
    part = window.loss_fn.sharded(*_loss_inputs(leaves), row_offset=window.local_offset,
                                  reduce_column_lse=window.reduce_column_lse, **texts)
    window.scaled_for_backward(_total(part)).backward()
    # × R: DDP/FSDP average the tower gradients over ranks (as in the unsharded phase)
    row_grads = {}
    if "image_features" in window.live_keys:
        row_grads["image_features"] = leaves["image_features"].grad * world
    if "text_features" in window.live_keys:
        row_grads["text_features"] = exchange.reduce_scatter_rows(leaves["text_features"].grad,
                                                                  window.counts("text_features")) * world
    scalar_keys = [key for key in SCALAR_KEYS if key in leaves]
    values = part.detach().double().reshape(-1)  # L(W)'s part, or each of its terms' parts
    parts = torch.cat([values, *(leaves[key].grad.double().reshape(1) for key in scalar_keys)])
    summed = exchange.sum_over_ranks(parts)  # Σ_r: L(W) (or its terms), ∂(s·L)/∂t, ∂(s·L)/∂b — counted once
    scalar_grads = {
        key: summed[len(values) + index].to(leaves[key].grad.dtype).reshape(leaves[key].grad.shape)
        for index, key in enumerate(scalar_keys)
    }
    return summed[: len(values)].reshape(part.shape), row_grads, scalar_grads


def _run_cache(window: _Window) -> torch.Tensor:
    states, local = window.cache()
    # phase 2: s·L(W) once, on detached leaves
    loss, row_grads, scalar_grads = (_sharded_loss if window.sharded else _whole_loss)(window, local)

    # phase 3: replay each microbatch with grad and push its cached row gradients into the towers
    start = dict.fromkeys(FEATURE_KEYS, 0)
    last_index = len(window.microbatches) - 1
    for index, (mb, state) in enumerate(zip(window.microbatches, states, strict=True)):
        sizes = {key: window.rows_of(mb, key) for key in FEATURE_KEYS}
        with window.sync(last=index == last_index):
            with state.replayed():
                out = window.grad_forward(mb, index)
            # d(surrogate)/d(features) is exactly the cached row gradient (already carrying s and R)
            surrogate = sum(
                (_loss_precision(out[key]) * row_grads[key][start[key] : start[key] + sizes[key]]).sum()
                for key in window.live_keys
            ) + window.term_part(out)
            if index == last_index:
                # logit_scale / logit_bias: their gradient was taken once in phase 2
                surrogate = surrogate + sum((out[key] * grad).sum() for key, grad in scalar_grads.items())
            _backward(surrogate)
        start = {key: start[key] + sizes[key] for key in FEATURE_KEYS}
    return loss


def _exchange_groups(window: _Window) -> None:
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


def _backward(value: torch.Tensor | int) -> None:
    """Backward, unless nothing trainable is reached (both towers locked, a microbatch before the last)."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        value.backward()


def _run_replay(window: _Window) -> torch.Tensor:
    states, local = window.cache()
    cached = {key: window.gather(local[key], key) for key in FEATURE_KEYS}
    teacher = _teacher_leaves(window, local, gather_images=True)  # constants of every replay
    last_index = len(window.microbatches) - 1
    loss = None
    start = {key: window.offset(key) for key in FEATURE_KEYS}
    for index, (mb, state) in enumerate(zip(window.microbatches, states, strict=True)):
        sizes = {key: window.rows_of(mb, key) for key in FEATURE_KEYS}
        with window.sync(last=index == last_index):
            with state.replayed():
                out = window.grad_forward(mb, index)
            # a locked tower's rows are the cached constants
            features = {key: cached[key] for key in FEATURE_KEYS if key not in window.live_keys}
            features.update(teacher)
            features.update(window.groups or {})
            for key in window.live_keys:
                # live rows for this microbatch, cached rows elsewhere; × R undoes the DDP average
                live = _ScaleGrad.apply(out[key], float(window.exchange.world_size))
                first, end = start[key], start[key] + sizes[key]
                features[key] = torch.cat([cached[key][:first], live.to(cached[key].dtype), cached[key][end:]])
            for key in SCALAR_KEYS:
                if out.get(key) is not None:
                    # live in exactly one replay (the last), a constant in the others
                    features[key] = out[key] if index == last_index else out[key].detach()
            loss = window.window_loss(features)
            _backward(window.scaled_for_backward(_total(loss)) + window.term_part(out))
        start = {key: start[key] + sizes[key] for key in FEATURE_KEYS}
    assert loss is not None
    return loss.detach()


def accumulate_gradients(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    microbatches: Sequence[dict[str, Any]],
    *,
    loss_scale: str = "none",
    reference_batch_size: int | None = None,
    method: str = "cache",
    exchange: WindowExchange | None = None,
    no_sync: Callable[[], ContextManager[Any]] | None = None,
    autocast: Callable[[], ContextManager[Any]] | None = None,
    grad_scaler: Any = None,
    teacher: nn.Module | None = None,
    example_terms: Sequence[ExampleTerm] = (),
    example_teacher: Callable[..., dict[str, Any]] | None = None,
) -> WindowStats:
    """Add `s(W)·∇θ L(W)` for this window to the parameters' `.grad` (no optimizer step).

    model: any module whose `forward(image=, text=)` returns OpenCLIP's output dict, or open_clip's tuple
        (`output_dict=False`: image_features, text_features, logit_scale[, logit_bias], read by position); for
        either input alone, that tower's features. One with `locked_towers()` (NaFlexClip) has its fully locked
        towers forwarded once.
    loss_fn: `loss(image_features, text_features, logit_scale, logit_bias=None)` over `[N, D]` rows; one
        that also has the per-rank form (`naflexclip.loss.ShardedLoss`: `ClipLoss`, `SigLipLoss`) is split
        over ranks in the `cache` method; any other is computed whole on every rank.
    microbatches: this rank's microbatches of the window, in order (sizes may differ).
    loss_scale / reference_batch_size: `--naflex-loss-scale` / `--batch-size`; dense windows scale 1.
    method: `cache` (gradient caching, default) or `replay` (OpenCLIP's scheme); both exact.
    exchange: the other ranks (default: this process is the whole window).
    no_sync: context factory that suppresses DDP/FSDP gradient sync, entered around the grad forward
        and backward of every microbatch but the window's last, so gradients sync once per window.
    autocast: context factory for the tower forwards (mixed precision); the loss runs in ≥ fp32.
    grad_scaler: a `torch.amp.GradScaler` for fp16; it scales the backward, not `s(W)`.
    teacher: a model to distil from (`forward(image=, text=)` as `model`'s), with a loss that takes its features
        (`naflexclip.loss.DistillLoss`); it is put in eval mode and run once per microbatch without gradient — its
        parameters get none. It reads each microbatch's `teacher_inputs` (its own processing of the same rows) where
        there are some, else the microbatch's `image` and `text`.
    example_terms: per-example terms of the objective (`ExampleTerm`), added as `s(W)·λ_k/Z_k(W)·Σ_i ℓ_k(i)`; the
        model's grad forward gets each microbatch's `example_inputs` as keyword arguments and returns the sums
        under `example_terms`. They need a trainable image tower.
    example_teacher: a frozen model feeding per-example terms (`naflexclip.objectives.self_distillation.EmaTeacher`):
    called as
        `example_teacher(image=)` once per microbatch without gradient in the cache phase (never replayed); its output
        dict goes to that microbatch's grad forward as `teacher_targets=`.
    """
    if method not in METHODS:
        raise ValueError(f"unknown accumulation method {method!r}; choose one of {METHODS}")
    takes_teacher = bool(getattr(loss_fn, "takes_teacher", False))
    if takes_teacher != (teacher is not None):
        raise ValueError("a distillation loss needs a teacher and a teacher needs a distillation loss: got "
                         f"teacher={'a model' if teacher is not None else None} with {type(loss_fn).__name__}")
    if teacher is not None:
        teacher.eval()
    naflex = _check_window(microbatches)
    grouped = [is_grouped(mb) for mb in microbatches]
    takes_groups = bool(getattr(loss_fn, "takes_groups", False))
    if any(grouped) != takes_groups or any(grouped) != all(grouped):
        raise ValueError(f"group ids (several captions per image) go with a multi-positive loss: microbatches "
                         f"{'with' if any(grouped) else 'without'} image_group/text_group "
                         f"({sum(grouped)} of {len(grouped)}) and {type(loss_fn).__name__}")
    if example_teacher is not None and not example_terms:
        raise ValueError("an example teacher feeds per-example terms: give example_terms with it")
    exchange = exchange or LocalExchange()
    local_sizes = [batch_size(mb) for mb in microbatches]
    sizes_per_rank = exchange.gather_sizes(local_sizes)
    all_sizes = [size for rank_sizes in sizes_per_rank for size in rank_sizes]
    # the window's one coefficient, from every rank's microbatch sizes, before any replay
    scale = window_loss_scale(all_sizes, reference_batch_size, loss_scale if naflex else "none")
    window = _Window(
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
        teacher=teacher,
        example_teacher=example_teacher,
        example_targets=None if example_teacher is None else [],
    )
    if takes_groups:
        _exchange_groups(window)
    if example_terms:
        _count_example_terms(window, tuple(example_terms))
    value = _run_cache(window) if method == "cache" else _run_replay(window)
    example_values = _example_term_values(window) if example_terms else None
    names = getattr(loss_fn, "term_names", None)
    terms = ({name: float(term) for name, term in zip(names, value.reshape(-1).tolist(), strict=True)}
             if value.dim() > 0 and names else None)
    return WindowStats(
        loss=float(_total(value)),
        scale=scale,
        num_examples=sum(all_sizes),
        num_microbatches=len(all_sizes),
        batch_sizes=tuple(all_sizes),
        terms=terms,
        example_terms=example_values,
    )


def _count_example_terms(window: _Window, terms: tuple[ExampleTerm, ...]) -> None:
    """`Z_k(W)` of every per-example term, summed over ranks (one small collective), and the coefficients
    `s(W)·λ_k/Z_k(W)` the grad forwards use — all before the first forward."""
    if "image" not in window.live:
        raise ValueError(f"per-example terms {[term.name for term in terms]} need the image tower's tokens, "
                         "but the image tower is locked")
    device = window.microbatches[0]["text"].device
    local = torch.tensor([float(sum(term.count(mb) for mb in window.microbatches)) for term in terms],
                         dtype=torch.float64, device=device)
    counts = window.exchange.sum_over_ranks(local).tolist()
    for term, count in zip(terms, counts, strict=True):
        if count <= 0:
            raise ValueError(f"per-example term {term.name!r} counts {count:g} in the window (nothing to normalise)")
    window.example_terms = terms
    window.term_counts = {term.name: count for term, count in zip(terms, counts, strict=True)}
    window.term_coefficients = {term.name: window.scale * term.weight / count
                                for term, count in zip(terms, counts, strict=True)}
    window.term_sums = {term.name: torch.zeros((), dtype=torch.float64, device=device) for term in terms}


def _example_term_values(window: _Window) -> dict[str, float]:
    """Each per-example term's value over the window, `(1/Z_k) Σ_{i∈W} ℓ_k(i)` (unweighted, unscaled)."""
    assert window.term_sums is not None and window.term_counts is not None
    names = [term.name for term in window.example_terms]
    sums = window.exchange.sum_over_ranks(torch.stack([window.term_sums[name] for name in names])).tolist()
    return {name: total / window.term_counts[name] for name, total in zip(names, sums, strict=True)}

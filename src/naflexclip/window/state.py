"""What the phases of one window share: the exchange with the other ranks, the window's state (`Window`: its
microbatches, scale, live towers, the terms' constants and coefficients) and the forwards it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from naflexclip.batch import GROUP_KEYS, batch_size, text_rows
from naflexclip.rng import RngState
from naflexclip.window.outputs import FEATURE_KEYS, SCALAR_KEYS, TOWER_FEATURES, loss_precision, output_dict
from naflexclip.window.terms import (
    EXAMPLE_LOSSES,
    Term,
    TermCoefficients,
    example_losses,
    loss_input_keys,
    output_tokens,
    pair_loss_inputs,
)


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


def _tensors(microbatch: dict[str, Any]) -> list[torch.Tensor]:
    """The microbatch's input tensors; other entries of a NaFlex dict (OpenCLIP's collator adds an int
    `seq_len`) are not inputs the RNG devices depend on."""
    image = microbatch["image"]
    images = list(image.values()) if isinstance(image, dict) else [image]
    return [t for t in (*images, microbatch["text"]) if isinstance(t, torch.Tensor)]


@dataclass
class Window:
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
    terms: tuple[Term, ...] = ()
    text_rows_per_rank: list[int] | None = None  # grouped windows: every rank's texts (else as rows_per_rank)
    groups: dict[str, torch.Tensor] | None = None  # grouped windows: the whole window's image and text group ids
    # each term's constants of each microbatch (`constants[t][m]`), computed in the cache phase
    constants: list[list[dict[str, Any]]] = field(default_factory=list)
    coefficients: TermCoefficients | None = None  # the terms' per-example parts, known before the first grad forward

    def counts(self, key: str) -> list[int]:
        """Every rank's rows of the feature `key` (texts may differ from images in a grouped window)."""
        texts = "text" in key and self.text_rows_per_rank is not None
        return self.text_rows_per_rank if texts else self.rows_per_rank  # type: ignore[return-value]

    def offset(self, key: str) -> int:
        return sum(self.counts(key)[: self.exchange.rank])

    def rows_of(self, microbatch: dict[str, Any], key: str) -> int:
        """Rows of the feature `key` in one microbatch."""
        return text_rows(microbatch) if "text" in key else batch_size(microbatch)

    @property
    def live_keys(self) -> tuple[str, ...]:
        return tuple(TOWER_FEATURES[name] for name in self.live)

    @property
    def local_offset(self) -> int:
        return self.offset("image_features")

    def _call(self, microbatch: dict[str, Any], inputs: Sequence[str], **options: Any) -> dict[str, Any]:
        out = output_dict(self.model(**{name: microbatch[name] for name in inputs}, **options))
        for key in (*(TOWER_FEATURES[name] for name in inputs), "logit_scale"):
            if key not in out:
                raise ValueError(f"model output has no {key!r}; it returned keys {sorted(out)}")
        return out

    def forward(self, microbatch: dict[str, Any], inputs: Sequence[str]) -> dict[str, torch.Tensor]:
        """The model on `inputs` of the microbatch (`image`, `text`, both, or neither for the scalars alone)."""
        with self.autocast():
            return self._call(microbatch, inputs)

    def grad_forward(self, microbatch: dict[str, Any], index: int) -> dict[str, Any]:
        """A microbatch's forward with grad (under its replayed RNG state): the live towers, and with per-example
        parts each term's losses of microbatch `index` from that forward's output (`EXAMPLE_LOSSES`)."""
        if self.coefficients is None:
            return self.forward(microbatch, self.live)
        with self.autocast():
            out = self._call(microbatch, self.live, **output_tokens(self.terms))
            held = [constants[index] for constants in self.constants]
            out[EXAMPLE_LOSSES] = example_losses(self.terms, self.model, microbatch, out, held)
        return out

    def term_part(self, out: dict[str, Any]) -> torch.Tensor | int:
        """The per-example parts' share of the backward of one grad forward: Σ_k s·λ_k/Z_k · Σ_i ℓ_k(i), × R
        (DDP/FSDP average the towers' gradients over ranks) and × the fp16 scaler's factor, if any."""
        if self.coefficients is None:
            return 0
        part = self.coefficients.backward_part(out[EXAMPLE_LOSSES], self.exchange.world_size)
        if self.grad_scaler is not None and isinstance(part, torch.Tensor):
            part = self.grad_scaler.scale(part)
        return part

    def gather(self, local_rows: torch.Tensor, key: str = "image_features") -> torch.Tensor:
        return self.exchange.gather_rows(local_rows, self.counts(key))

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
        features/scalars, with the terms' inputs to the pair loss. A fully locked tower and the terms' constants
        run here only, before the RNG state is recorded."""
        states, outputs = [], []
        # where any of the window's forwards may draw: looked up once per window, not per microbatch
        devices = RngState.devices_of(self.model, [t for mb in self.microbatches for t in _tensors(mb)])
        sources = [name for name in TOWER_FEATURES if name not in self.live]
        self.constants = [[] for _ in self.terms]
        with torch.no_grad():
            for mb in self.microbatches:
                out = self.forward(mb, sources) if sources else {}
                for term, held in zip(self.terms, self.constants, strict=True):
                    held.append(term.constants(mb, self.autocast))  # constants of the window: never replayed
                states.append(RngState(devices))
                if self.live:
                    out.update(self.forward(mb, self.live))
                outputs.append(out)
        cached = {key: torch.cat([out[key] for out in outputs]) for key in FEATURE_KEYS}
        for key in SCALAR_KEYS:
            if outputs[0].get(key) is not None:
                cached[key] = outputs[0][key]
        cached.update(pair_loss_inputs(self.terms, self.constants))
        return states, cached

    def constant_leaves(self, local: dict[str, torch.Tensor], gather_images: bool) -> dict[str, torch.Tensor]:
        """The terms' inputs to the pair loss as the loss phase sees them: their text rows from every rank (and their
        image rows too when the whole loss is computed here), their scalars; constants."""
        leaves = {}
        for key, rows in loss_input_keys(self.terms):
            if key not in local:
                continue
            if rows == "text":
                leaves[key] = self.gather(local[key], "text_features")
            elif rows == "image":
                leaves[key] = self.gather(local[key]) if gather_images else local[key]
            else:
                leaves[key] = local[key]
        return leaves

    def loss_inputs(self, features: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """The pair loss's positional inputs: the student's rows and scalars, then the terms' (a teacher's), then
        a grouped window's group ids."""
        keys = [*FEATURE_KEYS, *SCALAR_KEYS, *(key for key, _ in loss_input_keys(self.terms))]
        keys += [key for key in GROUP_KEYS if key in features]  # a grouped window: the whole window's group ids
        return tuple(loss_precision(features[key]) if features.get(key) is not None else None for key in keys)

    def window_loss(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss's value over the whole window (all ranks' rows) — unscaled: L(W), or its terms."""
        return self.loss_fn(*self.loss_inputs(features))

    def reduce_column_lse(self, partial: torch.Tensor) -> torch.Tensor:
        """`[N]` column log-sum-exps over this rank's rows → over every rank's rows (N numbers per rank)."""
        return self.exchange.gather_rows(partial[None], [1] * self.exchange.world_size).logsumexp(dim=0)


def total(value: torch.Tensor) -> torch.Tensor:
    """L(W) from a loss's value: the value, or the sum of its terms."""
    return value.sum() if value.dim() > 0 else value


def backward(value: torch.Tensor | int) -> None:
    """Backward, unless nothing trainable is reached (both towers locked, a microbatch before the last)."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        value.backward()

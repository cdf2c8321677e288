"""The terms of the window objective beyond the pair loss, and their coefficients.

A `Term` is what one objective adds to `J(W)`: constants computed once per microbatch without gradient (never
replayed), loss inputs handed to the pair loss after the student's rows, and per-example parts `ℓ_k(i)` with their
weights `λ_k` and each microbatch's share of `Z_k(W)`. `TermCoefficients` is the only place a coefficient
`s(W)·λ_k/Z_k(W)` is computed. docs/accumulation.md#the-window-objective-per-example-terms-siglip-2s-decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

from naflexclip.batch import TEACHER_INPUTS, batch_size, num_images, teacher_inputs, text_rows
from naflexclip.window.outputs import FEATURE_KEYS, SCALAR_KEYS, loss_precision, output_dict

EXAMPLE_LOSSES = "example_losses"  # a grad forward's entry: {part: each example's loss sum [B]}
TEACHER = "teacher_"  # prefix of a teacher's features and scalars among the pair loss's inputs


class Term:
    """One objective's contribution to the window objective (see the module docstring); the defaults contribute
    nothing, a subclass overrides what it adds."""

    parts: tuple[str, ...] = ()  # its per-example losses, each a term λ_k/Z_k Σ ℓ_k of J(W)
    weights: Mapping[str, float] = {}  # λ_k of each part
    # the constants it hands the pair loss, in the loss's argument order after the student's: (key, rows), rows
    # "image" or "text" for row tensors (exchanged across ranks), None for a scalar (the first microbatch's)
    loss_inputs: tuple[tuple[str, str | None], ...] = ()
    output_tokens: bool = False  # its parts read the image tower's un-pooled tokens (`model(output_tokens=True)`)

    def check(self, microbatches: Sequence[dict[str, Any]]) -> None:
        """Refuse, in one line, microbatches this term cannot read (before any forward)."""

    def count(self, microbatch: dict[str, Any]) -> Mapping[str, float]:
        """The microbatch's share of each part's normaliser `Z_k(W)` (its examples, or its target tokens)."""
        return {}

    def constants(self, microbatch: dict[str, Any], autocast: Callable[[], ContextManager[Any]]) -> dict[str, Any]:
        """The microbatch's constants (called without gradient, once per microbatch, in the cache phase)."""
        return {}

    def example_losses(self, model: nn.Module, microbatch: dict[str, Any], out: dict[str, Any],
                       constants: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Each part's `ℓ_k(i)` `[B]` for the microbatch, from its grad forward's output `out` (under its autocast)
        and its `constants`; `model` as given to the window (a DDP wrapper's module is `model.module`)."""
        return {}

    def random_inputs(self, model: nn.Module, num_examples: int, seed: int) -> dict[str, torch.Tensor]:
        """The `example_inputs` columns this term reads, drawn at random from `seed` for `num_examples` examples
        (`naflexclip verify`'s random window)."""
        return {}


class TeacherFeatures(Term):
    """A frozen model whose features and scalars enter the pair loss as constants (a distillation teacher, with a
    loss that takes them: `naflexclip.loss.DistillLoss`). It is put in eval mode and run once per microbatch
    without gradient — its parameters get none; it reads each microbatch's `teacher_inputs` (its own processing of
    the same rows) where there are some, else the microbatch's `image` and `text`."""

    loss_inputs = tuple((TEACHER + key, "text" if "text" in key else "image") for key in FEATURE_KEYS) + tuple(
        (TEACHER + key, None) for key in SCALAR_KEYS)

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def check(self, microbatches: Sequence[dict[str, Any]]) -> None:
        self.model.eval()
        for index, mb in enumerate(microbatches):
            own = mb.get(TEACHER_INPUTS)
            if own is not None and (num_images(own["image"]), text_rows(own)) != (batch_size(mb), text_rows(mb)):
                raise ValueError(f"microbatch {index} has {batch_size(mb)} images / {text_rows(mb)} texts but its "
                                 f"teacher_inputs {num_images(own['image'])} / {text_rows(own)}: the teacher's "
                                 f"inputs are the same rows")

    def constants(self, microbatch: dict[str, Any], autocast: Callable[[], ContextManager[Any]]) -> dict[str, Any]:
        with autocast():
            out = output_dict(self.model(**teacher_inputs(microbatch)))
        missing = [key for key in (*FEATURE_KEYS, "logit_scale") if key not in out]
        if missing:
            raise ValueError(f"the teacher's output has no {missing[0]!r}; it returned keys {sorted(out)}")
        return {TEACHER + key: out[key].detach() for key in (*FEATURE_KEYS, *SCALAR_KEYS) if out.get(key) is not None}


def output_tokens(terms: Sequence[Term]) -> dict[str, bool]:
    """The keyword the grad forward passes the model: `output_tokens=True` when a term reads the tokens."""
    return {"output_tokens": True} if any(term.output_tokens for term in terms) else {}


def example_losses(terms: Sequence[Term], model: nn.Module, microbatch: dict[str, Any], out: dict[str, Any],
                   constants: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every part's `ℓ_k(i)` of the microbatch (`constants`: each term's of this microbatch), checked present."""
    losses: dict[str, torch.Tensor] = {}
    for term, held in zip(terms, constants, strict=True):
        if term.parts:
            losses.update(term.example_losses(model, microbatch, out, held))
            missing = [name for name in term.parts if name not in losses]
            if missing:
                raise ValueError(f"{type(term).__name__} gave no per-example loss {missing[0]!r}; it gave "
                                 f"{sorted(losses)}")
    return losses


def pair_loss_inputs(terms: Sequence[Term], constants: Sequence[Sequence[dict[str, Any]]]
                     ) -> dict[str, torch.Tensor]:
    """The constants the terms hand the pair loss, over the given microbatches (`constants[t][m]`: term t's of
    microbatch m): row tensors concatenated in microbatch order, scalars the first microbatch's."""
    inputs: dict[str, torch.Tensor] = {}
    for term, held in zip(terms, constants, strict=True):
        for key, rows in term.loss_inputs:
            if rows is not None:
                inputs[key] = torch.cat([c[key] for c in held])
            elif held and held[0].get(key) is not None:
                inputs[key] = held[0][key]
    return inputs


def loss_input_keys(terms: Sequence[Term]) -> list[tuple[str, str | None]]:
    return [spec for term in terms for spec in term.loss_inputs]


class TermCoefficients:
    """The per-example parts of a window's terms: `Z_k(W)` (summed over ranks before the first forward), the
    coefficients `s(W)·λ_k/Z_k(W)` the grad forwards use, and this rank's running `Σ ℓ_k(i)` — never a microbatch's
    own count."""

    def __init__(self, terms: Sequence[Term], microbatches: Sequence[dict[str, Any]], scale: float,
                 sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        parts = [(term, name) for term in terms for name in term.parts]
        device = microbatches[0]["text"].device
        local = torch.tensor([float(sum(term.count(mb)[name] for mb in microbatches)) for term, name in parts],
                             dtype=torch.float64, device=device)
        counts = sum_over_ranks(local).tolist()
        for (_, name), count in zip(parts, counts, strict=True):
            if count <= 0:
                raise ValueError(f"per-example term {name!r} counts {count:g} in the window (nothing to normalise)")
        self.names = [name for _, name in parts]
        self.weights = {name: term.weights[name] for term, name in parts}
        self.counts = {name: count for name, count in zip(self.names, counts, strict=True)}
        self.coefficients = {name: scale * term.weights[name] / count
                             for (term, name), count in zip(parts, counts, strict=True)}
        self.sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in self.names}

    def backward_part(self, losses: Mapping[str, torch.Tensor], world_size: int) -> torch.Tensor | int:
        """One grad forward's share of the backward: Σ_k s·λ_k/Z_k · Σ_i ℓ_k(i), × R (DDP/FSDP average the towers'
        gradients over ranks); records the sums for `values`."""
        part: torch.Tensor | int = 0
        for name in self.names:
            sums = loss_precision(losses[name]).sum()
            self.sums[name] = self.sums[name] + sums.detach().double()
            part = part + sums * (self.coefficients[name] * world_size)
        return part

    def values(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Each part's value over the window, `(1/Z_k) Σ_{i∈W} ℓ_k(i)` (unweighted, unscaled)."""
        sums = sum_over_ranks(torch.stack([self.sums[name] for name in self.names])).tolist()
        return {name: total / self.counts[name] for name, total in zip(self.names, sums, strict=True)}


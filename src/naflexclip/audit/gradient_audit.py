"""The window audit: the gradients of a window accumulated over random splits into microbatches against its
full-batch reference `s(W)·∇θ L(W)`, worst relative error per parameter group against the tolerances of
docs/accumulation.md, with OpenCLIP's per-microbatch rule on the same splits for contrast (`naflexclip verify`
runs it and prints the table).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.audit.random_windows import random_split_sizes
from naflexclip.batch import GROUP_KEYS, batch_size, concat_microbatches, is_grouped, split_batch
from naflexclip.window import Term, accumulate_gradients, output_dict, window_loss_scale
from naflexclip.window.terms import example_losses, loss_input_keys, output_tokens, pair_loss_inputs

FLOAT64_TOLERANCE = 1e-10
FLOAT32_TOLERANCE = 1e-4
# timm's NaFlexVit resamples its learned position table in float32 even in a float64 model,
# so that one tensor's gradient agrees only to ~1e-8 (docs/accumulation.md, Tolerances).
POS_EMBED_TOLERANCE = 1e-6


def tolerance_for(param_name: str, dtype: torch.dtype) -> float:
    """The relative tolerance for one parameter's gradient (docs/accumulation.md, Tolerances)."""
    if dtype != torch.float64:
        return FLOAT32_TOLERANCE
    return POS_EMBED_TOLERANCE if "pos_embed" in param_name else FLOAT64_TOLERANCE


def relative_error(grad: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    """‖grad − reference‖ / ‖reference‖ (absolute when the reference is zero; None counts as zero)."""
    if grad is None and reference is None:
        return 0.0
    grad = torch.zeros_like(reference) if grad is None else grad
    reference = torch.zeros_like(grad) if reference is None else reference
    diff = (grad.double() - reference.double()).norm().item()
    ref_norm = reference.double().norm().item()
    return diff / ref_norm if ref_norm > 0 else diff


def parameter_group(name: str) -> str:
    """Report group of a parameter: `visual.blocks`, `visual.embeds.pos_embed`, `text.transformer`, ..."""
    if "pos_embed" in name:
        return "visual.embeds.pos_embed"
    parts = name.split(".")
    return ".".join(parts[:2])


def full_batch_gradients(
    model: nn.Module, loss_fn: nn.Module, batch: dict[str, Any], scale: float, terms: Sequence[Term] = (),
) -> dict[str, torch.Tensor]:
    """The reference: `scale · ∇θ J` of all rows as one batch, by one explicit backward: the pair loss (the sum of
    `loss_fn`'s terms, a teacher's features of the whole batch as constants) plus every term's per-example parts
    `Σ_k λ_k/Z_k Σ_i ℓ_k(i)`, `Z_k` the batch's count."""
    model.zero_grad(set_to_none=True)
    for term in terms:
        term.check([batch])
    with torch.no_grad():  # the terms' constants of the whole batch
        constants = [term.constants(batch, contextlib.nullcontext) for term in terms]
    out = output_dict(model(image=batch["image"], text=batch["text"], **output_tokens(terms)))
    losses = example_losses(terms, model, batch, out, constants)
    pair = pair_loss_inputs(terms, [[held] for held in constants])
    extra: tuple[Any, ...] = tuple(pair.get(key) for key, _ in loss_input_keys(terms))
    if is_grouped(batch):  # several captions per image: the group ids of the whole batch
        extra += tuple(batch[key] for key in GROUP_KEYS)
    loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"), *extra)
    loss = loss.sum() + sum(term.weights[name] * losses[name].sum() / term.count(batch)[name]
                            for term in terms for name in term.parts)
    (scale * loss).backward()
    return collect_gradients(model)


def collect_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def gradient_errors(
    model: nn.Module, grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Relative error per parameter name."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return {name: relative_error(grads.get(name), reference.get(name)) for name in names}


@dataclass
class GroupResult:
    group: str
    num_params: int
    worst_error: float
    tolerance: float
    legacy_error: float

    @property
    def passed(self) -> bool:
        return self.worst_error <= self.tolerance


@dataclass
class VerifyResult:
    groups: list[GroupResult]
    splits: list[list[int]]
    scale: float
    loss: float

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.groups)


def verify_window(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, Any],
    *,
    accum_freq: int,
    reference_batch_size: int | None,
    loss_scale: str,
    methods: Sequence[str],
    num_splits: int,
    seed: int,
    first_split: list[int] | None = None,
    grad_checkpointing: bool = False,
    terms: Sequence[Term] = (),
) -> VerifyResult:
    """Compare accumulated gradients of splits of `batch` (`first_split`, e.g. the loader's own, then
    random ones) with its full-batch reference. `grad_checkpointing`: the windows recompute the towers'
    activations (`model.set_grad_checkpointing`), the reference does not."""
    dtype = next(model.parameters()).dtype
    num_examples = batch_size(batch)
    rng = random.Random(seed)
    splits = [random_split_sizes(num_examples, accum_freq, rng) for _ in range(num_splits)]
    if first_split is not None:
        splits = [list(first_split), *splits[:-1]]
    scale = window_loss_scale(splits[0], reference_batch_size, loss_scale)
    reference = full_batch_gradients(model, loss_fn, concat_microbatches(split_batch(batch, splits[0])), scale, terms)
    worst: dict[str, float] = {}
    legacy_worst: dict[str, float] = {}
    loss = math.nan
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    for sizes in splits:
        microbatches = split_batch(batch, sizes)
        for method in methods:
            model.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                model, loss_fn, microbatches, loss_scale=loss_scale,
                reference_batch_size=reference_batch_size, method=method, terms=terms,
            )
            loss = stats.loss
            for name, err in gradient_errors(model, collect_gradients(model), reference).items():
                worst[name] = max(worst.get(name, 0.0), err)
        model.zero_grad(set_to_none=True)
        per_microbatch_scale_gradients(
            model, loss_fn, microbatches, loss_scale=loss_scale, reference_batch_size=reference_batch_size,
            terms=terms,
        )
        for name, err in gradient_errors(model, collect_gradients(model), reference).items():
            legacy_worst[name] = max(legacy_worst.get(name, 0.0), err)
    if grad_checkpointing:
        model.set_grad_checkpointing(False)
    model.zero_grad(set_to_none=True)
    return VerifyResult(_group_results(worst, legacy_worst, dtype), splits, scale, loss)


def _group_results(worst: dict[str, float], legacy: dict[str, float], dtype: torch.dtype) -> list[GroupResult]:
    groups: dict[str, GroupResult] = {}
    for name, err in worst.items():
        key = parameter_group(name)
        g = groups.setdefault(key, GroupResult(key, 0, 0.0, tolerance_for(name, dtype), 0.0))
        g.num_params += 1
        g.worst_error = max(g.worst_error, err)
        g.legacy_error = max(g.legacy_error, legacy.get(name, 0.0))
    return list(groups.values())

"""One optimizer step per accumulation window.

Each step hands `--accum-freq` microbatches (`grouping.window_sizes`) to `accumulate_gradients`, which leaves
`s(W)·∇θ L(W)` in `.grad` (nothing here computes a loss coefficient), then unscales, clips once, skips a
non-finite window alike on every rank, steps the optimizer, clamps `logit_scale` and advances the lr schedule
once per window, skipped or not. docs/training.md#one-step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from naflexclip.batch import is_naflex, to_device
from naflexclip.models.precision import Precision
from naflexclip.objectives.objective import TermSchedule
from naflexclip.parallel.process_group import DistributedEnv, fault_guard
from naflexclip.parallel.wrapping import no_sync_context, unwrap_model
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.grouping import window_sizes
from naflexclip.train.optim import LrSchedule
from naflexclip.window import Term, WindowStats, accumulate_gradients


@dataclass(frozen=True)
class StepResult:
    stats: WindowStats
    grad_norm: float
    skipped: bool
    lr: float


def _isolated(iterator: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The loader's items, fetched without touching the global torch RNG (a DataLoader draws its worker
    seed from it), so the model's random stream — and so a resumed run — does not depend on when
    loaders were started."""
    while True:
        with torch.random.fork_rng(devices=[]):
            item = next(iterator, None)
        if item is None:
            return
        yield item


def windows(loader: Any, accum_freq: int) -> Iterator[list[dict[str, Any]]]:
    """The loader's microbatches from its position on, grouped by `window_sizes` of the microbatches its epoch's
    plan has left (the same on every rank)."""
    sizes = iter(window_sizes(loader.num_batches - loader.position, accum_freq))
    window: list[dict[str, Any]] = []
    size = next(sizes, 0)
    for microbatch in _isolated(iter(loader)):
        window.append(microbatch)
        if len(window) == size:
            yield window
            window, size = [], next(sizes, 0)
    if window:
        yield window


def token_counts(microbatches: list[dict[str, Any]]) -> tuple[int, int]:
    """(valid image patches, padded patch slots) of a rank's window (on the loader's side: no device sync)."""
    masks = [mb["image"]["patch_valid"] for mb in microbatches if is_naflex(mb["image"])]
    return sum(int(mask.sum()) for mask in masks), sum(mask.numel() for mask in masks)


def step_metrics(result: StepResult, tokens: tuple[int, int], seconds: float) -> dict[str, float]:
    """What a step shows on every step (no device read); `tokens`: (valid image patches, padded patch slots) of
    the window on all ranks, `seconds`: since the previous step."""
    stats, (valid, slots) = result.stats, tokens
    # the objective the step optimises (before s(W)) and beside it each term's share of it, the same way for every
    # objective: contrastive, distill, locca, self_distill, masked_prediction (weighted: they sum to train/loss)
    terms = {f"loss/{name}": value for name, value in stats.objective_terms.items()}
    return {**terms,
        "train/loss": stats.objective, "train/lr": result.lr, "train/scale": stats.scale,
        "train/window_examples": stats.num_examples, "train/num_microbatches": stats.num_microbatches,
        "train/grad_norm": result.grad_norm,
        "train/samples_per_s": stats.num_examples / seconds, "train/image_tokens_per_s": valid / seconds,
        "train/padding_fraction": 1 - valid / max(1, slots), "train/skipped": float(result.skipped),
    }


class WindowStep:
    """Turns one window into at most one optimizer step (`model`: as wrapped for training)."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv, model: nn.Module, loss_fn: nn.Module,
                 optimizer: torch.optim.Optimizer, schedule: LrSchedule, precision: Precision, exchange: Any,
                 terms: Sequence[Term] = (), term_schedules: Sequence[TermSchedule] = ()) -> None:
        self.cfg, self.env, self.model, self.loss_fn = cfg, env, model, loss_fn
        self.terms = tuple(terms)  # the objectives' terms of every step (a distillation teacher's, the decoder's)
        # the objectives' terms that change over the run (SigLIP 2's EMA teacher: from --self-distill-start)
        self.term_schedules = tuple(term_schedules)
        self.optimizer, self.schedule, self.precision, self.exchange = optimizer, schedule, precision, exchange

    def __call__(self, microbatches: list[dict[str, Any]], step: int) -> StepResult:
        """The window of optimizer step `step` (1-based, as the logs count it); a non-finite loss or gradient
        leaves weights, optimizer state and grad-scaler growth untouched (the fp16 scaler still backs off)."""
        cfg = self.cfg
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batches = [to_device(mb, self.env.device) for mb in microbatches]
        terms = list(self.terms)
        for term_schedule in self.term_schedules:
            terms += term_schedule.terms(step, self.schedule.total_steps)
        lr = self.schedule.lr
        with fault_guard(self.env, f"step {step - 1}"):
            stats = accumulate_gradients(
                self.model, self.loss_fn, batches, loss_scale=cfg.naflex_loss_scale,
                reference_batch_size=cfg.batch_size, method=cfg.accum_method, exchange=self.exchange,
                no_sync=no_sync_context(self.model), autocast=self.precision.autocast,
                grad_scaler=self.precision.scaler, terms=terms,
            )
            grad_norm = self._unscale_and_clip()
        # the same on every rank, so every rank skips alike: the objective is the whole window's, the norm that of
        # the synchronised gradients
        bad = not (math.isfinite(stats.objective) and math.isfinite(grad_norm))
        if bad:
            self._skip()
        else:
            self._update()
        for term_schedule in self.term_schedules:
            term_schedule.after_step(skipped=bad)
        self.schedule.step()
        return StepResult(stats=stats, grad_norm=grad_norm, skipped=bad, lr=lr)

    def _unscale_and_clip(self) -> float:
        """The window's total gradient norm (after fp16 unscaling), clipped once if --grad-clip-norm."""
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # FSDP2: a sharded norm
            norm = norm.full_tensor()
        norm_value = float(norm)
        if self.cfg.grad_clip_norm is not None and math.isfinite(norm_value):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip_norm, norm)
        return norm_value

    def _update(self) -> None:
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        unwrap_model(self.model).clamp_logit_scale_()

    def _skip(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.precision.scaler is not None:
            self.precision.scaler.update()  # an inf found by unscale_ backs the fp16 scale off

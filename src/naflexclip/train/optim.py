"""AdamW parameter groups (no decay for norms, biases, embeddings, temperature) and the cosine schedule.

The schedule is stepped once per optimizer step (= once per accumulation window), as OpenCLIP's is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# parameters that are not matrices of a linear map: weight decay would only shrink them toward zero
NO_DECAY_NAME_PARTS = ("logit_scale", "logit_bias", "pos_embed", "positional_embedding", "token_embedding",
                       "cls_token", "reg_token", "embedding", "probe", "norm", "ln_", "bias")


def decays(name: str, param: nn.Parameter) -> bool:
    """True for parameters that get weight decay: ≥2-D weights that are not embeddings or norms."""
    if param.ndim < 2:
        return False  # biases, norm scales, logit_scale / logit_bias
    return not any(part in name for part in NO_DECAY_NAME_PARTS)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices and everything else (wd 0)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if decays(name, param) else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# devices with torch's fused AdamW kernel (torch >= 2.4 has CPU and CUDA): one kernel for every parameter
FUSED_DEVICE_TYPES = ("cuda", "cpu")


def adamw_implementation(params: list[nn.Parameter]) -> dict[str, bool]:
    """`{"fused": True}` when every parameter is a floating tensor on a fused-kernel device, else
    `{"foreach": True}` (one multi-tensor op per update term instead of a Python loop over parameters).
    Measured on the 2-core CPU, `small` preset: loop 46 ms, foreach 29 ms, fused 8 ms per step."""
    if params and all(p.device.type in FUSED_DEVICE_TYPES and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


def create_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW over `param_groups` (fused or foreach, see `adamw_implementation`); `lr` is the peak the
    schedule warms up to."""
    groups = param_groups(model, weight_decay)
    params = [p for group in groups for p in group["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_implementation(params))


def cosine_lr(step: int, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The lr of optimizer step `step` (0-based): linear warmup from 0 to `base_lr` over `warmup_steps`, then
    cosine decay to 0 at `total_steps`."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * base_lr


class CosineSchedule:
    """`cosine_lr` over the optimizer's steps; `step()` is called after each optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int, total_steps: int) -> None:
        self.optimizer = optimizer
        self.base_lr = base_lr
        self.warmup_steps = warmup_steps
        self.total_steps = max(1, total_steps)
        self.last_step = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        return cosine_lr(step, self.base_lr, self.warmup_steps, self.total_steps)

    @property
    def lr(self) -> float:
        return self.lr_at(self.last_step)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict[str, int | float]:
        return {"last_step": self.last_step, "base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, int | float]) -> None:
        self.base_lr = float(state["base_lr"])
        self.warmup_steps = int(state["warmup_steps"])
        self.total_steps = max(1, int(state["total_steps"]))
        self.last_step = int(state["last_step"])
        self._apply()

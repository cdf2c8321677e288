"""The optimizer (OpenCLIP's `--opt`: AdamW, NAdamW or any `timm/<name>` through timm's factory) over parameter
groups (no decay for norms, biases, embeddings, temperature; `--wd-exclude` patterns; layer-wise lr decay), and
the lr schedule (`--lr-scheduler cosine|const|const-cooldown`, linear warmup, or none with `--skip-scheduler`).

The schedule is stepped once per optimizer step (= once per accumulation window), as OpenCLIP's is; a group's lr is
the schedule's times its `lr_scale` (layer-wise decay), as OpenCLIP's `assign_learning_rate`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
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


def param_groups(model: nn.Module, weight_decay: float, *, wd_exclude: Sequence[str] = (),
                 lr_scales: dict[int, float] | None = None, fallback: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The optimizer's groups: decayed matrices and everything else (wd 0; also the parameters whose name matches a
    `wd_exclude` glob, OpenCLIP's `--wd-exclude`). With `lr_scales` (parameter id -> scale, `layer_lr_scales`) one
    pair of groups per scale, each with its `lr_scale`, largest first (OpenCLIP's layer-decay groups). Parameters
    whose name matches a `fallback` glob (OpenCLIP's `--opt-fallback-list`) go to groups flagged `use_fallback`
    (a Muon-family timm optimizer's AdamW fallback)."""
    buckets: dict[tuple[float, bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decayed = decays(name, param) and not any(fnmatch.fnmatchcase(name, p) for p in wd_exclude)
        scale = (lr_scales or {}).get(id(param), 1.0)
        falls_back = any(fnmatch.fnmatchcase(name, p) for p in fallback)
        buckets.setdefault((scale, decayed, falls_back), []).append(param)
    if lr_scales is None and not fallback:
        return [{"params": buckets.get((1.0, True, False), []), "weight_decay": weight_decay},
                {"params": buckets.get((1.0, False, False), []), "weight_decay": 0.0}]
    return [{"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr_scale": scale,
             **({"use_fallback": True} if falls_back else {})}
            for (scale, decayed, falls_back), params in sorted(
                buckets.items(), key=lambda item: (-item[0][0], not item[0][1], item[0][2]))]


def layer_lr_scales(model: nn.Module, image_layer_decay: float | None, text_layer_decay: float | None
                    ) -> dict[int, float] | None:
    """OpenCLIP's layer-wise lr decay: parameter id -> `decay ** (groups above it)` over a tower's layer groups
    (input to output, the lock groups of `naflexclip.models.lock`: the projection is the head at 1.0); None when neither
    decay is set (or both are 1). Parameters of an undecayed tower and the temperature stay at 1."""
    from naflexclip.models.lock import image_groups, text_groups
    from naflexclip.parallel.wrapping import unwrap_model

    module = unwrap_model(model)
    scales: dict[int, float] = {}
    for flag, decay, groups in (("--image-layer-decay", image_layer_decay, image_groups),
                                ("--text-layer-decay", text_layer_decay, text_groups)):
        if decay is None or decay == 1.0:
            continue
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"{flag} must be in (0, 1], got {decay}")
        tower = groups(module)
        for depth, group in enumerate(tower):
            for param in group:
                scales[id(param)] = decay ** (len(tower) - 1 - depth)
    return scales or None


# devices with torch's fused AdamW kernel (torch >= 2.4 has CPU and CUDA): one kernel for every parameter
FUSED_DEVICE_TYPES = ("cuda", "cpu")


def adamw_implementation(params: list[nn.Parameter]) -> dict[str, bool]:
    """`{"fused": True}` when every parameter is a floating tensor on a fused-kernel device, else
    `{"foreach": True}` (one multi-tensor op per update term instead of a Python loop over parameters).
    Measured on the 2-core CPU, `small` preset: loop 46 ms, foreach 29 ms, fused 8 ms per step."""
    if params and all(p.device.type in FUSED_DEVICE_TYPES and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


OPTIMIZERS = ("adamw", "nadamw")  # and "timm/<name>": any of timm.optim.list_optimizers()


def check_optimizer_name(opt: str) -> None:
    """One-line error for an --opt naflexclip cannot build."""
    if opt in OPTIMIZERS:
        return
    if opt.startswith("timm/"):
        from timm.optim import list_optimizers

        if opt[len("timm/"):] not in list_optimizers():
            raise ValueError(f"--opt {opt}: timm has no optimizer {opt[len('timm/'):]!r} "
                             f"(timm.optim.list_optimizers() names them)")
        return
    raise ValueError(f"--opt: {opt!r} is not one of {list(OPTIMIZERS)} or timm/<name>")


def create_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float | None, float | None],
    eps: float | None, opt: str = "adamw", opt_kwargs: dict[str, Any] | None = None, momentum: float | None = None,
    wd_exclude: Sequence[str] = (), image_layer_decay: float | None = None, text_layer_decay: float | None = None,
    fallback: Sequence[str] = (),
) -> torch.optim.Optimizer:
    """The --opt optimizer over `param_groups` (OpenCLIP's `create_optimizer`): AdamW (fused or foreach, see
    `adamw_implementation`), torch's NAdam with decoupled weight decay (`nadamw`), or `timm/<name>` through
    `timm.optim.create_optimizer_v2` (betas, eps and momentum passed only when set: else the optimizer's own).
    `opt_kwargs` are passed last. `lr` is the peak the schedule warms up to; each group starts at `lr · lr_scale`.
    `fallback`: --opt-fallback-list (a timm optimizer only)."""
    check_optimizer_name(opt)
    if fallback and not opt.startswith("timm/"):
        raise ValueError(f"--opt-fallback-list goes with a Muon-family timm optimizer (timm/muon, timm/adamuon, "
                         f"timm/nadamuon), not --opt {opt}")
    scales = layer_lr_scales(model, image_layer_decay, text_layer_decay)
    groups = param_groups(model, weight_decay, wd_exclude=wd_exclude, lr_scales=scales, fallback=fallback)
    params = [p for group in groups for p in group["params"]]
    extra = dict(opt_kwargs or {})
    if opt.startswith("timm/"):
        from timm.optim import create_optimizer_v2

        if (betas[0] is None) != (betas[1] is None):
            raise ValueError("--beta1/--beta2: with a timm optimizer give both or neither")
        kwargs = {**({"betas": betas} if betas[0] is not None else {}), **({"eps": eps} if eps is not None else {}),
                  **({"momentum": momentum} if momentum is not None else {})}
        try:
            optimizer = create_optimizer_v2(groups, opt[len("timm/"):], lr=lr, weight_decay=weight_decay,
                                            **{**kwargs, **extra})
        except (TypeError, ValueError) as error:  # an option it does not take, or a value it refuses
            raise ValueError(f"--opt {opt}: {error}") from None
    else:
        if momentum is not None:
            raise ValueError(f"--momentum goes with a timm optimizer (--opt timm/sgd, ...), not --opt {opt}")
        kwargs = {"lr": lr, "betas": betas, "eps": eps}
        try:
            if opt == "adamw":
                optimizer = torch.optim.AdamW(groups, **{**kwargs, **adamw_implementation(params), **extra})
            else:
                optimizer = torch.optim.NAdam(groups, **{**kwargs, "decoupled_weight_decay": True, **extra})
        except (TypeError, ValueError) as error:
            raise ValueError(f"--opt {opt}: {error}") from None
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return optimizer


def describe_param_groups(optimizer: torch.optim.Optimizer) -> str:
    """One line: the optimizer, its groups' parameter counts, lr scales and weight decay (OpenCLIP's log line)."""
    parts = [f"{sum(p.numel() for p in g['params']) / 1e6:.3g}M params, lr_scale {g.get('lr_scale', 1.0):.4g}, "
             f"wd {g['weight_decay']:g}" for g in optimizer.param_groups]
    return f"{type(optimizer).__name__}, {len(parts)} parameter groups: " + " | ".join(parts)


SCHEDULERS = ("cosine", "const", "const-cooldown")


def cosine_lr(step: int, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The lr of optimizer step `step` (0-based): linear warmup from 0 to `base_lr` over `warmup_steps`, then
    cosine decay to 0 at `total_steps`."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress)) * base_lr


def scheduled_lr(step: int, state: dict[str, Any]) -> float:
    """The lr of optimizer step `step` (0-based) under a schedule's `state` (`LrSchedule.state_dict()`): OpenCLIP's
    cosine, const and const-cooldown (warmup, constant, then `(1 - e/es) ** power` from the lr down to
    `cooldown_end_lr` over the last `cooldown_steps`); the base lr throughout with `skip` (--skip-scheduler)."""
    base, warmup, total = float(state["base_lr"]), int(state["warmup_steps"]), int(state["total_steps"])
    kind = state.get("kind", "cosine")
    if state.get("skip", False):
        return base
    if kind == "cosine":
        return cosine_lr(step, base, warmup, total)
    if step < warmup:
        return base * (step + 1) / warmup
    start = total - int(state.get("cooldown_steps", 0))
    if kind == "const" or step < start:
        return base
    end, power = float(state.get("cooldown_end_lr", 0.0)), float(state.get("cooldown_power", 1.0))
    progress = min(1.0, (step - start) / max(1, total - start))
    return (1 - progress) ** power * (base - end) + end


class LrSchedule:
    """`scheduled_lr` over the optimizer's steps; `step()` is called after each optimizer step. A group's lr is the
    schedule's times its `lr_scale`."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int, total_steps: int,
                 kind: str = "cosine", cooldown_steps: int = 0, cooldown_power: float = 1.0,
                 cooldown_end_lr: float = 0.0, skip: bool = False) -> None:
        if kind not in SCHEDULERS:
            raise ValueError(f"--lr-scheduler: {kind!r} is not one of {list(SCHEDULERS)}")
        self.optimizer = optimizer
        self.state = {"last_step": 0, "base_lr": base_lr, "warmup_steps": warmup_steps,
                      "total_steps": max(1, total_steps), "kind": kind, "cooldown_steps": cooldown_steps,
                      "cooldown_power": cooldown_power, "cooldown_end_lr": cooldown_end_lr, "skip": skip}
        self._apply()

    @property
    def last_step(self) -> int:
        return int(self.state["last_step"])

    @property
    def base_lr(self) -> float:
        return float(self.state["base_lr"])

    @property
    def warmup_steps(self) -> int:
        return int(self.state["warmup_steps"])

    @property
    def total_steps(self) -> int:
        return int(self.state["total_steps"])

    def lr_at(self, step: int) -> float:
        return scheduled_lr(step, self.state)

    @property
    def lr(self) -> float:
        return self.lr_at(self.last_step)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_scale", 1.0)

    def step(self) -> None:
        self.state["last_step"] += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved schedule (one saved before --lr-scheduler existed is a cosine one)."""
        self.state = {**self.state, "kind": "cosine", "cooldown_steps": 0, "skip": False, **state}
        self.state["total_steps"] = max(1, int(self.state["total_steps"]))
        self._apply()

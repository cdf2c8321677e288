"""Mixed precision for the training loop: the autocast context factory and the fp16 gradient scaler.

`fp32`: no autocast; `amp_bf16`: bfloat16 autocast on CPU or CUDA (no scaler: bf16 has fp32's range);
`amp`: float16 autocast on CUDA with a `GradScaler`, which the window uses to scale its backward and the
loop unscales before clipping and stepping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch

PRECISIONS = ("fp32", "amp_bf16", "amp")
# OpenCLIP's other --precision values: its second name of amp_bf16, and those that cast the weights, refused (the
# window accumulates fp32 gradients into fp32 weights and optimizer state)
PRECISION_ALIASES = {"amp_bfloat16": "amp_bf16"}
_BF16 = "use --precision amp_bf16 (bfloat16 autocast, fp32 weights)"
_FP16 = "use --precision amp (float16 autocast with a gradient scaler, CUDA)"
REFUSED_PRECISIONS = {
    "bf16": f"OpenCLIP's bfloat16 weights; naflexclip trains fp32 weights: {_BF16}",
    "pure_bf16": f"OpenCLIP's bfloat16 weights and inputs; naflexclip trains fp32 weights: {_BF16}",
    "fp16": f"OpenCLIP's float16 weights; naflexclip trains fp32 weights: {_FP16}",
    "pure_fp16": f"OpenCLIP's float16 weights and inputs; naflexclip trains fp32 weights: {_FP16}",
}


def check_precision(name: str) -> str:
    """The precision `--precision name` means (OpenCLIP's `amp_bfloat16` is `amp_bf16`); a ValueError of one line
    naming the flag, why and what to use for any other."""
    name = PRECISION_ALIASES.get(name, name)
    if name in PRECISIONS:
        return name
    why = REFUSED_PRECISIONS.get(name, f"not a precision; choose {', '.join(PRECISIONS)} (or OpenCLIP's amp_bfloat16)")
    raise ValueError(f"--precision {name}: {why}")


@dataclass
class Precision:
    """`autocast()` for the forwards and the fp16 `scaler` (None without one); its state is the scaler's."""

    name: str
    autocast: Callable[[], ContextManager[Any]]
    scaler: torch.amp.GradScaler | None

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved scaler's state; nothing where either run has no scaler (--precision may change)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def create_precision(name: str, device: torch.device) -> Precision:
    """The autocast factory and scaler for `--precision name` on `device`."""
    if name == "fp32":
        return Precision(name, contextlib.nullcontext, None)
    if name == "amp_bf16":
        return Precision(name, lambda: torch.autocast(device.type, dtype=torch.bfloat16), None)
    if name == "amp":
        if device.type != "cuda":
            raise ValueError(f"--precision amp is float16 with a gradient scaler and needs CUDA (device is "
                             f"{device}); use --precision amp_bf16 on CPU")
        return Precision(name, lambda: torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda"))
    raise ValueError(f"--precision: unknown value {name!r}")

"""The `replay` method (OpenCLIP's scheme, made exact): each microbatch's replay differentiates `s · L(W)` with that
microbatch's rows live and the other rows cached, plus its terms' per-example parts; `logit_scale`/`logit_bias` are
live in one replay (the last)."""

from __future__ import annotations

from typing import Any

import torch

from naflexclip.window.outputs import FEATURE_KEYS, SCALAR_KEYS
from naflexclip.window.state import Window, backward, total


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by a constant."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def run_replay(window: Window) -> torch.Tensor:
    states, local = window.cache()
    cached = {key: window.gather(local[key], key) for key in FEATURE_KEYS}
    constants = window.constant_leaves(local, gather_images=True)  # the terms' inputs to the loss, in every replay
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
            features.update(constants)
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
            backward(window.scaled_for_backward(total(loss)) + window.term_part(out))
        start = {key: start[key] + sizes[key] for key in FEATURE_KEYS}
    assert loss is not None
    return loss.detach()

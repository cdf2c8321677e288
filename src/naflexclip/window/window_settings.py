"""The window's settings, as `naflexclip train` and `naflexclip verify` take them: how many microbatches a window
holds, how its gradient is accumulated and how its loss is scaled (docs/accumulation.md); each field a setting
(`naflexclip.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from naflexclip.loss import DEFAULT_TILE_SIZE
from naflexclip.settings import APPLY, MODEL_SECTION, RESCHEDULE, setting
from naflexclip.window.accumulate import METHODS
from naflexclip.window.scale import SCALE_MODES


@dataclass(frozen=True)
class WindowSettings:
    """The window's settings (`TrainConfig` keeps them flat with `same_as`)."""

    batch_size: int | None = setting(None, rule=APPLY, section=MODEL_SECTION, openclip=64, help=(
        "reference batch size B_ref of --naflex-loss-scale, without which it has no effect (not OpenCLIP's rows "
        "per batch: the rows of each microbatch come from the token budget --naflex-max-tokens-per-batch)"))
    accum_freq: int = setting(2, rule=RESCHEDULE, section=MODEL_SECTION, openclip=1, help=(
        "microbatches per optimizer step (one window; every example is a negative for every other)"))
    accum_method: str = setting("cache", rule=APPLY, section=MODEL_SECTION, choices=METHODS, help=(
        "how the window's gradient is accumulated, exactly either way: cache (features without graph, the window's "
        "loss once, then each microbatch's forward and backward) or replay (the window's loss once per microbatch)"))
    loss_tile_size: int = setting(DEFAULT_TILE_SIZE, rule=APPLY, section=MODEL_SECTION, help=(
        "rows/columns of one block of the tiled loss (speed only; memory O(N·D + tile²))"))
    naflex_loss_scale: str = setting("none", rule=APPLY, section=MODEL_SECTION, openclip="none",
                                     choices=SCALE_MODES, help=(
        "OpenCLIP's NaFlex loss scale, one per window: its mean microbatch size over --batch-size (linear), that "
        "ratio's square root (sqrt), or 1 (none)"))

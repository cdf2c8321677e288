"""The accumulation window: one scale per optimizer step, and two exact ways to accumulate.

After `accumulate_gradients`, `.grad` holds (after DDP/FSDP averaging) `s(W) · ∇θ J(W)` for the window's examples
as one batch, however they are split into microbatches and ranks. The window knows nothing of loaders, optimizers,
logging, process groups or which objectives exist: exchange comes in as a `WindowExchange`, gradient-sync
suppression as a `no_sync` factory, objectives as terms. docs/accumulation.md#the-contract; parts: docs/code_map.md.
"""

from naflexclip.window.accumulate import METHODS, WindowStats, accumulate_gradients
from naflexclip.window.outputs import (
    FEATURE_KEYS,
    SCALAR_KEYS,
    TOWER_FEATURES,
    TUPLE_OUTPUT_KEYS,
    feature_sources,
    output_dict,
)
from naflexclip.window.scale import SCALE_MODES, window_loss_scale
from naflexclip.window.state import LocalExchange, WindowExchange
from naflexclip.window.terms import EXAMPLE_LOSSES, TEACHER, TeacherFeatures, Term, TermCoefficients

__all__ = [
    "EXAMPLE_LOSSES",
    "FEATURE_KEYS",
    "METHODS",
    "SCALAR_KEYS",
    "SCALE_MODES",
    "TEACHER",
    "TOWER_FEATURES",
    "TUPLE_OUTPUT_KEYS",
    "LocalExchange",
    "TeacherFeatures",
    "Term",
    "TermCoefficients",
    "WindowExchange",
    "WindowStats",
    "accumulate_gradients",
    "feature_sources",
    "output_dict",
    "window_loss_scale",
]

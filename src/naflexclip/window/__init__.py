"""The accumulation window: one scale per optimizer step, and two exact ways to accumulate.

A window is every microbatch behind one optimizer step (all ranks). After `accumulate_gradients`, the parameters'
`.grad` holds (after DDP/FSDP averaging) `s(W) · ∇θ J(W)`, `J(W)` the pair loss of all `N` pairs as one batch plus
the objectives' terms, and `s(W)` `window_loss_scale` over every microbatch size in the window — however the same
ordered examples are split into microbatches and ranks. docs/accumulation.md has the math.

What each part owns: `scale` the scale policy `s(W)`; `terms` what an objective adds to `J(W)` (`Term`) and the
only place their coefficients are computed; `state` the window's shared state and forwards; `cache_method` and
`replay_method` the two methods; `accumulate` the entry point. The window knows nothing of loaders, optimizers,
logging, process groups or which objectives exist: distributed feature exchange comes in as a `WindowExchange`,
gradient-sync suppression as a `no_sync` context factory, objectives as terms.
"""

from naflexclip.rng import RngState
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
    "RngState",
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

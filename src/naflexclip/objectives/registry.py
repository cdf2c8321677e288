"""The registered objectives, in the order they enter a run (the pair loss is changed in this order: several
captions per image before a teacher's logits), and their flags as one settings dataclass that a training config
extends. Registering an objective: its module's `Objective` in `OBJECTIVES`, its flags among `ObjectiveFlags`'s
bases (docs/code_map.md, "Adding an objective")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from naflexclip.objectives.distillation import Distillation, DistillFlags
from naflexclip.objectives.multi_positive import MultiPositive, MultiPositiveFlags
from naflexclip.objectives.objective import Objective
from naflexclip.objectives.siglip2_recipe import RecipeFlags, Siglip2Recipe

OBJECTIVES: tuple[type[Objective], ...] = (MultiPositive, Siglip2Recipe, Distillation)


# a dataclass's fields come from its bases last to first: distillation's flags, the recipe's, several captions'
@dataclass
class ObjectiveFlags(MultiPositiveFlags, RecipeFlags, DistillFlags):
    """Every registered objective's flags (`Objective.flags`), the fields a training config takes from them."""


def objectives_of(values: Any, check: bool = True, training: bool = True) -> list[Objective]:
    """Every registered objective with its flags read from `values` (a training config or parsed flags), each
    checked against the rest of them (`check`; `training`: for a run, not verify's audit of one window)."""
    objectives = [objective(values) for objective in OBJECTIVES]
    for objective in objectives if check else ():
        objective.check(values, training=training)
    return objectives


def unused_settings(values: Any) -> list[str]:
    """A line for each setting `values` gives an objective that is off (`Objective.unused_settings`)."""
    return [line for objective in objectives_of(values, check=False) for line in objective.unused_settings(values)]


def enabled_objectives(values: Any, training: bool = True) -> list[Objective]:
    """The objectives `values` turns on, checked (`objectives_of`)."""
    return [objective for objective in objectives_of(values, training=training) if objective.enabled]


def unattached_heads(model: Any) -> str | None:
    """The line for a model loaded with modules no enabled objective attached (a `--pretrained` run's LocCa decoder
    in a run without the recipe): which, and the flags that would train them; None when there are none."""
    slots = sorted(getattr(model, "pending_heads", {}))
    if not slots:
        return None
    flags = sorted({objective.switch_flags for objective in OBJECTIVES if set(objective.head_slots) & set(slots)})
    return (f"its {' and '.join(slots)} are not trained by this run (turned on by {' or '.join(flags) or 'none'}), "
            f"so they are not part of its model or checkpoints")

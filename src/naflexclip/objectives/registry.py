"""The registered objectives, in the order they enter a run (the pair loss is changed in this order: several
captions per image before a teacher's logits), and their flags as one settings dataclass that a training config
extends.

Registering an objective: its module's `Objective` in `BUILT_IN`, or, from a package of its own, an entry point in
the group `naflexclip.objectives` (`[project.entry-points."naflexclip.objectives"] name = "module:Class"`), loaded
after the built-in ones in the order of the entry points' names (docs/code_map.md, "Adding an objective").
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

from naflexclip.objectives.distillation import Distillation
from naflexclip.objectives.multi_positive import MultiPositive
from naflexclip.objectives.objective import Objective
from naflexclip.objectives.siglip2_recipe import Siglip2Recipe
from naflexclip.settings import settings_of

BUILT_IN: tuple[type[Objective], ...] = (MultiPositive, Siglip2Recipe, Distillation)
ENTRY_POINT_GROUP = "naflexclip.objectives"


def _plugins() -> tuple[type[Objective], ...]:
    """The objectives other packages register (entry points of `ENTRY_POINT_GROUP`), by entry point name."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name)
    plugins = tuple(point.load() for point in found)
    for point, plugin in zip(found, plugins, strict=True):
        if not (isinstance(plugin, type) and issubclass(plugin, Objective)):
            raise TypeError(f"entry point {point.name} = {point.value} ({ENTRY_POINT_GROUP}) is not an Objective class")
    return plugins


OBJECTIVES: tuple[type[Objective], ...] = BUILT_IN + _plugins()


def _flags_of(objectives: tuple[type[Objective], ...]) -> type:
    """One dataclass of the objectives' flags: each objective's in the registry's order, each in the order its
    flags dataclass declares them (whatever the classes' bases), a name declared twice refused."""
    fields: dict[str, tuple[type[Objective], dataclasses.Field]] = {}
    for objective in objectives:
        for f in dataclasses.fields(objective.flags):
            if f.name in fields:
                raise TypeError(f"objective {objective.name!r} declares the setting {f.name!r}, which objective "
                                f"{fields[f.name][0].name!r} declares too")
            fields[f.name] = (objective, f)
    return dataclasses.make_dataclass(
        "ObjectiveFlags", [(name, f.type, copy.copy(f)) for name, (_, f) in fields.items()],
        namespace={"__module__": __name__})


# every registered objective's flags (`Objective.flags`), the fields a training config takes from them, after its own
ObjectiveFlags = _flags_of(OBJECTIVES)


def objectives_of(values: Any, check: bool = True, training: bool = True) -> list[Objective]:
    """Every registered objective with its flags read from `values` (a training config or parsed flags), each
    checked against the rest of them (`check`; `training`: for a run, not verify's audit of one window)."""
    objectives = [objective(values) for objective in OBJECTIVES]
    for objective in objectives if check else ():
        objective.check(values, training=training)
    return objectives


def saved_objectives(config: Mapping[str, Any]) -> list[Objective]:
    """The objectives a run's saved config (`TrainConfig.to_dict()`, as a checkpoint holds it) turned on, unchecked;
    a flag it lacks (a pretrained directory's config, a config saved before the flag) at its default."""
    defaults = {key: d.default for objective in OBJECTIVES for key, d in settings_of(objective.flags).items()}
    values = SimpleNamespace(**{**defaults, **{key: config[key] for key in defaults if key in config}})
    return [objective for objective in objectives_of(values, check=False) if objective.enabled]


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

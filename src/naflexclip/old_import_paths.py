"""Import paths of modules that moved when the package was arranged by concept: each old path still imports, as the
module it moved to, with a DeprecationWarning naming the new path. Kept for one release."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "naflexclip.benchmark": "naflexclip.evaluation.benchmark_tasks",
    "naflexclip.data.cli": "naflexclip.data.data_command",
    "naflexclip.data.config": "naflexclip.data.data_config",
    "naflexclip.data.export": "naflexclip.data.dataset_export",
    "naflexclip.data.transform": "naflexclip.processing.naflex_transform",
    "naflexclip.distill": "naflexclip.objectives.distillation",
    "naflexclip.distributed": "naflexclip.parallel.process_group",
    "naflexclip.exchange": "naflexclip.parallel.feature_exchange",
    "naflexclip.export": "naflexclip.models.export_command",
    "naflexclip.factory": "naflexclip.models.factory",
    "naflexclip.launch": "naflexclip.parallel.launchers",
    "naflexclip.legacy": "naflexclip.audit.openclip_rule",
    "naflexclip.locca": "naflexclip.objectives.locca_decoder",
    "naflexclip.lock": "naflexclip.models.lock",
    "naflexclip.loss.distill": "naflexclip.loss.distill_loss",
    "naflexclip.loss.multi_positive": "naflexclip.loss.multi_positive_loss",
    "naflexclip.model": "naflexclip.models.naflex_clip",
    "naflexclip.random_windows": "naflexclip.audit.random_windows",
    "naflexclip.recipe": "naflexclip.objectives.siglip2_recipe",
    "naflexclip.run_checkpoint": "naflexclip.models.run_weights",
    "naflexclip.selfdistill": "naflexclip.objectives.self_distillation",
    "naflexclip.train.checkpoint": "naflexclip.checkpoints.storage",
    "naflexclip.train.cli": "naflexclip.train.train_command",
    "naflexclip.train.config": "naflexclip.train.train_config",
    "naflexclip.train.evaluate": "naflexclip.train.evaluator",
    "naflexclip.train.probe": "naflexclip.evaluation.dense_probe",
    "naflexclip.train.self_distill": "naflexclip.objectives.self_distill_schedule",
    "naflexclip.train.self_distill_schedule": "naflexclip.objectives.self_distill_schedule",
    "naflexclip.verify": "naflexclip.audit.verify_command",
    "naflexclip.window_audit": "naflexclip.audit.gradient_audit",
    "naflexclip.zeroshot": "naflexclip.evaluation.zero_shot",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module it moved to (the same module object: a patch through either
    path reaches the one module)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}; the old import path will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        # the import system reads sys.modules back after exec_module: the old name now is the moved module
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Make the old paths importable (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())

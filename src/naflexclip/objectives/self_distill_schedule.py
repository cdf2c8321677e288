"""SigLIP 2's self-distillation and masked prediction in a run: the EMA teacher's life, one component.

`SelfDistillation` decides for every optimizer step whether the two terms are on (from `--self-distill-start` of
the lr schedule's steps), builds the EMA teacher from the student at the switch, hands the window the recipe's
terms with the teacher's (`objectives.self_distillation.SelfDistillTerm`), updates the teacher after each step
(or forgets a skipped step's logits), and saves and restores it as the run state `ema_teacher`, sharded like the
student under FSDP2 (and saved as shards with `--fsdp-checkpoint sharded`).
docs/siglip2_recipe.md#self-distillation-and-masked-prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from naflexclip.checkpoints import sharded
from naflexclip.objectives.self_distillation import EmaTeacher, attach_heads
from naflexclip.parallel.process_group import DistributedEnv
from naflexclip.parallel.wrapping import (
    full_state_dict,
    is_fsdp,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
    unwrap_model,
)
from naflexclip.window import Term


class ScheduledRecipe(Protocol):
    """What the schedule reads of the recipe that builds it (`objectives.siglip2_recipe.Recipe`, which imports this
    module)."""

    @property
    def self_distill_enabled(self) -> bool: ...
    def self_distill_active(self, progress: float) -> bool: ...
    def value(self, name: str) -> Any: ...
    def ema_teacher(self, model: nn.Module) -> EmaTeacher: ...
    def terms(self, progress: float | None = None, teacher: EmaTeacher | None = None) -> list[Term]: ...


class SelfDistillation:
    """The EMA teacher of a run whose recipe has a self-distillation or masked-prediction weight > 0 (`model`: the
    student as wrapped for training; `sum_over_ranks`: the window exchange's; `notify`: the run's message line)."""

    def __init__(self, recipe: ScheduledRecipe, model: nn.Module, env: DistributedEnv,
                 sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
                 notify: Callable[[str], None] = lambda _: None) -> None:
        if not recipe.self_distill_enabled:
            raise ValueError("SelfDistillation needs a self-distillation or masked-prediction weight > 0")
        self.recipe, self.model, self.env = recipe, model, env
        self.sum_over_ranks, self.notify = sum_over_ranks, notify
        self.teacher: EmaTeacher | None = None

    def progress(self, step: int, total_steps: int) -> float:
        """The fraction of training done before optimizer step `step` (1-based) of `total_steps`."""
        return (step - 1) / max(1, total_steps)

    def terms(self, step: int, total_steps: int) -> list[Term]:
        """The recipe's terms of step `step`'s window: the self-distillation terms against the EMA teacher from the
        switch on (the teacher built at it), the decoder's throughout."""
        progress = self.progress(step, total_steps)
        if not self.recipe.self_distill_active(progress):
            if self.teacher is not None:  # resumed with the switch moved past this step (the flag, or a re-plan)
                self.teacher = None
                start = self.recipe.value("self_distill_start")
                switch = self.switch_step(step, total_steps)
                where, then = ((f"at step {switch}, after this one", "built again from the student there")
                               if switch is not None else
                               ("after the run's last step", "the rest of the run trains no self-distillation"))
                self.notify(f"step {step}: --self-distill-start {start:g} of {total_steps} steps puts the switch "
                            f"{where}: the EMA teacher the checkpoint holds is dropped and {then}")
            return self.recipe.terms(progress)
        if self.teacher is None:
            self.teacher = self.build()
            self.notify(f"step {step}: self-distillation and masked prediction on (--self-distill-start "
                        f"{self.recipe.value('self_distill_start'):g} of {total_steps} steps), the EMA teacher "
                        f"built from the student; logged as loss/self_distill and loss/masked_prediction")
        return self.recipe.terms(progress, self.teacher)

    def switch_step(self, step: int, total_steps: int) -> int | None:
        """The first optimizer step from `step` on that trains the terms (None: none of the run's)."""
        return next((k for k in range(step, total_steps + 1)
                     if self.recipe.self_distill_active(self.progress(k, total_steps))), None)

    def after_step(self, skipped: bool) -> None:
        """After the window's optimizer step: the teacher's EMA and centres; a skipped step leaves it as it was."""
        if self.teacher is None:
            return
        if is_fsdp(self.teacher):
            # FSDP2 leaves a root's parameters gathered after its forward, for a backward the teacher never runs
            self.teacher.reshard()
        if skipped:
            self.teacher.discard_pending()
        else:
            self.teacher.update(self.model, self.sum_over_ranks)

    def build(self) -> EmaTeacher:
        """The EMA teacher from the student as it is now (every rank; under FSDP2 sharded like the student)."""
        if not is_fsdp(self.model):
            return self.recipe.ema_teacher(self.model).to(self.env.device)
        from torch.distributed.fsdp import fully_shard

        from naflexclip.models.naflex_clip import NaFlexClip

        student = unwrap_model(self.model)
        reference = next(student.parameters())
        # an unsharded skeleton of the student's architecture (its own draws are not the run's: forked), sharded as
        # `parallel.wrap_model` shards the student, then given the student's values shard by shard
        with torch.random.fork_rng(devices=[]):
            skeleton = NaFlexClip(student.config)
            attach_heads(skeleton, student.config.self_distill)
        teacher = EmaTeacher(skeleton, momentum=float(self.recipe.value("ema_momentum")))
        teacher = teacher.to(self.env.device, reference.dtype)
        for block in teacher.visual.blocks:
            fully_shard(block)
        fully_shard(teacher)
        with torch.no_grad():
            for teacher_p, student_p in teacher.student_parameters(self.model):
                teacher_p.copy_(student_p.detach())
        return teacher

    def state_dict(self) -> dict[str, Any]:
        """Every rank must call it (FSDP2 gathers the teacher's shards)."""
        if self.teacher is None:
            return {"built": False}
        return {"built": True, "teacher": full_state_dict(self.teacher, self.env)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the model's state (the teacher is built from the loaded student, then given its saved values)."""
        if not state["built"]:
            self.teacher = None
            return
        if self.teacher is None:
            self.teacher = self.build()
        load_full_state_dict(self.teacher, state["teacher"], self.env)
        self.teacher.discard_pending()

    def sharded_state_dict(self) -> dict[str, Any]:
        """As `state_dict`, the teacher as this rank holds it (FSDP2: its shards, no gather), for a sharded save."""
        if self.teacher is None:
            return {"built": False}
        return {"built": True, "teacher": sharded_state_dict(self.teacher)}

    def load_sharded(self, checkpoint: Path, name: str) -> None:
        """Fill this rank's part of the teacher from the sharded checkpoint's state `name`, at any world size."""
        if not any(key.startswith("teacher.") for key in sharded.saved_keys(checkpoint, name)):
            self.teacher = None
            return
        if self.teacher is None:
            self.teacher = self.build()
        state = sharded_state_dict(self.teacher)
        sharded.load_into(checkpoint, {name: {"teacher": state}})
        load_sharded_state_dict(self.teacher, state)
        self.teacher.discard_pending()


"""`Objective`: what one objective beyond the pair loss adds to a run, as `naflexclip train` and `naflexclip verify`
both ask for it. Each objective is one module of this package, registered in `objectives.registry`; the commands
iterate the registry and never name an objective.

An objective declares its flags (a dataclass of `naflexclip.settings.setting` fields), checks them against the
rest of a run's settings, attaches the modules it trains to the model, changes the pair loss where it enters it
(several captions per image, a teacher's logits), builds what it reads without training (a frozen teacher), asks
the loader for the inputs its examples need (`naflexclip.data.sample_inputs.SampleInputs`), contributes its terms
of the window objective (`naflexclip.window.Term`), fixed or scheduled over the run (`TermSchedule`), and adds its
evaluations (`EvalTask`) to the run's and to `naflexclip eval`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from naflexclip.data.sample_inputs import SampleInputs
from naflexclip.settings import settings_of, shown_value
from naflexclip.window import Term


@dataclass
class BuildContext:
    """What an objective's frozen parts are built against: the student (unwrapped), its pair loss kind and data
    processing, where they run."""

    student: nn.Module
    loss: str
    processor: str | None = None  # the student's data processing (`DataConfig.hf_processor`)
    cache_dir: str | None = None
    augment: bool = False
    image_overrides: dict[str, Any] = field(default_factory=dict)
    own_inputs: bool = False  # a teacher reads its own inputs in any case (the student's patch size varies)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype | None = None
    # the run state (`run`) of the checkpoint this run resumes, None for a new run: what it was built from
    # (`Objective.run_record`) is built again where it still can be
    resumed_run: dict[str, Any] | None = None


@dataclass(frozen=True)
class EvalTask:
    """One evaluation: `run(model, skip_records)` -> metrics (`group/name`), every `frequency` epochs (0: only
    before training and at the end). `skip_records` receives the samples it left out. `brief`: its metrics in the
    one-line message after each evaluation; `unsharded`: what it is, when it runs modules outside the model's
    forward (FSDP gathers a sharded model's parameters only around that), so it is left out under --fsdp;
    `note`: a line said once where it is evaluated (what it leaves out)."""

    name: str
    frequency: int
    run: Callable[[nn.Module, list[dict[str, Any]]], dict[str, float]]
    brief: tuple[str, ...] = ()
    unsharded: str = ""
    note: str = ""


@dataclass(frozen=True)
class EvalContext:
    """What an objective's evaluations run against: the run's data settings (`naflexclip.data.DataConfig`: its
    validation split), the device, the autocast, and how often (--val-frequency)."""

    data: Any
    device: torch.device
    autocast: Callable[[], AbstractContextManager[Any]]
    frequency: int = 1


class TermSchedule(Protocol):
    """An objective's terms over a run's steps, with state a checkpoint saves (an EMA teacher)."""

    def terms(self, step: int, total_steps: int) -> list[Term]: ...
    def after_step(self, skipped: bool) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Objective:
    """One objective beyond the pair loss (see the module docstring). The defaults add nothing: a subclass sets
    `name` and `flags` and overrides what its objective needs."""

    name: ClassVar[str]
    flags: ClassVar[type]  # its settings, a dataclass whose fields are `setting(...)`s
    state_name: ClassVar[str | None] = None  # the run state its `TermSchedule` is saved as
    # the model's slots it attaches modules to (`NaFlexClip.attach_head`), each with the flags that shape its modules
    # and what they are (a resume that finds other modules there than the checkpoint's names them)
    head_slots: ClassVar[dict[str, str]] = {}
    switch_flags: ClassVar[str] = ""  # the flags that turn it on, as messages name them
    switch_fields: ClassVar[tuple[str, ...]] = ()  # the fields of those flags
    # it compares the student's data processing with its own (a teacher's inputs): an OpenCLIP name's is resolved
    compares_processing: ClassVar[bool] = False

    def __init__(self, values: Any) -> None:
        """Read its flags from `values` (a training config or parsed flags: attributes named as its flags' fields)."""

    @property
    def enabled(self) -> bool:
        return False

    def check(self, values: Any, training: bool = True) -> None:
        """Refuse, in one line, settings this objective cannot train with (`values`: a training config or verify's
        parsed flags; `training`: a run's, not verify's audit of one window); set what it needs of the data config
        (`values.data`, where there is one)."""

    def unused_settings(self, values: Any) -> list[str]:
        """When it is off, a line for each setting of its own that `values` holds other than its default (given,
        or kept from a resumed run's settings), which therefore changes nothing: the flags that turn it on."""
        if self.enabled:
            return []
        return [f"{declared.flag} {shown_value(value)}: changes nothing without {self.switch_flags}"
                for key, declared in settings_of(self.flags).items()
                if key not in self.switch_fields and declared.has_flag
                and (value := getattr(values, key, declared.default)) != declared.default]

    def pair_loss_kind(self) -> str | None:
        """The pair loss (`clip`/`siglip`) a model built from scratch trains with when `--loss` is not given, or
        None for the model's own."""
        return None

    def prepare(self, model: nn.Module, image_locked: bool = False) -> list[str]:
        """Attach the modules it trains to `model` (before locks, wrapping and the optimizer); the lines that say
        what it changed (`image_locked`: the image tower is fully locked)."""
        return []

    def loss(self, loss: nn.Module, kind: str, tile_size: int) -> nn.Module:
        """The pair loss with this objective in it (most objectives leave it as it is)."""
        return loss

    def build(self, context: BuildContext) -> None:
        """Build what it reads without training (a frozen teacher), after the model is wrapped and seeded."""

    def run_record(self) -> dict[str, Any]:
        """What it was built from, saved with the run state of every checkpoint (`run`), which a resume compares
        (`resume_error`); nothing by default."""
        return {}

    def resume_error(self, saved_run: dict[str, Any], run: dict[str, Any]) -> str | None:
        """Why a run with run state `run` cannot continue a checkpoint with `saved_run` for this objective (one
        line), or None."""
        return None

    def loader_inputs(self, student: nn.Module, processing: Any) -> list[SampleInputs]:
        """What its examples need from the training data besides the student's image and text, built per sample
        into each microbatch (`naflexclip.data.build.build_loader`'s `inputs`; `processing`: the student's)."""
        return []

    def terms(self) -> list[Term]:
        """Its terms of every window of a run (terms that change over the run come from `schedule`)."""
        return []

    def schedule(self, model: nn.Module, env: Any, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
                 notify: Callable[[str], None]) -> TermSchedule | None:
        """Its terms over a run's steps, for terms that switch on or read state that changes (None: `terms`)."""
        return None

    def verify_terms(self, model: nn.Module) -> list[Term]:
        """Its terms of a window after every switch of the run (what `naflexclip verify` checks)."""
        return self.terms()

    def random_window_flags(self) -> str | None:
        """The flags whose window `naflexclip verify` draws itself (its examples carry inputs no data source
        has), or None."""
        return None

    def random_window(self, num_examples: int, draw: Callable[..., dict[str, Any]],
                      generator: torch.Generator) -> dict[str, Any] | None:
        """A random window shaped for this objective (several captions per image), or None for the plain one.
        `draw(n, generator=...)`: n random examples for the student (`audit.random_windows.random_naflex_batch`
        with the model's sizes; keywords override them)."""
        return None

    def add_random_inputs(self, batch: dict[str, Any], num_examples: int, draw: Callable[..., dict[str, Any]],
                          seed: int) -> None:
        """Add to a random window the inputs it reads besides its terms' (`Term.random_inputs`), such as a
        teacher's own processing of the same examples (`draw` as for `random_window`)."""

    def eval_tasks(self, model: nn.Module, context: EvalContext) -> list[EvalTask]:
        """Its evaluations of `model` (the plain module: a run's after `prepare`, or a checkpoint's for
        `naflexclip eval`), run after the run's own (retrieval, zero-shot, the dense probe)."""
        return []

    def describe(self) -> list[str]:
        """The lines that say what it adds to the objective (a run's opening, verify's report)."""
        return []

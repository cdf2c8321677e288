"""The resume policy, in one place: what a resumed run may change, what it refuses, what is re-mapped; and the
resume itself (find the checkpoint, check it, restore every component, continue the logs).

A resume starts from the run's saved settings (`resumed_settings`); `POLICY`, from each setting's declared rule
(`naflexclip.settings`), refuses a changed flag in one line or applies it and names it in one notice. The rules on
the architecture, the world size, the lr schedule, the optimizer, the logs and `--remote-sync`:
docs/checkpoints.md#what-a-resume-may-change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from naflexclip.checkpoints import sharded, storage
from naflexclip.checkpoints.manager import CheckpointManager
from naflexclip.models.naflex_clip import weights_mismatch
from naflexclip.models.run_weights import architecture_changes
from naflexclip.objectives.objective import Objective
from naflexclip.objectives.registry import OBJECTIVES, objectives_of
from naflexclip.parallel.process_group import DistributedEnv, barrier, check_consistency, run_on_main
from naflexclip.settings import APPLY, IGNORE, REFUSE, RESCHEDULE, default_with_data, flat_config, switches_with_data
from naflexclip.train.components import Progress
from naflexclip.train.config.settings_display import shown_setting, shown_setting_value
from naflexclip.train.config.train_config import SETTINGS, TrainConfig, flag_name
from naflexclip.train.optim import scheduled_lr
from naflexclip.train.remote_sync import restore_from_backup
from naflexclip.train.report import Reporter, run_exists

# every setting of TrainConfig (data fields as `data.<name>`) -> (rule, what a refused change would change), as
# declared with it (`naflexclip.settings`: APPLY, REFUSE, RESCHEDULE, IGNORE)
POLICY: dict[str, tuple[str, str]] = {key: (d.setting.rule, d.setting.why) for key, d in SETTINGS.items()}


def resumed_settings(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """A command-line resume's TrainConfig keyword arguments (`values`, from the flags and their defaults): the
    run's saved settings, but for the flags given on the command line (`given`: parser destinations; the resume
    then compares them with the saved ones, `refusal` and `changed_flags`), those a resume does not compare
    (IGNORE: where the run writes, when it stops, its devices, how it logs) and how the job runs on its hardware
    (`runtime`: --fsdp, --grad-checkpointing, --torchcompile), which are this command line's; one of those not
    given there has the default of the run's data (OpenCLIP's for a run on --train-data).
    `values` as they are when the checkpoint has no run state to read (a new run, a --remote-sync restore)."""
    run = _saved_run(values.get("resume"), values.get("logs"), values.get("name"))
    if run is None:
        return values
    saved = flat_config(run["config"])
    keep = {key for key, d in SETTINGS.items()
            if d.setting.rule == IGNORE or d.setting.runtime or any(dest in given for dest in d.reads)}
    top = {key: saved[key] for key in saved if key in SETTINGS and key not in keep and "." not in key}
    data = {key.split(".", 1)[1]: saved[key] for key in saved
            if key in SETTINGS and key not in keep and key.startswith("data.")}
    # one of those not given has the default of the run's data, not of this command line's (which may lack it)
    with_data = bool(saved.get("data.train_data"))
    for key, d in SETTINGS.items():
        if key in keep and switches_with_data(d) and not any(dest in given for dest in d.reads):
            (data if key.startswith("data.") else top)[key.rsplit(".", 1)[-1]] = default_with_data(d, with_data)
    settings = {**values, **top, "data": dataclasses.replace(values["data"], **data)}
    if settings.get("fsdp_checkpoint") != "sharded" and "async_save" not in given:  # it writes sharded ones only
        settings["async_save"] = False
    return settings


def _saved_run(resume: str | None, logs: str | None, name: str | None) -> dict[str, Any] | None:
    """The run state of the checkpoint --resume names (`latest`: this run's), read without its tensors; None
    where there is none to read (the resume then says why)."""
    if resume is None or (resume == "latest" and name is None):
        return None
    return storage.read_run_state(Path(str(logs)) / str(name) / "checkpoints" if resume == "latest" else resume)


def resumed_run_state(cfg: TrainConfig) -> dict[str, Any] | None:
    """The run state of the checkpoint this run will resume, before it is loaded: what the run was built from
    (`Objective.run_record`, a teacher's checkpoint folder) is built again from it."""
    return _saved_run(cfg.resume, cfg.logs, cfg.name)


def _plain(value: Any) -> Any:
    """Lists and tuples compare alike (a config may come back from a checkpoint with either)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def _changed(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fields both configs have that differ (top-level ones first, each part by name)."""
    old, new = flat_config(saved), flat_config(current)
    return sorted((key for key in set(old) & set(new) if _plain(old[key]) != _plain(new[key])),
                  key=lambda key: (key.startswith("data."), key))


def _rule(key: str) -> str:
    """The key's resume rule; a key no setting declares (a saved config's field this version has not) is applied
    and named."""
    return POLICY.get(key, (APPLY, ""))[0]


def refusal(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a run with config `current` cannot continue one saved with `saved` (one line naming the flag and
    both values; the first such flag in `POLICY`), or None."""
    changed = set(_changed(saved, current))
    for key, (rule, what) in POLICY.items():
        if rule == REFUSE and key in changed:
            old, new = (_shown_refused(key, flat_config(config)[key]) for config in (saved, current))
            return (f"{flag_name(key)}: the checkpoint has {old}, this run {new}; a resume cannot change {what} "
                    f"(keep {flag_name(key)} as it was, or start a new --name)")
    return None


def _shown_refused(key: str, value: Any) -> str:
    """A value in a refusal: quoted as Python shows it, an on/off setting as its flag reads."""
    return shown_setting_value(key, value) if isinstance(value, bool) else repr(value)


def changed_flags(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The flags a resume applies although the checkpoint was saved with other values, as `--flag old -> new`, each
    once (a setting another flag sets, such as data.multi_caption by --multi-positive, is shown as that flag)."""
    old, new = flat_config(saved), flat_config(current)
    return list(dict.fromkeys(f"{shown_setting(key, old[key])} -> {shown_setting_value(key, new[key])}"
                              for key in _changed(saved, current) if _rule(key) in (APPLY, RESCHEDULE)))


def architecture_error(model: str | None, saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """One line naming what made this run's architecture differ from the checkpoint's, or None."""
    changed = architecture_changes(saved, current)
    if not changed:
        return None
    shown = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
    heads = {name.split(".", 1)[0] for name in changed}
    # modules an objective's flags add to the preset: a change there is those flags', not the preset's
    head_flags = {slot: flags for objective in OBJECTIVES for slot, flags in objective.head_slots.items()}
    if heads <= set(head_flags):
        flags = "; ".join(head_flags[head] for head in sorted(heads))
        return f"{flags}: not the checkpoint's (checkpoint -> this run: {shown}); resume with the checkpoint's values"
    return f"--model {model}: the preset's architecture is not the checkpoint's (checkpoint -> preset: {shown})"


def resume_error(states: dict[str, Any], checkpointer: CheckpointManager, model: Any,
                 weights: dict[str, Any] | None = None, objectives: Sequence[Objective] = ()) -> str | None:
    """Why this run cannot continue a checkpoint's `states` exactly (flags, what `objectives` were built from,
    architecture, weights, world size), or None. `model`: the plain (unwrapped) model this run built; `weights`: the
    checkpoint's model tensors (a sharded checkpoint's as empty tensors of their shapes), default
    `states["model"]`."""
    saved, current = states["run"], checkpointer.run
    error = refusal(saved["config"], current["config"])
    for objective in objectives:
        error = error or objective.resume_error(saved, current)
    if error is None:
        error = architecture_error(current["config"]["model"], saved["model_config"], current["model_config"])
    if error is None:
        error = weights_mismatch(model, states[storage.MODEL] if weights is None else weights)
    world_size, saved_world_size = current["world_size"], saved["world_size"]
    if error is None and saved_world_size != world_size and not checkpointer.components["data"].remaps(states["data"]):
        error = (f"world size: the checkpoint was saved by {saved_world_size} process(es), this run has {world_size}; "
                 f"its per-rank data position cannot be re-mapped exactly (resume with {saved_world_size})")
    return error


def reschedule(states: dict[str, Any], cfg: TrainConfig, world_size: int, progress: Progress,
               plan: Callable[[int, int, int], dict[str, Any]]) -> list[str]:
    """Where a flag that defines the lr schedule changed, or the world size (each step then covers another
    number of samples), replace the saved schedule in `states` by this run's, spanning the steps done plus the
    steps actually left from the resumed position (`progress`, loaded; `plan(epoch, next_batch, step)`: this run's
    schedule state from there, over the windows the rest of each epoch makes as re-planned, so none runs past its
    end at lr 0); the notice names the world sizes, both lengths and the lr at the resumed step."""
    saved, saved_world_size = states["lr_schedule"], states["run"]["world_size"]
    flags = any(_rule(key) == RESCHEDULE for key in _changed(states["run"]["config"], cfg.to_dict()))
    if not flags and saved_world_size == world_size:
        return []
    step = int(saved["last_step"])
    new = plan(progress.epoch, progress.next_batch, step)
    states["lr_schedule"] = new
    old_lr, new_lr = (scheduled_lr(step, s) for s in (saved, new))
    world = [f"world size {saved_world_size} -> {world_size}"] if saved_world_size != world_size else []
    return world + [f"lr schedule {saved['total_steps']} -> {new['total_steps']} steps "
                    f"(lr at step {step}: {old_lr:.3g} -> {new_lr:.3g})"]


def _start_fresh(cfg: TrainConfig, checkpointer: CheckpointManager, reporter: Reporter, env: DistributedEnv
                 ) -> bool:
    """--resume latest without a usable checkpoint: a new run starts; an existing one stops unless
    --resume-fresh says to start it over."""
    checkpoint_dir = checkpointer.checkpoint_dir
    run_dir = checkpoint_dir.parent
    existing = run_exists(run_dir) or (checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir()))
    if existing and not cfg.resume_fresh:
        raise ValueError(f"--resume latest: run {str(run_dir)!r} exists but has no usable checkpoint; pass "
                         f"--resume-fresh to start it over from scratch")
    if existing:
        reporter.message(f"--resume latest: no usable checkpoint in {checkpoint_dir}; starting the run over "
                         f"(--resume-fresh)")
        reporter.start_over()
    else:
        reporter.message(f"--resume latest: no checkpoint in {checkpoint_dir}; starting fresh")
    barrier(env)
    return False


def resume(cfg: TrainConfig, checkpointer: CheckpointManager, reporter: Reporter, model: Any,
           plan: Callable[[int, int, int], dict[str, Any]], env: DistributedEnv) -> bool:
    """Load --resume (a path, or `latest` of this run when there is one) into every component; True if a
    checkpoint was loaded. Every rank reads the checkpoint, so every rank raises the same one-line error.
    `model`: the plain model (its weights are checked against the checkpoint's); `plan(epoch, next_batch, step)`:
    this run's lr schedule from that microbatch to the end of the run, as the loaded data position plans the epoch
    (`reschedule`); `env`: this process's place in the job."""
    if cfg.resume is None:
        return False
    if cfg.resume == "latest":
        if cfg.remote_sync:  # OpenCLIP looks for the latest checkpoint in the backup: restore it when it is ahead
            run_dir = checkpointer.checkpoint_dir.parent
            run_on_main(env, "--remote-sync",
                        lambda: restore_from_backup(run_dir, str(cfg.remote_sync), cfg.remote_sync_protocol,
                                                        reporter.message))
        found = storage.load_latest(checkpointer.checkpoint_dir, notify=reporter.message)
        if found is None:
            return _start_fresh(cfg, checkpointer, reporter, env)
    else:
        try:
            found = storage.load_checkpoint(cfg.resume, notify=reporter.message)
        except FileNotFoundError as error:  # one line naming the flag and the path
            raise ValueError(f"--resume {cfg.resume!r}: {error}") from None
    states = dict(found.states)
    # a sharded checkpoint's model is checked by its shapes (read from DCP's index), then resharded on load
    weights = sharded.tensor_shapes(found.path, storage.MODEL) if storage.MODEL in found.sharded else None
    error = resume_error(states, checkpointer, model, weights, objectives_of(cfg, check=False))
    if error is not None:
        raise ValueError(f"--resume {str(found.path)!r}: {error}")
    try:
        checkpointer.load(states, skip=("reporter", "lr_schedule"), sharded_in=found.path,
                          sharded_states=found.sharded)
    except ValueError as error:  # a state that does not fit this run (every rank raises the same)
        raise ValueError(f"--resume {str(found.path)!r}: {error}") from None
    progress = checkpointer.progress  # the data position re-mapped to this world size, where it changed
    changes = changed_flags(states["run"]["config"], cfg.to_dict()) + reschedule(
        states, cfg, checkpointer.run["world_size"], progress, plan)
    checkpointer.components["lr_schedule"].load_state_dict(states["lr_schedule"])
    if found.path.resolve().parent == checkpointer.checkpoint_dir.resolve():  # this run's own checkpoint
        reporter.load_state_dict(states["reporter"], progress.step)
    else:  # another run's (--resume DIR under a new --name): its counts go on in this run's folder
        reporter.continue_counts(states["reporter"])
    barrier(env)
    check_consistency(env, step=progress.step, epoch=progress.epoch, next_batch=progress.next_batch)
    reporter.message(f"resumed from {found.path} at epoch {progress.epoch + 1}, step {progress.step}")
    if changes:
        reporter.message("resume applies changed flags: " + ", ".join(changes))
    return True


def nothing_left(cfg: TrainConfig, progress: Progress, notify: Callable[[str], None]) -> bool:
    """After a resume: True (and one line) when the checkpoint already is where this run would stop."""
    if progress.epoch >= cfg.epochs:
        notify(f"nothing to train: the run finished (epoch {progress.epoch} of --epochs {cfg.epochs}, step "
               f"{progress.step}); raise --epochs to train longer")
        return True
    if cfg.stop_after_steps is not None and progress.step >= cfg.stop_after_steps:
        notify(f"nothing to train: the checkpoint is at step {progress.step}, --stop-after-steps is "
               f"{cfg.stop_after_steps}")
        return True
    return False

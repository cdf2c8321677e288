"""The training loop: it composes the run's components and asks them to act, epoch after epoch.

`Trainer` builds the model, the window step (`train.step`), the loader, the evaluator (`train.evaluator`), the
reporter (`train.report`) and the checkpoint manager (`checkpoints.manager`), then resumes or evaluates first, trains
every remaining epoch one window per optimizer step, evaluates and saves where due, and reports at the end; a signal
ends it after the current step (`train.stop`). docs/training.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

from naflexclip.checkpoints import storage as ckpt
from naflexclip.checkpoints.manager import CheckpointManager
from naflexclip.data import build_loader
from naflexclip.families import data_processing
from naflexclip.loss import create_loss
from naflexclip.models.lock import Locks, lock_summary
from naflexclip.models.naflex_clip import config_to_dict
from naflexclip.models.precision import create_precision
from naflexclip.objectives.objective import BuildContext
from naflexclip.objectives.registry import enabled_objectives, unattached_heads, unused_settings
from naflexclip.parallel.feature_exchange import window_exchange
from naflexclip.parallel.process_group import (
    DistributedEnv,
    barrier,
    cleanup,
    init_distributed,
    run_on_main,
    share_from_main,
)
from naflexclip.parallel.wrapping import unwrap_model, wrap_model
from naflexclip.train.components import (
    DataPosition,
    ModelState,
    OptimizerState,
    Progress,
    RngStreams,
    checkpoint_ranks,
    create_run_model,
    seed_everything,
)
from naflexclip.train.config.config_checks import unused_settings as unused_train_settings
from naflexclip.train.config.openclip_flags import first_lines
from naflexclip.train.config.rank_agreement import check_ranks_agree
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.evaluator import Evaluator
from naflexclip.train.grouping import window_sizes
from naflexclip.train.optim import LrSchedule, create_optimizer, describe_param_groups
from naflexclip.train.remote_sync import RemoteSync
from naflexclip.train.report import Reporter, refuse_existing_run
from naflexclip.train.resume import nothing_left, resume, resumed_run_state
from naflexclip.train.step import StepResult, WindowStep, step_metrics, token_counts, windows
from naflexclip.train.stop import StopSignals, TrainingStopped


class Trainer:
    """One run's components; `fit()` runs it."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv) -> None:
        if cfg.name is None:
            raise ValueError("the run has no name: train() decides it on rank 0 before building the Trainer")
        self.cfg, self.env = cfg, env
        self.precision = create_precision(cfg.precision, env.device)
        # --model NAME with --pretrained weights (a preset with --pretrained DIR: the directory's architecture), the
        # --force-* overrides; seeded: the same initial weights on every rank (FSDP2 does not broadcast them)
        model = create_run_model(cfg)
        locks = Locks.pick(cfg)
        # the objectives beyond the pair loss, each checked by the config; they attach what they train (SigLIP 2's
        # decoder and self-distillation heads, fresh also with --pretrained towers, drawn after them)
        self.objectives = enabled_objectives(cfg)
        notes = [note for objective in self.objectives
                 for note in objective.prepare(model, image_locked=locks.image_fully_locked)]
        notes += [f"warning: {line}" for line in [*unused_settings(cfg), *unused_train_settings(cfg),
                                                  *cfg.data.unused_settings()]]
        unattached = unattached_heads(model)  # loaded with the model, attached by none of this run's objectives
        if unattached is not None:
            notes.append(f"--pretrained {cfg.pretrained}: {unattached}")
        locks.apply(model)  # before wrapping (DDP registers the trainable parameters) and the optimizer
        model = model.to(env.device)
        if cfg.grad_checkpointing:
            model.set_grad_checkpointing()
        if cfg.torchcompile:
            model.compile_towers()  # before wrapping: DDP/FSDP2 then see the compiled blocks (torchtitan's order)
        self.model = wrap_model(model, env, cfg.fsdp)
        # dropout / drop-path / patch-dropout draw a different stream on every rank (OpenCLIP: seed + rank);
        # the data order does not depend on it (the loader seeds itself from --seed, epoch and position)
        seed_everything(cfg.seed + env.rank)
        self.module = unwrap_model(self.model)
        # the pair loss as the objectives change it (several captions per image, a teacher's logits), then what they
        # read without training (a frozen teacher; one that reads other inputs gets its own from the loader)
        loss_fn = create_loss(cfg.loss, tile_size=cfg.loss_tile_size)
        for objective in self.objectives:
            loss_fn = objective.loss(loss_fn, cfg.loss, cfg.loss_tile_size)
        context = BuildContext(self.module, cfg.loss, cfg.data.hf_processor, cfg.cache_dir, cfg.data.augment,
                               cfg.data.image_overrides(),
                               cfg.data.patch_sizes(self.module.image_patch_size) is not None, env.device,
                               resumed_run=resumed_run_state(cfg))
        for objective in self.objectives:
            objective.build(context)
        # every window's size exchange also checks that the ranks agree on step, epoch and having data
        self.exchange = window_exchange(env, self.model)
        self.optimizer = create_optimizer(
            self.model, lr=cfg.lr, weight_decay=cfg.wd, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, opt=cfg.opt,
            opt_kwargs=cfg.opt_kwargs, momentum=cfg.momentum, wd_exclude=cfg.wd_exclude,
            image_layer_decay=cfg.image_layer_decay, text_layer_decay=cfg.text_layer_decay,
            fallback=cfg.opt_fallback_list)
        processing = data_processing(cfg.data.hf_processor, self.module.image_patch_size, augment=cfg.data.augment,
                                     **cfg.data.image_overrides())
        one_pair = cfg.data.token_budget().one_pair_windows(cfg.accum_freq * env.world_size)
        if one_pair is not None and one_pair[1]:  # every step would learn nothing
            raise ValueError(one_pair[0])
        self.loader = build_loader(cfg.data, split="train", patch_size=self.module.image_patch_size,
                                   context_length=self.module.context_length, rank=env.rank,
                                   world_size=env.world_size, device_pin=env.device.type == "cuda",
                                   processing=processing,
                                   inputs=[inputs for objective in self.objectives
                                           for inputs in objective.loader_inputs(self.module, processing)])
        self.batches_per_epoch = self._plan_batches()
        self.schedule = LrSchedule(self.optimizer, cfg.lr, cfg.warmup, 1, kind=cfg.lr_scheduler)
        self.schedule.load_state_dict(self.schedule_plan(0, 0, 0))
        self.progress = Progress()
        self.run_dir = Path(cfg.logs) / str(cfg.name)
        local_log = self.run_dir / f"out-{env.rank}.log" if cfg.log_local and env.local_rank == 0 else None
        self.reporter = Reporter(self.run_dir, rank=env.rank, report_to=cfg.report_to, config=cfg.to_dict(),
                                 name=str(cfg.name), log_file=local_log)
        # the objectives' terms: fixed (a teacher's features, the decoder's) or scheduled over the run (SigLIP 2's
        # self-distillation from --self-distill-start, against an EMA teacher saved as run state)
        terms = [term for objective in self.objectives for term in objective.terms()]
        schedules = {objective.state_name or objective.name: schedule for objective in self.objectives
                     if (schedule := objective.schedule(self.model, env, self.exchange.sum_over_ranks,
                                                        self.reporter.message)) is not None}
        self.window_step = WindowStep(cfg, env, self.model, loss_fn, self.optimizer, self.schedule, self.precision,
                                      self.exchange, terms, list(schedules.values()))
        self.evaluator = Evaluator(cfg, env, self.precision.autocast, self.reporter, self.module, self.objectives)
        optimizer_state = OptimizerState(self.model, self.optimizer, env)
        components = {"model": ModelState(self.model, env), "optimizer": optimizer_state,
                      "lr_schedule": self.schedule, "scaler": self.precision, "progress": self.progress,
                      "data": DataPosition(self.loader, env), "evaluation": self.evaluator, "reporter": self.reporter,
                      **schedules,  # after "model": an EMA teacher is built from the loaded student
                      "rng": RngStreams(env)}  # restored last: nothing above draws from it once it is restored
        run = {"config": cfg.to_dict(), "model_config": config_to_dict(self.module.config),
               "world_size": env.world_size,
               **{key: value for objective in self.objectives for key, value in objective.run_record().items()}}
        self.checkpointer = CheckpointManager(self.run_dir / "checkpoints", components, run, self.progress,
                                              checkpoint_ranks(env), self.reporter.message,
                                              sharded=cfg.fsdp_checkpoint == "sharded", async_save=cfg.async_save)
        self.stop = StopSignals()
        # --remote-sync: the run folder's backup (main rank), started before training and closed after it
        self.remote_sync = (RemoteSync(self.run_dir, cfg.remote_sync, cfg.remote_sync_frequency,
                                       cfg.remote_sync_protocol, self.reporter.message)
                            if cfg.remote_sync and env.is_main else None)
        self.opening: list[str] = []  # announced after the resume check (`announce`)
        if one_pair is not None:
            self.opening.append(f"warning: {one_pair[0]}")
        if cfg.debug:  # --debug: more information is logged (OpenCLIP's)
            logging.getLogger("naflexclip").setLevel(logging.DEBUG)
            self.opening.append(describe_param_groups(self.optimizer))
        self.opening += [line for objective in self.objectives for line in objective.describe()] + notes
        locked = lock_summary(self.module)
        if locked:
            self.opening.append(locked)

    def announce(self) -> None:
        """The run's first lines, after the resume check (a refused resume is its one line): the settings that differ
        from OpenCLIP's defaults and the built-in flags, what the run was built with (`self.opening`), and where its
        outputs go (so a user can watch them from the start, not from the first save)."""
        for line in [*first_lines(self.cfg.to_dict()), *self.opening, f"run folder: {self.run_dir}"]:
            self.reporter.message(line)

    def _plan_batches(self) -> list[int]:
        """Planned microbatches of each epoch (the same on every rank)."""
        counts = []
        for epoch in range(self.cfg.epochs):
            self.loader.set_epoch(epoch)
            counts.append(self.loader.num_batches)
        self.loader.set_epoch(0)
        return counts

    def windows_left(self, epoch: int, next_batch: int) -> int:
        """Optimizer steps from microbatch `next_batch` of `epoch` to the end of the run: the windows of the
        microbatches left in each epoch (the lr schedule spans them, whatever --accum-freq earlier steps used).
        `epoch` counts as the loader plans it now: a resume at another world size re-planned its rest."""
        counts = self.batches_per_epoch[epoch:]
        if counts and self.loader.epoch == epoch:
            counts[0] = self.loader.num_batches
        return sum(len(window_sizes(count - (next_batch if i == 0 else 0), self.cfg.accum_freq))
                   for i, count in enumerate(counts))

    def schedule_plan(self, epoch: int, next_batch: int, step: int) -> dict[str, Any]:
        """This run's lr schedule state at optimizer step `step`, microbatch `next_batch` of `epoch`: it spans the
        steps done and the windows left (`windows_left`); --lr-scheduler const-cooldown cools down over the windows
        of the last --epochs-cooldown epochs (OpenCLIP's), counted at this run's --accum-freq."""
        cfg = self.cfg
        total = step + self.windows_left(epoch, next_batch)
        cooldown = 0
        if cfg.lr_scheduler == "const-cooldown" and cfg.epochs_cooldown:
            first = cfg.epochs - cfg.epochs_cooldown  # the cooldown's first epoch
            if first >= epoch:
                cooldown = self.windows_left(first, 0)
            else:  # inside it: the windows before this position since its start, and those left
                done = sum(len(window_sizes(count, cfg.accum_freq)) for count in self.batches_per_epoch[first:epoch])
                cooldown = done + len(window_sizes(next_batch, cfg.accum_freq)) + self.windows_left(epoch, next_batch)
        return {"last_step": step, "base_lr": cfg.lr, "warmup_steps": cfg.warmup, "total_steps": total,
                "kind": cfg.lr_scheduler, "cooldown_steps": min(cooldown, total),
                "cooldown_power": cfg.lr_cooldown_power, "cooldown_end_lr": cfg.lr_cooldown_end,
                "skip": cfg.skip_scheduler}

    def train_step(self, microbatches: list[dict[str, Any]]) -> StepResult:
        """One window -> at most one optimizer step (`WindowStep`); counts the skipped ones."""
        # the step this window makes (as the logs count it), checked against every rank in its size exchange,
        # which also brings every rank's stop request and token counts (`exchange.agreed`)
        self.exchange.set_position(self.progress.step + 1, self.progress.epoch, stop=self.stop.number is not None,
                                   tokens=token_counts(microbatches))
        result = self.window_step(microbatches, self.progress.step + 1)
        self.progress.consecutive_skips = self.progress.consecutive_skips + 1 if result.skipped else 0
        self.progress.num_skipped_steps += int(result.skipped)
        return result

    def resume(self) -> bool:
        """Continue --resume's checkpoint (`train.resume`); True if one was loaded."""
        return resume(self.cfg, self.checkpointer, self.reporter, self.module, self.schedule_plan, self.env)

    def fit(self) -> dict[str, float]:
        """Resume if asked, evaluate, train every remaining epoch, report; returns the last evaluation."""
        resumed = self.resume()
        self.announce()
        if self.cfg.remote_sync:  # a target that cannot be written stops every rank before training
            run_on_main(self.env, "--remote-sync", self.remote_sync.start if self.remote_sync else lambda: None)
        if resumed and nothing_left(self.cfg, self.progress, self.reporter.message):
            return {}
        self.warn_long_warmup()
        if not resumed:
            self.evaluator(self.model, step=0, epoch=0.0, epochs_done=0)
        while self.progress.epoch < self.cfg.epochs:
            if self.train_epoch():
                self.reporter.message(f"stopped after step {self.progress.step} (--stop-after-steps)")
                break
            self.end_epoch()
        else:
            counts = {"skipped steps (non-finite)": self.progress.num_skipped_steps}
            self.reporter.finish(self.evaluator.history, counts, plot=self.cfg.plot)
        return self.evaluator.history[-1] if self.evaluator.history else {}

    def warn_long_warmup(self) -> None:
        """After any resume: the schedule the run follows (a resume may have re-planned it) is the one counted."""
        total, warmup = self.schedule.total_steps, self.schedule.warmup_steps
        if warmup > total:
            self.reporter.message(f"warning: --warmup {warmup} is longer than the run ({total} optimizer steps): "
                                  f"the learning rate never reaches --lr {self.schedule.base_lr:g}")

    def train_epoch(self) -> bool:
        """Train the rest of the current epoch; True when --stop-after-steps stopped the run."""
        with logging_redirect_tqdm():  # data warnings print on their own line above the bar, not inside it
            return self._train_epoch()

    def _train_epoch(self) -> bool:
        cfg, progress = self.cfg, self.progress
        self.loader.set_epoch(progress.epoch, start_batch=progress.next_batch)
        done = len(window_sizes(progress.next_batch, cfg.accum_freq))
        left = len(window_sizes(self.loader.num_batches - progress.next_batch, cfg.accum_freq))  # as `windows`
        bar = self.reporter.progress_bar(progress.epoch, done + left, done)
        tick = time.perf_counter()
        try:
            for microbatches in self._windows():
                self.log_skipped_samples()
                result = self.train_step(microbatches)
                progress.step += 1
                progress.next_batch = self.loader.position
                progress.num_samples_seen += result.stats.num_examples
                now = time.perf_counter()
                tokens = self.exchange.agreed.tokens  # every rank's, from the window's size exchange
                progress.num_tokens_seen += tokens[0]
                self.log_step(result, tokens, now - tick, bar)
                tick = now
                self.check_skips(result)
                if cfg.save_every_n_steps and progress.step % cfg.save_every_n_steps == 0:
                    self.checkpointer.save_step()
                if cfg.stop_after_steps is not None and progress.step >= cfg.stop_after_steps:
                    self.checkpointer.save_step()
                    return True
                self.check_stop_signal()
            # this rank's data for the epoch ended: meet the other ranks' next size exchange, so a rank
            # that still has microbatches fails at once, naming the ranks, instead of waiting for the timeout
            self.exchange.set_position(progress.step + 1, progress.epoch, stop=self.stop.number is not None)
            self.exchange.end_of_data()
            self.check_stop_signal()
        finally:
            self.log_skipped_samples()
            bar.close()
        return False

    def _windows(self) -> Iterator[list[dict[str, Any]]]:
        """The epoch's windows; an error reading them (a decode or IO error, a rank short of usable samples)
        is taken to the other ranks' next size exchange, so every rank stops at once naming this rank and
        its error (this rank re-raises its own) instead of the others waiting there until the timeout."""
        try:
            yield from windows(self.loader, self.cfg.accum_freq)
        except Exception as error:
            step = self.progress.step + 1
            self.exchange.set_position(step, self.progress.epoch)
            self.exchange.fail(error, f"reading data for step {step}")
            raise

    def log_skipped_samples(self) -> None:
        """Every rank logs the samples its training loader skipped since the last call."""
        records, self.loader.skip_records = self.loader.skip_records, []
        self.reporter.write_skips(records)

    def end_epoch(self) -> None:
        cfg, progress = self.cfg, self.progress
        barrier(self.env)  # every rank has written its skipped samples of the epoch
        self.reporter.log_epoch_data(progress.step, progress.epoch, progress.num_samples_seen,
                                     self.loader.planned_sources)
        progress.epoch += 1
        progress.next_batch = 0
        last = progress.epoch == cfg.epochs
        self.evaluator(self.model, progress.step, float(progress.epoch), epochs_done=progress.epoch, last=last)
        self.checkpointer.save_epoch(progress.epoch, last, frequency=cfg.save_frequency,
                                     most_recent=cfg.save_most_recent, delete_previous=cfg.delete_previous_checkpoint)

    def check_skips(self, result: StepResult) -> None:
        if not result.skipped:
            return
        self.reporter.message(
            f"step {self.progress.step}: skipped (loss {result.stats.objective:.4g}, grad norm "
            f"{result.grad_norm:.4g}); "
            f"{self.progress.consecutive_skips} in a row, {self.progress.num_skipped_steps} in total"
        )
        if self.progress.consecutive_skips >= self.cfg.max_skipped_steps:
            raise TrainingStopped(
                f"stopping: {self.progress.consecutive_skips} consecutive steps had a non-finite loss or gradient "
                f"(--max-skipped-steps {self.cfg.max_skipped_steps}); lower --lr, set --grad-clip-norm or use "
                f"--precision fp32, and resume from the last checkpoint"
            )

    def log_step(self, result: StepResult, tokens: tuple[int, int], seconds: float, bar: Any) -> None:
        """OpenCLIP's cadences: the progress bar advances every step and shows its figures every
        --log-every-n-steps (the console line); the sinks get the metrics every --log-metric-every-n-steps, and
        every skipped step. tokens: (valid image patches, padded slots) of this step's window, all ranks. No
        collective in here: logging may be main-rank only."""
        metrics = step_metrics(result, tokens, seconds)
        metrics.update({"train/skipped_steps": self.progress.num_skipped_steps,
                        "data/skipped_samples": sum(self.loader.skip_counts.values())})
        step = self.progress.step
        if step % self.cfg.log_every_n_steps == 0 or result.skipped:
            bar.set_postfix(loss=f"{result.stats.objective:.3f}", lr=f"{result.lr:.2e}", N=result.stats.num_examples,
                            s=f"{result.stats.scale:.2f}", sps=f"{metrics['train/samples_per_s']:.0f}",
                            tps=f"{metrics['train/image_tokens_per_s']:.0f}",
                            pad=f"{metrics['train/padding_fraction']:.2f}", refresh=False)
        bar.update(1)
        if step % self.cfg.log_metric_every_n_steps == 0 or result.skipped:
            epoch = self.progress.epoch + self.progress.next_batch / max(1, self.loader.num_batches)
            # read from the device only at the logging interval (a host sync)
            metrics["train/logit_scale"] = float(self.module.logit_scale.detach().exp())
            self.reporter.log("train", step, epoch, metrics)

    def check_stop_signal(self) -> None:
        """After a step (or the epoch's end): when SIGINT/SIGTERM reached any rank before this window's size
        exchange, every rank saves this step and the run ends. The request came to every rank with that exchange
        (a signal may reach one rank only, or a step apart): all stop at the same step. One process stops after
        the step in progress."""
        if self.exchange.should_stop(self.stop.number is not None):
            saved = self.checkpointer.save_step()
            self.checkpointer.wait()  # an asynchronous save completes before the run ends
            raise self.stop.stopped(self.progress.step, saved, show=self.env.is_main, name=str(self.cfg.name))


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run `cfg` in this process (joining the job of torchrun, srun or mpirun if launched by one); returns the last
    evaluation. Without `--name`, rank 0 names the run and every rank writes there.

    TrainingInterrupted when a signal ended it (the message names the last complete checkpoint)."""
    env = init_distributed(cfg.device, cfg.dist_timeout, dist_url=cfg.dist_url, dist_backend=cfg.dist_backend,
                           no_set_device_rank=cfg.no_set_device_rank)
    trainer = None
    try:
        check_ranks_agree(cfg, env)  # before anything is shared, read or written: one line on every rank
        if cfg.name is None:
            cfg.name = share_from_main(env, cfg.default_name())
        try:
            refuse_existing_run(Path(cfg.logs) / str(cfg.name), resuming=cfg.resume is not None)
        finally:
            barrier(env)  # every rank looked before any rank writes
        trainer = Trainer(cfg, env)
        with trainer.stop.installed():
            result = trainer.fit()
            trainer.checkpointer.wait()  # the last asynchronous save is written and published
        barrier(env)  # every rank has read rank 0's last word before rank 0 (srun: the store's host) leaves
        return result
    except KeyboardInterrupt:
        checkpoint_dir = Path(cfg.logs) / str(cfg.name) / "checkpoints"
        if env.is_main:
            ckpt.clean_stale(checkpoint_dir)
        stop = trainer.stop if trainer is not None else StopSignals()
        raise stop.interrupted(ckpt.find_latest(checkpoint_dir), show=env.is_main) from None
    finally:
        if trainer is not None:
            trainer.loader.close()  # its workers end now, not whenever the collector frees the loader
            if trainer.remote_sync is not None:
                trainer.remote_sync.close()  # after the last save: the backup ends complete
            trainer.reporter.close()
        cleanup(env)

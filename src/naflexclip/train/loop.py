"""The training loop: one optimizer step per accumulation window, epochs, evaluation, checkpoints, logs.

Each optimizer step takes `--accum-freq` consecutive microbatches from the loader (an epoch's tail of fewer
joins its last window, `grouping.window_sizes`) and hands them to `accumulate_gradients`, which leaves
`s(W)·∇θ L(W)` in `.grad`: the loop never computes a loss coefficient. After the window the loop unscales
(fp16), measures and clips the gradient norm once, skips the step if the loss or the gradient is not finite,
steps AdamW, clamps `logit_scale` and advances the cosine schedule (once per window, skipped or not, so the
schedule and the data position stay in step).

Stops and resumes: SIGINT/SIGTERM let the current step finish, save it and end the run with one line (a
second signal stops at once, naming the last complete checkpoint). A resume continues exactly or refuses in
one line (`checkpoint.resume_errors`); flags it may change are applied and listed, the lr schedule keeps its
saved length unless a flag that defines it changed, and `metrics.jsonl` is cut back to what the checkpoint
had logged, so every step appears once.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from naflexclip.batch import is_naflex, to_device
from naflexclip.data import build_loader
from naflexclip.distributed import (
    DistributedEnv,
    barrier,
    check_consistency,
    cleanup,
    fault_guard,
    gather_to_main,
    init_distributed,
    run_on_main,
)
from naflexclip.exchange import window_exchange
from naflexclip.factory import create_model
from naflexclip.lock import Locks, lock_summary
from naflexclip.loss import create_loss
from naflexclip.model import config_to_dict, weights_mismatch
from naflexclip.parallel import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    no_sync_context,
    unwrap_model,
    wrap_model,
)
from naflexclip.train import checkpoint as ckpt
from naflexclip.train.config import TrainConfig
from naflexclip.train.evaluate import evaluate
from naflexclip.train.grouping import window_sizes
from naflexclip.train.optim import CosineSchedule, create_optimizer
from naflexclip.train.precision import create_precision
from naflexclip.train.report import Reporter, refuse_existing_run, run_exists
from naflexclip.window import WindowStats, accumulate_gradients


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps in a row); the message says why."""


class TrainingInterrupted(TrainingStopped):
    """SIGINT/SIGTERM ended the run; the message says where its last complete checkpoint is. `show`: this rank
    is the one that tells the user (the main rank)."""

    def __init__(self, message: str, signal_number: int, show: bool = True) -> None:
        super().__init__(message)
        self.signal_number = signal_number
        self.show = show


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint. `next_batch`: microbatches of `epoch` consumed."""

    epoch: int = 0
    step: int = 0  # windows processed, skipped ones included (the schedule's position)
    next_batch: int = 0
    num_skipped_steps: int = 0
    consecutive_skips: int = 0
    num_samples_seen: int = 0


@dataclass(frozen=True)
class StepResult:
    stats: WindowStats
    grad_norm: float
    skipped: bool
    lr: float


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _isolated(iterator: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The loader's items, fetched without touching the global torch RNG (a DataLoader draws its worker
    seed from it), so the model's random stream — and so a resumed run — does not depend on when
    loaders were started."""
    while True:
        with torch.random.fork_rng(devices=[]):
            item = next(iterator, None)
        if item is None:
            return
        yield item


def windows(loader: Any, accum_freq: int) -> Iterator[list[dict[str, Any]]]:
    """The loader's microbatches from its position on, grouped by `window_sizes` of the microbatches its epoch's
    plan has left (the same on every rank)."""
    sizes = iter(window_sizes(loader.num_batches - loader.position, accum_freq))
    window: list[dict[str, Any]] = []
    size = next(sizes, 0)
    for microbatch in _isolated(iter(loader)):
        window.append(microbatch)
        if len(window) == size:
            yield window
            window, size = [], next(sizes, 0)
    if window:
        yield window


def _token_counts(microbatches: list[dict[str, Any]]) -> tuple[int, int]:
    """(valid image patches, padded patch slots) of a rank's window (on the loader's side: no device sync)."""
    masks = [mb["image"]["patch_valid"] for mb in microbatches if is_naflex(mb["image"])]
    return sum(int(mask.sum()) for mask in masks), sum(mask.numel() for mask in masks)


class Trainer:
    """Holds the model, optimizer, schedule, loader and reporter of one run; `fit()` runs it."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv) -> None:
        self.cfg, self.env = cfg, env
        seed_everything(cfg.seed)  # the same initial weights on every rank (FSDP2 does not broadcast them)
        self.precision = create_precision(cfg.precision, env.device)
        model = create_model(cfg.pretrained or cfg.model, loss=cfg.loss)  # --pretrained: a SigLIP 2 directory
        Locks.pick(cfg).apply(model)  # before wrapping (DDP registers the trainable parameters) and the optimizer
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
        self.loss_fn = create_loss(cfg.loss, tile_size=cfg.loss_tile_size)
        # every window's size exchange also checks that the ranks agree on step, epoch and having data
        self.exchange = window_exchange(env, self.model)
        self.optimizer = create_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.wd, betas=(cfg.beta1, cfg.beta2),
                                          eps=cfg.eps)
        self.loader = build_loader(cfg.data, split="train", patch_size=self.module.image_patch_size,
                                   context_length=self.module.context_length, rank=env.rank,
                                   world_size=env.world_size, device_pin=env.device.type == "cuda")
        self.batches_per_epoch = self._plan_batches()
        self.schedule = CosineSchedule(self.optimizer, cfg.lr, cfg.warmup, self.windows_left(0, 0))
        self.progress = Progress()
        self.run_dir = Path(cfg.logs) / str(cfg.name)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.reporter = Reporter(self.run_dir, rank=env.rank, report_to=cfg.report_to, config=cfg.to_dict(),
                                 name=str(cfg.name))
        self.evals: list[dict[str, float]] = []  # [0]: the evaluation before the run's first step
        self.stop_signal: int | None = None  # set by SIGINT/SIGTERM (see `stop_signals`)
        self.last_step_saved: int | None = None
        locked = lock_summary(self.module)
        if locked:
            self.reporter.message(locked)
        total = self.schedule.total_steps
        if cfg.warmup > total:
            self.reporter.message(f"warning: --warmup {cfg.warmup} is longer than the run ({total} optimizer steps): "
                                  f"the learning rate never reaches --lr {cfg.lr:g}")

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
        microbatches left in each epoch (the lr schedule spans them, whatever --accum-freq the earlier steps used)."""
        counts = self.batches_per_epoch[epoch:]
        return sum(len(window_sizes(count - (next_batch if i == 0 else 0), self.cfg.accum_freq))
                   for i, count in enumerate(counts))

    # ----------------------------------------------------------------------------------- one step

    def train_step(self, microbatches: list[dict[str, Any]]) -> StepResult:
        """One window → at most one optimizer step; a non-finite loss or gradient leaves weights,
        optimizer state and grad-scaler growth untouched (the fp16 scaler still backs off)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # the step this window makes (as the logs count it), checked against every rank in its size exchange,
        # which also brings every rank's stop request and token counts (`exchange.agreed`)
        self.exchange.set_position(self.progress.step + 1, self.progress.epoch, stop=self.stop_signal is not None,
                                   tokens=_token_counts(microbatches))
        batches = [to_device(mb, self.env.device) for mb in microbatches]
        lr = self.schedule.lr
        with fault_guard(self.env, f"step {self.progress.step}"):
            stats = accumulate_gradients(
                self.model, self.loss_fn, batches, loss_scale=self.cfg.naflex_loss_scale,
                reference_batch_size=self.cfg.batch_size, method=self.cfg.accum_method, exchange=self.exchange,
                no_sync=no_sync_context(self.model), autocast=self.precision.autocast,
                grad_scaler=self.precision.scaler,
            )
            grad_norm = self._unscale_and_clip()
        # the same on every rank, so every rank skips alike: the loss is L(W) of the whole window, the norm that of
        # the synchronised gradients
        bad = not (math.isfinite(stats.loss) and math.isfinite(grad_norm))
        if bad:
            self._skip_step()
        else:
            self._optimizer_step()
        self.schedule.step()
        return StepResult(stats=stats, grad_norm=grad_norm, skipped=bad, lr=lr)

    def _unscale_and_clip(self) -> float:
        """The window's total gradient norm (after fp16 unscaling), clipped once if --grad-clip-norm."""
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # FSDP2: a sharded norm
            norm = norm.full_tensor()
        norm_value = float(norm)
        if self.cfg.grad_clip_norm is not None and math.isfinite(norm_value):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip_norm, norm)
        return norm_value

    def _optimizer_step(self) -> None:
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.module.clamp_logit_scale_()
        self.progress.consecutive_skips = 0

    def _skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.precision.scaler is not None:
            self.precision.scaler.update()  # an inf found by unscale_ backs the fp16 scale off
        self.progress.num_skipped_steps += 1
        self.progress.consecutive_skips += 1

    # ------------------------------------------------------------------------------------ the run

    def fit(self) -> dict[str, float]:
        """Resume if asked, evaluate, train every remaining epoch, report; returns the last evaluation."""
        resumed = self.maybe_resume()
        if resumed and self.nothing_left():
            return {}
        if not resumed:
            self.run_evaluation()
        while self.progress.epoch < self.cfg.epochs:
            if self.train_epoch():
                self.reporter.message(f"stopped after step {self.progress.step} (--stop-after-steps)")
                return self.evals[-1] if self.evals else {}
            self.end_epoch()
        self.finish()
        return self.evals[-1] if self.evals else {}

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
                self.log_step(result, self.exchange.agreed.tokens, now - tick, bar)
                tick = now
                self.check_skips(result)
                if cfg.save_every_n_steps and progress.step % cfg.save_every_n_steps == 0:
                    self.save_step()
                if cfg.stop_after_steps is not None and progress.step >= cfg.stop_after_steps:
                    self.save_step()
                    return True
                self.check_stop_signal()
            # this rank's data for the epoch ended: meet the other ranks' next size exchange, so a rank
            # that still has microbatches fails at once, naming the ranks, instead of waiting for the timeout
            self.exchange.set_position(progress.step + 1, progress.epoch, stop=self.stop_signal is not None)
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
        self.reporter.log_epoch_data(progress.step, progress.epoch, progress.num_samples_seen)
        progress.epoch += 1
        progress.next_batch = 0
        last = progress.epoch == cfg.epochs
        if last or (cfg.val_frequency and progress.epoch % cfg.val_frequency == 0):
            self.run_evaluation()
        if cfg.save_frequency and (progress.epoch % cfg.save_frequency == 0 or last):
            self.save(f"epoch_{progress.epoch}")

    def check_skips(self, result: StepResult) -> None:
        if not result.skipped:
            return
        self.reporter.message(
            f"step {self.progress.step}: skipped (loss {result.stats.loss:.4g}, grad norm {result.grad_norm:.4g}); "
            f"{self.progress.consecutive_skips} in a row, {self.progress.num_skipped_steps} in total"
        )
        if self.progress.consecutive_skips >= self.cfg.max_skipped_steps:
            raise TrainingStopped(
                f"stopping: {self.progress.consecutive_skips} consecutive steps had a non-finite loss or gradient "
                f"(--max-skipped-steps {self.cfg.max_skipped_steps}); lower --lr, set --grad-clip-norm or use "
                f"--precision fp32, and resume from the last checkpoint"
            )

    def log_step(self, result: StepResult, tokens: tuple[int, int], seconds: float, bar: Any) -> None:
        """Progress bar every step; metrics.jsonl / TensorBoard every --log-every-n-steps.
        tokens: (valid image patches, padded slots) of this step's window, all ranks. No collective in here: logging
        may be main-rank only."""
        stats = result.stats
        valid, slots = tokens
        metrics = {
            "train/loss": stats.loss, "train/lr": result.lr, "train/scale": stats.scale,
            "train/window_examples": stats.num_examples, "train/num_microbatches": stats.num_microbatches,
            "train/grad_norm": result.grad_norm, "train/logit_scale": float(self.module.logit_scale.detach().exp()),
            "train/samples_per_s": stats.num_examples / seconds, "train/image_tokens_per_s": valid / seconds,
            "train/padding_fraction": 1 - valid / max(1, slots), "train/skipped": float(result.skipped),
            "train/skipped_steps": self.progress.num_skipped_steps,
            "data/skipped_samples": sum(self.loader.skip_counts.values()),
        }
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.3f}", lr=f"{result.lr:.2e}", N=stats.num_examples, s=f"{stats.scale:.2f}",
                        sps=f"{metrics['train/samples_per_s']:.0f}", tps=f"{metrics['train/image_tokens_per_s']:.0f}",
                        pad=f"{metrics['train/padding_fraction']:.2f}", refresh=False)
        if self.progress.step % self.cfg.log_every_n_steps == 0 or result.skipped:
            self.reporter.log("train", self.progress.step, self._fractional_epoch(), metrics)

    def nothing_left(self) -> bool:
        """After a resume: True (and one line) when the checkpoint already is where this run would stop."""
        cfg, progress = self.cfg, self.progress
        if progress.epoch >= cfg.epochs:
            self.reporter.message(f"nothing to train: the run finished (epoch {progress.epoch} of --epochs "
                                  f"{cfg.epochs}, step {progress.step}); raise --epochs to train longer")
            return True
        if cfg.stop_after_steps is not None and progress.step >= cfg.stop_after_steps:
            self.reporter.message(f"nothing to train: the checkpoint is at step {progress.step}, "
                                  f"--stop-after-steps is {cfg.stop_after_steps}")
            return True
        return False

    def check_stop_signal(self) -> None:
        """After a step (or the epoch's end): when SIGINT/SIGTERM reached any rank before this window's size
        exchange, every rank saves this step and the run ends. The request came to every rank with that exchange
        (a signal may reach one rank only, or a step apart): all stop at the same step. One process stops after
        the step in progress."""
        if not self.exchange.should_stop(self.stop_signal is not None):
            return
        number = self.stop_signal or signal.SIGTERM
        path = self.save_step()
        raise TrainingInterrupted(f"stopped by {signal.Signals(number).name} after step {self.progress.step}; saved "
                                  f"{path} (continue with --resume latest)", number, show=self.env.is_main)

    def _fractional_epoch(self) -> float:
        return self.progress.epoch + self.progress.next_batch / max(1, self.loader.num_batches)

    def run_evaluation(self) -> dict[str, float]:
        """Evaluate on the main rank while the others wait without a collective timeout, learning of an error
        at once (`run_on_main`); FSDP: every rank runs the forwards, which need all shards."""

        def work() -> dict[str, float]:
            # the zero-shot tasks are the built-in dataset's attributes: only a model trained on it knows them
            on_builtin = self.cfg.data.source("train") == ("synthetic", None)
            model = self.model if self.cfg.fsdp else self.module
            skips: list[dict[str, Any]] = []
            metrics = evaluate(model, self.cfg.data, self.env.device, self.precision.autocast,
                               zero_shot_samples=self.cfg.zero_shot_samples if on_builtin else 0, skip_records=skips)
            if self.env.is_main:  # (FSDP: every rank evaluated the same validation data)
                self.reporter.write_skips(skips, step=self.progress.step)
            if self.env.is_main and metrics:
                self.evals.append(metrics)
                self.reporter.log("eval", self.progress.step, self._fractional_epoch(), metrics)
                self.reporter.message(f"eval after step {self.progress.step}: " + _brief(metrics))
            return metrics

        if self.cfg.fsdp:
            metrics = work()
            barrier(self.env)
            return metrics
        return run_on_main(self.env, "evaluating", work) or {}

    def finish(self) -> None:
        """Curves, summary table and skip counts (main rank)."""
        self.reporter.finish(self.evals, {"skipped steps (non-finite)": self.progress.num_skipped_steps},
                             plot=self.cfg.plot)

    # ------------------------------------------------------------------------------- checkpoints

    def train_state(self) -> dict[str, Any]:
        """Everything a resume needs (every rank must call it: the RNG states are gathered to rank 0)."""
        scaler = self.precision.scaler
        rng = ckpt.rng_state(self.env.device)
        return {
            "config": self.cfg.to_dict(),
            "model_config": config_to_dict(self.module.config),
            "progress": asdict(self.progress),
            "optimizer": full_optimizer_state_dict(self.model, self.optimizer, self.env),
            "schedule": self.schedule.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng,
            "rng_per_rank": gather_to_main(self.env, rng),
            "data": {"epoch": self.progress.epoch, "next_batch": self.progress.next_batch,
                     "skip_counts": dict(self.loader.skip_counts),
                     # every rank's loader position (a rank may be covering a broken microbatch); on rank 0
                     "ranks": gather_to_main(self.env, self.loader.state_dict())},
            "world_size": self.env.world_size,
            # the summary's "before" column, and what each sink had logged (main rank)
            "first_eval": self.evals[0] if self.evals else None,
            "reporter": self.reporter.state_dict(),
        }

    def save(self, name: str) -> Path:
        """Gather (every rank) and write (main rank) one checkpoint; its path."""
        model_state = full_state_dict(self.model, self.env)
        state = self.train_state()
        path = self.checkpoint_dir / name

        def write() -> Path:
            written = ckpt.save_checkpoint(self.checkpoint_dir, name, model_state, state)
            self.reporter.message(f"saved {written}")
            return written

        # the others wait without a collective timeout (a large checkpoint may take longer) and hear of an error
        return run_on_main(self.env, f"writing checkpoint {name}", write) or path

    def save_step(self) -> Path:
        """Save `step_{step}` unless this step was saved already (--save-every-n-steps and --stop-after-steps
        or a stop signal at the same step write it once)."""
        path = self.checkpoint_dir / f"step_{self.progress.step:08d}"
        if self.last_step_saved != self.progress.step:
            path = self.save(path.name)
            self.last_step_saved = self.progress.step
        return path

    def maybe_resume(self) -> bool:
        """Load --resume (a path, or `latest` of this run when there is one); True if a checkpoint was loaded.

        Every rank reads the checkpoint, so every rank raises the same error."""
        cfg = self.cfg
        if cfg.resume is None:
            return False
        if cfg.resume == "latest":
            found = ckpt.load_latest(self.checkpoint_dir, notify=self.reporter.message)
            if found is None:
                return self._start_fresh()
        else:
            found = ckpt.load_checkpoint_from(cfg.resume, notify=self.reporter.message)
        path, model_state, state = found
        self.check_resumable(path, model_state, state)
        changes = self.load_train_state(model_state, state)
        self._cut_metrics(path, state)
        self.reporter.message(f"resumed from {path} at epoch {self.progress.epoch}, step {self.progress.step}")
        if changes:
            self.reporter.message("resume applies changed flags: " + ", ".join(changes))
        return True

    def _start_fresh(self) -> bool:
        """--resume latest without a usable checkpoint: a new run starts; an existing one stops unless
        --resume-fresh says to start it over."""
        existing = run_exists(self.run_dir) or (self.checkpoint_dir.is_dir() and any(self.checkpoint_dir.iterdir()))
        if existing and not self.cfg.resume_fresh:
            raise ValueError(f"--resume latest: run {str(self.run_dir)!r} exists but has no usable checkpoint; pass "
                             f"--resume-fresh to start it over from scratch")
        if existing:
            self.reporter.message(f"--resume latest: no usable checkpoint in {self.checkpoint_dir}; starting the run "
                                  f"over (--resume-fresh)")
            self.reporter.start_over()
        else:
            self.reporter.message(f"--resume latest: no checkpoint in {self.checkpoint_dir}; starting fresh")
        barrier(self.env)
        return False

    def check_resumable(self, path: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """One-line ValueError when this run cannot continue the checkpoint exactly (model, loss, data, world
        size; see `checkpoint.resume_errors`)."""
        saved_world_size = int(state.get("world_size", 1))
        error = ckpt.resume_errors(state["config"], self.cfg.to_dict(), saved_world_size, self.env.world_size,
                                   state.get("data", {}))
        if error is None and state.get("model_config") is not None:
            changed = ckpt.architecture_changes(state["model_config"], config_to_dict(self.module.config))
            if changed:
                error = (f"--model {self.cfg.model}: the preset's architecture is not the checkpoint's (checkpoint -> "
                         "preset: " + ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "") + ")")
        if error is None:
            error = weights_mismatch(self.module, model_state)
        if error is not None:
            raise ValueError(f"--resume {str(path)!r}: {error}")

    def load_train_state(self, model_state: dict[str, torch.Tensor], state: dict[str, Any]) -> list[str]:
        """Restore the checkpoint on every rank; returns the changed flags applied (`--flag old -> new`)."""
        changes = ckpt.resume_changes(state["config"], self.cfg.to_dict())
        load_full_state_dict(self.model, model_state, self.env)
        # the optimizer state restores the saved hyperparameters too: keep this run's (--wd, --beta1, ...)
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], self.env)
        for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
            group.update(values)
        self.progress = Progress(**state["progress"])
        changes += self._restore_schedule(state["schedule"], state["config"])
        if self.precision.scaler is not None and state["grad_scaler"]:
            self.precision.scaler.load_state_dict(state["grad_scaler"])
        self.last_step_saved = self.progress.step
        self.loader.load_state_dict(state["data"].get("ranks") or dict(state["data"]))
        per_rank = state.get("rng_per_rank")
        own = per_rank[self.env.rank] if per_rank and len(per_rank) == self.env.world_size else state["rng"]
        ckpt.set_rng_state(own, self.env.device)
        if state.get("first_eval"):
            self.evals = [state["first_eval"]]
        check_consistency(self.env, step=self.progress.step, epoch=self.progress.epoch,
                          next_batch=self.progress.next_batch)
        return changes

    def _restore_schedule(self, saved: dict[str, Any], saved_config: dict[str, Any]) -> list[str]:
        """Continue the saved lr schedule; only when a flag that defines it changed (--lr, --warmup, --epochs,
        --accum-freq) does this run's schedule replace it, spanning the steps actually left, and the lr change at
        the resumed step is listed."""
        step = int(saved["last_step"])
        defining = ("lr", "warmup", "epochs", "accum_freq")
        current = self.cfg.to_dict()
        if all(saved_config.get(key) == current[key] for key in defining):
            self.schedule.base_lr = float(saved["base_lr"])
            self.schedule.warmup_steps = int(saved["warmup_steps"])
            self.schedule.total_steps = int(saved["total_steps"])
            self.schedule.load_state_dict(saved)
            return []
        old = CosineSchedule(self.optimizer, float(saved["base_lr"]), int(saved["warmup_steps"]),
                             int(saved["total_steps"])).lr_at(step)
        self.schedule.total_steps = step + self.windows_left(self.progress.epoch, self.progress.next_batch)
        self.schedule.load_state_dict(saved)  # (after the line above set the optimizer's lr) this run's lr
        return [f"lr schedule {saved['total_steps']} -> {self.schedule.total_steps} steps "
                f"(lr at step {step}: {old:.3g} -> {self.schedule.lr:.3g})"]

    def _cut_metrics(self, path: Path, state: dict[str, Any]) -> None:
        """Drop what the sinks logged after this checkpoint (a crash or stop after it), so each step appears
        once; only for this run's own checkpoints."""
        if path.resolve().parent == self.checkpoint_dir.resolve():
            self.reporter.load_state_dict(state["reporter"], self.progress.step)
        barrier(self.env)


def _brief(metrics: dict[str, float]) -> str:
    keys = ("val/image_to_text_R@1", "val/text_to_image_R@1", "val/image_to_text_R@10", "zeroshot/shape_top1",
            "zeroshot/colour_top1")
    return ", ".join(f"{k.split('/', 1)[1]}={metrics[k]:.3f}" for k in keys if k in metrics)


def prepare_run_dir(cfg: TrainConfig, env: DistributedEnv) -> None:
    """Refuse to overwrite another run's logs unless resuming it (OpenCLIP's rule)."""
    try:
        refuse_existing_run(Path(cfg.logs) / str(cfg.name), resuming=cfg.resume is not None)
    finally:
        barrier(env)  # every rank looked before any rank writes


@contextlib.contextmanager
def stop_signals(trainer: Trainer) -> Iterator[None]:
    """While training: SIGINT/SIGTERM ask the loop to stop after the current step (it saves, then ends the
    run); the same signal again stops at once (KeyboardInterrupt). Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(number: int, frame: Any) -> None:
        # Ctrl-C under torchrun reaches a worker twice, as SIGINT from the terminal and SIGTERM from the agent:
        # only a repeat of the first signal means "now"
        if trainer.stop_signal == number:
            raise KeyboardInterrupt
        if trainer.stop_signal is None:
            trainer.stop_signal = number  # no output here: a handler may run in the middle of a write to stderr

    previous = {number: signal.signal(number, request_stop) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run `cfg` in this process (joining torchrun's job if launched by it); returns the last evaluation.

    TrainingInterrupted when a signal ended it (the message names the last complete checkpoint)."""
    env = init_distributed(cfg.device, cfg.dist_timeout)
    trainer = None
    try:
        prepare_run_dir(cfg, env)
        trainer = Trainer(cfg, env)
        with stop_signals(trainer):
            return trainer.fit()
    except KeyboardInterrupt:
        checkpoint_dir = Path(cfg.logs) / str(cfg.name) / "checkpoints"
        if env.is_main:
            ckpt.clean_stale(checkpoint_dir)
        latest = ckpt.find_latest(checkpoint_dir)
        number = trainer.stop_signal if trainer is not None and trainer.stop_signal else signal.SIGINT
        raise TrainingInterrupted(f"interrupted by {signal.Signals(number).name}; last complete checkpoint: "
                                  f"{latest if latest is not None else 'none'}", number, show=env.is_main) from None
    finally:
        if trainer is not None:
            trainer.reporter.close()
        cleanup(env)

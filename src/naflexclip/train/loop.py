"""The training loop: one optimizer step per accumulation window, epochs, evaluation, checkpoints, logs.

Each optimizer step takes `--accum-freq` consecutive microbatches from the loader (the last window of an
epoch may hold fewer) and hands them to `accumulate_gradients`, which leaves `s(W)·∇θ L(W)` in `.grad`:
the loop never computes a loss coefficient. After the window the loop unscales (fp16), measures and
clips the gradient norm once, skips the step if the loss or the gradient is not finite, steps AdamW,
clamps `logit_scale` and advances the cosine schedule (once per window, skipped or not, so the schedule
and the data position stay in step).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from naflexclip.batch import is_naflex, to_device
from naflexclip.data import build_loader
from naflexclip.distributed import (
    DistributedEnv,
    any_rank_true,
    barrier,
    check_consistency,
    cleanup,
    fault_guard,
    full_optimizer_state_dict,
    full_state_dict,
    init_distributed,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    no_sync_context,
    sum_over_ranks,
    unwrap_model,
    window_exchange,
    wrap_model,
)
from naflexclip.loss import create_loss
from naflexclip.model import config_to_dict, create_model, weights_mismatch
from naflexclip.train import checkpoint as ckpt
from naflexclip.train.config import TrainConfig
from naflexclip.train.evaluate import evaluate
from naflexclip.train.optim import CosineSchedule, create_optimizer
from naflexclip.train.precision import create_precision
from naflexclip.train.report import PLOT_FILE, Reporter, plot_curves, read_metrics, summary_table
from naflexclip.window import WindowStats, accumulate_gradients


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps in a row); the message says why."""


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
    """Consecutive groups of `accum_freq` microbatches; the epoch's last group may be shorter."""
    window: list[dict[str, Any]] = []
    for microbatch in _isolated(iter(loader)):
        window.append(microbatch)
        if len(window) == accum_freq:
            yield window
            window = []
    if window:
        yield window


def _token_counts(microbatches: list[dict[str, Any]]) -> tuple[int, int]:
    """(valid image patches, padded patch slots) of a rank's window."""
    masks = [mb["image"]["patch_valid"] for mb in microbatches if is_naflex(mb["image"])]
    return sum(int(mask.sum()) for mask in masks), sum(mask.numel() for mask in masks)


class Trainer:
    """Holds the model, optimizer, schedule, loader and reporter of one run; `fit()` runs it."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv) -> None:
        self.cfg, self.env = cfg, env
        seed_everything(cfg.seed)  # the same initial weights on every rank (FSDP2 does not broadcast them)
        self.precision = create_precision(cfg.precision, env.device)
        self.model = wrap_model(create_model(cfg.model, siglip=cfg.siglip).to(env.device), env, cfg.fsdp)
        # dropout / drop-path / patch-dropout draw a different stream on every rank (OpenCLIP: seed + rank);
        # the data order does not depend on it (the loader seeds itself from --seed, epoch and position)
        seed_everything(cfg.seed + env.rank)
        self.module = unwrap_model(self.model)
        self.loss_fn = create_loss(cfg.siglip)
        # every window's size exchange also checks that the ranks agree on step, epoch and having data
        self.exchange = window_exchange(env, equal_counts=cfg.fsdp)
        self.optimizer = create_optimizer(self.model, lr=cfg.lr, weight_decay=cfg.wd, betas=(cfg.beta1, cfg.beta2),
                                          eps=cfg.eps)
        self.loader = build_loader(cfg.data, split="train", patch_size=self.module.image_patch_size,
                                   context_length=self.module.context_length, rank=env.rank,
                                   world_size=env.world_size, device_pin=env.device.type == "cuda")
        self.windows_per_epoch = self._plan_windows()
        self.schedule = CosineSchedule(self.optimizer, cfg.lr, cfg.warmup, sum(self.windows_per_epoch))
        self.progress = Progress()
        self.run_dir = Path(cfg.logs) / str(cfg.name)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.reporter = Reporter(self.run_dir, enabled=env.is_main, tensorboard=cfg.report_to == "tensorboard")
        self.evals: list[dict[str, float]] = []

    def _plan_windows(self) -> list[int]:
        """Optimizer steps in each epoch (the schedule's length): ceil(planned microbatches / accum_freq)."""
        counts = []
        for epoch in range(self.cfg.epochs):
            self.loader.set_epoch(epoch)
            counts.append(math.ceil(self.loader.num_batches / self.cfg.accum_freq))
        self.loader.set_epoch(0)
        return counts

    # ----------------------------------------------------------------------------------- one step

    def train_step(self, microbatches: list[dict[str, Any]]) -> StepResult:
        """One window → at most one optimizer step; a non-finite loss or gradient leaves weights,
        optimizer state and grad-scaler growth untouched (the fp16 scaler still backs off)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batches = [to_device(mb, self.env.device) for mb in microbatches]
        lr = self.schedule.lr
        # the step this window makes (as the logs count it), checked against every rank in its size exchange
        self.exchange.set_position(self.progress.step + 1, self.progress.epoch)
        with fault_guard(self.env, f"step {self.progress.step}"):
            stats = accumulate_gradients(
                self.model, self.loss_fn, batches, loss_scale=self.cfg.naflex_loss_scale,
                reference_batch_size=self.cfg.batch_size, method=self.cfg.accum_method, exchange=self.exchange,
                no_sync=no_sync_context(self.model), autocast=self.precision.autocast,
                grad_scaler=self.precision.scaler,
            )
            grad_norm = self._unscale_and_clip()
            bad = any_rank_true(self.env, not (math.isfinite(stats.loss) and math.isfinite(grad_norm)))
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
        cfg, progress = self.cfg, self.progress
        self.loader.set_epoch(progress.epoch, start_batch=progress.next_batch)
        total = self.windows_per_epoch[progress.epoch]
        bar = self.reporter.progress_bar(progress.epoch, total, math.ceil(progress.next_batch / cfg.accum_freq))
        tick = time.perf_counter()
        try:
            for microbatches in windows(self.loader, cfg.accum_freq):
                result = self.train_step(microbatches)
                progress.step += 1
                progress.next_batch = self.loader.position
                progress.num_samples_seen += result.stats.num_examples
                now = time.perf_counter()
                tokens = self.window_token_counts(microbatches)  # a collective: every rank, every step
                self.log_step(result, tokens, now - tick, bar)
                tick = now
                self.check_skips(result)
                if cfg.save_every_n_steps and progress.step % cfg.save_every_n_steps == 0:
                    self.save(f"step_{progress.step:08d}")
                if cfg.stop_after_steps is not None and progress.step >= cfg.stop_after_steps:
                    self.save(f"step_{progress.step:08d}")
                    return True
            # this rank's data for the epoch ended: meet the other ranks' next size exchange, so a rank
            # that still has microbatches fails at once, naming the ranks, instead of waiting for the timeout
            self.exchange.set_position(progress.step + 1, progress.epoch)
            self.exchange.end_of_data()
        finally:
            bar.close()
        return False

    def end_epoch(self) -> None:
        cfg, progress = self.cfg, self.progress
        progress.epoch += 1
        progress.next_batch = 0
        last = progress.epoch == cfg.epochs
        if cfg.val_frequency and (progress.epoch % cfg.val_frequency == 0 or last):
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
        tokens: `window_token_counts` of this step. No collective in here: logging may be main-rank only."""
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

    def window_token_counts(self, microbatches: list[dict[str, Any]]) -> tuple[int, int]:
        """(valid image patches, padded patch slots) of the whole window, all ranks. A collective: every rank
        calls it every step, whether or not it logs (calling it only where rank 0 logs would deadlock)."""
        valid, slots = sum_over_ranks(self.env, _token_counts(microbatches))
        return valid, slots

    def _fractional_epoch(self) -> float:
        return self.progress.epoch + self.progress.next_batch / max(1, self.loader.num_batches)

    def run_evaluation(self) -> dict[str, float]:
        """Evaluate on the main rank (FSDP: every rank runs the forwards, which need all shards)."""
        metrics: dict[str, float] = {}
        if self.env.is_main or self.cfg.fsdp:
            # the zero-shot tasks are the built-in dataset's attributes: only a model trained on it knows them
            on_builtin = self.cfg.data.source("train") == ("synthetic", None)
            model = self.model if self.cfg.fsdp else self.module
            metrics = evaluate(model, self.cfg.data, self.env.device, self.precision.autocast,
                               zero_shot_samples=self.cfg.zero_shot_samples if on_builtin else 0)
        if self.env.is_main and metrics:
            self.evals.append(metrics)
            self.reporter.log("eval", self.progress.step, self._fractional_epoch(), metrics)
            self.reporter.message(f"eval after step {self.progress.step}: " + _brief(metrics))
        barrier(self.env)
        return metrics

    def finish(self) -> None:
        """Curves, summary table and skip counts (main rank)."""
        if not self.env.is_main:
            return
        counts = {"skipped steps (non-finite)": self.progress.num_skipped_steps,
                  "skipped samples (bad data)": sum(self.loader.skip_counts.values())}
        if self.loader.skip_counts:
            counts.update({f"  skipped: {k}": v for k, v in sorted(self.loader.skip_counts.items())})
        if self.cfg.plot:
            plot_curves(read_metrics(self.reporter.metrics_path), self.run_dir / PLOT_FILE)
        if self.evals:
            print(summary_table(self.evals[0], self.evals[-1], counts))
        print(f"outputs in {self.run_dir}")
        self.reporter.close()

    # ------------------------------------------------------------------------------- checkpoints

    def train_state(self) -> dict[str, Any]:
        scaler = self.precision.scaler
        return {
            "config": self.cfg.to_dict(),
            "model_config": config_to_dict(self.module.config),
            "progress": asdict(self.progress),
            "optimizer": full_optimizer_state_dict(self.model, self.optimizer, self.env),
            "schedule": self.schedule.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
            "rng": ckpt.rng_state(),
            "data": {"epoch": self.progress.epoch, "next_batch": self.progress.next_batch,
                     "skip_counts": dict(self.loader.skip_counts)},
            "world_size": self.env.world_size,
        }

    def save(self, name: str) -> None:
        """Gather (every rank) and write (main rank) one checkpoint."""
        model_state = full_state_dict(self.model, self.env)
        state = self.train_state()
        if self.env.is_main:
            path = ckpt.save_checkpoint(self.checkpoint_dir, name, model_state, state)
            self.reporter.message(f"saved {path}")
        barrier(self.env)

    def maybe_resume(self) -> bool:
        """Load --resume (a path, or `latest` of this run when there is one); True if a checkpoint was loaded."""
        if self.cfg.resume is None:
            return False
        if self.cfg.resume == "latest":
            path = ckpt.find_latest(self.checkpoint_dir)
            if path is None:
                self.reporter.message(f"--resume latest: no checkpoint in {self.checkpoint_dir}; starting fresh")
                return False
        else:
            path = ckpt.resolve(self.cfg.resume)
        model_state, state = ckpt.load_checkpoint(path)
        mismatch = weights_mismatch(self.module, model_state)  # every rank reads the file: all raise alike
        if mismatch is not None:
            raise ValueError(f"--resume {str(path)!r}: {mismatch}")
        self.load_train_state(model_state, state)
        self.reporter.message(f"resumed from {path} at epoch {self.progress.epoch}, step {self.progress.step}")
        return True

    def load_train_state(self, model_state: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        load_full_state_dict(self.model, model_state, self.env)
        load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], self.env)
        self.schedule.load_state_dict(state["schedule"])
        if self.precision.scaler is not None and state["grad_scaler"]:
            self.precision.scaler.load_state_dict(state["grad_scaler"])
        self.progress = Progress(**state["progress"])
        self.loader.skip_counts.update(state["data"]["skip_counts"])
        ckpt.set_rng_state(state["rng"])
        check_consistency(self.env, step=self.progress.step, epoch=self.progress.epoch,
                          next_batch=self.progress.next_batch)


def _brief(metrics: dict[str, float]) -> str:
    keys = ("val/image_to_text_R@1", "val/text_to_image_R@1", "val/image_to_text_R@10", "zeroshot/shape_top1",
            "zeroshot/colour_top1")
    return ", ".join(f"{k.split('/', 1)[1]}={metrics[k]:.3f}" for k in keys if k in metrics)


def prepare_run_dir(cfg: TrainConfig, env: DistributedEnv) -> None:
    """Refuse to overwrite another run's logs unless resuming it (OpenCLIP's rule)."""
    run_dir = Path(cfg.logs) / str(cfg.name)
    exists = cfg.resume is None and (run_dir / "metrics.jsonl").exists()
    barrier(env)  # every rank looked before any rank writes
    if exists:
        raise ValueError(f"--name: run {str(run_dir)!r} already exists; pick another --name or pass --resume latest")


def train(cfg: TrainConfig) -> dict[str, float]:
    """Run `cfg` in this process (joining torchrun's job if launched by it); returns the last evaluation."""
    env = init_distributed(cfg.device, cfg.dist_timeout)
    try:
        prepare_run_dir(cfg, env)
        trainer = Trainer(cfg, env)
        return trainer.fit()
    finally:
        cleanup(env)

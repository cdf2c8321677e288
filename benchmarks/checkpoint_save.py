"""Checkpoint saves at scale: the full form (every state gathered to rank 0, which writes it) against the sharded
one (`--fsdp-checkpoint sharded`: every rank writes its own shards through torch.distributed.checkpoint), and the
time a training step is blocked by a save with and without `--async-save`.

R processes on CPU with gloo (default 2 and 4) train nothing: each builds `--model` (default `base`), shards it with
FSDP2 as a run does, gives AdamW its state (one step), and saves it through the trainer's own `CheckpointManager`
(`model`, `optimizer`, `progress`) in each form, alternating, `--repeats` times. Measured per rank: the seconds
`save` takes (the step is blocked that long; asynchronous: until the shards are copied aside, then the seconds
until they are written and published) and the peak resident memory above the rank's memory before the save
(sampled every millisecond). The bytes written per parameter give the estimate for larger models on more ranks.

Usage: `python benchmarks/checkpoint_save.py [--world-sizes 2 4] [--model base] [--repeats 1] [--out FILE.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORMS = ("full", "sharded", "async")
GB = 1e9


class PeakRss:
    """The peak resident memory of this process above its memory at `start`, sampled every millisecond."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.running = False
        self.base = self.peak = 0
        self.thread: threading.Thread | None = None

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def start(self) -> None:
        self.base = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        assert self.thread is not None
        self.thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak - self.base


def _worker(rank: int, world_size: int, port: int, model_name: str, repeats: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from naflexclip.checkpoints.manager import CheckpointManager
    from naflexclip.models.naflex_clip import PRESETS, NaFlexClip
    from naflexclip.parallel.process_group import init_distributed
    from naflexclip.parallel.wrapping import wrap_model
    from naflexclip.train.components import ModelState, OptimizerState, Progress, checkpoint_ranks

    env = init_distributed("cpu", 600.0)
    torch.manual_seed(0)
    model = wrap_model(NaFlexClip(PRESETS[model_name]), env, fsdp=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():  # AdamW's moments and step counts exist after a step
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = parameters(PRESETS[model_name])
    progress = Progress(step=1)
    components = {"model": ModelState(model, env), "optimizer": OptimizerState(model, optimizer, env),
                  "progress": progress}
    root = Path(folder)
    savers = {form: CheckpointManager(root / form, components, {"world_size": world_size}, progress,
                                      checkpoint_ranks(env), lambda line: None, sharded=form != "full",
                                      async_save=form == "async")
              for form in FORMS}
    results: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
    sampler = PeakRss()
    for repeat in range(repeats):
        for form, saver in savers.items():
            dist.barrier()
            sampler.start()
            start = time.perf_counter()
            saver.save(f"step_{repeat}")
            blocked = time.perf_counter() - start
            saver.wait()
            total = time.perf_counter() - start
            memory = sampler.stop()
            dist.barrier()
            written = sum(p.stat().st_size for p in (root / form / f"step_{repeat}").iterdir()) if rank == 0 else 0
            results[form].append({"blocked_s": blocked, "total_s": total, "peak_bytes": memory, "bytes": written})
            if rank == 0:  # keep the disk free: one save of each form at a time
                shutil.rmtree(root / form / f"step_{repeat}")
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps({"world_size": world_size, "params": params, "ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world_size: int, model_name: str, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        mp.spawn(_worker, args=(world_size, _free_port(), model_name, repeats, str(Path(folder) / "saves"),
                                str(out)), nprocs=world_size, join=True)
        return json.loads(out.read_text())


def summary(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per form: the medians over repeats after the first (the first sets up DCP's planner and the gloo group;
    all of them with one repeat) of rank 0's and the other ranks' (their largest) figures."""
    rows: dict[str, dict[str, float]] = {}
    for form in FORMS:
        def median(rank: int, key: str, form: str = form) -> float:
            runs = result["ranks"][rank][form]
            runs = runs[1:] if len(runs) > 1 else runs
            return statistics.median(run[key] for run in runs)

        others = range(1, result["world_size"])
        rows[form] = {
            "rank0_blocked_s": median(0, "blocked_s"), "rank0_total_s": median(0, "total_s"),
            "rank0_peak_gb": median(0, "peak_bytes") / GB,
            "others_blocked_s": max(median(r, "blocked_s") for r in others),
            "others_peak_gb": max(median(r, "peak_bytes") for r in others) / GB,
            "bytes_per_param": median(0, "bytes") / result["params"],
        }
    return rows


def parameters(config: Any) -> int:
    from naflexclip.models.naflex_clip import NaFlexClip

    with torch.device("meta"):
        return sum(p.numel() for p in NaFlexClip(config).parameters())


def estimate(bytes_per_param: float, ranks: int = 64) -> list[str]:
    """On paper: the state a save moves for SigLIP 2 So400m and g, in each form, on `ranks` ranks."""
    from naflexclip.families.openclip_names import model_config
    from naflexclip.models.naflex_clip import PRESETS

    lines = []
    for name, config in (("So400m (siglip2-so400m)", PRESETS["siglip2-so400m"]),
                         ("g (ViT-gopt-16-SigLIP2-256)", model_config("ViT-gopt-16-SigLIP2-256"))):
        total = parameters(config) * bytes_per_param
        lines.append(f"| {name} | {parameters(config) / 1e9:.2f} B | {total / GB:.1f} GB | {total / GB:.1f} GB "
                     f"| {total / ranks / GB:.2f} GB | {ranks}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="base")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the raw figures to this JSON file")
    args = parser.parse_args()
    raw, table = [], []
    bytes_per_param = 0.0
    for world_size in args.world_sizes:
        result = measure(world_size, args.model, args.repeats)
        raw.append(result)
        rows = summary(result)
        bytes_per_param = rows["sharded"]["bytes_per_param"]
        full, sharded, asynchronous = rows["full"], rows["sharded"], rows["async"]
        print(f"R={world_size}, {args.model} ({result['params'] / 1e6:.0f} M parameters), "
              f"{bytes_per_param:.2f} bytes per parameter saved (model + AdamW)")
        for form, row in rows.items():
            print(f"  {form:8s} rank 0: blocked {row['rank0_blocked_s']:6.2f} s (written {row['rank0_total_s']:6.2f}"
                  f" s), peak +{row['rank0_peak_gb']:.2f} GB; other ranks: blocked {row['others_blocked_s']:6.2f} s,"
                  f" peak +{row['others_peak_gb']:.2f} GB")
        table.append(
            f"| {world_size} | {full['rank0_total_s']:.2f} / {sharded['rank0_total_s']:.2f} "
            f"({full['rank0_total_s'] / sharded['rank0_total_s']:.1f}x) "
            f"| {full['rank0_peak_gb']:.2f} / {sharded['rank0_peak_gb']:.2f} "
            f"({full['rank0_peak_gb'] / max(sharded['rank0_peak_gb'], 1e-3):.1f}x) "
            f"| {full['others_peak_gb']:.2f} / {sharded['others_peak_gb']:.2f} "
            f"| {sharded['rank0_blocked_s']:.2f} / {asynchronous['rank0_blocked_s']:.2f} "
            f"({sharded['rank0_blocked_s'] / asynchronous['rank0_blocked_s']:.1f}x) "
            f"| {asynchronous['rank0_total_s']:.2f} | {asynchronous['rank0_peak_gb']:.2f} |")
    print("\n| R | save s, full / sharded | rank 0 peak GB, full / sharded | other ranks' peak GB, full / sharded "
          "| step blocked s, sharded / async | async written s | async rank 0 peak GB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(table))
    print("\n| model | parameters | full: rank 0 gathers and writes | full: rank 0 extra memory | sharded: each of 64 "
          "ranks writes and holds | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(estimate(bytes_per_param)))
    if args.out:
        Path(args.out).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()

"""Tower benchmark: activation checkpointing and torch.compile, side by side on one model and one batch.

`ratios` (the CPU figures): one `cache` window of the `base` preset, with and without
`--grad-checkpointing` and compiled vs eager. Peak memory comes from a fresh process per variant (peak RSS
over the current RSS before the step, .grad buffers allocated beforehand, so the growth is the step's
activations and temporaries); the activations autograd keeps per microbatch are also counted exactly
(saved-tensor bytes of one grad forward). Times come from one process in which the variants alternate
round by round (median per variant). Compiled towers run windows of other shapes too, and the graphs
torch.compile built are counted after each (recompiles).

`sweep` (the GPU figures, bf16 autocast): per tower size and sequence length, one full-batch step of a fixed
token budget and the `cache` window over the same examples at n = 1, 2, 4, 8, each eager / checkpointed /
compiled / both (`--variants`; variant by variant over every length, the compiled ones last): seconds, × the
full batch, peak memory, image tokens/s and MFU (FLOPs of the full-batch step counted by
torch.utils.flop_counter ÷ seconds ÷ the device's bf16 peak; the window's extra forwards are overhead, not
counted). Every row is printed and appended to `--out` (and, with `--results DIR`, as a JSON record to
DIR/results.jsonl) as soon as it is measured, so a timeout keeps what was done. A model name `create_model`
does not know is skipped with one line.

    python benchmarks/towers.py ratios --threads 1                          # CPU, base preset
    python benchmarks/towers.py sweep --model base siglip2-base --seq-lens 576 1024 256 --out OUT/towers.md
    python benchmarks/towers.py sweep --model tiny --seq-lens 16 --tokens-per-batch 256 --device cpu  # dry run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from measure import Results, in_subprocess, synchronize, time_and_peak
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

from naflexclip import accumulate_gradients, create_loss
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.batch import split_batch, to_device
from naflexclip.families.factory import create_model
from naflexclip.models.naflex_clip import NaFlexClip
from naflexclip.models.precision import create_precision

# dense bf16 tensor-core peaks (vendor datasheets, without sparsity), FLOP/s
BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def build_model(name: str, device: torch.device) -> NaFlexClip:
    """A preset (`base`, `siglip2-base`, ...) on `device`."""
    return create_model(name).to(device)


def make_batch(model: NaFlexClip, num_examples: int, seq_lens: list[int], seed: int = 0) -> dict:
    return random_naflex_batch(num_examples, patch_size=model.image_patch_size, context_length=model.context_length,
                               seq_lens=tuple(seq_lens), generator=torch.Generator().manual_seed(seed),
                               dtype=torch.float32)


def split_evenly(batch: dict, n: int, device: torch.device) -> list[dict]:
    sizes = [len(part) for part in torch.arange(batch["text"].shape[0]).tensor_split(n)]
    return [to_device(mb, device) for mb in split_batch(batch, sizes)]


def window_step(model: torch.nn.Module, loss_fn: Callable, microbatches: list[dict], autocast: Callable) -> None:
    model.zero_grad(set_to_none=False)
    accumulate_gradients(model, loss_fn, microbatches, autocast=autocast)


def full_step(model: torch.nn.Module, loss_fn: Callable, batch: dict, autocast: Callable) -> None:
    """One forward/backward of the whole batch (the baseline), the loss in fp32 as in the window."""
    model.zero_grad(set_to_none=False)
    with autocast():
        out = model(image=batch["image"], text=batch["text"])
    loss_fn(out["image_features"].float(), out["text_features"].float(), out["logit_scale"].float(),
            out["logit_bias"].float() if out.get("logit_bias") is not None else None).backward()


def allocate_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def num_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def saved_activation_bytes(model: torch.nn.Module, microbatch: dict, autocast: Callable) -> int:
    """Bytes autograd keeps for backward in one grad forward, weights excluded (a checkpointed block keeps
    only its input)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}  # a tensor saved by several ops (or as views) is kept once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        model(image=microbatch["image"], text=microbatch["text"])
    return sum(storages.values())


# ------------------------------------------------------------------------------------------------ ratios (CPU)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ratios_setup(config: dict) -> tuple[NaFlexClip, list[dict], Callable]:
    torch.manual_seed(0)
    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    model = build_model(config["model"], device).train()
    batch = make_batch(model, config["num_examples"], config["seq_lens"])
    autocast = create_precision(config["precision"], device).autocast
    return model, split_evenly(batch, config["splits"], device), autocast


def _peak_memory(config: dict, checkpointing: bool, queue: mp.Queue) -> None:
    model, microbatches, autocast = _ratios_setup(config)
    model.set_grad_checkpointing(checkpointing)
    allocate_grads(model)
    before = _rss_bytes()
    window_step(model, create_loss(model.config.loss), microbatches, autocast)
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)  # Linux reports KiB


def _timed_ratios(config: dict) -> list[str]:
    """Checkpointed vs plain and compiled vs eager, alternating round by round; compile recompile counts."""
    model, microbatches, autocast = _ratios_setup(config)
    loss_fn = create_loss(model.config.loss)
    saved = {}
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        saved[checkpointing] = saved_activation_bytes(model, max(microbatches, key=lambda mb: mb["text"].shape[0]),
                                                      autocast)
    model.set_grad_checkpointing(False)
    variants: dict[str, Callable[[], None]] = {}
    compiled = None
    compile_rows = []
    if config["compile"]:
        compiled = build_model(config["model"], torch.device(config["device"])).train()
        compiled.load_state_dict(model.state_dict())
        compiled.compile_towers()
        start = time.perf_counter()
        window_step(compiled, loss_fn, microbatches, autocast)
        compile_rows.append(f"compile + first window: {time.perf_counter() - start:.1f} s, {num_graphs()} graphs")
        # windows of other sizes and padded lengths, as the token-budget schedule makes them
        for index, (num, lens) in enumerate(((config["num_examples"] + 3, [16, 100]), (config["num_examples"] - 2,
                                                                                        [36, 196]))):
            other = split_evenly(make_batch(compiled, num, lens, seed=index + 1), config["splits"], model_device(model))
            window_step(compiled, loss_fn, other, autocast)
            compile_rows.append(f"after a window of N={num}, seq lens {lens}: {num_graphs()} graphs")

    def with_checkpointing(target: NaFlexClip, enable: bool) -> Callable[[], None]:
        def step() -> None:
            target.set_grad_checkpointing(enable)
            window_step(target, loss_fn, microbatches, autocast)
        return step

    variants["eager"] = with_checkpointing(model, False)
    variants["eager + checkpointing"] = with_checkpointing(model, True)
    if compiled is not None:
        variants["compiled"] = with_checkpointing(compiled, False)
        variants["compiled + checkpointing"] = with_checkpointing(compiled, True)
    for step in variants.values():
        step()  # warm-up (and the checkpointed compiled graphs)
    graphs_after_warmup = num_graphs()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(config["repeats"]):
        for name, step in variants.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = [f"saved activations per microbatch (largest of n={config['splits']}): "
            f"{saved[False] / 2**20:.1f} MiB plain, {saved[True] / 2**20:.1f} MiB checkpointed "
            f"({saved[True] / saved[False]:.2f}×)",
            "| variant | s / window | × eager |", "| --- | --- | --- |"]
    rows += [f"| {name} | {t:.3f} | {t / medians['eager']:.2f} |" for name, t in medians.items()]
    if compiled is not None:
        rows += compile_rows + [f"after the timing rounds: {num_graphs()} graphs "
                                f"({num_graphs() - graphs_after_warmup} new after warm-up)"]
    return rows


def run_ratios(args: argparse.Namespace) -> None:
    config = dict(model=args.model[0], num_examples=args.num_examples, seq_lens=args.seq_lens, splits=args.splits,
                  threads=args.threads, device=args.device, precision=args.precision, repeats=args.repeats,
                  compile=not args.no_compile)
    emit(args.out, f"\n### {config['model']}, cache window N = {args.num_examples} in n = {args.splits}, "
                   f"seq lens {args.seq_lens}, {args.device}, {args.threads} thread(s), {args.precision}, "
                   f"median of {args.repeats}")
    memory = {ckpt: in_subprocess(_peak_memory, config, ckpt) for ckpt in (False, True)}
    emit(args.out, f"peak memory of the window over model + grads + batch (fresh processes): "
                   f"{memory[False] / 2**20:.0f} MiB plain, {memory[True] / 2**20:.0f} MiB checkpointed "
                   f"({memory[True] / max(memory[False], 1):.2f}×)")
    for row in in_subprocess(_timed_ratios_to_queue, config):
        emit(args.out, row)


def _timed_ratios_to_queue(config: dict, queue: mp.Queue) -> None:
    queue.put(_timed_ratios(config))


# ------------------------------------------------------------------------------------------------- sweep (GPU)


def device_peak(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def emit(out: str | Results | None, line: str) -> None:
    """Print `line` and append it to `out` (a markdown file, or a Results folder)."""
    if isinstance(out, Results):
        out.line(line)
        return
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


SWEEP_VARIANTS = {"eager": (False, False), "checkpointing": (False, True), "compiled": (True, False),
                  "compiled + checkpointing": (True, True)}  # name -> (compiled, checkpointing)


def _sweep_model(args: argparse.Namespace, results: Results, model_name: str, device: torch.device,
                 autocast: Callable, peak_flops: float | None) -> None:
    """One tower size: every variant at every sequence length, variant by variant (the compiled ones last, so a
    time limit cuts those first); each row written as it is measured."""
    try:
        eager = build_model(model_name, device).train()
    except Exception as error:  # e.g. an OpenCLIP name before create_model knows it: one line, the next model
        results.skip(f"towers of {model_name}", f"create_model({model_name!r}) failed: {error}")
        return
    variants = [v for v in args.variants if not (SWEEP_VARIANTS[v][0] and args.no_compile)]
    compiled = None
    if any(SWEEP_VARIANTS[v][0] for v in variants):
        compiled = build_model(model_name, device).train()
        compiled.load_state_dict(eager.state_dict())
        compiled.compile_towers()
    for model in (eager, compiled):
        if model is not None:
            allocate_grads(model)
    loss_fn = create_loss(eager.config.loss)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cases = {}  # seq len -> (batch on the host, full batch on the device, image tokens, FLOPs of the full step)
    for seq_len in args.seq_lens:
        num_examples = max(8, args.tokens_per_batch // seq_len)
        batch = make_batch(eager, num_examples, [seq_len])
        full = to_device(batch, device)
        with FlopCounterMode(display=False) as flops:
            full_step(eager, loss_fn, full, autocast)
        cases[seq_len] = (batch, full, int(batch["image"]["patch_valid"].sum()), flops.get_total_flops())
        emit(results, f"{model_name}, seq len {seq_len}: N = {num_examples} ({cases[seq_len][2]} image tokens), "
                      f"full-batch step {cases[seq_len][3] / 1e12:.2f} TFLOP (fwd+bwd, counted)")
    emit(results, f"\n### towers: {model_name}, {name}, {args.precision}, {args.tokens_per_batch} image tokens per "
                  f"full batch, median of {args.repeats}")
    baseline_name = f"× {variants[0]} full batch"  # every row against the first variant's full batch
    emit(results, f"| seq len | variant | step | s | {baseline_name} | peak MiB | {baseline_name} | image tokens/s | "
                  "MFU | graphs |")
    emit(results, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    baseline: dict[int, tuple[float, int | None]] = {}  # seq len -> the first variant's full batch (seconds, peak)
    for variant in variants:
        is_compiled, checkpointing = SWEEP_VARIANTS[variant]
        model = compiled if is_compiled else eager
        model.set_grad_checkpointing(checkpointing)
        for seq_len, (batch, full, image_tokens, total_flops) in cases.items():
            for n in (0, *args.splits):  # 0: the full batch without the window
                if n == 0:
                    def step(model=model, full=full) -> None:
                        full_step(model, loss_fn, full, autocast)
                else:
                    microbatches = split_evenly(batch, n, device)

                    def step(model=model, microbatches=microbatches) -> None:
                        window_step(model, loss_fn, microbatches, autocast)
                seconds, peak = time_and_peak(step, device, args.repeats)
                full_seconds, full_peak = baseline.setdefault(seq_len, (seconds, peak))
                mfu = total_flops / seconds / peak_flops if peak_flops else None
                memory_ratio = peak / full_peak if peak is not None and full_peak else None
                label = "full batch" if n == 0 else f"cache n={n}"
                results.record(
                    f"| {seq_len} | {variant} | {label} | {seconds:.4f} | {seconds / full_seconds:.2f} | "
                    f"{'n/a' if peak is None else f'{peak / 2**20:.0f}'} | "
                    f"{'n/a' if memory_ratio is None else f'{memory_ratio:.2f}'} | {image_tokens / seconds:,.0f} | "
                    f"{'n/a' if mfu is None else f'{mfu:.1%}'} | {num_graphs()} |",
                    kind="towers", model=model_name, device=name, precision=args.precision, seq_len=seq_len,
                    num_examples=batch["text"].shape[0], image_tokens=image_tokens, variant=variant,
                    microbatches=n, seconds=seconds, time_ratio=seconds / full_seconds, ratios_to=variants[0],
                    peak_bytes=peak,
                    memory_ratio=memory_ratio, image_tokens_per_s=image_tokens / seconds, flops=total_flops,
                    mfu=mfu, graphs=num_graphs())
        model.set_grad_checkpointing(False)


def run_sweep(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    autocast = create_precision(args.precision, device).autocast
    results = Results(args.results, "towers", markdown=args.out)
    for model_name in args.model:
        torch.manual_seed(0)
        _sweep_model(args, results, model_name, device, autocast, device_peak(device, args.peak_tflops))
        if device.type == "cuda":
            torch.cuda.empty_cache()


# host-side costs per window: device-to-host reads (.item(), .tolist()), syncs, copies, kernel launches
HOST_COST_EVENTS = ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                    "cudaMemcpyAsync", "cudaLaunchKernel", "aten::copy_", "aten::get_rng_state",
                    "aten::set_rng_state")


def run_profile(args: argparse.Namespace) -> None:
    """Where a window's host time goes: one eager `cache` window at the largest n, torch.profiler table."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    autocast = create_precision(args.precision, device).autocast
    model = build_model(args.model[0], device).train()
    allocate_grads(model)
    seq_len = args.seq_lens[0]
    batch = make_batch(model, max(8, args.tokens_per_batch // seq_len), [seq_len])
    loss_fn = create_loss(model.config.loss)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for n in (1, max(args.splits)):
        microbatches = split_evenly(batch, n, device)
        window_step(model, loss_fn, microbatches, autocast)
        synchronize(device)
        with profile(activities=activities) as prof:
            window_step(model, loss_fn, microbatches, autocast)
            synchronize(device)
        events = prof.key_averages()
        counts = {key: sum(e.count for e in events if e.key == key) for key in HOST_COST_EVENTS}
        table = events.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
        emit(args.out, f"\n### profile: {args.model[0]}, seq len {seq_len}, cache n={n}\n"
                       + ", ".join(f"{key}: {count}" for key, count in counts.items()) + f"\n{table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("ratios", "sweep", "profile"))
    parser.add_argument("--model", nargs="+", default=None, help="ratios: base; sweep: base siglip2-base")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, choices=("fp32", "amp_bf16"),
                        help="default: amp_bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--out", default=None, help="also append every row to this file as it is measured")
    parser.add_argument("--results", default=None,
                        help="sweep: also append every row to DIR/results.md and a JSON record to DIR/results.jsonl")
    r = parser.add_argument_group("ratios")
    r.add_argument("--num-examples", type=int, default=8)
    r.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help="ratios: the batch's sequence lengths (default 64 144); sweep: one table each "
                        "(default 576 1024 256)")
    r.add_argument("--splits", type=int, nargs="+", default=None, help="ratios: n (default 2); sweep: 1 2 4 8")
    s = parser.add_argument_group("sweep")
    s.add_argument("--tokens-per-batch", type=int, default=65536, help="image tokens of the full batch")
    s.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak (default: known GPUs)")
    s.add_argument("--variants", nargs="+", default=list(SWEEP_VARIANTS), choices=list(SWEEP_VARIANTS),
                   help="sweep: which of eager / checkpointing / compiled / compiled + checkpointing, in this order")
    s.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args()
    args.precision = args.precision or ("amp_bf16" if args.device.startswith("cuda") else "fp32")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.mode == "ratios":
        args.model = args.model or ["base"]
        args.seq_lens = args.seq_lens or [64, 144]
        args.splits = (args.splits or [2])[0]
        run_ratios(args)
        return
    args.model = args.model or ["base", "siglip2-base"]
    args.seq_lens = args.seq_lens or [576, 1024, 256]
    args.splits = args.splits or [1, 2, 4, 8]
    run_sweep(args) if args.mode == "sweep" else run_profile(args)


if __name__ == "__main__":
    main()

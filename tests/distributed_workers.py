"""Worker processes for the multi-process tests: launched once per rank with torchrun's environment.

`python tests/distributed_workers.py SCENARIO OUT_DIR` runs one rank of a scenario (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment, as torchrun sets them) and writes its results
to `OUT_DIR/rank{RANK}.json`. One launch loops over many configurations, because process start-up
(torch + timm + open_clip imports) costs seconds. `launch` is the parent side, used by the tests.

Scenarios:
  exact     — DDP (and FSDP2 where it runs) gradients of whole windows against the single-process
              full-batch reference, over methods × losses × scale modes × splits; teeth variants;
              gradient syncs per window; consistency checks; full state dict round trip.
  kill      — rank 1 dies (os._exit) mid-window; rank 0 must fail with a message naming rank 1.
  raise     — rank 1 raises mid-window; rank 0 must fail with a message naming rank 1 and its error.
  agree     — ranks meet a window's size exchange at different steps/epochs, or one with no data left:
              every rank raises the same RanksDisagree at once; a Trainer draws per-rank random streams.
  shard     — the loss split over ranks with small tiles (4 ranks): cache and replay windows, CLIP and SigLIP,
              every scale mode, uneven sizes and counts, against the single-process full batch with the dense
              loss; teeth (no reduce-scatter, unsummed logit_scale/bias); an FSDP2 window.
  locked    — LiT windows (2 ranks): a locked image tower, a locked text tower, a partly locked image tower, under
              DDP and FSDP2, cache and replay, the sharded loss; against the single-process full batch for the
              trainable parameters; image-tower forwards per rank.
  distill   — distillation windows (3 ranks, uneven sizes; DDP with equal and unequal microbatch counts, FSDP2):
              a clip student with a clip teacher (8-px patches and 24 tokens: its own inputs of the same rows) and a
              siglip student with a siglip teacher, cache and replay, the sharded DistillLoss in 2-row tiles; against
              the single-process full batch; teacher forwards per rank.
  multi_positive — grouped windows (3 ranks; images with 1-3 captions, texts cut over ranks otherwise than images):
              the multi-positive losses (clip; siglip symmetric and soft) under DDP (equal and unequal microbatch
              counts) and FSDP2, cache and replay, in 2-row tiles; against the single-process full batch.
  trainer_faults — a Trainer whose loader raises on rank 1 between windows, and whose rank-0 evaluation
              outlasts the collective timeout or raises: every rank stops at once naming the rank, or waits.
  self_distill_train — a Trainer with SigLIP 2's self-distillation under DDP and FSDP2 (2 ranks): the EMA teacher's
              forwards per step, its placement (sharded like the student under FSDP2), centres and state round trip.
  fsdp_uneven — the README's library recipe with an FSDP2 model, ranks holding 2, 1 and 4 microbatches.
  loop      — a Trainer's epoch under DDP and FSDP2 with torch.distributed's collectives counted (Python level):
              the collectives between one step's start and the next's, and every step's loss and grad norm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

# the ordered global window, and how it is cut into ranks × microbatches (rank-major); every split of
# one world size has the same number of microbatches, so `linear`/`sqrt` give the same s(W)
NUM_EXAMPLES = 10
REFERENCE_BATCH_SIZE = 2
SPLITS: dict[int, list[list[list[int]]]] = {
    2: [[[1, 2, 3], [2, 1, 1]], [[3, 1, 1], [1, 2, 2]]],
    3: [[[1, 2], [3, 1], [2, 1]], [[2, 2], [1, 1], [1, 3]]],
}
# ranks holding different numbers of microbatches (an epoch's end): allowed by the window
UNEVEN_COUNT_SPLIT: dict[int, list[list[int]]] = {2: [[2, 3], [1, 1, 3]], 3: [[2, 3], [1], [1, 1, 2]]}
TIMEOUT_S = 20.0  # short collective timeout for the fault scenarios
# the `shard` scenario: a 4-rank window cut with equal and with unequal microbatch counts, in 2-row loss tiles
SHARD_SPLITS: dict[int, list[list[list[int]]]] = {
    4: [[[1, 2], [2, 1], [1, 1], [1, 1]], [[3], [1, 2], [1], [1, 1, 1]]],
}
SHARD_TILE_SIZE = 2
EVAL_TIMEOUT_S = 5.0  # trainer_faults: a collective timeout that rank 0's slow evaluation outlasts


# ----------------------------------------------------------------------------------------- parent side


def ema_schedule(trainer):
    """The run's SigLIP 2 self-distillation schedule (its EMA teacher), or None."""
    return next(iter(trainer.window_step.term_schedules), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(scenario: str, world_size: int, out_dir: Path, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run `scenario` on `world_size` local processes; return per rank {returncode, stderr, result}."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # a few cores for several ranks: threads per rank would only fight each other
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, scenario, str(out_dir)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    reports = []
    for rank, proc in enumerate(procs):
        try:
            _, stderr = proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            stderr += f"\n[launch] rank {rank} killed after {timeout_s}s"
        result_file = out_dir / f"rank{rank}.json"
        reports.append(
            {
                "returncode": proc.returncode,
                "stderr": stderr,
                "result": json.loads(result_file.read_text()) if result_file.exists() else None,
            }
        )
    return reports


def launch_results(scenario: str, world_size: int, out_dir: Path, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every rank's result of `scenario` (`launch`), each rank having exited 0; else an AssertionError with the
    first failed rank's stderr."""
    reports = launch(scenario, world_size, out_dir, timeout_s)
    for rank, report in enumerate(reports):
        assert report["returncode"] == 0, f"rank {rank} exited {report['returncode']}:\n{report['stderr'][-4000:]}"
    return [report["result"] for report in reports]


# ----------------------------------------------------------------------------------------- worker side


def _local_microbatches(batch: dict[str, Any], split: Sequence[Sequence[int]], rank: int) -> list[dict[str, Any]]:
    from naflexclip.batch import split_batch

    pieces = split_batch(batch, [size for rank_sizes in split for size in rank_sizes])
    first = sum(len(rank_sizes) for rank_sizes in split[:rank])
    return pieces[first : first + len(split[rank])]


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) gradients by the user's parameter names; a collective under FSDP2."""
    from torch.distributed.tensor import DTensor

    from naflexclip.parallel.wrapping import unwrap_model

    grads = {}
    for name, param in unwrap_model(model).named_parameters():
        grad = param.grad
        if grad is None:
            continue
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return grads


def _errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Worst relative error of pos_embed and of every other parameter (docs/accumulation.md, Tolerances)."""
    from naflexclip.audit.gradient_audit import relative_error

    worst = {"params": 0.0, "pos_embed": 0.0, "missing": 0.0}
    for name in reference.keys() | grads.keys():
        if name not in grads or name not in reference:
            worst["missing"] += 1
            continue
        key = "pos_embed" if "pos_embed" in name else "params"
        worst[key] = max(worst[key], relative_error(grads[name], reference[name]))
    return worst


class _WorldSizeOne:
    """Teeth: an exchange that gathers like the real one but reports world size 1, so the window does not
    multiply this rank's row gradients by R and DDP's average divides the gradient by R."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = 1

    def gather_sizes(self, local_sizes: Sequence[int]) -> list[list[int]]:
        return self.inner.gather_sizes(local_sizes)

    def gather_rows(self, local_rows: torch.Tensor, rows_per_rank: Sequence[int]) -> torch.Tensor:
        return self.inner.gather_rows(local_rows, rows_per_rank)


def _scaled_loss(loss_fn: Callable[..., torch.Tensor], factor: Callable[[], float]) -> Callable[..., torch.Tensor]:
    def loss(*args: Any) -> torch.Tensor:
        return factor() * loss_fn(*args)

    return loss


class _Counter:
    def __init__(self) -> None:
        self.count = 0


def _counting(factory: Callable[[], Any], counter: _Counter) -> Callable[[], Any]:
    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        counter.count += 1
        with factory():
            yield

    return entered


def _register_counting_hook(model: Any, calls: _Counter) -> None:
    """Count DDP's gradient all-reduces (one per bucket) through a comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations it finds
        calls.count += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)


def _count_reduce_scatters(calls: _Counter) -> None:
    """Count FSDP2's gradient reduce-scatters (one per sharded unit) by wrapping the collective it calls."""
    import torch.distributed as dist

    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)
    if getattr(original, "_counting", False):
        original = original._original

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.count += 1
        return original(*args, **kwargs)

    counting._counting, counting._original = True, original  # type: ignore[attr-defined]
    setattr(dist, name, counting)


def _fsdp_available(env: Any) -> tuple[bool, str]:
    """FSDP2 on this backend/device? Try one sharded forward/backward on a toy model."""
    from torch.distributed.fsdp import fully_shard

    try:
        toy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
        fully_shard(toy[0])
        fully_shard(toy)
        toy(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        return True, ""
    except Exception as error:  # noqa: BLE001 - report why, the test decides
        return False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


_PROCESS_START = time.monotonic()


def _log(env: Any, message: str) -> None:
    print(f"[rank {env.rank} +{time.monotonic() - _PROCESS_START:.1f}s] {message}", file=sys.stderr, flush=True)


def _configs(world: int, fsdp: bool) -> list[tuple[int, str, str]]:
    """(split index, method, scale mode) to run: every method × mode on the first split, and both methods
    on the other splits (invariance). Split `len(SPLITS)` has ranks with different microbatch counts,
    which changes s(W) for `linear`/`sqrt`, so it runs with `none`. FSDP2 runs a smaller set (time)."""
    methods = ("cache", "replay")
    uneven = len(SPLITS[world])
    if fsdp:
        # every mode on the first split, and the other splits of the same window (uneven microbatch sizes
        # in other places); not the uneven-count split: FSDP needs the same number of forwards on every rank
        configs = [(0, method, mode) for method in methods for mode in ("none", "linear", "sqrt")]
        return configs + [(index, "cache", "sqrt") for index in range(1, uneven)]
    configs = [(0, method, mode) for method in methods for mode in ("none", "linear", "sqrt")]
    configs += [(index, method, "linear") for index in range(1, uneven) for method in methods]
    return configs + [(uneven, method, "none") for method in methods]


def scenario_exact(env: Any) -> dict[str, Any]:
    from naflexclip.audit.gradient_audit import full_batch_gradients
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import concat_microbatches, split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import create_loss
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.process_group import check_consistency
    from naflexclip.parallel.wrapping import (
        full_state_dict,
        load_full_state_dict,
        no_sync_context,
        unwrap_model,
        wrap_model,
    )
    from naflexclip.window import accumulate_gradients, window_loss_scale

    world = env.world_size
    batch = random_naflex_batch(
        NUM_EXAMPLES, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(123)
    )
    results: dict[str, Any] = {"exact": {}, "teeth": {}, "syncs": {}}
    fsdp_ok, fsdp_why = _fsdp_available(env)
    results["fsdp_available"], results["fsdp_why"] = fsdp_ok, fsdp_why

    def build(siglip: bool) -> torch.nn.Module:
        # identical initialisation on every rank (DDP would broadcast rank 0's anyway; FSDP2 would not)
        torch.manual_seed(0)
        return create_model("tiny", loss="siglip" if siglip else "clip").double()

    references: dict[tuple[bool, str], dict[str, torch.Tensor]] = {}

    def reference(siglip: bool, mode: str, split: list[list[int]]) -> dict[str, torch.Tensor]:
        # s(W)·∇L(W) of the same ordered window as one batch in one process (s depends on R·n only)
        sizes = [size for rank_sizes in split for size in rank_sizes]
        key = (siglip, mode, len(sizes))
        if key not in references:
            scale = window_loss_scale(sizes, REFERENCE_BATCH_SIZE, mode)
            full = concat_microbatches(split_batch(batch, sizes))
            references[key] = full_batch_gradients(build(siglip), create_loss("siglip" if siglip else "clip"), full,
                                                   scale)
        return references[key]

    for fsdp in (False, True) if fsdp_ok else (False,):
        wrapper = "fsdp" if fsdp else "ddp"
        for siglip in (False, True):
            _log(env, f"{wrapper} siglip={siglip}")
            model = wrap_model(build(siglip), env, fsdp=fsdp)
            exchange = window_exchange(env, model)
            loss_fn = create_loss("siglip" if siglip else "clip")
            hook_calls = _Counter()
            if fsdp:
                _count_reduce_scatters(hook_calls)
            else:
                _register_counting_hook(model, hook_calls)
            # the collectives of one plain synchronised backward make one gradient sync; the second
            # backward counts, after DDP has rebuilt its buckets in gradient-ready order
            for _ in range(2):
                hook_calls.count = 0
                out = model(**concat_microbatches(_local_microbatches(batch, SPLITS[world][0], env.rank)))
                (out["image_features"].sum() + out["text_features"].sum() + out["logit_scale"]
                 + (out["logit_bias"] if siglip else 0)).backward()
            results["syncs"][f"{wrapper}/siglip={siglip}/collectives_per_sync"] = hook_calls.count
            for split_index, method, mode in _configs(world, fsdp):
                split = [*SPLITS[world], UNEVEN_COUNT_SPLIT[world]][split_index]
                microbatches = _local_microbatches(batch, split, env.rank)
                model.zero_grad(set_to_none=True)
                no_sync_calls = _Counter()
                hook_calls.count = 0
                accumulate_gradients(
                    model, loss_fn, microbatches, loss_scale=mode, reference_batch_size=REFERENCE_BATCH_SIZE,
                    method=method, exchange=exchange, no_sync=_counting(no_sync_context(model), no_sync_calls),
                )
                name = f"{wrapper}/siglip={siglip}/split={split_index}/{method}/{mode}"
                results["exact"][name] = _errors(_gradients(model), reference(siglip, mode, split))
                results["syncs"][name] = {
                    "no_sync_entered": no_sync_calls.count,
                    "num_local_microbatches": len(microbatches),
                    "gradient_collectives": hook_calls.count,
                }
            if not fsdp:
                _teeth(env, model, loss_fn, batch, siglip, reference, exchange, results["teeth"])
            results.setdefault("state_dict", {})[f"{wrapper}/siglip={siglip}"] = _state_dict_round_trip(
                env, model, build(siglip), full_state_dict, load_full_state_dict, unwrap_model
            )

    _log(env, "consistency")
    results["consistency"] = _consistency(env, check_consistency)
    return results


def _teeth(env: Any, model: Any, loss_fn: Any, batch: Any, siglip: bool, reference: Any, exchange: Any,
           out: dict[str, Any]) -> None:
    """Wrong rules that must fail the comparison the exact window passes."""
    from naflexclip.batch import batch_size
    from naflexclip.parallel.wrapping import no_sync_context
    from naflexclip.window import accumulate_gradients, window_loss_scale

    split = SPLITS[env.world_size][0]
    microbatches = _local_microbatches(batch, split, env.rank)
    all_sizes = [size for rank_sizes in split for size in rank_sizes]
    local_sizes = split[env.rank]

    def run(name: str, method: str, mode: str, loss: Any, exch: Any, ref_mode: str) -> None:
        model.zero_grad(set_to_none=True)
        accumulate_gradients(
            model, loss, microbatches, loss_scale=mode, reference_batch_size=REFERENCE_BATCH_SIZE,
            method=method, exchange=exch, no_sync=no_sync_context(model),
        )
        out[f"siglip={siglip}/{name}"] = _errors(_gradients(model), reference(siglip, ref_mode, split))

    # per rank: s from this rank's sizes only (the window's one coefficient, swapped for a local one)
    ratio = window_loss_scale(local_sizes, REFERENCE_BATCH_SIZE, "linear") / window_loss_scale(
        all_sizes, REFERENCE_BATCH_SIZE, "linear"
    )
    run("per_rank_scale", "cache", "linear", _scaled_loss(loss_fn, lambda: ratio), exchange, "linear")
    # no ×R on this rank's rows: DDP's average then divides the tower gradients by R
    run("no_world_size_factor", "cache", "none", loss_fn, _WorldSizeOne(exchange), "none")
    # per microbatch (OpenCLIP's rule): each replay's loss times its own microbatch's b_j / B_ref
    calls = iter(range(len(microbatches)))
    per_mb = [batch_size(mb) / REFERENCE_BATCH_SIZE for mb in microbatches]
    run("per_microbatch_scale", "replay", "none", _scaled_loss(loss_fn, lambda: per_mb[next(calls)]), exchange,
        "linear")


def _state_dict_round_trip(env: Any, model: Any, fresh: Any, full_state_dict: Any, load_full_state_dict: Any,
                           unwrap_model: Any) -> dict[str, Any]:
    """full_state_dict equals the unwrapped weights; loading it back after a perturbation restores them."""
    state = full_state_dict(model, env)
    expected = fresh.state_dict()
    result: dict[str, Any] = {"keys_match": None, "max_diff": None}
    if env.is_main:
        result["keys_match"] = sorted(state) == sorted(expected)
        result["max_diff"] = max(float((state[k].double() - expected[k].double()).abs().max()) for k in expected)
    with torch.no_grad():
        for param in unwrap_model(model).parameters():
            param.add_(1.0)
    load_full_state_dict(model, state if env.is_main else {}, env)
    again = full_state_dict(model, env)
    if env.is_main:
        result["restored_max_diff"] = max(float((again[k].double() - expected[k].double()).abs().max())
                                          for k in expected)
    # every rank holds the restored weights, not only rank 0
    local = {k: v for k, v in unwrap_model(model).state_dict().items()}
    from torch.distributed.tensor import DTensor

    result["local_restored_max_diff"] = max(
        float(((v.full_tensor() if isinstance(v, DTensor) else v).double().cpu() - expected[k].double()).abs().max())
        for k, v in local.items()
    )

    from naflexclip.parallel.wrapping import full_optimizer_state_dict, load_full_optimizer_state_dict

    # optimizer: save after one step, take another, load the saved state back
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()  # the gradients of the last window
    saved = full_optimizer_state_dict(model, optimizer, env)
    optimizer.step()
    if not _is_fsdp_model(model):
        # DDP: every rank loads the state it read from the checkpoint itself (no pickle broadcast)
        import torch.distributed as dist

        holder = [saved if env.is_main else None]
        dist.broadcast_object_list(holder, src=0)  # stands in for every rank reading the same file
        saved_here = holder[0]
    else:
        saved_here = saved if env.is_main else {}
    load_full_optimizer_state_dict(model, optimizer, saved_here, env)
    steps = {float(s["step"]) for s in optimizer.state_dict()["state"].values()}
    optimizer_result: dict[str, Any] = {"local_steps": sorted(steps)}
    again = full_optimizer_state_dict(model, optimizer, env)
    if env.is_main:
        optimizer_result["restored_max_diff"] = max(
            float((again["state"][k][name].double() - saved["state"][k][name].double()).abs().max())
            for k in saved["state"] for name in ("exp_avg", "exp_avg_sq")
        )
    optimizer.zero_grad(set_to_none=True)

    result["optimizer"] = optimizer_result
    return result


def _consistency(env: Any, check_consistency: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    check_consistency(env, step=10, window=3, schedule="abc123", lr=0.001)
    result["agree"] = "ok"
    try:
        check_consistency(env, step=10 + (env.rank == env.world_size - 1), window=3, schedule="abc123")
        result["step_mismatch"] = None
    except RuntimeError as error:
        result["step_mismatch"] = str(error)
    try:
        check_consistency(env, step=10, schedule=f"hash{env.rank}")
        result["schedule_mismatch"] = None
    except RuntimeError as error:
        result["schedule_mismatch"] = str(error)
    return result


def scenario_fault(env: Any, how: str) -> dict[str, Any]:
    """Rank 1 dies or raises inside the second microbatch's replay forward; rank 0 must name it."""
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import create_loss
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.process_group import fault_guard
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import accumulate_gradients

    batch = random_naflex_batch(8, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = wrap_model(create_model("tiny").double(), env)
    microbatches = _local_microbatches(batch, [[2, 2], [2, 2]], env.rank)
    forwards = _Counter()

    def fault(*_: Any) -> None:
        forwards.count += 1
        # forwards 1-2 cache, 3-4 replay: fail in the replay, after the features were exchanged
        if env.rank == 1 and forwards.count == 3:
            if how == "kill":
                os._exit(17)
            raise ValueError("bad microbatch on purpose")

    model.module.register_forward_pre_hook(fault)
    start = time.monotonic()
    try:
        with fault_guard(env, "window 0"):
            accumulate_gradients(model, create_loss("clip"), microbatches, exchange=window_exchange(env, model),
                                 no_sync=no_sync_context(model))
    finally:
        # the parent checks this rank failed promptly; stderr carries the error itself
        print(f"[rank {env.rank}] elapsed {time.monotonic() - start:.2f}s", file=sys.stderr, flush=True)
    return {"completed": True}


def _is_fsdp_model(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def scenario_agree(env: Any, out_dir: Path) -> dict[str, Any]:
    """Every case meets in one size exchange; each rank records what it raised and how long it took."""
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.data import DataConfig
    from naflexclip.families.factory import create_model
    from naflexclip.loss import create_loss
    from naflexclip.parallel.feature_exchange import RanksDisagree, window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, unwrap_model, wrap_model
    from naflexclip.train.config.train_config import TrainConfig
    from naflexclip.train.loop import Trainer
    from naflexclip.window import accumulate_gradients

    batch = random_naflex_batch(8, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = wrap_model(create_model("tiny").double(), env)
    microbatches = _local_microbatches(batch, [[2, 2], [1, 3]], env.rank)
    exchange = window_exchange(env, model)
    results: dict[str, Any] = {}

    def attempt(name: str, step: int, epoch: int, has_data: bool = True, exch: Any = exchange,
                counts: int | None = None) -> None:
        exch.set_position(step, epoch)
        start = time.monotonic()
        try:
            if counts is not None:
                exch.gather_sizes([2] * counts)
            elif has_data:
                model.zero_grad(set_to_none=True)
                accumulate_gradients(model, create_loss("clip"), microbatches, exchange=exch,
                                     no_sync=no_sync_context(model))
            else:
                exch.end_of_data()
            results[name] = {"error": None}
        except RanksDisagree as error:
            results[name] = {"error": str(error)}
        results[name]["seconds"] = time.monotonic() - start

    attempt("agree", 1, 0)
    attempt("step", 2 + env.rank, 0)  # rank 1 is one step ahead
    attempt("epoch", 3, env.rank)  # rank 1 is in the next epoch
    attempt("no_data", 4, 0, has_data=env.rank == 0)  # rank 1's data ended, rank 0 still has a window
    attempt("all_ended", 4, 0, has_data=False)  # the epoch ends on every rank: agreed
    attempt("after", 5, 0)  # the ranks are still in step after the errors
    sharded = window_exchange(env, wrap_model(create_model("tiny").double(), env, fsdp=True))
    attempt("fsdp_counts", 6, 0, exch=sharded, counts=1 + env.rank)
    attempt("fsdp_equal_counts", 7, 0, exch=sharded, counts=2)

    # a Trainer: the initial weights of --seed on every rank, a different random stream for stochastic layers.
    # FSDP2, because it does not broadcast rank 0's weights as DDP does: each rank's shards are its own init
    cfg = TrainConfig(data=DataConfig(synthetic_train_size=16, synthetic_val_size=8, naflex_seq_lens=(16,),
                                      naflex_max_tokens_per_batch=64, workers=0),
                      model="tiny", epochs=1, logs=str(out_dir), name="seeds", device="cpu", zero_shot_samples=8,
                      fsdp=True)
    trainer = Trainer(cfg, env)
    draw = torch.rand(4).tolist()
    weights = [_full_sum(p) for p in unwrap_model(trainer.model).parameters()]
    torch.manual_seed(cfg.seed)
    reference = [float(p.detach().double().sum()) for p in create_model("tiny").parameters()]
    results["seeds"] = {"draw": draw, "weights": weights, "reference": reference}
    return results


def scenario_trainer_faults(env: Any, out_dir: Path) -> dict[str, Any]:
    """Faults outside the step, each recorded per rank as {error, seconds}; the process group survives them."""
    from naflexclip.data import DataConfig
    from naflexclip.parallel.process_group import barrier
    from naflexclip.train import loop
    from naflexclip.train.config.train_config import TrainConfig

    cfg = TrainConfig(data=DataConfig(synthetic_train_size=16, synthetic_val_size=8, naflex_seq_lens=(16,),
                                      naflex_max_tokens_per_batch=32, workers=0),
                      model="tiny", epochs=1, accum_freq=2, logs=str(out_dir), name="faults", device="cpu",
                      zero_shot_samples=8, plot=False, dist_timeout=EVAL_TIMEOUT_S)
    trainer = loop.Trainer(cfg, env)
    results: dict[str, Any] = {}
    real_windows, real_tasks = loop.windows, trainer.evaluator.tasks

    def windows_failing_on_rank_1(loader: Any, accum_freq: int) -> Iterator[list[dict[str, Any]]]:
        for index, window in enumerate(real_windows(loader, accum_freq)):
            if index == 1 and env.rank == 1:  # e.g. an unreadable shard, at the start of the second window
                raise OSError("unreadable shard on purpose")
            yield window

    def evaluate_on_rank_0(how: str) -> list[Any]:
        def run(task: Any, model: Any, skips: list[dict[str, Any]]) -> dict[str, float]:
            assert env.rank == 0, "only rank 0 evaluates"
            if how == "raise":
                raise ValueError("evaluation failed on purpose")
            time.sleep(EVAL_TIMEOUT_S + 3)  # longer than any collective may wait
            return task.run(model, skips)
        first, *others = real_tasks  # the first task waits or fails, on rank 0
        return [dataclasses.replace(first, run=functools.partial(run, first)), *others]

    def evaluation() -> dict[str, float]:
        return trainer.evaluator(trainer.model, step=0, epoch=0.0, epochs_done=0)

    def attempt(name: str, run: Callable[[], Any]) -> None:
        start = time.monotonic()
        try:
            run()
            results[name] = {"error": None}
        except Exception as error:  # noqa: BLE001 - recorded for the parent to check
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["seconds"] = time.monotonic() - start
        barrier(env)  # the process group still works: no rank was left inside a collective

    loop.windows = windows_failing_on_rank_1
    attempt("loader", trainer.train_epoch)
    loop.windows = real_windows
    trainer.evaluator.tasks = evaluate_on_rank_0("sleep")
    attempt("eval_slow", evaluation)
    results["eval_slow"]["evals"] = len(trainer.evaluator.history)
    trainer.evaluator.tasks = evaluate_on_rank_0("raise")
    attempt("eval_raise", evaluation)
    return results


def _full_sum(param: torch.Tensor) -> float:
    """The sum of a parameter's whole (unsharded) value; a collective for an FSDP2 DTensor."""
    from torch.distributed.tensor import DTensor

    value = param.full_tensor() if isinstance(param, DTensor) else param
    return float(value.detach().double().sum())


class _ExchangeVariant:
    """Teeth: the real exchange with one of its collectives replaced by a wrong one."""

    def __init__(self, inner: Any, **replaced: Callable[..., Any]) -> None:
        self.inner, self.replaced = inner, replaced

    def __getattr__(self, name: str) -> Any:
        return self.replaced[name] if name in self.replaced else getattr(self.inner, name)


def scenario_shard(env: Any) -> dict[str, Any]:
    from naflexclip.audit.gradient_audit import full_batch_gradients
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import concat_microbatches, split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import clip_loss_dense, create_loss, siglip_loss_dense
    from naflexclip.parallel.feature_exchange import ProcessGroupExchange, window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import accumulate_gradients, window_loss_scale

    world = env.world_size
    batch = random_naflex_batch(
        NUM_EXAMPLES, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(321)
    )
    results: dict[str, Any] = {"exact": {}, "loss": {}, "teeth": {}}

    def build(siglip: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        return create_model("tiny", loss="siglip" if siglip else "clip").double()

    def reference(siglip: bool, mode: str, split: list[list[int]]) -> tuple[dict[str, torch.Tensor], float]:
        """s(W)·∇L(W) and L(W) of the whole window in one process, with the dense (N×N) loss."""
        sizes = [size for rank_sizes in split for size in rank_sizes]
        full = concat_microbatches(split_batch(batch, sizes))
        dense = siglip_loss_dense if siglip else clip_loss_dense
        model = build(siglip)
        grads = full_batch_gradients(model, dense, full, window_loss_scale(sizes, REFERENCE_BATCH_SIZE, mode))
        with torch.no_grad():
            out = model(**full)
            loss = dense(out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"))
        return grads, float(loss)

    # (split, method, mode): every mode, both methods, and ranks holding different numbers of microbatches
    configs = [(0, "cache", "none"), (0, "cache", "linear"), (0, "cache", "sqrt"), (0, "replay", "sqrt"),
               (1, "cache", "linear"), (1, "replay", "none")]
    def window(model: Any, loss_fn: Any, split_index: int, method: str, mode: str, exch: Any) -> Any:
        model.zero_grad(set_to_none=True)
        return accumulate_gradients(
            model, loss_fn, _local_microbatches(batch, SHARD_SPLITS[world][split_index], env.rank), loss_scale=mode,
            reference_batch_size=REFERENCE_BATCH_SIZE, method=method, exchange=exch, no_sync=no_sync_context(model),
        )

    exchange = ProcessGroupExchange(env)  # the exchange of every DDP model
    offset = sum(sum(rank_sizes) for rank_sizes in SHARD_SPLITS[world][0][: env.rank])
    rows = sum(SHARD_SPLITS[world][0][env.rank])
    wrong = {
        # each rank keeps its own block's gradient for its text rows: the other ranks' terms are lost
        "no_reduce_scatter": _ExchangeVariant(
            exchange, reduce_scatter_rows=lambda grad, _: grad[offset : offset + rows]
        ),
        # each rank keeps its own block's logit_scale/logit_bias gradient (and loss): not summed over ranks
        "unsummed_scalars": _ExchangeVariant(exchange, sum_over_ranks=lambda values: values),
    }
    for siglip in (False, True):
        _log(env, f"shard siglip={siglip}")
        model = wrap_model(build(siglip), env)
        loss_fn = create_loss("siglip" if siglip else "clip", tile_size=SHARD_TILE_SIZE)
        for split_index, method, mode in configs:
            stats = window(model, loss_fn, split_index, method, mode, exchange)
            grads, loss = reference(siglip, mode, SHARD_SPLITS[world][split_index])
            name = f"siglip={siglip}/split={split_index}/{method}/{mode}"
            results["exact"][name] = _errors(_gradients(model), grads)
            results["loss"][name] = abs(stats.loss - loss) / abs(loss)
        grads, _ = reference(siglip, "none", SHARD_SPLITS[world][0])
        scalar_grads = {key: value for key, value in grads.items() if key.startswith("logit_")}
        for teeth_name, variant in wrong.items():
            window(model, loss_fn, 0, "cache", "none", variant)
            ours = _gradients(model)
            results["teeth"][f"siglip={siglip}/{teeth_name}"] = {
                "all": _errors(ours, grads),
                "scalars": _errors({key: ours[key] for key in scalar_grads}, scalar_grads),
            }

    _log(env, "fsdp")
    # FSDP2 (equal microbatch counts, which its exchange requires): the sharded loss with small tiles is exact
    model = wrap_model(build(False), env, fsdp=True)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, create_loss("clip", tile_size=SHARD_TILE_SIZE),
                         _local_microbatches(batch, SHARD_SPLITS[world][0], env.rank),
                         exchange=window_exchange(env, model), no_sync=no_sync_context(model))
    results["fsdp"] = _errors(_gradients(model), reference(False, "none", SHARD_SPLITS[world][0])[0])
    return results


# the Python-level collectives of torch.distributed that the `loop` scenario counts
COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "all_gather", "all_gather_object", "all_reduce",
               "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "broadcast", "broadcast_object_list",
               "barrier", "gather_object", "gather", "scatter", "all_to_all", "all_to_all_single", "reduce")


def count_collectives() -> dict[str, int]:
    """Wrap torch.distributed's collectives (before naflexclip binds any) with a counter by name; a collective
    that calls another through torch's own aliases counts once."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    depth = [0]

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[name] = counts.get(name, 0) + 1
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counting(name, getattr(dist, name)))
    return counts


def scenario_loop(env: Any, out_dir: Path, counts: dict[str, int]) -> dict[str, Any]:
    from naflexclip.data import DataConfig
    from naflexclip.parallel.process_group import barrier
    from naflexclip.train import loop
    from naflexclip.train.config.train_config import TrainConfig
    from naflexclip.train.stop import TrainingInterrupted

    results: dict[str, Any] = {}
    for fsdp in (False, True):
        wrapper = "fsdp" if fsdp else "ddp"
        _log(env, f"loop {wrapper}")
        # 16 pairs per rank, 2 per microbatch, --accum-freq 2: 4 steps of 2 microbatches per rank
        cfg = TrainConfig(data=DataConfig(synthetic_train_size=32, synthetic_val_size=8, naflex_seq_lens=(16,),
                                          naflex_max_tokens_per_batch=32, workers=0),
                          model="tiny", epochs=1, accum_freq=2, logs=str(out_dir), name=f"loop_{wrapper}",
                          device="cpu", zero_shot_samples=8, plot=False, fsdp=fsdp)
        trainer = loop.Trainer(cfg, env)
        marks: list[dict[str, int]] = []
        steps: list[dict[str, Any]] = []
        real_step = trainer.train_step

        def train_step(microbatches: list[dict[str, Any]], real_step: Any = real_step, marks: Any = marks,
                       steps: Any = steps) -> Any:
            marks.append(dict(counts))
            result = real_step(microbatches)
            steps.append({"loss": result.stats.loss, "grad_norm": result.grad_norm, "skipped": result.skipped})
            return result

        trainer.train_step = train_step  # type: ignore[method-assign]
        trainer.train_epoch()
        per_step = [{name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
                    for before, after in zip(marks, marks[1:], strict=False)]
        results[wrapper] = {"per_step": per_step, "steps": steps}

    # a stop signal on rank 1 only, before or after step 2's size exchange: every rank stops after the same step
    for when in ("before", "after"):
        _log(env, f"loop stop {when}")
        trainer = loop.Trainer(dataclasses.replace(cfg, fsdp=False, name=f"stop_{when}"), env)
        real_step = trainer.train_step

        def signalled_step(microbatches: list[dict[str, Any]], real_step: Any = real_step, trainer: Any = trainer,
                           when: str = when) -> Any:
            signalled = env.rank == 1 and trainer.progress.step == 1
            if signalled and when == "before":
                trainer.stop.number = signal.SIGTERM
            result = real_step(microbatches)
            if signalled and when == "after":
                trainer.stop.number = signal.SIGTERM
            return result

        trainer.train_step = signalled_step  # type: ignore[method-assign]
        try:
            trainer.train_epoch()
            error = None
        except TrainingInterrupted as raised:
            error = str(raised)
        results[f"stop_{when}"] = {"error": error, "step": trainer.progress.step,
                                   "saved": trainer.checkpointer.last_step_saved}
        barrier(env)  # rank 1 may still be waiting, on the store rank 0 hosts here, for the checkpoint write to end
    return results


def scenario_fsdp_uneven(env: Any) -> dict[str, Any]:
    """Every rank records what the window raised (or None) and how long it took."""
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import create_loss
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import accumulate_gradients

    count = (2, 1, 4)[env.rank]
    batch = random_naflex_batch(4, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(env.rank))
    torch.manual_seed(0)
    model = wrap_model(create_model("tiny").double(), env, fsdp=True)
    start = time.monotonic()
    try:
        accumulate_gradients(model, create_loss("clip"), split_batch(batch, [1] * 4)[:count],
                             exchange=window_exchange(env, model), no_sync=no_sync_context(model))
        error = None
    except Exception as raised:  # noqa: BLE001 - recorded for the parent to check
        error = f"{type(raised).__name__}: {raised}"
    return {"error": error, "seconds": time.monotonic() - start}



# the `locked` scenario: (lock flags, loss)
LOCKS = {"image": ({"lock_image": True}, "clip"),
         "text": ({"lock_text": True, "lock_text_freeze_layer_norm": True}, "siglip"),
         "image+2": ({"lock_image": True, "lock_image_unlocked_groups": 2}, "siglip")}


def scenario_locked(env: Any) -> dict[str, Any]:
    from naflexclip.audit.gradient_audit import full_batch_gradients
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import concat_microbatches, split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import create_loss
    from naflexclip.models.lock import Locks
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, unwrap_model, wrap_model
    from naflexclip.window import accumulate_gradients, window_loss_scale

    split = SPLITS[env.world_size][0]
    sizes = [size for rank_sizes in split for size in rank_sizes]
    batch = random_naflex_batch(NUM_EXAMPLES, patch_size=4, context_length=16,
                                generator=torch.Generator().manual_seed(7))
    scale = window_loss_scale(sizes, REFERENCE_BATCH_SIZE, "linear")
    microbatches = _local_microbatches(batch, split, env.rank)
    results: dict[str, Any] = {"exact": {}, "forwards": {}}
    calls: list[int] = []  # image-tower forwards of the current window

    def build(lock: str) -> torch.nn.Module:
        flags, loss = LOCKS[lock]
        torch.manual_seed(0)
        model = create_model("tiny", loss=loss).double()
        Locks(**flags).apply(model)
        return model

    for fsdp in (False, True):
        for lock, (_, loss) in LOCKS.items():
            _log(env, f"locked {lock} fsdp={fsdp}")
            reference = full_batch_gradients(build(lock), create_loss(loss),
                                             concat_microbatches(split_batch(batch, sizes)), scale)
            model = wrap_model(build(lock), env, fsdp=fsdp)
            unwrap_model(model).visual.register_forward_hook(lambda *_: calls.append(1))
            for method in ("cache", "replay"):
                model.zero_grad(set_to_none=True)
                calls.clear()
                accumulate_gradients(model, create_loss(loss, tile_size=SHARD_TILE_SIZE), microbatches,
                                     loss_scale="linear", reference_batch_size=REFERENCE_BATCH_SIZE, method=method,
                                     exchange=window_exchange(env, model), no_sync=no_sync_context(model))
                name = f"{'fsdp' if fsdp else 'ddp'}/{lock}/{method}"
                results["exact"][name] = _errors(_gradients(model), reference)
                results["forwards"][name] = [len(calls), len(microbatches)]
    return results


def scenario_distill(env: Any) -> dict[str, Any]:
    from naflexclip.audit.gradient_audit import full_batch_gradients
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import TEACHER_INPUTS, concat_microbatches, split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import DistillLoss, create_loss
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import TeacherFeatures, accumulate_gradients, window_loss_scale

    world = env.world_size
    batch = random_naflex_batch(NUM_EXAMPLES, patch_size=4, context_length=16,
                                generator=torch.Generator().manual_seed(11))
    results: dict[str, Any] = {"exact": {}, "forwards": {}, "plain": {}}
    calls: list[int] = []  # teacher forwards of the current window

    def build(loss: str, seed: int, **overrides: Any) -> torch.nn.Module:
        torch.manual_seed(seed)  # the same initialisation on every rank
        return create_model("tiny", loss=loss, **overrides).double()

    # (wrapper, split, method, scale mode): FSDP2 needs equal microbatch counts; the unequal split runs with `none`
    configs = [(False, SPLITS[world][0], "cache", "linear"), (False, SPLITS[world][0], "replay", "linear"),
               (False, UNEVEN_COUNT_SPLIT[world], "cache", "none"), (True, SPLITS[world][1], "cache", "sqrt"),
               (True, SPLITS[world][0], "replay", "linear")]
    own_inputs = {**batch, TEACHER_INPUTS: random_naflex_batch(NUM_EXAMPLES, patch_size=8, context_length=24,
                                                               generator=torch.Generator().manual_seed(12))}
    for loss in ("clip", "siglip"):
        # the clip student's teacher reads its own inputs (another patch size and context length)
        teacher = build(loss, seed=1, **({"patch_size": 8, "context_length": 24} if loss == "clip" else {})).eval()
        teacher.register_forward_hook(lambda *_: calls.append(1))
        window = own_inputs if loss == "clip" else batch
        references: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        for fsdp, split, method, mode in configs:
            sizes = [size for rank_sizes in split for size in rank_sizes]
            scale = window_loss_scale(sizes, REFERENCE_BATCH_SIZE, mode)
            full = concat_microbatches(split_batch(window, sizes))
            key = (mode, len(sizes))
            if key not in references:
                references[key] = full_batch_gradients(build(loss, 0), DistillLoss(loss, weight=0.6), full, scale,
                                                       [TeacherFeatures(teacher)])
                if not results["plain"].get(loss):  # teeth: without the teacher the gradient is another one
                    plain = full_batch_gradients(build(loss, 0), create_loss(loss), full, scale)
                    results["plain"][loss] = _errors(plain, references[key])
            _log(env, f"distill {loss} fsdp={fsdp} {method} {mode} {split}")
            model = wrap_model(build(loss, 0), env, fsdp=fsdp)
            microbatches = _local_microbatches(window, split, env.rank)
            calls.clear()
            accumulate_gradients(model, DistillLoss(loss, weight=0.6, tile_size=SHARD_TILE_SIZE), microbatches,
                                 loss_scale=mode, reference_batch_size=REFERENCE_BATCH_SIZE, method=method,
                                 exchange=window_exchange(env, model), no_sync=no_sync_context(model),
                                 terms=[TeacherFeatures(teacher)])
            name = f"{'fsdp' if fsdp else 'ddp'}/{loss}/{method}/{mode}/{sizes}"
            results["exact"][name] = _errors(_gradients(model), references[key])
            results["forwards"][name] = [len(calls), len(microbatches)]
    return results


def scenario_self_distill(env: Any) -> dict[str, Any]:
    """SigLIP 2's self-distillation and masked prediction under DDP: the EMA teacher runs once per local microbatch,
    the terms are normalised by the window's examples on every rank (Z counted over ranks)."""
    from naflexclip.audit.gradient_audit import full_batch_gradients
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import EXAMPLE_INPUTS, concat_microbatches, split_batch
    from naflexclip.loss import create_loss
    from naflexclip.models.naflex_clip import NaFlexClip, model_config
    from naflexclip.objectives.self_distillation import (
        MASKED_PREDICTION,
        SELF_DISTILL,
        EmaTeacher,
        SelfDistillTerm,
        attach_heads,
        head_config,
    )
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import accumulate_gradients, window_loss_scale

    world = env.world_size
    batch = random_naflex_batch(NUM_EXAMPLES, patch_size=4, context_length=16,
                                generator=torch.Generator().manual_seed(13))
    batch[EXAMPLE_INPUTS] = {"view_seed": torch.arange(NUM_EXAMPLES) * 7919 + 1}
    weights = {SELF_DISTILL: 0.7, MASKED_PREDICTION: 0.3}
    results: dict[str, Any] = {"exact": {}, "forwards": {}}
    calls: list[int] = []

    def build() -> torch.nn.Module:
        torch.manual_seed(0)  # the same initialisation on every rank
        model = NaFlexClip(model_config("tiny", loss="siglip"))
        attach_heads(model, head_config(32, 2, 0.5))
        return model.double().eval()

    teacher = EmaTeacher(build(), momentum=0.9)
    with torch.no_grad():  # a teacher that differs from the student
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.05)
    teacher.register_forward_hook(lambda *_: calls.append(1))
    for split, method, mode in ((SPLITS[world][0], "cache", "linear"), (UNEVEN_COUNT_SPLIT[world], "replay", "none")):
        sizes = [size for rank_sizes in split for size in rank_sizes]
        scale = window_loss_scale(sizes, REFERENCE_BATCH_SIZE, mode)
        reference = full_batch_gradients(build(), create_loss("siglip"), concat_microbatches(split_batch(batch, sizes)),
                                         scale, [SelfDistillTerm(teacher, weights)])
        _log(env, f"self_distill {method} {mode} {split}")
        model = wrap_model(build(), env, fsdp=False)
        microbatches = _local_microbatches(batch, split, env.rank)
        calls.clear()
        accumulate_gradients(model, create_loss("siglip"), microbatches, loss_scale=mode,
                             reference_batch_size=REFERENCE_BATCH_SIZE, method=method,
                             exchange=window_exchange(env, model), no_sync=no_sync_context(model),
                             terms=[SelfDistillTerm(teacher, weights)])
        name = f"ddp/{method}/{mode}/{sizes}"
        results["exact"][name] = _errors(_gradients(model), reference)
        results["forwards"][name] = [len(calls), len(microbatches)]
    return results


def scenario_self_distill_train(env: Any, out_dir: Path) -> dict[str, Any]:
    """A Trainer with self-distillation and masked prediction from step 1 under DDP and FSDP2 (2 ranks, 2 steps of 2
    microbatches per rank): per step the EMA teacher's forwards and the terms; where the teacher's parameters live;
    its centres on every rank; its full state (rank 0, `teacher_{wrapper}.pt`) and a load of it into a fresh one."""
    from torch.distributed.tensor import DTensor

    from naflexclip.data import DataConfig
    from naflexclip.objectives.self_distill_schedule import SelfDistillation
    from naflexclip.objectives.self_distillation import EmaTeacher
    from naflexclip.train import loop
    from naflexclip.train.config.train_config import TrainConfig

    results: dict[str, Any] = {}
    forwards: list[int] = []
    real_forward = EmaTeacher.forward

    def counted(self: Any, **kw: Any) -> Any:
        forwards.append(1)
        return real_forward(self, **kw)

    EmaTeacher.forward = counted  # type: ignore[method-assign]
    for fsdp in (False, True):
        wrapper = "fsdp" if fsdp else "ddp"
        _log(env, f"self_distill_train {wrapper}")
        # 32 pairs of 16 patches, 4 per microbatch: 4 microbatches per rank, --accum-freq 2: 2 steps
        cfg = TrainConfig(data=DataConfig(synthetic_train_size=32, synthetic_val_size=8, naflex_seq_lens=(16,),
                                          naflex_max_tokens_per_batch=64, workers=0),
                          model="tiny", epochs=1, accum_freq=2, logs=str(out_dir), name=f"sd_{wrapper}",
                          device="cpu", zero_shot_samples=8, plot=False, fsdp=fsdp, self_distill_loss_weight=1.0,
                          masked_prediction_loss_weight=0.25, local_crops=2, self_distill_start=0.0)
        trainer = loop.Trainer(cfg, env)
        steps: list[dict[str, Any]] = []
        real_step = trainer.train_step

        def train_step(microbatches: list[dict[str, Any]], real_step: Any = real_step, steps: Any = steps) -> Any:
            forwards.clear()
            result = real_step(microbatches)
            steps.append({"microbatches": len(microbatches), "forwards": len(forwards),
                          "terms": result.stats.example_terms, "loss": result.stats.loss})
            return result

        trainer.train_step = train_step  # type: ignore[method-assign]
        trainer.train_epoch()
        component = ema_schedule(trainer)
        teacher = component.teacher
        placements = [[repr(p.placements) if isinstance(p, DTensor) else "whole" for p in pair]
                      for pair in teacher.student_parameters(trainer.model)]
        state = component.state_dict()
        if env.rank == 0:
            torch.save(state["teacher"], out_dir / f"teacher_{wrapper}.pt")
        fresh = SelfDistillation(component.recipe, trainer.model, env, trainer.exchange.sum_over_ranks)
        fresh.load_state_dict(state if env.rank == 0 else {"built": True, "teacher": {}})
        local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731
        reloaded = all(torch.equal(local(a), local(b)) for a, b in zip(teacher.state_dict().values(),
                                                                        fresh.teacher.state_dict().values(),
                                                                        strict=True))
        results[wrapper] = {"steps": steps, "placements": placements, "reloaded": reloaded,
                            "center": teacher.global_center.tolist()[:8]}
    return results


def scenario_multi_positive(env: Any) -> dict[str, Any]:
    from naflexclip.audit.gradient_audit import full_batch_gradients
    from naflexclip.audit.random_windows import random_grouped_batch
    from naflexclip.batch import concat_microbatches, split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import MultiPositiveDistillLoss, MultiPositiveLoss
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import TeacherFeatures, accumulate_gradients, window_loss_scale

    world = env.world_size
    batch = random_grouped_batch(NUM_EXAMPLES, generator=torch.Generator().manual_seed(5), patch_size=4,
                                 context_length=16, dtype=torch.float64)
    results: dict[str, Any] = {"exact": {}, "texts": {}}

    def build(loss: str, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)  # the same initialisation on every rank
        return create_model("tiny", loss=loss).double()

    configs = [(False, SPLITS[world][0], "cache", "linear"), (False, SPLITS[world][0], "replay", "linear"),
               (False, UNEVEN_COUNT_SPLIT[world], "cache", "none"), (True, SPLITS[world][1], "cache", "sqrt")]
    # the last: distillation too (a teacher of another initialisation), the sharded DDP window and FSDP2
    for loss, weighting, distilled in (("clip", "symmetric", False), ("siglip", "symmetric", False),
                                       ("siglip", "soft", False), ("clip", "symmetric", True)):
        references: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        teacher = build(loss, seed=1).eval() if distilled else None
        terms = [TeacherFeatures(teacher)] if teacher is not None else []

        def loss_fn(tile: int = 1024, loss: str = loss, weighting: str = weighting, distilled: bool = distilled
                    ) -> torch.nn.Module:
            return (MultiPositiveDistillLoss(loss, weighting, weight=0.7, tile_size=tile) if distilled
                    else MultiPositiveLoss(loss, weighting, tile_size=tile))

        for fsdp, split, method, mode in (configs[::3] if distilled else configs):
            sizes = [size for rank_sizes in split for size in rank_sizes]
            scale = window_loss_scale(sizes, REFERENCE_BATCH_SIZE, mode)
            key = (mode, len(sizes))
            if key not in references:
                full = concat_microbatches(split_batch(batch, sizes))
                references[key] = full_batch_gradients(build(loss), loss_fn(), full, scale, terms)
            _log(env, f"multi_positive {loss} {weighting} distilled={distilled} fsdp={fsdp} {method} {mode} {split}")
            model = wrap_model(build(loss), env, fsdp=fsdp)
            microbatches = _local_microbatches(batch, split, env.rank)
            accumulate_gradients(model, loss_fn(SHARD_TILE_SIZE), microbatches, loss_scale=mode,
                                 reference_batch_size=REFERENCE_BATCH_SIZE, method=method,
                                 exchange=window_exchange(env, model), no_sync=no_sync_context(model),
                                 terms=terms)
            objective = f"{loss}/{weighting}{'/distilled' if distilled else ''}"
            name = f"{'fsdp' if fsdp else 'ddp'}/{objective}/{method}/{mode}/{sizes}"
            results["exact"][name] = _errors(_gradients(model), references[key])
            results["texts"][name] = [int(mb["text"].shape[0]) for mb in microbatches]
    return results


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    counts = count_collectives() if scenario == "loop" else {}
    from naflexclip.parallel.process_group import cleanup, init_distributed

    fault = scenario in ("kill", "raise")
    short = fault or scenario in ("agree", "fsdp_uneven")
    timeout_s = EVAL_TIMEOUT_S if scenario == "trainer_faults" else TIMEOUT_S if short else 120.0
    env = init_distributed(device="cpu", timeout_s=timeout_s)
    if scenario == "agree":
        result = scenario_agree(env, out_dir)
    elif scenario == "shard":
        result = scenario_shard(env)
    elif scenario == "locked":
        result = scenario_locked(env)
    elif scenario == "distill":
        result = scenario_distill(env)
    elif scenario == "self_distill":
        result = scenario_self_distill(env)
    elif scenario == "multi_positive":
        result = scenario_multi_positive(env)
    elif scenario == "self_distill_train":
        result = scenario_self_distill_train(env, out_dir)
    elif scenario == "trainer_faults":
        result = scenario_trainer_faults(env, out_dir)
    elif scenario == "fsdp_uneven":
        result = scenario_fsdp_uneven(env)
    elif scenario == "loop":
        result = scenario_loop(env, out_dir, counts)
    else:
        result = scenario_fault(env, scenario) if fault else scenario_exact(env)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1, default=repr))
    cleanup(env)
    _log(env, "done")
    # skip the interpreter's slow teardown of torch/gloo threads: the results are on disk
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # the tests/ directory is not a package: make `python tests/distributed_workers.py` importable alike
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

__all__ = ["EVAL_TIMEOUT_S", "NUM_EXAMPLES", "SHARD_SPLITS", "SPLITS", "TIMEOUT_S", "launch"]

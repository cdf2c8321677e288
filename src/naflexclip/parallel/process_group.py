"""Multi-process plumbing on torch.distributed: the process group, the device, rank 0's work, agreement, faults.

What the window's exchange (`feature_exchange`) and the model wrapping (`wrapping`) stand on. `init_distributed`
starts one process group, its collectives under a timeout, where the launcher's variables say (`launchers`); a
single process has none, and everything here is a no-op. `run_on_main` runs rank 0's work (evaluation, checkpoint
writing) while the others wait on the rendezvous store without a timeout; `check_consistency`,
`gather_if_different` and `gather_to_main` compare and collect small per-rank values; `fault_guard` /
`translate_faults` record a rank's error in the store and name the rank that raised, died or stopped answering, in
one line. docs/training.md#several-processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from naflexclip.parallel.launchers import (
    ENV_INIT,
    LOCAL_RANK_VARIABLES,
    Launch,
    check_backend,
    check_dist_url,
    read_launch,
)
from naflexclip.settings import APPLY, DEVICES_SECTION, IGNORE, setting

# rendezvous-store keys used to say which rank failed and which are still alive
_STORE_PREFIX = "naflexclip/fault"


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job. `backend` is None when there is no process group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    timeout_s: float = 600.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class DistributedFault(RuntimeError):
    """Another rank raised, died or stopped answering; the message names it."""


class RankFailed(DistributedFault):
    """Another rank raised outside a collective (e.g. its loader, said so at the window's size exchange; or rank
    0's work in `run_on_main`); the message names the rank and its error. That rank re-raises its own error."""


DEVICE_CHOICES = ("cpu", "cuda", "cuda:N")


@dataclass(frozen=True)
class DeviceSettings:
    """Where and how a command runs its model (`--device`, `--grad-checkpointing`), as `naflexclip train` and
    `naflexclip verify` take them; each field a setting (`naflexclip.settings`)."""

    device: str | None = setting(None, rule=IGNORE, section=DEVICES_SECTION,
                                 per_rank="each process its own GPU (cuda:<local rank>)",
                                 help=", ".join(DEVICE_CHOICES),
                                 default_help="cuda if available; cuda:<local rank> in a job")
    # recompute block activations in backward (both towers)
    grad_checkpointing: bool = setting(False, rule=APPLY, section=DEVICES_SECTION, openclip=False, runtime=True, help=(
        "recompute each tower block's activations in backward: less memory, ~1.3x time; stays exact"))


def check_device(device: str | None) -> None:
    """A `--device` value: None (automatic), `cpu`, `cuda` or `cuda:N` (CUDA available); else ValueError naming it."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda") or (parsed.type == "cpu" and parsed.index):
        raise ValueError(f"--device: {device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} requested but CUDA is not available")


def _resolve_device(device: str | None, launch: Launch, no_set_device_rank: bool) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)  # `cpu`, or `cuda:N` as given
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if no_set_device_rank:
        # OpenCLIP's --no-set-device-rank: each process sees its own GPU(s) (CUDA_VISIBLE_DEVICES), use the first
        return torch.device("cuda", torch.cuda.current_device())
    # one process per GPU: the local rank picks this process's GPU
    if launch.world_size > 1 and not launch.local_rank_known:
        raise ValueError(f"{launch.named} but no local rank ({', '.join(LOCAL_RANK_VARIABLES)}) to pick this "
                         "process's GPU: set one, or pass --no-set-device-rank when each process sees only its GPU")
    if launch.local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {launch.local_rank} ({launch.named}) but only {torch.cuda.device_count()} "
                         "CUDA devices are visible (one GPU per process via CUDA_VISIBLE_DEVICES? pass "
                         "--no-set-device-rank)")
    return torch.device("cuda", launch.local_rank)


def init_distributed(device: str | None = None, timeout_s: float = 600.0, dist_url: str | None = None,
                     dist_backend: str | None = None, no_set_device_rank: bool = False) -> DistributedEnv:
    """Join the launcher's job (torchrun, srun, mpirun; `read_launch`) or run as one process; return where this
    process sits.

    device: None → `cuda:{local rank}` when CUDA is available else `cpu`; `"cuda"` → `cuda:{local rank}`
        (`no_set_device_rank`: the first visible GPU); anything else (`"cpu"`, `"cuda:1"`) is used as given.
    timeout_s: every collective of the process group fails after this many seconds instead of hanging; so does
        forming the job when a process never arrives.
    dist_url, dist_backend: OpenCLIP's `--dist-url` (torch's init method, default `env://`) and `--dist-backend`.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    check_dist_url(dist_url)
    launch = read_launch(dist_url=dist_url)
    resolved = _resolve_device(device, launch, no_set_device_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    if launch.world_size == 1:
        return DistributedEnv(0, 1, launch.local_rank, resolved, None, timeout_s)
    backend = check_backend(dist_backend, resolved) or ""
    rank, world_size = launch.rank, launch.world_size
    if not dist.is_initialized():
        # torchrun's names for what srun or mpirun said (OpenCLIP does the same), for torch's env:// and for code
        # that reads them later; torchrun's own MASTER_ADDR/MASTER_PORT are kept
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(launch.local_rank))
        if launch.master is not None:
            os.environ.setdefault("MASTER_ADDR", launch.master[0])
            os.environ.setdefault("MASTER_PORT", str(launch.master[1]))
        try:
            dist.init_process_group(
                backend=backend, init_method=dist_url or ENV_INIT, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
                # binds the NCCL communicator to this GPU eagerly (and lets barrier() know the device)
                device_id=resolved if resolved.type == "cuda" else None,
            )
        except (RuntimeError, dist.DistError) as error:
            where = dist_url or f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            # e.g. `python -m naflexclip train` in an sbatch script: one process of SLURM_NTASKS, the rest never start
            hint = "; srun starts every task (the batch script alone is one)" if "SLURM_" in launch.named else ""
            raise DistributedFault(f"rank {rank} of {world_size} ({launch.named}) could not form the job at {where} "
                                   f"within {timeout_s:g} s (--dist-timeout): {one_line(error)}{hint}") from error
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"a process group is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
            f"but the environment says {launch.named}"
        )
    return DistributedEnv(rank, world_size, launch.local_rank, resolved, dist.get_backend(), timeout_s)


def share_from_main(env: DistributedEnv, text: str) -> str:
    """Rank 0's `text` on every rank (every rank must call it): e.g. the run name, decided once. No pickling: the
    UTF-8 bytes go as a tensor."""
    if not env.distributed:
        return text
    with translate_faults(env, "sharing rank 0's run name"):
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=env.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=env.device)
        dist.broadcast(size, src=0)
        if not env.is_main:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=env.device)
        dist.broadcast(data, src=0)
    return bytes(data.tolist()).decode()


def barrier(env: DistributedEnv) -> None:
    """Wait for every rank (no-op in one process)."""
    if env.distributed:
        with translate_faults(env, "barrier"):
            if env.backend == "nccl":
                dist.barrier(device_ids=[env.device.index])
            else:
                dist.barrier()


def cleanup(env: DistributedEnv) -> None:
    """Tear down the process group, if this job has one.

    Without torchrun's agent (srun, mpirun) the rendezvous store lives in rank 0's process: rank 0 then keeps it
    a few seconds more, until every other rank has said it is leaving, so that a rank still reading rank 0's last
    word (`run_on_main`'s outcome at a stop, the cause of a failure) finds it. The process group goes first: a
    rank waiting for rank 0 in a collective fails at once and can still ask the store why. (A run that ends well
    meets in a barrier before this; a rank that died never says it is leaving, hence the bound.)
    """
    if not (env.distributed and dist.is_initialized()):
        return
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"{_STORE_PREFIX}/left/{env.rank}", "1")
    dist.destroy_process_group()
    if store is not None and env.is_main and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        keys = [f"{_STORE_PREFIX}/left/{rank}" for rank in range(1, env.world_size)]
        deadline = time.monotonic() + _LEAVE_GRACE_S
        pause = _POLL_FIRST_S
        with contextlib.suppress(Exception):
            while not store.check(keys) and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(_POLL_MAX_S, pause * 1.5)


# -------------------------------------------------------------------------------------- agreement


def _digest(values: dict[str, Any]) -> int:
    """A signed 63-bit digest of the names, types and exact values (repr of floats is exact)."""
    text = repr(sorted((key, type(value).__name__, repr(value)) for key, value in values.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def gather_if_different(env: DistributedEnv, values: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's `values` (by rank) when some rank's differ, None when all agree (every rank must call it).

    Cheap: one all-gather of an int64 digest; the values themselves are exchanged only on a mismatch, so that every
    rank can say which rank differs and how, and raise the same error (no rank is left in a collective)."""
    if not env.distributed:
        return None
    with translate_faults(env, "checking cross-rank consistency"):
        digest = torch.tensor([_digest(values)], dtype=torch.int64, device=env.device)
        digests = all_gather_tensor(env, digest).tolist()
        if len(set(digests)) == 1:
            return None
        every: list[dict[str, Any] | None] = [None] * env.world_size
        dist.all_gather_object(every, dict(values))
    return [rank_values or {} for rank_values in every]


def check_consistency(env: DistributedEnv, **values: int | float | str) -> None:
    """All ranks must agree on `values` (step, epoch, window, schedule hash, ...), else RuntimeError naming every
    difference; every rank raises the same error (`gather_if_different`)."""
    every = gather_if_different(env, values)
    if every is None:
        return
    reference = every[0] or {}
    problems = []
    for rank, rank_values in enumerate(every[1:], start=1):
        rank_values = rank_values or {}
        for key in sorted(set(reference) | set(rank_values)):
            if key not in rank_values:
                problems.append(f"rank {rank} has no {key!r} (rank 0 has {reference[key]!r})")
            elif key not in reference:
                problems.append(f"rank {rank} has {key}={rank_values[key]!r} which rank 0 lacks")
            elif repr(rank_values[key]) != repr(reference[key]) or type(rank_values[key]) is not type(reference[key]):
                problems.append(f"rank {rank} has {key}={rank_values[key]!r} but rank 0 has {reference[key]!r}")
    raise RuntimeError("ranks disagree: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------- faults


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store (e.g. a custom init): fall back to an anonymous message
        return None


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 500 characters: how another rank names this error."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]


def _record_failure(env: DistributedEnv, error: BaseException) -> None:
    """Leave this rank's error in the rendezvous store so the other ranks can name it."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"{_STORE_PREFIX}/failed/{env.rank}", one_line(error))


T = TypeVar("T")
_MAIN_WORK_CALLS = itertools.count()  # every rank calls run_on_main in the same order: the same key
# the waiting ranks poll the store ever less often (many ranks polling one store), at most once a second
_POLL_FIRST_S, _POLL_MAX_S = 0.05, 1.0
_LEAVE_GRACE_S = 15.0  # rank 0 hosting the store waits at most this long for the others to leave (`cleanup`)


def run_on_main(env: DistributedEnv, what: str, work: Callable[[], T]) -> T | None:
    """`work()` on rank 0 while the other ranks wait for it (every rank must call this); its result on rank 0,
    None on the others.

    The others poll a key rank 0 sets in the rendezvous store when it is done, instead of waiting in a
    barrier: no collective timeout applies, so an evaluation or a checkpoint write may take longer than
    `--dist-timeout`; an error in `work` reaches them at once as `RankFailed` naming it (`what`, e.g.
    "evaluating"), while rank 0 re-raises its own. Without a store it falls back to a barrier.
    """
    if not env.distributed:
        return work()
    store = _store()
    if store is None:
        result = work() if env.is_main else None
        barrier(env)
        return result
    key = f"{_STORE_PREFIX}/main_work/{next(_MAIN_WORK_CALLS)}"
    if env.is_main:
        try:
            result = work()
        except BaseException as error:
            with contextlib.suppress(Exception):
                store.set(key, "error " + one_line(error))
            raise
        store.set(key, "ok")
        return result
    try:
        pause = _POLL_FIRST_S
        while not store.check([key]):
            time.sleep(pause)
            pause = min(_POLL_MAX_S, pause * 1.5)
        outcome = store.get(key).decode(errors="replace")
    except Exception as error:  # the store lives on rank 0 unless torchrun's agent hosts it
        raise DistributedFault(f"rank {env.rank} stopped while rank 0 was {what}: the rendezvous store is "
                               f"unreachable (rank 0 may have died): {one_line(error)}") from error
    if outcome != "ok":
        raise RankFailed(f"rank 0 raised {outcome.removeprefix('error ')} (while {what})")
    return None


def _diagnose(env: DistributedEnv, what: str, error: BaseException) -> str:
    """One line: which ranks raised (with their error) or did not answer a roll call in the store."""
    cause = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    store = _store()
    if store is None:
        return f"rank {env.rank}: a collective failed while {what}: {cause}"
    others = [r for r in range(env.world_size) if r != env.rank]
    try:
        # roll call: the live ranks answer within a grace period; the rest died or hang
        store.set(f"{_STORE_PREFIX}/alive/{env.rank}", "1")
        failed: dict[int, str] = {}
        deadline = time.monotonic() + min(10.0, max(2.0, env.timeout_s / 4))
        while True:
            for r in others:
                if r not in failed and store.check([f"{_STORE_PREFIX}/failed/{r}"]):
                    failed[r] = store.get(f"{_STORE_PREFIX}/failed/{r}").decode(errors="replace")
            silent = [
                r for r in others if r not in failed and not store.check([f"{_STORE_PREFIX}/alive/{r}"])
            ]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:
        return (
            f"rank {env.rank}: a collective failed while {what} and the rendezvous store is unreachable "
            f"(it lives on rank 0 unless torchrun's agent hosts it; rank 0 may have died): {cause}"
        )
    parts = [f"rank {r} raised {message}" for r, message in sorted(failed.items())]
    parts += [f"rank {r} died or stopped responding" for r in silent]
    culprit = "; ".join(parts) if parts else "no rank reported a failure"
    return f"rank {env.rank} stopped while {what}: {culprit} (collective error: {cause})"


def _is_collective_error(error: BaseException) -> bool:
    # NCCL raises DistError; gloo a plain RuntimeError naming itself for closed connections and timeouts.
    # Any other error (a shape mismatch, CUDA out of memory) is this rank's own and says what it is.
    if isinstance(error, DistributedFault):
        return False
    return isinstance(error, dist.DistError) or _looks_like_collective_failure(error)


@contextlib.contextmanager
def translate_faults(env: DistributedEnv, what: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        if not env.distributed or not _is_collective_error(error):
            raise
        raise DistributedFault(_diagnose(env, what, error)) from error


@contextlib.contextmanager
def fault_guard(env: DistributedEnv, what: str = "a training step") -> Iterator[None]:
    """Around a step: a collective failure (also inside DDP/FSDP backward) becomes a one-line
    `DistributedFault` naming the rank that raised, died or hung; any other error this rank raises is
    recorded for the other ranks to name, then re-raised. In one process it does nothing.

    Collectives give up after `timeout_s` of `init_distributed`, so a hung or dead peer surfaces within it.
    """
    if not env.distributed:
        yield
        return
    try:
        yield
    except DistributedFault:
        raise
    except Exception as error:
        if _is_collective_error(error):
            raise DistributedFault(_diagnose(env, what, error)) from error
        _record_failure(env, error)
        raise
    except BaseException as error:  # KeyboardInterrupt, SystemExit: still tell the others why
        _record_failure(env, error)
        raise


def _looks_like_collective_failure(error: BaseException) -> bool:
    """gloo reports a lost peer or a timeout as a plain RuntimeError raised from the reducer/backward."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        marker in text
        for marker in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe", "socket")
    )

def gather_to_main(env: DistributedEnv, value: Any) -> list[Any] | None:
    """Every rank's `value` (small picklable objects, e.g. RNG states), in rank order, on rank 0; None on the
    other ranks. Every rank must call it."""
    if not env.distributed:
        return [value]
    gathered: list[Any] | None = [None] * env.world_size if env.is_main else None
    with translate_faults(env, "gathering per-rank state"):
        dist.gather_object(value, gathered, dst=0)
    return gathered


def all_gather_tensor(env: DistributedEnv, tensor: torch.Tensor) -> torch.Tensor:
    """`[world_size * rows, ...]`: every rank's equal-shaped tensor, in rank order."""
    out = tensor.new_empty((env.world_size * tensor.shape[0], *tensor.shape[1:]))
    # torch ≥ 2.14 renames all_gather_into_tensor (and warns on the old name)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, tensor)
    return out

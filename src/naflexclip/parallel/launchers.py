"""Where this process is in the job, from its launcher's environment: torchrun's, srun's (SLURM), mpirun's
(OpenMPI) or PMI's (MPICH, Intel MPI) variables, in OpenCLIP's order; the rendezvous (MASTER_ADDR and MASTER_PORT,
else the first node of SLURM's host list, else this host for a job on one node); and the checks of OpenCLIP's
`--dist-url` and `--dist-backend`. `read_launch` refuses, in one line, what cannot form one job;
`naflexclip.parallel.process_group.init_distributed` starts the process group on what it says.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _env_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


# Where each number comes from, first present wins (OpenCLIP's order, open_clip_train/distributed.py):
# torchrun, then MPICH / Intel MPI (PMI), then SLURM's srun, then OpenMPI's mpirun.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
RANK_VARIABLES = ("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
# the processes on this node (all of them: the job fits on one node and its master is this host)
LOCAL_WORLD_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
# the first node of the srun step (where its task 0 runs), else of the job
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
DEFAULT_MASTER_PORT = 12802  # OpenCLIP's SLURM example: export MASTER_PORT=12802
ENV_INIT = "env://"


@dataclass(frozen=True)
class Launch:
    """What the launcher's environment says about this process. `named` says which variables set rank, world size
    and local rank (e.g. "SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_LOCALID=0"); `master` is (address, port) of the
    rendezvous for torch's `env://` (None: one process, or `--dist-url` names another init method)."""

    rank: int
    world_size: int
    local_rank: int
    named: str
    local_rank_known: bool = True
    master: tuple[str, int] | None = None


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        if environ.get(name, "") != "":
            return name, _env_int(name, 0, environ)
    return None


_HOST_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """`a[1-2,5],b` → [`a[1-2,5]`, `b`]: commas inside brackets are ranges, not separators."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError("'[' without ']'")
    return [*parts, text[start:]]


def _expand_host(pattern: str) -> list[str]:
    head, bracket, rest = pattern.partition("[")
    if not bracket:
        return [pattern]
    ranges, _, tail = rest.partition("]")
    tails = _expand_host(tail)  # `rack[1-2]-node[01-02]`: every combination, in order
    hosts = []
    for item in ranges.split(","):
        match = _HOST_RANGE.match(item.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"bad range {item!r}")
        width = len(match[1])  # `[08-11]` keeps the zero padding of its lower bound
        for number in range(int(match[1]), int(match[2] or match[1]) + 1):
            hosts += [f"{head}{number:0{width}d}{end}" for end in tails]
    return hosts


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (`node[01-04,07],gpu-a[1-2]-ib`) as host names, in order (what
    `scontrol show hostnames` prints). ValueError naming the list when it is malformed."""
    try:
        hosts = [host for part in _split_top_level(nodelist.strip()) if part for host in _expand_host(part)]
    except ValueError as error:
        raise ValueError(f"cannot read the host list {nodelist!r}: {error}") from None
    if not hosts:
        raise ValueError(f"cannot read the host list {nodelist!r}: no host in it")
    return hosts


def _master(environ: Mapping[str, str], world_size: int, named: str) -> tuple[str, int]:
    """The rendezvous address: MASTER_ADDR, else the first node of SLURM's host list, else this host when every
    process runs here; MASTER_PORT, else OpenCLIP's 12802."""
    port_text = environ.get("MASTER_PORT") or str(DEFAULT_MASTER_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"environment variable MASTER_PORT={port_text!r} is not a port number")
    address = environ.get("MASTER_ADDR")
    if not address:
        nodelist = next(((name, environ[name]) for name in NODELIST_VARIABLES if environ.get(name)), None)
        local = _first_set(environ, LOCAL_WORLD_SIZE_VARIABLES)
        if nodelist is not None:
            try:
                address = expand_hostlist(nodelist[1])[0]
            except ValueError as error:
                raise ValueError(f"{named}: {nodelist[0]}: {error}; set MASTER_ADDR to the host of rank 0") from None
        elif local is not None and local[1] == world_size:
            address = "127.0.0.1"
        else:
            raise ValueError(
                f"{named} is one of {world_size} processes, but where they meet is unknown: set MASTER_ADDR (and "
                f"MASTER_PORT, default {DEFAULT_MASTER_PORT}) to the host of rank 0, or pass --dist-url tcp://HOST:PORT"
            )
    return address, int(port_text)


def read_launch(environ: Mapping[str, str] | None = None, dist_url: str | None = None) -> Launch:
    """This process's place in the job, from torchrun's, srun's, mpirun's or PMI's variables (OpenCLIP's order).

    Anything that cannot form one job is a ValueError in one line, naming the variables: a world size above one
    without a rank, a rank outside the world, a process that is one of several tasks but alone in its world (they
    would train as separate runs into one folder), or no way to find the master (`dist_url`: `env://` or None
    needs MASTER_ADDR, SLURM's host list, or a job on one node).
    """
    environ = os.environ if environ is None else environ
    world = _first_set(environ, WORLD_SIZE_VARIABLES)
    rank = _first_set(environ, RANK_VARIABLES)
    local = _first_set(environ, LOCAL_RANK_VARIABLES)
    world_size = world[1] if world else 1
    named = " ".join(f"{name}={value}" for name, value in filter(None, (rank, world, local)))
    if world_size < 1:
        raise ValueError(f"{named}: the world size must be at least 1")
    if world_size == 1:
        # a task k > 0 of a multi-task launch that sees a world of one would start its own run
        others = [(name, value) for name in RANK_VARIABLES for value in [_env_int(name, 0, environ)] if value > 0]
        if others:
            name, value = others[0]
            raise ValueError(
                f"{name}={value} says this is one of several tasks, but {named or 'no world size variable'} makes "
                f"it a run of its own (tasks would race on one run folder): launch one job (srun's, mpirun's or "
                f"torchrun's variables, not a mix) or run a single process"
            )
        return Launch(0, 1, local[1] if local else 0, named, local is not None)
    if rank is None:
        raise ValueError(f"{named} but no rank ({', '.join(RANK_VARIABLES)}): each process must know which it is")
    if not 0 <= rank[1] < world_size:
        raise ValueError(f"{named}: the rank must be in 0..{world_size - 1}")
    if local is not None and not 0 <= local[1] < world_size:
        raise ValueError(f"{named}: the local rank must be in 0..{world_size - 1}")
    master = _master(environ, world_size, named) if (dist_url or ENV_INIT) == ENV_INIT else None
    return Launch(rank[1], world_size, local[1] if local else 0, named, local is not None, master)


def launched_world_size(dist_url: str | None = None) -> int:
    """The number of processes the launcher (torchrun, srun, mpirun) started for this job (1 without one)."""
    return read_launch(dist_url=dist_url).world_size


def check_backend(backend: str | None, device: torch.device | None = None) -> str | None:
    """`--dist-backend` (OpenCLIP's: None → nccl on CUDA, gloo otherwise), checked against this torch's backends
    (and `device`, when given); `cpu:gloo,cuda:nccl` names one per device type. ValueError naming the flag."""
    if backend is None:
        return None if device is None else "nccl" if device.type == "cuda" else "gloo"
    available = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available,
                 "ucc": dist.is_ucc_available, "xccl": getattr(dist, "is_xccl_available", lambda: False)}
    known = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    for part in backend.split(","):
        name = part.rpartition(":")[2].strip().lower()
        if name not in known:
            raise ValueError(f"--dist-backend: {backend!r}: {name!r} is not one of {', '.join(known)}")
        if name in available and not available[name]():
            raise ValueError(f"--dist-backend {backend}: this PyTorch build has no {name} backend")
    if device is not None and backend.strip().lower() == "nccl" and device.type != "cuda":
        raise ValueError(f"--dist-backend nccl: needs CUDA devices, but this run is on {device}")
    return backend


_DIST_URL = re.compile(r"^(env://$|tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):\d+/?$|file://.)")


def check_dist_url(dist_url: str | None) -> None:
    """`--dist-url`: torch's init methods, `env://` (default), `tcp://HOST:PORT` or `file:///shared/path`."""
    if dist_url is not None and not _DIST_URL.match(dist_url):
        raise ValueError(f"--dist-url: {dist_url!r} is not env://, tcp://HOST:PORT or file:///path")

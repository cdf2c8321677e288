"""Cluster launchers: srun's, mpirun's, PMI's and torchrun's variables each form one job (OpenCLIP's order of
precedence); a launch that cannot form one job stops every task in one line; a run without --name is named by
rank 0 and every rank writes there. The slow tests start real processes on this machine with the launchers'
variables set (two "nodes": 127.0.0.1 and 127.0.0.2, both loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest_data import image_bytes

from naflexclip.cli import build_parser
from naflexclip.parallel.launchers import (
    DEFAULT_MASTER_PORT,
    LOCAL_RANK_VARIABLES,
    LOCAL_WORLD_SIZE_VARIABLES,
    NODELIST_VARIABLES,
    RANK_VARIABLES,
    WORLD_SIZE_VARIABLES,
    check_backend,
    check_dist_url,
    expand_hostlist,
    read_launch,
)
from naflexclip.parallel.process_group import _resolve_device
from naflexclip.train.config.flags import config_from_args

# ---------------------------------------------------------------------------------------- host lists


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("localhost", ["localhost"]),
    ("login1,gpu[8-10]", ["login1", "gpu8", "gpu9", "gpu10"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("rack[1-2]-gpu[01-02]-ib", ["rack1-gpu01-ib", "rack1-gpu02-ib", "rack2-gpu01-ib", "rack2-gpu02-ib"]),
    ("a[3],b[1-2],c", ["a3", "b1", "b2", "c"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_slurm_host_lists_expand_like_scontrol_show_hostnames(nodelist: str, hosts: list[str]) -> None:
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "why"), [
    ("node[1-", "'[' without ']'"), ("node1]", "']' without '['"), ("node[3-1]", "bad range '3-1'"),
    ("node[a-b]", "bad range 'a-b'"), ("", "no host in it"), ("n[[1]]", "nested '['"),
])
def test_a_malformed_host_list_is_named(nodelist: str, why: str) -> None:
    with pytest.raises(ValueError) as error:
        expand_hostlist(nodelist)
    assert str(error.value) == f"cannot read the host list {nodelist!r}: {why}"


# --------------------------------------------------------------------------- reading the environment


def test_no_launcher_is_one_process() -> None:
    launch = read_launch({})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master) == (0, 1, 0, None)
    assert read_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}).world_size == 1


def test_srun_forms_one_job_with_the_first_node_of_the_step_as_master() -> None:
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-06]"}
    launch = read_launch(srun)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert launch.master == ("gpu03", DEFAULT_MASTER_PORT) and DEFAULT_MASTER_PORT == 12802  # OpenCLIP's port
    # the step's nodes (where its task 0 runs) before the job's; MASTER_ADDR / MASTER_PORT before both
    assert read_launch({**srun, "SLURM_STEP_NODELIST": "gpu[05-06]"}).master == ("gpu05", 12802)
    assert read_launch({**srun, "MASTER_ADDR": "head", "MASTER_PORT": "2345"}).master == ("head", 2345)
    # another init method needs no master from the environment
    assert read_launch(srun, dist_url="tcp://head:2345").master is None


def test_torchrun_under_srun_takes_precedence_as_in_openclip() -> None:
    """`srun torchrun ...`: torchrun's RANK / WORLD_SIZE / LOCAL_RANK win over SLURM's (one task per node)."""
    launch = read_launch({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                          "SLURM_JOB_NODELIST": "n[1-2]", "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
                          "MASTER_ADDR": "n1", "MASTER_PORT": "29500"})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master) == (6, 8, 2, ("n1", 29500))
    assert launch.named == "RANK=6 WORLD_SIZE=8 LOCAL_RANK=2"


def test_openmpi_and_pmi_variables_form_one_job() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    launch = read_launch(ompi)
    # all four on this node: the master is this host
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master) == (3, 4, 3, ("127.0.0.1", 12802))
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "a", "MASTER_PORT": "7"}
    assert read_launch(pmi).master == ("a", 7) and read_launch(pmi).rank == 1
    # precedence of each number: torchrun, PMI, SLURM, OpenMPI (open_clip_train.distributed.world_info_from_env)
    assert RANK_VARIABLES == ("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
    assert WORLD_SIZE_VARIABLES == ("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
    assert LOCAL_RANK_VARIABLES == ("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
    both = read_launch({**ompi, "PMI_RANK": "2", "PMI_SIZE": "4"})
    assert (both.rank, both.world_size) == (2, 4)


@pytest.mark.parametrize(("variables", "message"), [
    # srun without a way to find task 0's host
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"},
     "SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_LOCALID=0 is one of 2 processes, but where they meet is unknown: set "
     "MASTER_ADDR"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[1-"},
     r"SLURM_JOB_NODELIST: cannot read the host list 'gpu\[1-'"),
    ({"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}, "SLURM_NTASKS=2 but no rank"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, r"SLURM_PROCID=2 SLURM_NTASKS=2: the rank must be in 0\.\.1"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not an integer"),
    # one of several tasks that sees a world of one: it would start a run of its own
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "0", "WORLD_SIZE": "1"},
     "SLURM_PROCID=1 says this is one of several tasks, but RANK=0 WORLD_SIZE=1 makes it a run of its own"),
    # mpirun over several nodes
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     "where they meet is unknown"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port"),
])
def test_a_launch_that_cannot_form_one_job_is_refused_in_one_line(variables: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        read_launch(variables)
    assert "\n" not in str(error.value)


def test_the_gpu_is_the_local_ranks_unless_no_set_device_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device cuda` (or none, with CUDA) is cuda:<local rank>; with --no-set-device-rank the first visible GPU
    (OpenCLIP's meaning: CUDA_VISIBLE_DEVICES gives each process its own); `cuda:N` is used as given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    srun = read_launch({"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "MASTER_ADDR": "h"})
    assert _resolve_device("cuda", srun, False) == _resolve_device(None, srun, False) == torch.device("cuda", 5)
    assert _resolve_device("cuda", srun, True) == torch.device("cuda", 0)
    assert _resolve_device("cuda:3", srun, False) == torch.device("cuda", 3)
    no_local_rank = read_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(ValueError, match=r"PMI_RANK=1 PMI_SIZE=2 but no local rank \(LOCAL_RANK, MPI_LOCALRANKID"):
        _resolve_device("cuda", no_local_rank, False)
    assert _resolve_device("cuda", no_local_rank, True) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="local rank 5 .* but only 1 CUDA devices are visible .* --no-set-device-rank"):
        _resolve_device("cuda", srun, False)


def test_dist_backend_and_dist_url_are_checked() -> None:
    cpu = torch.device("cpu")
    assert check_backend(None, cpu) == "gloo" and check_backend(None, torch.device("cuda", 0)) == "nccl"
    assert check_backend("cpu:gloo,cuda:nccl", cpu) == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="--dist-backend: 'glo': 'glo' is not one of gloo, nccl"):
        check_backend("glo", cpu)
    with pytest.raises(ValueError, match="--dist-backend nccl: needs CUDA devices, but this run is on cpu"):
        check_backend("nccl", cpu)
    for url in ("env://", "tcp://10.0.0.1:23456", "tcp://[::1]:23456", "file:///shared/rdzv"):
        check_dist_url(url)
    with pytest.raises(ValueError, match="--dist-url: 'tcp://head' is not env://, tcp://HOST:PORT"):
        check_dist_url("tcp://head")


def test_launcher_flags_are_saved_in_the_run_config() -> None:
    args = build_parser().parse_args(["train", "--dist-url", "tcp://head:2345", "--dist-backend", "gloo",
                                      "--no-set-device-rank"])
    cfg = config_from_args(args).to_dict()
    assert (cfg["dist_url"], cfg["dist_backend"], cfg["no_set_device_rank"]) == ("tcp://head:2345", "gloo", True)
    defaults = config_from_args(build_parser().parse_args(["train"])).to_dict()
    assert (defaults["dist_url"], defaults["dist_backend"], defaults["no_set_device_rank"]) == (None, None, False)
    for flags, message in ((["--dist-backend", "glo"], "--dist-backend: 'glo': 'glo' is not one of"),
                           (["--dist-url", "http://head"], "--dist-url: 'http://head' is not env://")):
        with pytest.raises(ValueError, match=message):
            config_from_args(build_parser().parse_args(["train", *flags]))


# ------------------------------------------------------------------------------------ real processes

RUN_FLAGS = [
    "train", "--model", "tiny", "--epochs", "1", "--accum-freq", "2", "--warmup", "1", "--device", "cpu",
    "--synthetic-train-size", "64", "--synthetic-val-size", "8", "--naflex-seq-lens", "16", "32",
    "--naflex-max-tokens-per-batch", "128", "--workers", "0", "--zero-shot-samples", "8", "--no-plot",
    "--val-frequency", "0", "--dist-timeout", "60", "--precision", "fp32", "--log-metric-every-n-steps", "1",
]
SAMPLES = 64
# `naflexclip train`; with LATE=1 this process's clock reads an hour later (a rank that starts in another second
# than rank 0, or whose clock is off); the dense probe as small as tests/conftest.py's small_dense_probe makes it
START = """
import os, sys, time
if os.environ.get("LATE") == "1":
    clock = time.strftime
    time.strftime = lambda fmt, t=None: clock(fmt, time.localtime(time.time() + 3600) if t is None else t)
from naflexclip.cli import main
from naflexclip.evaluation import dense_probe as probe
probe.PROBE_SCENES.update(train=12, val=6)
sys.exit(main(sys.argv[1:]))
"""
LAUNCHER_VARIABLES = {*RANK_VARIABLES, *WORLD_SIZE_VARIABLES, *LOCAL_RANK_VARIABLES, *LOCAL_WORLD_SIZE_VARIABLES,
                      *NODELIST_VARIABLES, "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCHER_VARIABLES and not key.startswith(("SLURM_", "OMPI_", "PMI_"))}
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def start_tasks(tmp_path: Path, task_variables: list[dict[str, str]], *flags: str,
                command: list[str] | None = None) -> list[subprocess.CompletedProcess]:
    """One process per entry of `task_variables` (its launcher's variables), all started at once; each runs
    `naflexclip train` (or `command`) into tmp_path/logs."""
    script = tmp_path / "start.py"
    script.write_text(START)
    command = command or [sys.executable, str(script)]
    procs = [subprocess.Popen([*command, *RUN_FLAGS, "--logs-dir", str(tmp_path / "logs"), *flags],
                              env={**clean_environment(), **variables}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for variables in task_variables]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def assert_one_run_trained_every_sample_once(tmp_path: Path, results: list[subprocess.CompletedProcess],
                                            samples: int = SAMPLES) -> Path:
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"task {rank}:\n{result.stderr[-3000:]}"
    runs = sorted((tmp_path / "logs").iterdir())
    assert len(runs) == 1, [run.name for run in runs]
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    # one job of 2 ranks: every sample once over the epoch (two one-process runs would each train all of them)
    assert sum(r["train/window_examples"] for r in train) == samples
    return runs[0]


def tsv_with_broken_images(folder: Path, rows: int = 24, every: int = 4) -> Path:
    """Every `every`-th image is not an image: whichever rank reads it skips it and logs it."""
    lines = ["filepath\ttitle"]
    for index in range(rows):
        path = folder / f"img{index}.png"
        path.write_bytes(image_bytes(24, 16, "PNG", seed=index) if index % every else b"not an image")
        lines.append(f"{path}\tcaption {index}")
    (folder / "train.tsv").write_text("\n".join(lines) + "\n")
    return folder / "train.tsv"


@pytest.mark.slow
def test_srun_tasks_on_two_nodes_form_one_job_named_by_rank_0(tmp_path: Path) -> None:
    """`srun --ntasks 2` over two nodes, one task each: SLURM's variables only, the master from the host list.
    No --name, rank 1's clock an hour ahead: every rank writes into rank 0's run folder (each rank used to name
    the run by its own clock: rank 1's skipped samples went to a folder of its own)."""
    port = str(free_port())
    tasks = [{"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
              "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "MASTER_PORT": port, "LATE": str(rank)} for rank in range(2)]
    results = start_tasks(tmp_path, tasks, "--train-data", str(tsv_with_broken_images(tmp_path)))
    run = assert_one_run_trained_every_sample_once(tmp_path, results, samples=18)
    skips = [json.loads(line) for line in (run / "skipped_samples.jsonl").read_text().splitlines()]
    assert len(skips) == 6 and {skip["rank"] for skip in skips} == {0, 1}


@pytest.mark.slow
def test_mpirun_tasks_form_one_job(tmp_path: Path) -> None:
    """`mpirun -np 2` (OpenMPI) on one node: its variables only, the master is this host."""
    port = str(free_port())
    tasks = [{"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": port} for rank in range(2)]
    assert_one_run_trained_every_sample_once(tmp_path, start_tasks(tmp_path, tasks, "--name", "mpi"))


@pytest.mark.slow
def test_two_node_torchrun_forms_one_job(tmp_path: Path) -> None:
    """`torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1 --master-addr ...` on two "nodes" of this host."""
    port = str(free_port())
    script = tmp_path / "start.py"
    script.write_text(START)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", port]
    procs = [subprocess.Popen([*torchrun, "--node-rank", str(node), str(script), *RUN_FLAGS,
                               "--logs-dir", str(tmp_path / "logs")],
                              env={**clean_environment(), "LATE": str(node)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert_one_run_trained_every_sample_once(tmp_path, results)


@pytest.mark.slow
def test_srun_tasks_without_a_master_each_stop_in_one_line(tmp_path: Path) -> None:
    """SLURM_NTASKS=2 with no MASTER_ADDR and no host list: every task exits non-zero with the same one line and
    nothing is written (never two runs racing on one folder)."""
    tasks = [{"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank)} for rank in range(2)]
    results = start_tasks(tmp_path, tasks, "--name", "run")
    for rank, result in enumerate(results):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
        assert lines[0] == (f"naflexclip train: error: SLURM_PROCID={rank} SLURM_NTASKS=2 SLURM_LOCALID={rank} is "
                            "one of 2 processes, but where they meet is unknown: set MASTER_ADDR (and MASTER_PORT, "
                            "default 12802) to the host of rank 0, or pass --dist-url tcp://HOST:PORT")
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_a_task_whose_peers_never_start_stops_after_the_timeout_in_one_line(tmp_path: Path) -> None:
    """`python -m naflexclip train` alone in an sbatch script of 2 tasks: task 0 waits --dist-timeout for task 1,
    then stops with one line naming where it waited (it does not train alone)."""
    port = str(free_port())
    (result,) = start_tasks(tmp_path, [{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                                        "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port}],
                            "--name", "run", "--dist-timeout", "3")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"naflexclip train: rank 0 of 2 (SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_LOCALID=0) could "
                               f"not form the job at localhost:{port} within 3 s (--dist-timeout): "), lines[0]
    assert lines[0].endswith("; srun starts every task (the batch script alone is one)")
    assert not (tmp_path / "logs").exists()

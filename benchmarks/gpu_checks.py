"""Every GPU measurement of the project in one run: each step in its own process with its own time limit, every
figure appended to the output folder as it is measured, so one run of at most 9.5 minutes yields them all and a
step cut by its limit keeps what it measured.

    python benchmarks/gpu_checks.py all --out OUT                  # on the GPU machine (bash gpu_checks.sh all)
    python benchmarks/gpu_checks.py loss towers-siglip2-base       # some steps only
    python benchmarks/gpu_checks.py all --dry-run --out /tmp/dry   # tiny sizes on the CPU (~30 s of CPU time)
    python benchmarks/gpu_checks.py --fetch-wheels .gpu_wheels     # where PyPI is reachable: the wheels to carry
    python benchmarks/gpu_checks.py --list                         # the steps and their time limits

What it writes under OUT (default: $OUT, else ./gpu_checks): `results.jsonl`, one JSON object per figure, each
tagged with its step (`kind`: `env`, `loss`, `loss_tile`, `towers`, `window`, `objective`, `skipped`, ... and one
`step` record per step: status ok / failed / timeout, exit code, seconds, limit); `results.md`, the same figures as
the markdown tables the steps print; `steps.log`, every step's whole output. Three files, so that all of them come
back from a machine that returns only a few; nothing else is written there (the demo's run folder goes to a
temporary folder).

The GPU machine has no network: the packages it lacks (open_clip_torch and its ftfy, webdataset, and the peers
siglip-kernel, inf-cl, memeff) are installed by the `env` step into a private folder (`--site`, put on the
steps' PYTHONPATH) from `--wheels DIR` (made by `--fetch-wheels DIR` on a machine that reaches PyPI, carried
along), else from PyPI; a peer that is still missing is skipped by the loss step with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent

# what the GPU machine's image may lack, as (distribution, minimum version or None); installed from the wheels
# when absent or older. The peers of the loss step are pinned: their adapters follow these versions' APIs.
DEPENDENCIES = (("open_clip_torch", "3.0"), ("timm", "1.0.20"), ("webdataset", "0.2.86"), ("braceexpand", None),
                ("ftfy", None), ("wcwidth", None))
PEERS = (("siglip-kernel", "0.1.2"), ("inf-cl", "1.2.1"), ("memeff", "0.3.1"))
DRY_RUN_MIN_LIMIT_S = 180  # every step's limit in a dry run, at least (its tiny sizes take seconds on an idle CPU)


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: float  # the step's own time limit (the step is killed at it; what it wrote stays)
    what: str
    full: tuple[str, ...]  # the command after `python`, on the GPU
    dry: tuple[str, ...]  # the same with tiny sizes on the CPU


def _towers(model: str, seq_lens: str, variants: str, dry_model: str, dry_variants: str, dry_splits: str = "1 2"
            ) -> tuple[tuple, tuple]:
    common = ("benchmarks/towers.py", "sweep", "--results", "{out}")
    full = (*common, "--model", model, "--seq-lens", *seq_lens.split(), "--tokens-per-batch", "65536",
            "--repeats", "2", "--variants", *variants.split(","))
    dry = (*common, "--model", dry_model, "--seq-lens", "16", "--tokens-per-batch", "128", "--splits",
           *dry_splits.split(), "--repeats", "1", "--device", "cpu", "--threads", "1", "--variants",
           *dry_variants.split(","))
    return full, dry


# The budget plan (H200): the limits add up to 540 s, and the run's own overhead (process starts within the
# limits, the summary) stays under 30 s, so `all` ends within 9.5 minutes. Steps that measure several things
# get their limit less a margin as `--budget-s` ({budget}), order their measurements cheapest first and skip, with
# one line, what would not fit; `--limit STEP=SECONDS` gives a step more (a second run: `loss --limit loss=540`).
STEPS = (
    # pip installing ~5 MB of wheels and importing torch: ~15 s; the steps after it import what it installs
    Step("env", 40, "versions, the GPU, and the packages it lacks installed from --wheels (else PyPI)",
         ("benchmarks/gpu_checks.py", "--run-env", "--out", "{out}", "--site", "{site}", "--wheels", "{wheels}"),
         ("benchmarks/gpu_checks.py", "--run-env", "--out", "{out}", "--site", "{site}", "--wheels", "{wheels}",
          "--dry-run")),
    Step("tests", 50, "the CUDA tests (pytest -m gpu)",
         # the test files that mark tests gpu: others may import what the GPU machine lacks (wandb, ...)
         ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rfEs", "{gpu_test_files}"),
         ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rfEs", "tests/test_gpu.py")),
    Step("loss", 140, "the loss alone: ours (tiled) vs siglip-kernel, Inf-CL, memeff and OpenCLIP's losses at "
                      "N = 65,536 / 262,144 / 1,048,576, D = 768 / 1152; our tile swept",
         ("benchmarks/loss_peers.py", "--out", "{out}", "--budget-s", "{budget}"),
         ("benchmarks/loss_peers.py", "--out", "{out}", "--device", "cpu", "--sizes", "128", "256", "--dims", "32",
          "--tiles", "64", "128", "--repeats", "1", "--threads", "1")),
    Step("towers-siglip2-base", 110, "siglip2-base towers: window vs full batch at n = 1, 2, 4, 8, tokens/s, MFU, "
                                     "± checkpointing, ± torch.compile, seq len 256 and 1024",
         *_towers("siglip2-base", "256 1024", "eager,checkpointing,compiled,compiled + checkpointing", "tiny",
                  "eager,checkpointing")),
    Step("towers-base", 30, "the base preset's towers, seq len 576 (eager, checkpointing, compiled)",
         *_towers("base", "576", "eager,checkpointing,compiled", "tiny", "eager")),
    Step("towers-ViT-B-16", 25, "OpenCLIP's ViT-B-16 as a NaFlex model, seq len 576 (eager, checkpointing); "
                                "skipped with one line where create_model does not know the name",
         # the dry run: a smaller OpenCLIP name, the same path (ViT-B-16 takes 4 s a step on a CPU)
         *_towers("ViT-B-16", "576", "eager,checkpointing", "ViT-S-32", "eager", dry_splits="1")),
    # ~70 s of it the 262,144-pair window itself: 2.3e16 FLOP of towers at ~400 TFLOP/s, and its loss in fp32
    Step("window", 110, "one whole window of 262,144 pairs through accumulate_gradients (siglip2-base) vs 16,384",
         ("benchmarks/big_window.py", "--out", "{out}", "--budget-s", "{budget}"),
         ("benchmarks/big_window.py", "--out", "{out}", "--model", "tiny", "--sizes", "512", "128", "--seq-len", "16",
          "--microbatch-tokens", "1024", "--device", "cpu", "--threads", "1")),
    Step("objectives", 35, "LiT, distillation, multi-positive, the SigLIP 2 recipe (those present) vs the plain "
                           "window: time and memory per pair",
         ("benchmarks/objectives.py", "--out", "{out}", "--budget-s", "{budget}"),
         ("benchmarks/objectives.py", "--out", "{out}", "--model", "tiny", "--num-examples", "128", "--seq-len", "16",
          "--microbatch-tokens", "512", "--device", "cpu", "--threads", "1")),
)
OPTIONAL_STEPS = (  # not in `all`: the earlier checks, by name
    Step("recipe", 90, "SigLIP 2's recipe window part by part (LocCa decoder, EMA teacher, local crops, masked pass) "
                       "vs the sigmoid-only window: time, peak memory, teacher forwards",
         ("benchmarks/recipe.py", "--model", "base", "--num-examples", "256", "--splits", "4", "--seq-len", "256",
          "--precision", "amp_bf16", "--repeats", "3"),
         ("benchmarks/recipe.py", "--model", "tiny", "--num-examples", "4", "--splits", "2", "--seq-len", "16",
          "--local-crops", "2", "--repeats", "1", "--device", "cpu", "--threads", "1")),
    Step("profile", 90, "torch.profiler of a window at n = 1 and 8 (small, base): host syncs, launches",
         ("benchmarks/towers.py", "profile", "--model", "base", "--seq-lens", "576", "--splits", "8",
          "--out", "{out}/results.md"),
         ("benchmarks/towers.py", "profile", "--model", "tiny", "--seq-lens", "16", "--tokens-per-batch", "128",
          "--splits", "2", "--device", "cpu", "--out", "{out}/results.md")),
    Step("demo", 180, "the demo job (`naflexclip train`) on CUDA",
         ("-m", "naflexclip", "train", "--device", "cuda", "--workers", "8", "--logs", "{tmp}/demo_logs",
          "--name", "demo", "--no-plot"),
         ("-m", "naflexclip", "train", "--model", "tiny", "--epochs", "1", "--device", "cpu", "--logs",
          "{tmp}/demo_logs", "--name", "demo", "--no-plot")),
)


def gpu_test_files() -> list[str]:
    """tests/ files with a test marked `gpu`."""
    return sorted(f"tests/{path.name}" for path in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in path.read_text())


class Output:
    """The run's own lines and records: printed, appended to results.md / results.jsonl."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def line(self, text: str) -> None:
        print(text, flush=True)
        with open(self.out / "results.md", "a") as f:
            f.write(text + "\n")

    def record(self, step: str, **fields: object) -> None:
        with open(self.out / "results.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **fields}) + "\n")


class ForkedStep:
    """A step run in a fork of this process, which has imported torch and the package already (the imports cost
    more than a dry run's measurements, and several seconds of every step on the GPU machine). The child starts
    its own process group, sends its output through a pipe, and runs the step's script (or `-m module`) as
    `__main__`. This process never touches CUDA, so each child initialises it afresh."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                os.setsid()
                os.close(read)
                os.dup2(write, 1)
                os.dup2(write, 2)
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(env)
                for stream in (sys.stdout, sys.stderr):
                    stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
                code = _run_as_main(command[1:])
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        self.stdout = os.fdopen(read, "r", errors="replace")
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            else:
                time.sleep(0.05)
        return self.returncode


def _run_as_main(arguments: list[str]) -> int:
    """`python ARGUMENTS` in this process: a script, or `-m module`, with its own argv."""
    import runpy

    if arguments[0] == "-m":
        sys.argv = [arguments[1], *arguments[2:]]
        runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(arguments)
        sys.path.insert(0, str(Path(arguments[0]).resolve().parent))
        runpy.run_path(arguments[0], run_name="__main__")
    return 0


def _warm_imports(site: Path) -> bool:
    """Import what every step imports, once, here (after the env step installed what was missing); False if that
    fails (then every step starts a fresh interpreter)."""
    sys.path[:0] = [str(site), str(REPO / "src"), str(BENCHMARKS)]
    importlib.invalidate_caches()
    try:
        import torch.utils.flop_counter  # noqa: F401

        import naflexclip.cli  # noqa: F401  (the train, verify and data modules)
        import naflexclip.models.precision  # noqa: F401
    except Exception as error:
        print(f"warm imports failed ({type(error).__name__}: {error}): each step starts a fresh interpreter",
              flush=True)
        return False
    return True


def _kill_group(proc: subprocess.Popen | ForkedStep) -> None:
    """The step and everything it started (spawned measuring processes, compile workers)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, args: argparse.Namespace, output: Output, fork: bool) -> dict:
    """Run one step under its limit, its output shown and appended to `steps.log`; its `step` record."""
    # {budget}: what a step that plans its own measurements may spend, its limit less a margin for its start
    budget = step.limit_s - min(15.0, 0.2 * step.limit_s)
    values = {"out": str(args.out), "site": str(args.site), "wheels": str(args.wheels or ""), "budget": f"{budget:.0f}",
              "tmp": tempfile.gettempdir()}
    command = [sys.executable]
    for part in step.dry if args.dry_run else step.full:
        command += gpu_test_files() if part == "{gpu_test_files}" else [part.format(**values)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_CHECKS_STEP=step.name,
               PYTHONPATH=os.pathsep.join(p for p in (str(args.site), str(REPO / "src"), str(BENCHMARKS),
                                                      os.environ.get("PYTHONPATH", "")) if p))
    output.line(f"\n## {step.name} (limit {step.limit_s:.0f} s): {step.what}")
    start = time.monotonic()
    timed_out = threading.Event()
    last_lines: list[str] = []
    with open(args.out / "steps.log", "a") as log:
        log.write(f"\n===== {step.name} (limit {step.limit_s:.0f} s)\n$ " + " ".join(command) + "\n")
        log.flush()
        sys.stdout.flush()
        proc: subprocess.Popen | ForkedStep
        if fork and sys.modules["torch"].cuda.is_initialized():  # a fork would share this process's CUDA context
            fork = False
        if fork:
            proc = ForkedStep(command, REPO, env)
        else:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", start_new_session=True)

        def expire() -> None:
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(step.limit_s, expire)
        timer.start()
        try:
            assert proc.stdout is not None
            for text in proc.stdout:
                log.write(text)
                log.flush()
                print(text, end="", flush=True)
                last_lines = (last_lines + [text.rstrip()])[-3:]
            code = proc.wait()
        finally:
            timer.cancel()
            proc.stdout.close()
    seconds = time.monotonic() - start
    status = "timeout" if timed_out.is_set() else ("ok" if code == 0 else "failed")
    summary = last_lines[-1] if last_lines else ""
    output.line(f"== {step.name}: {status} (exit {code}) after {seconds:.0f} s of {step.limit_s:.0f} s")
    record = dict(kind="step", status=status, exit_code=code, seconds=round(seconds, 1), limit_s=step.limit_s,
                  dry_run=args.dry_run, forked=fork, command=command[1:], last_line=summary)
    output.record(step.name, **record)
    return record


# ------------------------------------------------------------------------------------------------------- env step


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _older(version: str, minimum: str) -> bool:
    def parts(text: str) -> tuple[int, ...]:
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:3])
    return parts(version) < parts(minimum)


def _pip_install(names: list[str], site: Path, wheels: str, timeout: float) -> str:
    """Install `names` (no dependencies) into `site` from the wheel folder, else from PyPI; one line of outcome."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-cache-dir",
               "--disable-pip-version-check", "--target", str(site), "--upgrade"]
    source = f"wheels in {wheels}" if wheels and Path(wheels).is_dir() else "PyPI"
    command += ["--no-index", "--find-links", wheels] if source != "PyPI" else ["--retries", "0", "--timeout", "10"]
    try:
        done = subprocess.run(command + names, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"pip install from {source}: no answer in {timeout:.0f} s"
    if done.returncode != 0:
        return f"pip install from {source} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:300]}"
    return f"installed from {source}: {' '.join(names)}"


def run_env(args: argparse.Namespace) -> None:
    """The `env` step: install what the GPU machine lacks (not in a dry run), then record the versions."""
    sys.path.insert(0, str(args.site))
    output = Output(args.out)
    # by name: whatever version the wheel folder holds (--fetch-wheels: the versions of the machine that made it)
    missing = [name for name, minimum in DEPENDENCIES
               if _version(name) is None or (minimum and _older(_version(name), minimum))]
    peers = [f"{name}=={version}" for name, version in PEERS if _version(name) != version]
    if args.dry_run:
        output.line(f"dry run: nothing installed (would install: {' '.join(missing + peers) or 'nothing'})")
    else:
        for names in (missing, peers):  # the project's dependencies first: a peer failing must not block them
            if names:
                output.line(_pip_install(names, args.site, args.wheels, timeout=60))
        importlib.invalidate_caches()
    import torch

    cuda = torch.cuda.is_available()
    record = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(0) if cuda else None,
              "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
              "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
              "commit": _commit()}
    for name, _ in (*DEPENDENCIES, *PEERS, ("triton", None), ("transformers", None)):
        record[name] = _site_version(name, args.site)
    output.record("env", kind="env", **record)
    output.line("env: " + ", ".join(f"{key} {value}" for key, value in record.items()))


def _site_version(distribution: str, site: Path) -> str | None:
    found = list(importlib.metadata.distributions(name=distribution, path=[str(site)]))
    return found[0].version if found else _version(distribution)


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def fetch_wheels(folder: str) -> int:
    """Download (no dependencies) every wheel the GPU machine may lack, at this machine's versions, into `folder`."""
    names = [f"{name}=={_version(name)}" if _version(name) else name for name, _ in DEPENDENCIES]
    names += [f"{name}=={version}" for name, version in PEERS]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", folder, *names]
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="*", help="`all` (default) or step names; --list shows them")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU; the CUDA-only peers skipped")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_checks"))
    parser.add_argument("--wheels", default=None,
                        help="a folder of wheels to install what the machine lacks from (default: .gpu_wheels in the "
                             "repository, where it exists)")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "naflexclip_gpu_site",
                        help="where the env step installs them (put first on every step's PYTHONPATH)")
    parser.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                        help="another time limit for a step (repeatable), e.g. --limit loss=200")
    parser.add_argument("--list", action="store_true", help="print the steps and their time limits")
    parser.add_argument("--fetch-wheels", metavar="DIR", default=None,
                        help="download the wheels the GPU machine may lack into DIR, and stop")
    parser.add_argument("--no-fork", action="store_true",
                        help="start every step in a fresh interpreter (default: a fork of this one, whose imports "
                             "are done once)")
    parser.add_argument("--run-env", action="store_true", help=argparse.SUPPRESS)  # the env step itself
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.wheels is None and (REPO / ".gpu_wheels").is_dir():
        args.wheels = str(REPO / ".gpu_wheels")
    args.site = args.site.resolve()
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels)
    if args.run_env:
        run_env(args)
        return 0
    by_name = {step.name: step for step in (*STEPS, *OPTIONAL_STEPS)}
    limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in by_name or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--limit {item!r}: expected STEP=SECONDS with a step of {', '.join(by_name)}")
        limits[name] = float(seconds)
    if args.list:
        for step in (*STEPS, *OPTIONAL_STEPS):
            print(f"{step.name:20} {step.limit_s:4.0f} s  {'' if step in STEPS else '(not in all) '}{step.what}")
        print(f"{'all':20} {sum(step.limit_s for step in STEPS):4.0f} s  (the limits added up)")
        return 0
    names = args.steps or ["all"]
    unknown = [name for name in names if name != "all" and name not in by_name]
    if unknown:
        parser.error(f"unknown step {unknown[0]!r}; choose all or some of {', '.join(by_name)}")
    if args.dry_run:  # a dry run runs on a CPU shared with other work, not within the GPU budget: ample limits
        limits = {step.name: max(step.limit_s, DRY_RUN_MIN_LIMIT_S) for step in by_name.values()} | limits
    chosen = [dataclasses.replace(step, limit_s=limits.get(step.name, step.limit_s))
              for step in (*STEPS, *OPTIONAL_STEPS) if step.name in names or ("all" in names and step in STEPS)]
    if chosen[0].name != "env" and not args.dry_run:
        chosen.insert(0, dataclasses.replace(by_name["env"], limit_s=limits.get("env", by_name["env"].limit_s)))
        # (the env step first: the packages the other steps import)
    output = Output(args.out)
    output.line(f"# gpu_checks {'(dry run) ' if args.dry_run else ''}{time.strftime('%Y-%m-%d %H:%M:%S')}: "
                f"{', '.join(step.name for step in chosen)}; limits add up to {sum(s.limit_s for s in chosen):.0f} s")
    start = time.monotonic()
    records = {}
    # the env step installs what the imports need, so it runs in a fresh interpreter and the imports after it
    fork = chosen[0].name != "env" and not args.no_fork and _warm_imports(args.site)
    for step in chosen:
        records[step.name] = run_step(step, args, output, fork)
        if step.name == "env":
            fork = not args.no_fork and _warm_imports(args.site)
    output.line(f"\n## summary ({time.monotonic() - start:.0f} s)\n| step | status | s | limit s |\n"
                "| --- | --- | --- | --- |")
    for name, record in records.items():
        output.line(f"| {name} | {record['status']} | {record['seconds']:.0f} | {record['limit_s']:.0f} |")
    return 0 if all(record["status"] == "ok" for record in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A command that starts loader workers ends when its work is done, whatever the garbage collector does.

The workers ignore SIGTERM (a SIGTERM to the process group is the training process's to handle), so the
`terminate()` that multiprocessing's exit handler sends its daemonic children is lost on them: a loader whose
persistent workers are still alive at interpreter exit would make that handler's join wait for ever. Every loader
is shut down explicitly when a command ends, and at the latest before that handler runs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from naflexclip.data import DataConfig, build_loader

# after its last line a command has this long to exit (it takes well under a second when it works)
EXIT_WITHIN_S = 20.0

_WITH_COLLECTOR_OFF = ("import gc, sys; gc.disable(); from naflexclip.cli import main; "
                       "sys.exit(main(sys.argv[1:]))")


def _run_until_exit(argv: list[str], cwd: Path, last_line: str, limit_s: float = 400.0) -> tuple[str, float]:
    """Run `naflexclip ARGV` with the collector off; its output and the seconds from `last_line` to its exit."""
    process = subprocess.Popen([sys.executable, "-c", _WITH_COLLECTOR_OFF, *argv], cwd=cwd, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    seen_at: list[float] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if last_line in line and not seen_at:
                seen_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        while process.poll() is None:
            now = time.monotonic()
            if (seen_at and now - seen_at[0] > EXIT_WITHIN_S) or now - started > limit_s:
                break
            time.sleep(0.2)
        exited_at = time.monotonic() if process.poll() is not None else None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=10)
    output = "".join(lines)
    assert seen_at, f"no {last_line!r} in the output:\n{output[-3000:]}"
    assert exited_at is not None, (f"still alive {EXIT_WITHIN_S:.0f} s after {last_line!r} (a loader's workers "
                                   f"kept it from exiting):\n{output[-2000:]}")
    assert process.returncode == 0, output[-3000:]
    return output, exited_at - seen_at[0]


@pytest.mark.slow
def test_train_and_eval_exit_within_seconds_of_their_last_line_with_the_collector_off(tmp_path: Path) -> None:
    flags = ["--model", "tiny", "--device", "cpu", "--precision", "fp32", "--workers", "2"]
    _run_until_exit(["train", *flags, "--synthetic-train-size", "32", "--epochs", "1", "--name", "run"],
                    tmp_path, "outputs in")
    _run_until_exit(["eval", "--checkpoint", "logs/run/checkpoints"], tmp_path, "probe/miou_chance")


def test_closing_a_loader_ends_its_persistent_workers() -> None:
    before = set(multiprocessing.active_children())
    data = DataConfig(synthetic_train_size=16, synthetic_val_size=16, workers=2, naflex_seq_lens=[16],
                      naflex_max_tokens_per_batch=64)
    with build_loader(data, split="val", patch_size=16, context_length=16) as loader:
        assert sum(batch["text"].shape[0] for batch in loader) == 16
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 2  # kept for the next epoch
    for worker in workers:
        worker.join(timeout=10)
    assert not any(worker.is_alive() for worker in workers)
    assert sum(batch["text"].shape[0] for batch in loader) == 16  # a closed loader starts new workers
    loader.close()

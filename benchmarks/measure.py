"""What the benchmark scripts share: running one measurement in a fresh process (so peak memory is its own)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable


def in_subprocess(target: Callable[..., None], *args: object) -> object:
    """Run `target(*args, queue)` in a spawned process and return what it put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result

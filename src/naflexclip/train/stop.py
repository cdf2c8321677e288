"""How a run ends early: `TrainingStopped` (it cannot go on), and SIGINT/SIGTERM, which let the current step
finish, save it and end the run with one line (`TrainingInterrupted`); the same signal again stops at once,
naming the last complete checkpoint."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps in a row); the message says why."""


class TrainingInterrupted(TrainingStopped):
    """SIGINT/SIGTERM ended the run; the message says where its last complete checkpoint is. `show`: this rank
    is the one that tells the user (the main rank)."""

    def __init__(self, message: str, signal_number: int, show: bool = True) -> None:
        super().__init__(message)
        self.signal_number = signal_number
        self.show = show


class StopSignals:
    """While `installed()`: SIGINT/SIGTERM set `number` (the loop stops after the current step); the same signal
    again raises KeyboardInterrupt (stop now). Only the main thread can take signals."""

    def __init__(self) -> None:
        self.number: int | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(number: int, frame: Any) -> None:
            # Ctrl-C under torchrun reaches a worker twice, as SIGINT from the terminal and SIGTERM from the agent:
            # only a repeat of the first signal means "now"
            if self.number == number:
                raise KeyboardInterrupt
            if self.number is None:
                self.number = number  # no output here: a handler may run in the middle of a write to stderr

        previous = {number: signal.signal(number, request_stop) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def stopped(self, step: int, saved: Path, show: bool, name: str) -> TrainingInterrupted:
        """The clean stop after `step` (a signal reached this rank or another: SIGTERM then); the hint names the run,
        whose generated name a bare `--resume latest` would not find."""
        number = self.number or signal.SIGTERM
        return TrainingInterrupted(f"stopped by {signal.Signals(number).name} after step {step}; saved {saved} "
                                   f"(continue with --name {name} --resume latest)", number, show=show)

    def interrupted(self, latest: Path | None, show: bool) -> TrainingInterrupted:
        """The stop at once (a second signal, or Ctrl-C outside the loop)."""
        number = self.number or signal.SIGINT
        return TrainingInterrupted(f"interrupted by {signal.Signals(number).name}; last complete checkpoint: "
                                   f"{latest if latest is not None else 'none'}", number, show=show)

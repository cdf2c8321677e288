"""Where logged metrics go: the `Sink` interface every logger implements, what a sink is built from
(`SinkContext`), and the two sinks that need no extra package (`metrics.jsonl`, TensorBoard). The registry of
`--report-to` names is `report.SINKS`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"


class Sink(Protocol):
    """Where logged metrics go. `kind`: "train", "eval" or "data"; keys are `group/name` ("train/loss")."""

    def log(self, kind: str, step: int, epoch: float, metrics: Mapping[str, float]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (JSONL: the bytes written; a hosted logger: its run id)."""
        ...

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Continue after `step`: nothing logged after it appears twice. `state` is empty when the sink saved
        nothing (a run started over, or a sink the checkpoint's run did not use)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SinkContext:
    """What a sink is built from: the run's folder, its config (`TrainConfig.to_dict()`) and its name."""

    run_dir: Path
    config: dict[str, Any]
    name: str


SinkFactory = Callable[[SinkContext], Sink]


class JsonlSink:
    """`metrics.jsonl`: one line `{"kind", "step", "epoch", <metrics>}` per call."""

    def __init__(self, context: SinkContext) -> None:
        self.path = context.run_dir / METRICS_FILE

    def log(self, kind: str, step: int, epoch: float, metrics: Mapping[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "step": step, "epoch": epoch, **metrics}) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {"bytes": self.path.stat().st_size if self.path.exists() else 0}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Cut the file back to what was written when the state was saved (a crash or stop after it)."""
        size = int(state.get("bytes", 0))
        if self.path.exists() and self.path.stat().st_size > size:
            os.truncate(self.path, size)

    def close(self) -> None:
        pass


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file (a torn last line from a crash is ignored)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class TensorBoardSink:
    """TensorBoard scalars under `{run_dir}/tensorboard` (tag `group/name`, or `kind/name` for a bare name)."""

    def __init__(self, context: SinkContext) -> None:
        self.log_dir = context.run_dir / "tensorboard"
        self.writer = self._open()

    def _open(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(self, kind: str, step: int, epoch: float, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key if "/" in key else f"{kind}/{key}", value, step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """TensorBoard hides the events an earlier process logged after `step`."""
        self.writer.close()
        self.writer = self._open(purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()

"""What a user sees of a run: the per-epoch progress bar, `metrics.jsonl`, TensorBoard, `curves.png` and
the terminal summary table. Only the main rank reports; on other ranks every method is a no-op.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from naflexclip.data.samples import NOT_SAMPLE_REASONS

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
# one JSON line per skipped sample: source, key, line, reason, detail, split, epoch, rank (and, for the
# validation split, the step of the evaluation that left it out)
SKIP_LOG_FILE = "skipped_samples.jsonl"
# the metrics of the summary table, with the chance level next to them where there is one
SUMMARY_KEYS = (
    "val/image_to_text_R@1", "val/image_to_text_R@5", "val/image_to_text_R@10", "val/image_to_text_median_rank",
    "val/text_to_image_R@1", "val/text_to_image_R@5", "val/text_to_image_R@10", "val/text_to_image_median_rank",
    "zeroshot/shape_top1", "zeroshot/colour_top1",
)


class Reporter:
    """Writes every logged metric as one JSON line `{"step", "epoch", "kind", <metrics>}` and, with
    `--report-to tensorboard`, as TensorBoard scalars under `{run_dir}/tensorboard`."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.writer = None
        self.tensorboard = enabled and tensorboard
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / METRICS_FILE
        if self.tensorboard:
            self._open_writer()

    def _open_writer(self, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def purge_after(self, step: int) -> None:
        """After a resume at `step`: TensorBoard hides the events a previous process logged after it
        (as metrics.jsonl is cut back), so each step appears once."""
        if self.writer is not None:
            self.writer.close()
            self._open_writer(purge_step=step + 1)

    def log(self, kind: str, step: int, epoch: float, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "epoch": epoch, **metrics}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key if "/" in key else f"{kind}/{key}", value, step)

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if self.enabled:
            tqdm.write(text, file=sys.stderr)

    def progress_bar(self, epoch: int, total: int, initial: int) -> tqdm:
        return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", unit="step", dynamic_ncols=True,
                    disable=not self.enabled, file=sys.stderr, leave=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file (a torn last line from a crash is ignored)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_curves(records: list[dict[str, Any]], out_path: Path) -> None:
    """Loss per step and retrieval / zero-shot per evaluation, in one PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train and not evals:
        return  # nothing to plot: no empty figure, no matplotlib warnings
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_loss.plot([r["step"] for r in train], [r["train/loss"] for r in train], lw=0.8)
    ax_loss.set(xlabel="optimizer step", ylabel="window loss L(W)", title="training loss")
    ax_loss.grid(alpha=0.3)
    for key, label in (("val/image_to_text_R@1", "image→text R@1"), ("val/text_to_image_R@1", "text→image R@1"),
                       ("val/image_to_text_R@10", "image→text R@10"), ("zeroshot/shape_top1", "zero-shot shape"),
                       ("zeroshot/colour_top1", "zero-shot colour")):
        points = [(r["step"], r[key]) for r in evals if key in r]
        if points:
            ax_eval.plot(*zip(*points, strict=True), marker="o", label=label)
    ax_eval.set(xlabel="optimizer step", ylabel="accuracy / recall", ylim=(0, 1), title="evaluation")
    ax_eval.grid(alpha=0.3)
    if ax_eval.get_lines():
        ax_eval.legend(loc="lower right", fontsize=8)
    else:
        ax_eval.text(0.5, 0.5, "no evaluation data", ha="center", va="center", transform=ax_eval.transAxes)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def summary_table(first: dict[str, float], last: dict[str, float], counts: dict[str, int]) -> str:
    """Before/after table of the evaluation metrics, and the run's skip counts."""
    rows = [("metric", "before", "after", "chance")]
    num_val = last.get("val/num_samples", first.get("val/num_samples"))
    for key in SUMMARY_KEYS:
        if key not in last:
            continue
        chance = ""
        if key.startswith("zeroshot/"):
            chance = f"{last.get(key.replace('_top1', '_chance'), math.nan):.3f}"
        elif "R@" in key and num_val:
            chance = f"{min(1.0, int(key.rsplit('@', 1)[1]) / num_val):.3f}"
        elif "median_rank" in key and num_val:
            chance = f"{(num_val + 1) / 2:.1f}"
        before = f"{first[key]:.3f}" if key in first else "-"
        rows.append((key, before, f"{last[key]:.3f}", chance))
    width = max(len(r[0]) for r in rows)
    lines = [f"{r[0]:<{width}}  {r[1]:>8}  {r[2]:>8}  {r[3]:>8}" for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"{key}: {value}" for key, value in counts.items()]
    return "\n".join(lines)


def read_skip_log(path: Path) -> list[dict[str, Any]]:
    """The run's skipped samples, each once: a sample re-read after a resume is not counted twice."""
    if not path.exists():
        return []
    seen, records = set(), []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        ident = tuple(str(record.get(k)) for k in ("split", "step", "epoch", "source", "key", "line", "reason"))
        if ident not in seen:
            seen.add(ident)
            records.append(record)
    return records


def epoch_data_record(run_dir: Path, epoch: int, num_samples_seen: int) -> dict[str, Any]:
    """The `data` record of a finished epoch: samples trained in it (all ranks) and skipped by reason
    (training samples: the validation split's skips are in the skip log apart)."""
    metrics_path = run_dir / METRICS_FILE
    earlier = {}
    if metrics_path.exists():
        earlier = {int(r["data/epoch"]): r["data/trained_samples"]
                   for r in read_metrics(metrics_path) if r["kind"] == "data" and r["data/epoch"] < epoch}
    record: dict[str, Any] = {"data/epoch": epoch, "data/trained_samples": num_samples_seen - sum(earlier.values())}
    for skip in read_skip_log(run_dir / SKIP_LOG_FILE):
        if skip.get("epoch") == epoch and skip.get("split", "train") == "train":
            key = f"data/skipped/{skip['reason']}"
            record[key] = record.get(key, 0) + 1
    return record


def data_summary(records: list[dict[str, Any]], skip_log: Path) -> str:
    """Per epoch: samples trained, bad samples skipped by reason, and shard/plan problems apart."""
    epochs = {int(r["data/epoch"]): r for r in records if r["kind"] == "data"}
    lines = []
    for epoch, record in sorted(epochs.items()):
        skips = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("data/skipped/")}
        bad = {k: v for k, v in skips.items() if k not in NOT_SAMPLE_REASONS}
        other = {k: v for k, v in skips.items() if k in NOT_SAMPLE_REASONS}
        line = f"epoch {epoch}: trained {record['data/trained_samples']} samples, skipped {sum(bad.values())} bad"
        if bad:
            line += " (" + ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) + ")"
        if other:
            line += "; " + ", ".join(f"{k}={v}" for k, v in sorted(other.items()))
        lines.append(line)
    if any("data/skipped/" in k for r in epochs.values() for k in r):
        lines.append(f"every skipped sample, with its file, key or line: {skip_log}")
    return "\n".join(lines) if lines else "no epoch finished"

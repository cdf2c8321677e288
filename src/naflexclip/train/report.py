"""What a user sees of a run: the progress bar and messages, the logged metrics, the skip log, `curves.png` and
the terminal summary.

Metrics go to a `Reporter` of sinks (`metrics.jsonl` always, others by `--report-to`), each a small `Sink` class
registered by name in `SINKS`, on the main rank only, saving what a resume needs (`state_dict`). Every rank appends
its skipped samples to `skipped_samples.jsonl`. docs/training.md#outputs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from naflexclip.data.samples import NOT_SAMPLE_REASONS, NOTE_REASONS, READ_NOTES
from naflexclip.train.sinks import (
    METRICS_FILE,
    JsonlSink,
    Sink,
    SinkContext,
    SinkFactory,
    TensorBoardSink,
    read_metrics,
)
from naflexclip.train.wandb_sink import WandbSink

PLOT_FILE = "curves.png"
# one JSON line per skipped sample: source, key, line, reason, detail, split, epoch (numbered from 1, as everywhere
# a user reads one), rank (and, for the validation split, the step of the evaluation that left it out)
SKIP_LOG_FILE = "skipped_samples.jsonl"
MAX_SKIP_LINES = 20  # skipped samples (and notes, apart) printed per split and epoch; all are in the skip log
# the reporter's saved state beside its sinks': the skip log's size, and the counts a resume under another --name
# continues (a checkpoint written before this was recorded has none)
COUNTS_STATE = "counts"
# the metrics of the summary table, with the chance level next to them where there is one
SUMMARY_KEYS = (
    "val/image_to_text_R@1", "val/image_to_text_R@5", "val/image_to_text_R@10", "val/image_to_text_median_rank",
    "val/text_to_image_R@1", "val/text_to_image_R@5", "val/text_to_image_R@10", "val/text_to_image_median_rank",
    "zeroshot/shape_top1", "zeroshot/colour_top1", "decoder/caption_bleu4", "decoder/aref_acc", "probe/miou",
)
# zero-shot classification of a user's ImageFolder during training: zeroshot/<folder name>/<metric>
FOLDER_ZEROSHOT_METRICS = ("top1", "top5")


# --report-to names; "jsonl" is always on
SINKS: dict[str, SinkFactory] = {
    "jsonl": JsonlSink,
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
}


def report_to_names(text: str) -> list[str]:
    """The sinks of `--report-to` (OpenCLIP's comma form, e.g. "wandb,tensorboard"); one-line ValueError
    naming an unknown one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in SINKS:
            raise ValueError(f"--report-to: unknown {name!r}; choose from {', '.join(sorted(SINKS))} "
                             f"(several comma-separated)")
    return names


def refuse_existing_run(run_dir: Path, resuming: bool) -> None:
    """OpenCLIP's rule: a new run does not write over another run's logs. And the run folder can be written
    (`check_writable`): both before the model is built or any data read."""
    if not resuming and (run_dir / METRICS_FILE).exists():
        raise ValueError(f"--name: run {str(run_dir)!r} already exists; pick another --name or pass --resume latest")
    check_writable(run_dir)


def check_writable(run_dir: Path) -> None:
    """The run folder `{--logs}/{--name}` can be created and written: else one line naming the directory in the
    way (a file, or one this user may not write), not a traceback at the first write."""
    folder = run_dir
    while not folder.exists() and folder != folder.parent:  # the nearest part that exists
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"--logs {run_dir.parent}: cannot create the run folder {run_dir}: {folder} is a file, "
                         f"not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--logs {run_dir.parent}: cannot write the run folder {run_dir}: {folder} is not writable")


def run_exists(run_dir: Path) -> bool:
    """True when the run folder holds logs of an earlier start."""
    return (run_dir / METRICS_FILE).exists()


class Reporter:
    """The run's logs: sinks (main rank), messages and the progress bar (main rank), the skip log (every rank).

    `state_dict()` holds each sink's state under its name, and under `COUNTS_STATE` the skip log's size and the
    counts of the epochs' data records; `load_state_dict(state, step)` continues this run's logs after `step`,
    `continue_counts(state)` another run's counts in this run's folder."""

    def __init__(self, run_dir: Path, *, rank: int = 0, report_to: str = "", config: dict[str, Any] | None = None,
                 name: str | None = None, log_file: Path | None = None) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.enabled = rank == 0
        self.log_file = log_file  # --log-local: this process's messages also go here (OpenCLIP's out-{rank}.log)
        self.metrics_path = run_dir / METRICS_FILE
        self.skips_printed: dict[tuple[str, int, bool], int] = {}  # (split, epoch, a note): lines printed
        self.sinks: dict[str, Sink] = {}
        # samples trained in each finished epoch (numbered from 1); None: unknown (a checkpoint that did not record
        # them), then read from this run's metrics.jsonl
        self.trained_by_epoch: dict[int, int] | None = {}
        # training skips by epoch and reason that another run's checkpoint counted before this run's skip log began
        self.carried_skips: dict[int, dict[str, int]] = {}
        names = dict.fromkeys(["jsonl", *report_to_names(report_to)])
        if self.enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            context = SinkContext(run_dir, dict(config or {}), name or run_dir.name)
            self.sinks = {name: SINKS[name](context) for name in names}

    def log(self, kind: str, step: int, epoch: float, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks.values():
            sink.log(kind, step, epoch, metrics)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: sink.state_dict() for name, sink in self.sinks.items()}
        if self.enabled:  # every rank has written its skips up to this step: the main rank reads them
            skip_log = self.run_dir / SKIP_LOG_FILE
            skips = train_skip_counts(read_skip_log(skip_log))
            for epoch, counts in self.carried_skips.items():
                for reason, count in counts.items():
                    skips.setdefault(epoch, {})[reason] = skips.get(epoch, {}).get(reason, 0) + count
            state[COUNTS_STATE] = {"skip_log_bytes": skip_log.stat().st_size if skip_log.exists() else 0,
                                   "trained_by_epoch": dict(self._trained_by_epoch()), "skipped_by_epoch": skips,
                                   "carried_skips": self.carried_skips}
        return state

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Continue this run's own checkpoint: every log written after it (metrics, skip log) is cut back to it."""
        for name, sink in self.sinks.items():
            sink.load_state_dict(state.get(name, {}), step)
        counts = state.get(COUNTS_STATE)
        skip_log = self.run_dir / SKIP_LOG_FILE
        if self.enabled and counts is not None and skip_log.exists():
            if skip_log.stat().st_size > int(counts["skip_log_bytes"]):
                os.truncate(skip_log, int(counts["skip_log_bytes"]))
        self._continue_trained(counts)
        self.carried_skips = _skips_by_epoch((counts or {}).get("carried_skips", {}))  # not in this run's skip log

    def continue_counts(self, state: dict[str, Any]) -> None:
        """Continue another run's checkpoint in this run's folder: its epochs' counts carry on here (this run's
        skip log holds only what this run skips)."""
        counts = state.get(COUNTS_STATE)
        self._continue_trained(counts)
        self.carried_skips = _skips_by_epoch((counts or {}).get("skipped_by_epoch", {}))

    def _continue_trained(self, counts: dict[str, Any] | None) -> None:
        self.trained_by_epoch = (None if counts is None else
                                 {int(epoch): int(n) for epoch, n in counts["trained_by_epoch"].items()})

    def _trained_by_epoch(self) -> dict[int, int]:
        if self.trained_by_epoch is None:  # resumed from a checkpoint that did not record them: this run's metrics
            self.trained_by_epoch = ({int(r["data/epoch"]): int(r["data/trained_samples"])
                                      for r in read_metrics(self.metrics_path) if r["kind"] == "data"}
                                     if self.metrics_path.exists() else {})
        return self.trained_by_epoch

    def start_over(self) -> None:
        """A run started over from scratch (`--resume-fresh`): what earlier starts logged is dropped."""
        self.load_state_dict({COUNTS_STATE: {"skip_log_bytes": 0, "trained_by_epoch": {}}}, step=-1)

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if self.enabled:
            tqdm.write(text, file=sys.stderr)
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_file, "a") as log:
                log.write(text + "\n")

    def progress_bar(self, epoch: int, total: int, initial: int) -> tqdm:
        """The bar of the epoch whose index is `epoch` (0: the first), shown numbered from 1."""
        return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}", unit="step", dynamic_ncols=True,
                    disable=not self.enabled, file=sys.stderr, leave=True)

    def write_skips(self, records: list[dict[str, Any]], **extra: Any) -> None:
        """Append skip records (with this rank and `extra`) to the skip log; the main rank also prints the first
        few per split and epoch, each on its own line above the progress bar."""
        if not records:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # ranks append to one file: one O_APPEND write per line keeps every line whole
        fd = os.open(self.run_dir / SKIP_LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for record in records:
                os.write(fd, (json.dumps({**record, "rank": self.rank, **extra}) + "\n").encode())
        finally:
            os.close(fd)
        for record in records:
            split = record.get("split", "train")
            note = record["reason"] in NOTE_REASONS  # a note's samples trained
            key = (split, record.get("epoch"), note)
            self.skips_printed[key] = shown = self.skips_printed.get(key, 0) + 1
            where = ", ".join(f"{k} {record[k]}" for k in ("key", "line") if record.get(k) is not None)
            reason = record["reason"] if split == "train" else f"{record['reason']}, {split}"
            if shown <= MAX_SKIP_LINES:
                said = "noted" if note else "skipped"
                self.message(f"{said} ({reason}): {record['source']}" + (f" [{where}]" if where else ""))
            elif shown == MAX_SKIP_LINES + 1:
                more = f"more notes ({split})" if note else f"more skipped {split} samples"
                self.message(f"{more}: see {self.run_dir / SKIP_LOG_FILE}")

    def log_epoch_data(self, step: int, epoch: int, num_samples_seen: int, sources: Mapping[str, int] | None = None
                       ) -> None:
        """The `data` record of the finished epoch whose index is `epoch` (0: the first; it is numbered from 1 in the
        record and messages), after every rank wrote its skip records; `sources`: the samples each `::` source of a
        mixture contributed to it, as planned."""
        if self.enabled:
            trained = self._trained_by_epoch()
            earlier = sum(n for e, n in trained.items() if e < epoch + 1)
            record = epoch_data_record(self.run_dir, epoch + 1, num_samples_seen - earlier,
                                       self.carried_skips.get(epoch + 1, {}))
            trained[epoch + 1] = record["data/trained_samples"]
            for i, (name, count) in enumerate((sources or {}).items()):
                record[f"data/source/{i}"] = count
                self.message(f"data epoch {epoch + 1}: source {i} ({name}): {count} samples")
            self.log("data", step, epoch + 1.0, record)

    def finish(self, evals: list[dict[str, float]], counts: dict[str, int], plot: bool) -> None:
        """Curves, the before/after summary table, skip counts and the data summary (main rank)."""
        if not self.enabled:
            return
        records = read_metrics(self.metrics_path) if self.metrics_path.exists() else []
        if plot:
            plot_curves(records, self.run_dir / PLOT_FILE)
        if evals:
            print(summary_table(evals[0], evals[-1], counts))
        else:
            print("\n".join(f"{key}: {value}" for key, value in counts.items()))
        print(data_summary(records, self.run_dir / SKIP_LOG_FILE))
        print(f"outputs in {self.run_dir}")

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()


def folder_zeroshot_keys(record: Mapping[str, Any]) -> list[str]:
    """The `zeroshot/<folder name>/top1` and `top5` keys of an evaluation record, by folder name."""
    return sorted(key for key in record if key.startswith("zeroshot/") and key.count("/") == 2
                  and key.rsplit("/", 1)[1] in FOLDER_ZEROSHOT_METRICS)


OBJECTIVE_CURVE = "objective (train/loss)"


def loss_curves(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """The training curves of the loss plot, by label: the objective the steps optimise (`train/loss`), then each
    term's share of it (`loss/<term>`, from the step it is on), as (steps, values)."""
    train = [r for r in records if r["kind"] == "train"]
    keys = {"train/loss": OBJECTIVE_CURVE}
    for record in train:
        keys.update({key: key.split("/", 1)[1] for key in record if key.startswith("loss/") and key not in keys})
    curves = {}
    for key, label in keys.items():
        points = [(r["step"], r[key]) for r in train if key in r]
        if points:
            curves[label] = ([step for step, _ in points], [value for _, value in points])
    return curves


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
    curves = loss_curves(records)
    for label, (steps, values) in curves.items():
        ax_loss.plot(steps, values, lw=1.2 if label == OBJECTIVE_CURVE else 0.8, label=label,
                     **({} if label == OBJECTIVE_CURVE else {"alpha": 0.8}))
    ax_loss.set(xlabel="optimizer step", ylabel="window objective (before s(W))", title="training loss")
    ax_loss.grid(alpha=0.3)
    if len(curves) > 1:  # the objective and the terms it sums
        ax_loss.legend(loc="upper right", fontsize=8)
    for key, label in (("val/image_to_text_R@1", "image→text R@1"), ("val/text_to_image_R@1", "text→image R@1"),
                       ("val/image_to_text_R@10", "image→text R@10"), ("zeroshot/shape_top1", "zero-shot shape"),
                       ("zeroshot/colour_top1", "zero-shot colour")):
        points = [(r["step"], r[key]) for r in evals if key in r]
        if points:
            ax_eval.plot(*zip(*points, strict=True), marker="o", label=label)
    for key in sorted({key for r in evals for key in folder_zeroshot_keys(r)}):
        _, name, metric = key.split("/")
        points = [(r["step"], r[key]) for r in evals if key in r]
        ax_eval.plot(*zip(*points, strict=True), marker="o", ls="-" if metric == "top1" else "--",
                     label=f"zero-shot {name} top-{metric[3:]}")
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
    for key in (*SUMMARY_KEYS, *folder_zeroshot_keys(last)):
        if key not in last:
            continue
        chance = ""
        if key in SUMMARY_KEYS and key.startswith("zeroshot/"):
            chance = f"{last.get(key.replace('_top1', '_chance'), math.nan):.3f}"
        elif key == "probe/miou":
            chance = f"{last.get('probe/miou_chance', math.nan):.3f}"
        elif key.startswith("zeroshot/"):  # a folder's: top-k of its classes by chance
            top1 = last.get(f"{key.rsplit('/', 1)[0]}/chance", math.nan)
            chance = f"{min(1.0, int(key.rsplit('/top', 1)[1]) * top1):.3f}"
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
    """The run's skipped samples, each once: a sample re-read after a resume is not counted twice. A retried read
    (`read_retry`, `read_throttled`: naming no sample) is an event of its own, each one counted, as the loader counts
    them."""
    if not path.exists():
        return []
    seen, records = set(), []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        ident = tuple(str(record.get(k)) for k in ("split", "step", "epoch", "source", "key", "line", "reason"))
        if record.get("reason") in READ_NOTES or ident not in seen:
            seen.add(ident)
            records.append(record)
    return records


def _skips_by_epoch(saved: Mapping[Any, Mapping[str, int]]) -> dict[int, dict[str, int]]:
    return {int(epoch): {reason: int(count) for reason, count in skips.items()} for epoch, skips in saved.items()}


def train_skip_counts(records: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Skip records of the training split, counted by epoch (from 1) and reason."""
    counts: dict[int, dict[str, int]] = {}
    for skip in records:
        if skip.get("split", "train") == "train" and skip.get("epoch") is not None:
            epoch = counts.setdefault(int(skip["epoch"]), {})
            epoch[skip["reason"]] = epoch.get(skip["reason"], 0) + 1
    return counts


def epoch_data_record(run_dir: Path, epoch: int, trained_samples: int,
                      carried_skips: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The `data` record of finished epoch number `epoch` (from 1): samples trained in it (all ranks) and skipped by
    reason (training samples: the validation split's skips are in the skip log apart), those of the skip log and
    `carried_skips` (counted by the run whose checkpoint this one continues under another --name)."""
    record: dict[str, Any] = {"data/epoch": epoch, "data/trained_samples": trained_samples}
    skips = dict(carried_skips or {})
    for reason, count in train_skip_counts(read_skip_log(run_dir / SKIP_LOG_FILE)).get(epoch, {}).items():
        skips[reason] = skips.get(reason, 0) + count
    record.update({f"data/skipped/{reason}": count for reason, count in skips.items()})
    return record


def data_summary(records: list[dict[str, Any]], skip_log: Path) -> str:
    """Per epoch: samples trained, bad samples skipped by reason, and shard/plan problems apart."""
    epochs = {int(r["data/epoch"]): r for r in records if r["kind"] == "data"}
    lines = []
    for epoch, record in sorted(epochs.items()):
        skips = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("data/skipped/")}
        bad = {k: v for k, v in skips.items() if k not in NOT_SAMPLE_REASONS}
        other = {k: v for k, v in skips.items() if k in NOT_SAMPLE_REASONS and k not in NOTE_REASONS}
        noted = {k: v for k, v in skips.items() if k in NOTE_REASONS}
        line = f"epoch {epoch}: trained {record['data/trained_samples']} samples"
        sources = [f"source {k.rsplit('/', 1)[1]}: {v}" for k, v in record.items() if k.startswith("data/source/")]
        if sources:
            line += f" ({', '.join(sources)} planned)"
        line += f", skipped {sum(bad.values())} bad"
        if bad:
            line += " (" + ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) + ")"
        if other:
            line += "; " + ", ".join(f"{k}={v}" for k, v in sorted(other.items()))
        if noted:  # their samples trained
            line += "; noted: " + ", ".join(f"{k}={v}" for k, v in sorted(noted.items()))
        lines.append(line)
    if any("data/skipped/" in k for r in epochs.values() for k in r):
        lines.append(f"every skipped sample, with its file, key or line: {skip_log}")
    return "\n".join(lines) if lines else "no epoch finished"

"""`--report-to wandb`: a Weights & Biases run per training run, which every resume continues.

The run id is saved in the checkpoint (`state_dict`); a resume reopens that run and logs only the steps it lacks
(online the server says which, offline the run's earlier offline files do), those up to its checkpoint that a kill
kept wandb from writing taken from `metrics.jsonl`. wandb's own settings apply; online without an API key is an
error before training. Imported only when the sink is built (the `wandb` extra). docs/training.md#weights--biases.
"""

from __future__ import annotations

import logging
import os
import secrets
import string
import struct
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from naflexclip.train.sinks import METRICS_FILE, SinkContext, read_metrics

logger = logging.getLogger(__name__)

DEFAULT_PROJECT = "naflexclip"  # without --wandb-project-name or WANDB_PROJECT
# wandb-core writes an offline run's file every 15 s by default; a killed process loses what is not yet written
# (steps up to its last checkpoint the resume logs again from metrics.jsonl; later ones it trains again). A short
# interval keeps the offline file close to the run.
FLUSH_SECONDS = 1.0
FLUSH_SETTING, FLUSH_ENV = "x_transaction_log_flush_interval", "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ValueError("--report-to wandb: the wandb package is not installed; "
                         "pip install 'naflexclip[wandb]'") from None
    return wandb


def _settings_error(error: ValueError) -> str:
    """A wandb setting wandb refused, in one line: the variable that set it (WANDB_MODE for `mode`, WANDB__X for
    `x_x`, as wandb maps them), its value and what wandb takes instead."""
    errors = getattr(error, "errors", None)
    if not callable(errors) or not errors():
        return str(error).splitlines()[0]
    first = errors()[0]
    field = str(first["loc"][0]) if first.get("loc") else ""
    named = f"WANDB__{field[2:].upper()}" if field.startswith("x_") else f"WANDB_{field.upper()}"
    if os.environ.get(named) == first.get("input"):
        where = f"{named}={first['input']!r}"
    else:  # set another way: `wandb offline`'s settings file, another variable
        where = f"the wandb setting {field}={first.get('input')!r}"
    message = str(first.get("msg", ""))
    return f"{where} is not valid: {message[:1].lower()}{message[1:]}"


class WandbSink:
    """One W&B run: `log` sends each record's metrics at its optimizer step (names as in TensorBoard: `train/loss`,
    a bare `name` of kind `k` as `k/name`, plus `epoch`). The run starts at the first record, or at
    `load_state_dict` when resuming."""

    def __init__(self, ctx: SinkContext) -> None:
        self.wandb = _import_wandb()
        self.ctx = ctx
        self.run: Any = None
        # wandb's form of a run id: 8 lowercase letters and digits
        self.run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.last_step = -1  # the last step this run holds (as far as this process knows)
        self.first_step = 0  # records below this step are in the run already
        try:
            settings = self.wandb.setup().settings
        except ValueError as error:  # pydantic's ValidationError of wandb's Settings, from WANDB_* or its files
            raise ValueError(f"--report-to wandb: {_settings_error(error)}") from None
        if settings.mode not in ("offline", "dryrun", "disabled") and not self.wandb.login(prompt=False,
                                                                                            verify=False):
            raise ValueError("--report-to wandb: no W&B API key; run `wandb login` (or set WANDB_API_KEY), or set "
                             "WANDB_MODE=offline to log locally and `wandb sync` later")

    def _start(self, resuming: bool) -> None:
        wandb, config = self.wandb, self.ctx.config
        settings = {}
        if FLUSH_SETTING in wandb.Settings.model_fields and FLUSH_ENV not in os.environ:
            settings[FLUSH_SETTING] = FLUSH_SECONDS
        try:
            self.run = wandb.init(
                project=config.get("wandb_project_name") or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=self.ctx.name,
                notes=config.get("wandb_notes") or None, config=dict(config), id=self.run_id, resume="allow",
                dir=None if "WANDB_DIR" in os.environ else str(self.ctx.run_dir), reinit="create_new",
                settings=wandb.Settings(**settings),
            )
        except wandb.Error as error:  # e.g. online with no network: a timeout after init_timeout
            raise ValueError(f"--report-to wandb: W&B could not start run {self.run_id}: "
                             f"{str(error).splitlines()[0]} (WANDB_MODE=offline logs locally)") from None
        if not resuming or self.run.disabled:
            return
        # the first step the run does not have: the server's, or after the earlier offline files of the run
        held = self.run.starting_step - 1
        if self.run.offline:
            own = Path(self.run.settings.sync_dir)
            for path in own.parent.glob(f"offline-run-*-{self.run_id}/run-{self.run_id}.wandb"):
                if path.parent != own:
                    held = max([held, *history_steps(path)])
        if held < self.last_step:
            self._fill(held)
        elif held > self.last_step:
            logger.warning(f"wandb: run {self.run_id} already has steps up to {held} (logged before the stop); "
                           f"this resume logs from step {held + 1}")
        self.first_step = max(self.first_step, held + 1)
        self.last_step = max(self.last_step, held)

    def _fill(self, held: int) -> None:
        """Log the steps `held + 1 .. last_step`, which the stopped process logged before its checkpoint but wandb
        had not written when it stopped, from the run's record (`metrics.jsonl`, cut back to the checkpoint)."""
        path = self.ctx.run_dir / METRICS_FILE
        records = [r for r in (read_metrics(path) if path.exists() else []) if held < r["step"] <= self.last_step]
        for record in records:
            metrics = {k: v for k, v in record.items() if k not in ("kind", "step", "epoch")}
            self._log_row(record["kind"], record["step"], record["epoch"], metrics)
        if records:
            logger.warning(f"wandb: run {self.run_id} lacked the steps {held + 1}..{self.last_step} the stopped "
                           f"process logged (not yet written when it stopped): logged them from {path}")
        else:
            logger.warning(f"wandb: run {self.run_id} lacks the steps {held + 1}..{self.last_step} the stopped process "
                           f"logged: it had not written them yet (or its files are elsewhere), and {path} has none")

    def _log_row(self, kind: str, step: int, epoch: float, metrics: Mapping[str, Any]) -> None:
        row = {key if "/" in key else f"{kind}/{key}": value for key, value in metrics.items()}
        self.run.log({"epoch": epoch, **row}, step=step)

    def log(self, kind: str, step: int, epoch: float, metrics: Mapping[str, float]) -> None:
        if self.run is None:
            self._start(resuming=False)
        if step < self.first_step:
            return
        self._log_row(kind, step, epoch, metrics)
        self.last_step = max(self.last_step, step)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Continue the saved run after `step` (a state without a run id, from a run that did not report to
        wandb, starts a new run)."""
        if self.run is not None:
            raise RuntimeError("WandbSink.load_state_dict: the run has started already")
        if state.get("run_id"):
            self.run_id = state["run_id"]
            self.last_step = int(state["last_step"])
        self.first_step = step + 1
        self._start(resuming=bool(state.get("run_id")))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


# The `.wandb` file of a run is wandb's transaction log: LevelDB's log framing (32 KiB blocks of chunks, each a
# CRC-32, a length and a type: full, first, middle or last) after a 7-byte header, around `wandb.proto` Records.
_HEADER = struct.Struct("<4sHB")  # b":W&B", 0xBEE1, version 0
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_run_file(path: Path) -> Iterator[Any]:
    """The `wandb.proto` Records of a `.wandb` file, up to the first torn or damaged chunk (a killed process's
    last write)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _HEADER.size or _HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        raise ValueError(f"{path}: not a wandb run file")
    pos, parts = _HEADER.size, []
    while True:
        if _BLOCK - pos % _BLOCK < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
        if pos + _CHUNK.size > len(data):
            return
        checksum, length, kind = _CHUNK.unpack_from(data, pos)
        chunk = data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            return
        pos += _CHUNK.size + length
        if kind in (_FULL, _FIRST):
            parts = [chunk]
        elif kind in (_MIDDLE, _LAST) and parts:
            parts.append(chunk)
        if kind in (_FULL, _LAST) and parts:
            yield wandb_internal_pb2.Record.FromString(b"".join(parts))
            parts = []


def history_steps(path: Path) -> list[int]:
    """The `_step` of every history row in a `.wandb` file, in order."""
    steps = []
    for record in read_run_file(path):
        if record.WhichOneof("record_type") == "history":
            steps += [int(item.value_json) for item in record.history.item
                      if item.key == "_step" or list(item.nested_key) == ["_step"]]  # older and newer wandb
    return steps

"""`--report-to wandb` with the real wandb package, offline: runs read back with wandb's own reader
(`wandb leet inspect --json`), across resumes and a killed process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_loop import TINY_DATA_FLAGS

from naflexclip.checkpoints import storage as ckpt
from naflexclip.cli import main
from naflexclip.train.report import Reporter
from naflexclip.train.sinks import SinkContext
from naflexclip.train.wandb_sink import WandbSink, history_steps

wandb = pytest.importorskip("wandb")

CONFIG = {"lr": 0.001, "epochs": 2, "data": {"workers": 0}, "wandb_project_name": "proj", "wandb_notes": "a note"}


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Offline, quiet and kept inside tmp_path; wandb reads its environment once per process, so each test
    starts from a torn-down wandb."""
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    env = {"WANDB_MODE": "offline", "WANDB_CONSOLE": "off", "WANDB_SILENT": "true", "WANDB__DISABLE_STATS": "true",
           "WANDB__DISABLE_META": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    wandb.teardown()
    yield env
    wandb.teardown()


def _context(run_dir: Path, config: dict | None = None) -> SinkContext:
    return SinkContext(run_dir=run_dir, config=dict(config or CONFIG), name="my-run")


def _log_steps(sink: WandbSink, steps: range) -> None:
    for step in steps:
        sink.log("train", step, step / 10, {"train/loss": 10.0 - step, "lr": 0.5})


def read_back(run_dir: Path) -> list[list[dict]]:
    """Every offline run file under run_dir/wandb, in start order, as wandb's own reader prints its records."""
    return read_back_files(sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")))


def read_back_files(files: list[Path]) -> list[list[dict]]:
    """These offline run files' records, as wandb's own reader prints them."""
    runs = []
    for path in files:
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                             capture_output=True, text=True, check=True).stdout
        runs.append([json.loads(line) for line in out.splitlines() if line.strip()])
    return runs


def _run_ids(runs: list[list[dict]]) -> set[str]:
    return {r["run"]["run_id"] for records in runs for r in records if r["type"] == "run"}


def _history(runs: list[list[dict]]) -> list[dict]:
    return [r["history"]["item"] for records in runs for r in records if r["type"] == "history"]


def test_a_run_logs_every_record_at_its_step_with_the_config_once(tmp_path: Path) -> None:
    sink = WandbSink(_context(tmp_path))
    _log_steps(sink, range(1, 5))
    sink.log("eval", 4, 0.4, {"val/image_to_text_R@1": 0.25})
    state = sink.state_dict()
    sink.close()
    [records] = read_back(tmp_path)
    assert _run_ids([records]) == {state["run_id"]} and state["last_step"] == 4
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "proj" and run["display_name"] == "my-run" and run["notes"] == "a note"
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == CONFIG
    assert not [r for r in records if r["type"] == "config" and set(r["config"].get("update", {})) - {"_wandb"}]
    history = _history([records])
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    # a bare name gets its kind, as in TensorBoard; records of one step share its row
    assert history[0]["train/loss"] == 9.0 and history[0]["train/lr"] == 0.5 and history[0]["epoch"] == 0.1
    assert history[-1]["val/image_to_text_R@1"] == 0.25 and history[-1]["train/loss"] == 6.0
    # this module's reader of the file agrees with wandb's
    assert history_steps(next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == [1, 2, 3, 4]


def test_a_resume_continues_the_run_and_each_step_is_in_it_once(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A process saves at step 5, logs steps 6-7 and stops; the resume at step 5 logs from step 8, where
    the run has nothing yet."""
    first = WandbSink(_context(tmp_path))
    _log_steps(first, range(1, 6))
    checkpoint = first.state_dict()
    _log_steps(first, range(6, 8))
    first.close()
    second = WandbSink(_context(tmp_path, {**CONFIG, "epochs": 3}))
    with caplog.at_level(logging.WARNING):
        second.load_state_dict(checkpoint, step=5)
    assert "already has steps up to 7" in caplog.text and "logs from step 8" in caplog.text
    _log_steps(second, range(6, 11))
    assert second.state_dict() == {"run_id": checkpoint["run_id"], "last_step": 10}
    second.close()
    runs = read_back(tmp_path)
    assert len(runs) == 2 and _run_ids(runs) == {checkpoint["run_id"]}
    history = _history(runs)
    assert [row["_step"] for row in history] == list(range(1, 11))
    assert [row["train/loss"] for row in history] == [10.0 - s for s in range(1, 11)]
    # the resumed process states its flags (a resume may change some)
    [resumed] = [r["run"] for r in runs[1] if r["type"] == "run"]
    assert resumed["config"]["update"]["epochs"] == 3 and resumed["run_id"] == checkpoint["run_id"]


def test_resumes_after_resumes_keep_one_run(tmp_path: Path) -> None:
    state, step = None, 0
    for stop in (3, 6, 9):
        sink = WandbSink(_context(tmp_path))
        if state is not None:
            sink.load_state_dict(state, step=step)
        _log_steps(sink, range(step + 1, stop + 1))
        state, step = sink.state_dict(), stop
        sink.close()
    runs = read_back(tmp_path)
    assert len(runs) == 3 and len(_run_ids(runs)) == 1
    assert [row["_step"] for row in _history(runs)] == list(range(1, 10))


def test_a_checkpoint_without_a_wandb_run_starts_one(tmp_path: Path) -> None:
    """Resuming, with --report-to wandb, a run that did not report to wandb: a new run from the resumed step."""
    sink = WandbSink(_context(tmp_path))
    sink.load_state_dict({}, step=4)
    _log_steps(sink, range(3, 7))
    sink.close()
    runs = read_back(tmp_path)
    assert _run_ids(runs) == {sink.state_dict()["run_id"]}
    assert [row["_step"] for row in _history(runs)] == [5, 6]


def test_a_resume_says_when_the_run_lacks_steps_the_checkpoint_logged(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    first = WandbSink(_context(tmp_path))
    _log_steps(first, range(1, 4))
    first.close()
    (tmp_path / "wandb").rename(tmp_path / "elsewhere")
    second = WandbSink(_context(tmp_path))
    with caplog.at_level(logging.WARNING):
        second.load_state_dict(first.state_dict(), step=3)
    second.close()
    assert f"run {first.state_dict()['run_id']} lacks the steps 0..3" in caplog.text


def test_a_resume_logs_the_steps_wandb_had_not_written_from_metrics_jsonl(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The stopped process logged steps 1-10 and saved at step 10, but its wandb file holds only 1-8 (wandb had
    not written 9-10 when it was killed); metrics.jsonl, the run's record, has all ten. The resume logs 9-10
    from it, then its own steps: the run holds each step once, with metrics.jsonl's values."""
    reporter = Reporter(tmp_path, report_to="wandb", config=CONFIG, name="my-run")
    wandb_sink = reporter.sinks.pop("wandb")  # the steps wandb wrote before the kill
    for step in range(1, 11):
        if step <= 8:
            _log_steps(wandb_sink, range(step, step + 1))
        reporter.log("train", step, step / 10, {"train/loss": 10.0 - step, "lr": 0.5})
    reporter.log("eval", 10, 1.0, {"val/image_to_text_R@1": 0.25})
    checkpoint = {**reporter.state_dict(), "wandb": {"run_id": wandb_sink.run_id, "last_step": 10}}
    reporter.log("train", 11, 1.1, {"train/loss": -1.0, "lr": 0.5})  # after the checkpoint: trained again
    wandb_sink.close()
    resumed = Reporter(tmp_path, report_to="wandb", config=CONFIG, name="my-run")
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(checkpoint, step=10)
    assert "lacked the steps 9..10" in caplog.text and "metrics.jsonl" in caplog.text
    for step in range(11, 13):
        resumed.log("train", step, step / 10, {"train/loss": 10.0 - step, "lr": 0.5})
    for sink in resumed.sinks.values():
        sink.close()
    runs = read_back(tmp_path)
    assert len(runs) == 2 and _run_ids(runs) == {wandb_sink.run_id}
    history = _history(runs)
    assert [row["_step"] for row in history] == list(range(1, 13))
    assert [row["train/loss"] for row in history] == [10.0 - s for s in range(1, 13)]
    assert history[9]["val/image_to_text_R@1"] == 0.25 and history[9]["epoch"] == 1.0
    assert history[8]["train/lr"] == 0.5


KILLED_PROCESS = """
import json, sys, time
from pathlib import Path
from naflexclip.train.report import Reporter
from naflexclip.train.sinks import SinkContext
from naflexclip.train.wandb_sink import WandbSink
run_dir = Path(sys.argv[1])
sink = WandbSink(SinkContext(run_dir=run_dir, config={"lr": 0.001}, name="killed"))
for step in range(1, 10):
    sink.log("train", step, step / 10, {"train/loss": 10.0 - step})
    if step == 5:
        (run_dir / "checkpoint.json").write_text(json.dumps(sink.state_dict()))
time.sleep({wait})
print("logged", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_killed_process_is_continued_with_each_step_once(tmp_path: Path, wandb_offline: dict) -> None:
    """SIGKILL after steps 6-9 (logged after the step-5 checkpoint) reached the offline file: the resume adds 10-12."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, **wandb_offline, "PYTHONPATH": src}
    process = subprocess.Popen([sys.executable, "-c", KILLED_PROCESS.replace("{wait}", "3"), str(tmp_path)],
                               env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "logged"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    sink = WandbSink(_context(tmp_path))
    sink.load_state_dict(checkpoint, step=5)
    _log_steps(sink, range(6, 13))
    sink.close()
    runs = read_back(tmp_path)
    assert len(runs) == 2 and _run_ids(runs) == {checkpoint["run_id"]}
    assert not [r for r in runs[0] if r["type"] == "exit"]  # the first process never finished its run
    assert [row["_step"] for row in _history(runs)] == list(range(1, 13))


KILLED_BEFORE_WANDB_WROTE = """
import json, sys, time
from pathlib import Path
from naflexclip.train.report import Reporter
run_dir = Path(sys.argv[1])
reporter = Reporter(run_dir, report_to="wandb", config={"lr": 0.001}, name="killed")
for step in range(1, 10):
    reporter.log("train", step, step / 10, {"train/loss": 10.0 - step})
    if step == 5:
        (run_dir / "checkpoint.json").write_text(json.dumps(reporter.state_dict()))
print("logged", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_steps_wandb_had_not_written_at_a_kill_are_logged_by_the_resume(tmp_path: Path, wandb_offline: dict) -> None:
    """SIGKILL before wandb wrote any step (a flush interval of 60 s): the steps up to the step-5 checkpoint come
    from metrics.jsonl, the later ones are logged again as the resumed run trains them."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, **wandb_offline, "PYTHONPATH": src, "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "60"}
    process = subprocess.Popen([sys.executable, "-c", KILLED_BEFORE_WANDB_WROTE, str(tmp_path)], env=env,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "logged"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    [killed] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert history_steps(killed) == []  # what the kill lost
    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    resumed = Reporter(tmp_path, report_to="wandb", config={"lr": 0.001}, name="killed")
    resumed.load_state_dict(checkpoint, step=5)
    for step in range(6, 13):
        resumed.log("train", step, step / 10, {"train/loss": 10.0 - step})
    resumed.sinks["wandb"].close()
    [own] = set((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")) - {killed}
    # wandb's service may still be writing the offline file when close() returns (seen under a loaded -n 2 run)
    deadline = time.monotonic() + 60
    while history_steps(own) != list(range(1, 13)) and time.monotonic() < deadline:
        time.sleep(1)
    assert history_steps(own) == list(range(1, 13))
    [records] = read_back_files([own])
    assert [row["train/loss"] for row in _history([records])] == [10.0 - s for s in range(1, 13)]


def test_disabled_mode_logs_nothing_and_resumes_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = WandbSink(_context(tmp_path))
    _log_steps(sink, range(1, 4))
    state = sink.state_dict()
    sink.close()
    resumed = WandbSink(_context(tmp_path))
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(state, step=2)
    _log_steps(resumed, range(3, 5))
    resumed.close()
    assert not (tmp_path / "wandb").exists()
    assert not [r for r in caplog.records if r.name.startswith("naflexclip")]


def test_online_without_an_api_key_is_a_one_line_error_not_a_prompt(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(ValueError, match=r"^--report-to wandb: no W&B API key.*WANDB_MODE=offline") as error:
        WandbSink(_context(tmp_path))
    assert "\n" not in str(error.value)


def test_a_bad_wandb_setting_is_one_line_naming_the_variable_its_value_and_the_choices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match=r"^--report-to wandb: WANDB_MODE='bogus' is not valid: .*'online', "
                                         r"'offline'.*'disabled'") as error:
        WandbSink(_context(tmp_path))
    assert "\n" not in str(error.value) and "validation error" not in str(error.value)


@pytest.mark.slow
def test_online_with_no_network_is_a_one_line_error_after_wandbs_timeout(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    sink = WandbSink(_context(tmp_path))
    with pytest.raises(ValueError, match=r"^--report-to wandb: W&B could not start run \w{8}: .*WANDB_MODE=offline"):
        sink.log("train", 1, 0.1, {"train/loss": 1.0})


def test_a_missing_wandb_package_names_the_flag_and_the_extra(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"^--report-to wandb: .*pip install 'naflexclip\[wandb\]'"):
        WandbSink(_context(tmp_path))


@pytest.mark.slow
def test_training_reports_one_wandb_run_with_each_step_once_across_a_crash_and_resume(tmp_path: Path) -> None:
    """`naflexclip train --report-to wandb,tensorboard` offline; the process dies after logging step 5 but before
    saving it; `--resume latest` continues the same W&B run, which has every step of metrics.jsonl once."""
    flags = ["train", "--model", "tiny", "--epochs", "2", "--warmup", "2", "--device", "cpu", "--zero-shot-samples",
             "16", "--val-frequency", "0", "--no-plot", *TINY_DATA_FLAGS, "--logs", str(tmp_path), "--name", "run",
             "--report-to", "wandb,tensorboard", "--wandb-project-name", "proj", "--wandb-notes", "a LiT run"]
    assert main([*flags, "--save-every-n-steps", "2", "--stop-after-steps", "5"]) == 0
    run_dir = tmp_path / "run"
    shutil.rmtree(run_dir / "checkpoints" / "step_00000005")
    assert main([*flags, "--resume", "latest"]) == 0
    runs = read_back(run_dir)
    state = ckpt.load_checkpoint(ckpt.find_latest(run_dir / "checkpoints")).states
    assert len(runs) == 2 and _run_ids(runs) == {state["reporter"]["wandb"]["run_id"]}
    history = {row["_step"]: row for row in _history(runs)}
    assert len(history) == len(_history(runs))  # each step once
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(history) == sorted({r["step"] for r in records})
    train = [r for r in records if r["kind"] == "train"]
    assert 5 in [r["step"] for r in train] and all(history[r["step"]]["train/loss"] == r["train/loss"] for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(history[r["step"]]["val/image_to_text_R@1"] == r["val/image_to_text_R@1"] for r in evals)
    [first, resumed] = [[r["run"] for r in records if r["type"] == "run"][0] for records in runs]
    assert first["project"] == resumed["project"] == "proj" and first["notes"] == "a LiT run"
    assert first["config"]["update"]["report_to"] == "wandb,tensorboard"
    assert any((run_dir / "tensorboard").iterdir())

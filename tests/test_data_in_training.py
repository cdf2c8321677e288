"""Data trust inside a training run: skipped_samples.jsonl, the per-epoch summary without validation data, and
two ranks sharing too little data (gloo, torchrun). The two-rank run with a missing image that used to leave ranks
waiting on each other is test_rank_agreement's test_a_missing_image_on_one_rank_trains_its_7_pairs_in_seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest_data import image_bytes

from naflexclip.cli import main

# with --train-data the defaults are OpenCLIP's: these tests keep the demo's (fp32, accum 2, divisor 1, ...)
RUN = ["--model", "tiny", "--warmup", "1", "--device", "cpu", "--naflex-seq-lens", "16", "32",
       "--naflex-max-tokens-per-batch", "32", "--workers", "0", "--precision", "fp32", "--accum-freq", "2",
       "--naflex-batch-divisor", "1", "--log-metric-every-n-steps", "1", "--grad-clip-norm", "1", "--lr", "1e-3",
       "--wd", "0.1"]


def eight_rows_one_missing(root: Path) -> str:
    rows = ["filepath\ttitle"]
    for i in range(8):
        if i != 5:
            (root / f"i{i}.png").write_bytes(image_bytes(16, 16 + 2 * i, seed=i))
        rows.append(f"i{i}.png\ta picture number {i}")
    (root / "data.tsv").write_text("\n".join(rows) + "\n")
    return str(root / "data.tsv")


def test_a_run_names_every_skipped_sample_and_sums_up_each_epoch(tmp_path, capsys):
    table = eight_rows_one_missing(tmp_path)
    (tmp_path / "i2.png").write_bytes(b"not a png")  # broken only when decoded
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. matplotlib's "no artists with labels" on empty plots
        code = main(["train", *RUN, "--epochs", "2", "--accum-freq", "2", "--train-data", table,
                     "--logs", str(tmp_path), "--name", "run"])
    assert code == 0
    out = capsys.readouterr()
    log = [json.loads(line) for line in (tmp_path / "run" / "skipped_samples.jsonl").read_text().splitlines()]
    # epochs are numbered from 1 everywhere: skip log, data records, progress bar, closing summary
    assert sorted((r["epoch"], r["reason"], r["key"], r["line"]) for r in log) == [
        (1, "missing_file", "i5.png", 7), (1, "not_an_image", "i2.png", 4),
        (2, "missing_file", "i5.png", 7), (2, "not_an_image", "i2.png", 4)]
    assert all(r["source"] == table for r in log)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["data/epoch"], r["epoch"]) for r in metrics if r["kind"] == "data"] == [(1, 1.0), (2, 2.0)]
    assert "epoch 1: 100%" in out.err and "epoch 2: 100%" in out.err and "epoch 0" not in out.err
    assert "epoch 1: trained 6 samples, skipped 2 bad (missing_file=1, not_an_image=1)" in out.out
    assert "epoch 2: trained 6 samples" in out.out and "skipped_samples.jsonl" in out.out
    assert "skipped (missing_file): " in out.err  # each on its own line, not inside the progress bar
    assert (tmp_path / "run" / "curves.png").exists()


def test_validation_skips_are_in_the_skip_log_apart_from_training(tmp_path, capsys):
    train_dir, val_dir = tmp_path / "train", tmp_path / "val"
    train_dir.mkdir()
    val_dir.mkdir()
    train_table, val_table = eight_rows_one_missing(train_dir), eight_rows_one_missing(val_dir)
    code = main(["train", *RUN, "--no-plot", "--epochs", "1", "--train-data", train_table, "--val-data", val_table,
                 "--logs", str(tmp_path), "--name", "run"])
    assert code == 0
    out = capsys.readouterr()
    log = [json.loads(line) for line in (tmp_path / "run" / "skipped_samples.jsonl").read_text().splitlines()]
    assert sorted((r["split"], r["key"]) for r in log if r["source"] == train_table) == [("train", "i5.png")]
    # both evaluations (before step 1, after the epoch) left out the validation row, each naming its step
    val = [r for r in log if r["source"] == val_table]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in metrics if r["kind"] == "train")
    assert sorted((r["split"], r["step"], r["reason"], r["key"], r["line"], r["rank"]) for r in val) == [
        ("val", 0, "missing_file", "i5.png", 7, 0), ("val", last, "missing_file", "i5.png", 7, 0)]
    assert "epoch 1: trained 7 samples, skipped 1 bad (missing_file=1)" in out.out  # the epoch counts training only
    assert f"skipped (missing_file, val): {val_table} [key i5.png, line 7]" in out.err


def test_resume_with_other_workers_trains_the_same_weights(tmp_path):
    """Broken rows make the loader split microbatches; a run stopped mid-epoch and resumed with another
    --workers ends with the weights of the uninterrupted run."""
    import torch

    from naflexclip.checkpoints.storage import find_latest, load_checkpoint
    from naflexclip.data import DataConfig
    from naflexclip.train.config.train_config import TrainConfig
    from naflexclip.train.loop import train

    rows = ["filepath\ttitle"]
    for i in range(16):
        (tmp_path / f"i{i}.png").write_bytes(image_bytes(16, 16 + i, seed=i) if i % 3 else b"broken")
        rows.append(f"i{i}.png\ta picture number {i}")
    (tmp_path / "t.tsv").write_text("\n".join(rows) + "\n")

    def config(name: str, workers: int, **overrides) -> TrainConfig:
        data = DataConfig(train_data=str(tmp_path / "t.tsv"), naflex_seq_lens=(16,), naflex_max_tokens_per_batch=32,
                          workers=workers)
        return TrainConfig(data=data, model="tiny", epochs=1, accum_freq=1, lr=1e-3, warmup=1, logs=str(tmp_path),
                           name=name, device="cpu", val_frequency=0, plot=False, **overrides)

    train(config("straight", 0))
    train(config("split", 0, stop_after_steps=3))
    halfway = load_checkpoint(find_latest(tmp_path / "split" / "checkpoints")).states
    assert halfway["progress"]["next_batch"] == 3
    train(config("split", 2, resume="latest"))
    state_a = load_checkpoint(find_latest(tmp_path / "straight" / "checkpoints")).states
    state_b = load_checkpoint(find_latest(tmp_path / "split" / "checkpoints")).states
    straight, split = state_a["model"], state_b["model"]
    assert state_a["progress"] == state_b["progress"]
    assert all(torch.equal(straight[k], split[k]) for k in straight)
    from naflexclip.train.report import read_skip_log

    log = read_skip_log(tmp_path / "split" / "skipped_samples.jsonl")
    assert sorted(r["key"] for r in log) == [f"i{i}.png" for i in (0, 12, 15, 3, 6, 9)]  # each once
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    (data,) = [r for r in records if r["kind"] == "data"]
    assert data["data/trained_samples"] == 10 and data["data/skipped/not_an_image"] == 6


def test_a_validation_set_with_more_broken_images_than_its_planned_batches_allow_still_evaluates(tmp_path, capsys):
    """Validation runs on one rank, so its microbatch count need not match anyone's: broken images that leave
    it fewer usable samples than planned microbatches shrink the evaluation (counted, logged) instead of
    stopping the run — only training ranks must run equally many microbatches."""
    train_dir, val_dir = tmp_path / "train", tmp_path / "val"
    train_dir.mkdir()
    val_dir.mkdir()
    train_table, val_table = eight_rows_one_missing(train_dir), eight_rows_one_missing(val_dir)
    for broken in ("i1.png", "i2.png", "i3.png"):  # found only when decoded, after the plan was made
        (val_dir / broken).write_bytes(b"not a png")
    code = main(["train", *RUN, "--no-plot", "--epochs", "1", "--naflex-seq-len-probs", "0", "1",
                 "--train-data", train_table, "--val-data", val_table, "--logs", str(tmp_path), "--name", "run"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    log = [json.loads(line) for line in (tmp_path / "run" / "skipped_samples.jsonl").read_text().splitlines()]
    val = {(r["step"], r["reason"], r["key"]) for r in log if r["source"] == val_table}
    assert {key for _, reason, key in val if reason == "not_an_image"} == {"i1.png", "i2.png", "i3.png"}


def test_a_run_on_a_shard_cut_inside_its_last_sample_trains_every_whole_sample(tmp_path, capsys):
    """The shard's download died inside the image of its last sample: the sample before it is whole and trains;
    the cut one is named in skipped_samples.jsonl and counted in the epoch's summary."""
    from conftest_data import truncate_inside_last_member, write_tar

    members = [m for j in range(5) for m in ((f"k{j}.png", image_bytes(16, 16 + j, seed=j)), (f"k{j}.txt", b"a pic"))]
    write_tar(str(tmp_path / "shard.tar"), members[:-1])
    truncate_inside_last_member(str(tmp_path / "shard.tar"))  # k4's image cut, its caption never written
    code = main(["train", *RUN, "--no-plot", "--epochs", "1", "--train-data", str(tmp_path / "shard.tar"),
                 "--logs", str(tmp_path), "--name", "run"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    log = [json.loads(line) for line in (tmp_path / "run" / "skipped_samples.jsonl").read_text().splitlines()]
    assert sorted(((r["key"], r["reason"]) for r in log), key=repr) == [
        ("k4", "truncated_sample"), (None, "truncated_shard")]
    assert "epoch 1: trained 4 samples, skipped 1 bad (truncated_sample=1)" in out.out


def _one_row_table(root: Path) -> str:
    (root / "only.png").write_bytes(image_bytes(16, 16))
    (root / "one.tsv").write_text("filepath\ttitle\nonly.png\tthe only picture\n")
    return str(root / "one.tsv")


def test_one_usable_sample_is_refused_in_one_line_not_trained_at_loss_0(tmp_path, capsys):
    code = main(["train", *RUN, "--epochs", "1", "--train-data", _one_row_table(tmp_path), "--logs", str(tmp_path),
                 "--name", "one"])
    err = capsys.readouterr().err
    assert code == 2 and "1 usable sample" in err and "at least 2" in err
    assert not (tmp_path / "one" / "checkpoints").exists()


def test_fewer_samples_than_ranks_is_refused_on_every_rank(tmp_path):
    from naflexclip.data import DataConfig, DataError, build_loader

    cfg = DataConfig(train_data=_one_row_table(tmp_path), naflex_seq_lens=(16,), naflex_max_tokens_per_batch=32,
                     workers=0)
    for rank in range(2):  # each of two ranks would train 0 samples and save a checkpoint
        with pytest.raises(DataError, match="1 usable sample for 2 ranks"):
            build_loader(cfg, split="train", patch_size=8, context_length=16, rank=rank, world_size=2)


@pytest.mark.slow
def test_a_mixture_run_reports_each_sources_samples_per_epoch(tmp_path, capsys):
    from conftest_data import write_tar

    specs = []
    for name, n in (("a", 6), ("b", 4)):
        write_tar(str(tmp_path / f"{name}.tar"), [m for i in range(n) for m in (
            (f"{name}{i}.png", image_bytes(16, 16, seed=i)), (f"{name}{i}.txt", f"{name} picture {i}".encode()))])
        specs.append(str(tmp_path / f"{name}.tar"))
    code = main(["train", *RUN, "--no-plot", "--epochs", "2", "--train-data", "::".join(specs),
                 "--train-data-upsampling-factors", "1::0.5", "--logs", str(tmp_path), "--name", "mix"])
    assert code == 0
    out = capsys.readouterr()
    records = [json.loads(line) for line in (tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()]
    data = [r for r in records if r["kind"] == "data"]
    assert [(r["data/source/0"], r["data/source/1"], r["data/trained_samples"]) for r in data] == [(6, 2, 8)] * 2
    assert "epoch 1: trained 8 samples (source 0: 6, source 1: 2 planned)" in out.out
    assert f"source 1 ({specs[1]}): 2 samples" in out.err


@pytest.mark.slow
def test_two_ranks_with_one_sample_stop_in_one_line_without_a_checkpoint(tmp_path):
    """torchrun, 2 processes, a table of one usable pair: it trained 0 samples, exited 0 and saved a checkpoint."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "naflexclip", "train", *RUN, "--no-plot", "--epochs", "1", "--train-data", _one_row_table(tmp_path),
           "--dist-timeout", "60", "--logs-dir", str(tmp_path), "--name", "one"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0
    assert "has 1 usable sample for 2 ranks: a contrastive step needs at least 2" in result.stderr
    assert result.stderr.count("naflexclip train: error: training data") == 2  # one line per rank, no traceback
    assert "naflexclip/data" not in result.stderr  # (torchrun's own failure report follows)
    assert not (tmp_path / "one" / "checkpoints").exists()


def _broken_rows_table(root: Path) -> str:
    """16 rows, every third image broken (found when decoded): 10 trained and 6 skipped per epoch."""
    rows = ["filepath\ttitle"]
    for i in range(16):
        (root / f"i{i}.png").write_bytes(image_bytes(16, 16 + i, seed=i) if i % 3 else b"broken")
        rows.append(f"i{i}.png\ta picture number {i}")
    (root / "t.tsv").write_text("\n".join(rows) + "\n")
    return str(root / "t.tsv")


def _counting_config(root: Path, name: str, **overrides):
    from naflexclip.data import DataConfig
    from naflexclip.train.config.train_config import TrainConfig

    data = DataConfig(train_data=_broken_rows_table(root), naflex_seq_lens=(16,), naflex_max_tokens_per_batch=32,
                      workers=0)
    return TrainConfig(data=data, model="tiny", epochs=2, accum_freq=1, lr=1e-3, warmup=1, logs=str(root),
                       name=name, device="cpu", val_frequency=0, plot=False, **overrides)


def _epoch_counts(run_dir: Path) -> list[dict]:
    """Each epoch's data record: samples trained and skipped by reason."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("data/")} for r in records if r["kind"] == "data"]


def _skip_lines(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "skipped_samples.jsonl").read_text().splitlines()
    return sorted((r["epoch"], r["key"], r["reason"]) for r in map(json.loads, lines))


@pytest.fixture(scope="module")
def straight_counted_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epochs of 10 trained and 6 skipped samples, uninterrupted."""
    from naflexclip.train.loop import train

    root = tmp_path_factory.mktemp("straight")
    train(_counting_config(root, "straight"))
    return root / "straight"


def test_a_resume_under_a_new_name_counts_each_epoch_as_the_uninterrupted_run(straight_counted_run, tmp_path,
                                                                               capsys):
    """--resume of another run's checkpoint taken in epoch 2, under a new --name: the new run's epoch record and
    summary count the samples of that epoch once (trained and skipped), as the straight run does."""
    from naflexclip.checkpoints.storage import find_latest
    from naflexclip.train.loop import train

    straight = _epoch_counts(straight_counted_run)
    assert [r["data/trained_samples"] for r in straight] == [10, 10]
    steps_per_epoch = next(json.loads(line)["step"] for line in
                           (straight_counted_run / "metrics.jsonl").read_text().splitlines() if '"data"' in line)
    train(_counting_config(tmp_path, "cut", stop_after_steps=steps_per_epoch + 3))
    capsys.readouterr()
    train(_counting_config(tmp_path, "new", resume=str(find_latest(tmp_path / "cut" / "checkpoints"))))
    assert _epoch_counts(tmp_path / "new") == straight[1:]
    assert "epoch 2: trained 10 samples, skipped 6 bad (not_an_image=6)" in capsys.readouterr().out


def test_a_resume_cuts_the_skip_log_back_to_the_checkpoint(straight_counted_run, tmp_path):
    """A run that died after its last save had logged skips of samples it trains again when resumed: the resume
    cuts skipped_samples.jsonl back to the checkpoint, so every skip is in it once, as in the uninterrupted run."""
    import shutil

    from naflexclip.train.loop import train

    train(_counting_config(tmp_path, "cut", stop_after_steps=3))
    train(_counting_config(tmp_path, "cut", resume="latest", stop_after_steps=8, save_every_n_steps=100))
    # as if the process had died after step 8 but before saving it
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_00000008")
    train(_counting_config(tmp_path, "cut", resume="latest"))
    assert _skip_lines(tmp_path / "cut") == _skip_lines(straight_counted_run)
    assert _epoch_counts(tmp_path / "cut") == _epoch_counts(straight_counted_run)


def test_a_checkpoint_without_the_reporters_counts_still_resumes_with_the_right_counts(straight_counted_run,
                                                                                      tmp_path):
    """A checkpoint written before the reporter saved its counts (main's) resumes as it did: the epochs' samples
    read from the run's metrics.jsonl."""
    from test_train_resume import _edit_state

    from naflexclip.checkpoints.storage import find_latest
    from naflexclip.train.loop import train
    from naflexclip.train.report import COUNTS_STATE

    steps_per_epoch = next(json.loads(line)["step"] for line in
                           (straight_counted_run / "metrics.jsonl").read_text().splitlines() if '"data"' in line)
    train(_counting_config(tmp_path, "old", stop_after_steps=steps_per_epoch + 3))
    _edit_state(find_latest(tmp_path / "old" / "checkpoints"), lambda state: state["reporter"].pop(COUNTS_STATE))
    train(_counting_config(tmp_path, "old", resume="latest"))
    assert _epoch_counts(tmp_path / "old") == _epoch_counts(straight_counted_run)

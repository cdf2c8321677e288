"""How an epoch's microbatches group into windows (optimizer steps): every microbatch once, no window smaller
than --accum-freq microbatches at an epoch's end, and the lr schedule and progress bar count the steps taken."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from naflexclip.cli import main
from naflexclip.train.grouping import window_sizes

# the built-in data at the demo's token budget (36/64/100 patches, 1024 per microbatch): with --seed 0, epoch 0
# plans 9 microbatches and epoch 1 plans 11, the last of them 2 examples
RUN = ["--model", "tiny", "--synthetic-train-size", "192", "--synthetic-val-size", "8", "--zero-shot-samples", "1",
       "--epochs", "2", "--accum-freq", "2", "--warmup", "100", "--device", "cpu", "--workers", "0",
       "--val-frequency", "0", "--no-plot"]


@pytest.mark.slow
def test_an_epoch_ends_with_no_degenerate_window(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """192 samples, 2 epochs: each epoch's odd microbatch joins its last window (never a step of 2 examples
    alone), every sample is trained once per epoch, and the schedule and the bars count the steps taken."""
    assert main(["train", *RUN, "--logs", str(tmp_path), "--name", "run"]) == 0
    err = capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["train/num_microbatches"] for r in steps] == [2, 2, 2, 3] + [2, 2, 2, 2, 3]
    assert min(r["train/window_examples"] for r in steps) > 2
    first_epoch = [r for r in steps if r["epoch"] <= 1]
    assert sum(r["train/window_examples"] for r in first_epoch) == 192
    assert sum(r["train/window_examples"] for r in steps) == 2 * 192
    # the lr schedule spans the 9 steps taken (so the last one is not cut off before its end) ...
    assert "longer than the run (9 optimizer steps)" in err
    # ... and each epoch's bar ends full at its number of steps
    bars = {total: done for done, total in re.findall(r"(\d+)/(\d+) \[", err)}
    assert bars == {"4": "4", "5": "5"}


@given(st.integers(0, 500), st.integers(1, 40))
def test_window_sizes_take_every_microbatch_once_in_windows_of_at_least_accum_freq(num_microbatches: int,
                                                                                   accum_freq: int) -> None:
    sizes = window_sizes(num_microbatches, accum_freq)
    assert sum(sizes) == num_microbatches and all(size >= 1 for size in sizes)
    if num_microbatches >= accum_freq:
        assert all(accum_freq <= size < 2 * accum_freq for size in sizes)
        assert sizes[:-1] == [accum_freq] * (len(sizes) - 1)  # only the last window holds the tail
        assert len(sizes) == num_microbatches // accum_freq  # the optimizer steps the lr schedule spans
    else:
        assert sizes == ([num_microbatches] if num_microbatches else [])


@given(st.integers(0, 500), st.integers(1, 40), st.data())
def test_the_rest_of_an_epoch_from_a_window_boundary_groups_as_the_whole_epoch(num_microbatches: int, accum_freq: int,
                                                                               data: st.DataObject) -> None:
    """A resume at a window boundary (a checkpoint is taken after a step) continues the same windows."""
    sizes = window_sizes(num_microbatches, accum_freq)
    done = data.draw(st.integers(0, len(sizes)))
    boundary = ([0, *accumulate(sizes)])[done]
    assert window_sizes(num_microbatches - boundary, accum_freq) == sizes[done:]


@pytest.mark.parametrize(("num_microbatches", "accum_freq", "flag"), [(-1, 2, "microbatches"), (4, 0, "--accum-freq")])
def test_window_sizes_refuse_bad_counts(num_microbatches: int, accum_freq: int, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        window_sizes(num_microbatches, accum_freq)


ONE_IMAGE = ["--model", "tiny", "--synthetic-train-size", "16", "--synthetic-val-size", "8", "--zero-shot-samples", "1",
             "--epochs", "1", "--warmup", "1", "--device", "cpu", "--workers", "0", "--val-frequency", "0",
             "--no-plot", "--naflex-max-tokens-per-batch", "128", "--naflex-batch-divisor", "8"]


def test_a_token_budget_whose_windows_hold_one_pair_is_refused_in_one_line(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """OpenCLIP's divisor 8 rounds the 3 images of 36 patches that 128 tokens hold down to 1 (at least 1): with
    --accum-freq 1 every window is one pair, whose contrastive loss is 0. The run stops before training."""
    code = main(["train", *ONE_IMAGE, "--naflex-seq-lens", "36", "--accum-freq", "1", "--logs", str(tmp_path),
                 "--name", "run"])
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "--naflex-batch-divisor" in line)
    assert code != 0 and "--naflex-max-tokens-per-batch 128" in line and "--naflex-batch-divisor 8" in line
    assert "one pair" in line and "36" in line and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_token_budget_with_some_one_pair_windows_trains_and_says_so_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """At 16 patches 128 tokens hold 8 images, at 36 one (the divisor's rounding): the steps drawn at 36 learn
    nothing, and the run says which length and both flags once."""
    code = main(["train", *ONE_IMAGE, "--naflex-seq-lens", "16", "36", "--accum-freq", "1", "--logs", str(tmp_path),
                 "--name", "run"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "--naflex-batch-divisor 8" in line and "one pair" in line]
    assert code == 0 and len(lines) == 1 and "--naflex-max-tokens-per-batch 128" in lines[0]

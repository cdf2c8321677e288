"""Ranks that never fall out of step: every window's size exchange checks step, epoch and data on every rank,
a disagreement is one line on every rank at once (never a wait until --dist-timeout); per-rank random streams;
errors that are not collective failures say what they are; the device flags fail in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest_data import image_bytes
from distributed_workers import EVAL_TIMEOUT_S, TIMEOUT_S, launch_results

import naflexclip.parallel.feature_exchange as exchange_module
import naflexclip.parallel.process_group as distributed
from naflexclip.cli import main
from naflexclip.parallel.feature_exchange import ProcessGroupExchange, RanksDisagree, window_exchange
from naflexclip.parallel.process_group import DistributedEnv, DistributedFault, RankFailed, fault_guard
from naflexclip.rng import RngState

# --------------------------------------------------------------------- the exchange, ranks simulated


def _gathered_headers(headers: list[list[int]]) -> torch.Tensor:
    """Every rank's header [microbatches, position set, step, epoch, stop, valid tokens, token slots], flattened as
    the all-gather returns it; rows given shorter end in zeros."""
    return torch.tensor([row + [0] * (7 - len(row)) for row in headers], dtype=torch.int64).flatten()


def _exchange_seeing(monkeypatch: pytest.MonkeyPatch, headers: list[list[int]], **kwargs: Any) -> ProcessGroupExchange:
    """Rank 0's exchange in a 3-rank job whose header all-gather returns `headers` (no processes needed)."""
    env = DistributedEnv(0, len(headers), 0, torch.device("cpu"), "gloo", 5.0)
    gathered = iter([_gathered_headers(headers), torch.tensor([2, 2, 2], dtype=torch.int64)])
    monkeypatch.setattr(exchange_module, "all_gather_tensor", lambda env, tensor: next(gathered))
    exchange = ProcessGroupExchange(env, **kwargs)
    exchange.set_position(7, 1)  # epoch index 1: the second, shown as epoch 2
    return exchange


def test_a_rank_at_another_step_is_named_with_both_values(monkeypatch: pytest.MonkeyPatch) -> None:
    exchange = _exchange_seeing(monkeypatch, [[1, 1, 7, 1], [1, 1, 7, 1], [1, 1, 8, 1]])
    with pytest.raises(RanksDisagree) as raised:
        exchange.gather_sizes([2])
    assert str(raised.value) == (
        "ranks disagree at the window's size exchange: ranks 0, 1: step 7, epoch 2, 1 microbatch; "
        "rank 2: step 8, epoch 2, 1 microbatch"
    )


def test_a_rank_without_data_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    exchange = _exchange_seeing(monkeypatch, [[3, 1, 7, 1], [0, 1, 7, 1], [2, 1, 7, 1]])
    with pytest.raises(RanksDisagree, match=r"rank 1: step 7, epoch 2, no microbatches left.*ended at different"):
        exchange.gather_sizes([2, 2, 2])


def test_uneven_counts_pass_but_not_under_fsdp(monkeypatch: pytest.MonkeyPatch) -> None:
    headers = [[1, 1, 7, 1], [1, 1, 7, 1], [1, 1, 7, 1]]
    headers_uneven = [[2, 1, 7, 1], [1, 1, 7, 1], [1, 1, 7, 1]]
    assert _exchange_seeing(monkeypatch, headers).gather_sizes([2]) == [[2], [2], [2]]
    gathered = iter([_gathered_headers(headers_uneven), torch.tensor([2, 3, 2, 0, 2, 0])])
    monkeypatch.setattr(exchange_module, "all_gather_tensor", lambda env, tensor: next(gathered))
    exchange = ProcessGroupExchange(DistributedEnv(0, 3, 0, torch.device("cpu"), "gloo", 5.0))
    assert exchange.gather_sizes([2, 3]) == [[2, 3], [2], [2]]
    fsdp = _exchange_seeing(monkeypatch, headers_uneven, equal_counts=True)
    with pytest.raises(RanksDisagree, match=r"rank 0: 2 microbatches; ranks 1, 2: 1 microbatch \(FSDP needs"):
        fsdp.gather_sizes([2, 3])


def test_the_stop_request_and_token_counts_of_every_rank_come_with_the_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 2 was asked to stop; the token counts are summed over ranks; the header this rank sends carries its own
    headers = [[1, 1, 7, 1, 0, 30, 40], [1, 1, 7, 1, 0, 10, 16], [1, 1, 7, 1, 1, 5, 8]]
    sent: list[list[int]] = []
    gathered = iter([_gathered_headers(headers), torch.tensor([2, 2, 2], dtype=torch.int64)])
    monkeypatch.setattr(exchange_module, "all_gather_tensor",
                        lambda env, tensor: sent.append(tensor.tolist()) or next(gathered))
    exchange = ProcessGroupExchange(DistributedEnv(0, 3, 0, torch.device("cpu"), "gloo", 5.0))
    exchange.set_position(7, 1, stop=False, tokens=(30, 40))
    assert exchange.gather_sizes([2]) == [[2], [2], [2]]
    assert sent[0] == [1, 1, 7, 1, 0, 30, 40]
    assert exchange.agreed.stop and exchange.agreed.tokens == (45, 64)
    assert exchange.should_stop(requested=False)  # this rank's own request (none) is not what decides
    # the stop request is not a disagreement: every rank learns it and stops after the same window
    single = window_exchange(DistributedEnv(0, 1, 0, torch.device("cpu"), None), torch.nn.Linear(1, 1))
    single.set_position(3, 0, stop=False, tokens=(5, 6))
    assert single.agreed.tokens == (5, 6) and single.should_stop(requested=True)  # one process: as it stands


def test_ranks_that_failed_between_windows_are_named_with_their_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    exchange = _exchange_seeing(monkeypatch, [[-1, 1, 7, 1], [2, 1, 7, 1], [-1, 1, 7, 1]])
    reasons = ["OSError: unreadable shard (while reading data for step 7)", None, "DataError: no samples (while x)"]
    monkeypatch.setattr(exchange_module.dist, "all_gather_object",
                        lambda out, own: out.__setitem__(slice(None), reasons))
    with pytest.raises(RankFailed) as raised:
        exchange.gather_sizes([2])
    assert str(raised.value) == ("rank 0 raised OSError: unreadable shard (while reading data for step 7); "
                                 "rank 2 raised DataError: no samples (while x)")


def test_single_process_exchange_accepts_the_agreement_calls() -> None:
    exchange = window_exchange(DistributedEnv(0, 1, 0, torch.device("cpu"), None), torch.nn.Linear(1, 1))
    exchange.set_position(1, 0)
    exchange.end_of_data()
    exchange.fail(ValueError("nothing to tell"), "reading data")
    assert distributed.run_on_main(DistributedEnv(0, 1, 0, torch.device("cpu"), None), "evaluating", lambda: 5) == 5
    assert exchange.gather_sizes([3, 1]) == [[3, 1]]


# ------------------------------------------------------------------- collective failures vs own errors

TWO_RANKS = DistributedEnv(0, 2, 0, torch.device("cpu"), "gloo", 5.0)


def test_an_error_that_is_not_a_collective_failure_says_what_it_is() -> None:
    # e.g. CUDA out of memory or a shape mismatch inside a step: no roll call, no "collective failed"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="^shape mismatch on purpose$") as raised:
        with distributed.translate_faults(TWO_RANKS, "gathering features"):
            raise RuntimeError("shape mismatch on purpose")
    assert not isinstance(raised.value, DistributedFault)
    with pytest.raises(RuntimeError, match="^CUDA out of memory") as raised:
        with fault_guard(TWO_RANKS, "step 3"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not isinstance(raised.value, DistributedFault)
    assert time.monotonic() - start < 1.0


def test_a_gloo_timeout_is_a_collective_failure() -> None:
    with pytest.raises(DistributedFault, match="a collective failed while gathering features.*Timed out"):
        with distributed.translate_faults(TWO_RANKS, "gathering features"):
            raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")


# ---------------------------------------------------------------------------------- random streams


def test_rng_state_records_the_models_devices_not_only_the_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # a library caller passing CPU microbatches to a model on cuda:1 (devices faked: this runs on CPU)
    model = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda", 1))] * 2))
    inputs = [torch.zeros(2), torch.zeros(2, dtype=torch.long)]
    devices = RngState.devices_of(model, inputs)  # type: ignore[arg-type]
    assert devices == [torch.device("cpu"), torch.device("cuda", 1)]
    recorded: list[int] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda index: recorded.append(index) or torch.zeros(1))
    state = RngState(devices)
    assert state.cuda_devices == [1] and recorded == [1]


# ------------------------------------------------------------------------------ CLI: device flags


@pytest.mark.parametrize("command", [["train"], ["eval", "--checkpoint", "nowhere"], ["verify"]])
def test_unknown_device_is_one_line_naming_value_and_choices(command: list[str],
                                                            capsys: pytest.CaptureFixture) -> None:
    assert main([*command, "--device", "gpu"]) == 2
    captured = capsys.readouterr()
    out = (captured.err + captured.out).strip()
    assert out.count("\n") == 0, out
    assert "--device: 'gpu' is not one of cpu, cuda, cuda:N" in out


def test_verify_runs_on_the_given_device(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--device", "cpu", "--splits", "1", "--accum-freq", "2", "--accum-method", "cache"]) == 0
    assert "float64 on cpu" in capsys.readouterr().out


def test_fsdp_without_torchrun_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--fsdp", "--model", "tiny", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("naflexclip train: error: --fsdp:") and "torchrun" in err


# --------------------------------------------------------------------------- real processes (gloo)


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("agree")
    return launch_results("agree", 2, Path(out_dir), timeout_s=TIMEOUT_S + 90)


@pytest.mark.slow
def test_every_rank_raises_the_same_disagreement_at_once(agree: list[dict[str, Any]]) -> None:
    prefix = "ranks disagree at the window's size exchange: "
    expected = {
        "agree": None,
        "step": prefix + "rank 0: step 2, epoch 1, 2 microbatches; rank 1: step 3, epoch 1, 2 microbatches",
        "epoch": prefix + "rank 0: step 3, epoch 1, 2 microbatches; rank 1: step 3, epoch 2, 2 microbatches",
        "no_data": prefix + "rank 0: step 4, epoch 1, 2 microbatches; rank 1: step 4, epoch 1, no microbatches left "
                            "(the ranks' data ended at different points)",
        "all_ended": None,
        "after": None,
        "fsdp_counts": prefix + "rank 0: 1 microbatch; rank 1: 2 microbatches "
                                "(FSDP needs the same number of microbatches on every rank)",
        "fsdp_equal_counts": None,
    }
    for rank, result in enumerate(agree):
        for case, error in expected.items():
            assert result[case]["error"] == error, (rank, case, result[case])
            # in the same collective as the sizes: no rank waits for a timeout
            assert result[case]["seconds"] < TIMEOUT_S / 4, (rank, case, result[case])


@pytest.mark.slow
def test_ranks_start_alike_but_draw_their_own_random_streams(agree: list[dict[str, Any]]) -> None:
    first, second = (result["seeds"] for result in agree)
    # the model is built from --seed on every rank (FSDP2 assembles it from every rank's own shards)
    assert first["weights"] == first["reference"] and second["weights"] == second["reference"]
    assert first["draw"] != second["draw"]


def _tsv_with_one_missing_image(folder: Path) -> Path:
    rows = ["filepath\ttitle"]
    for index in range(8):
        path = folder / f"img{index}.png"
        if index != 5:  # one missing file: the loader skips it on one rank only
            path.write_bytes(image_bytes(24, 16, "PNG", seed=index))
        rows.append(f"{path}\tcaption {index}")
    (folder / "train.tsv").write_text("\n".join(rows) + "\n")
    return folder / "train.tsv"


def _train_two_ranks_one_pair_per_microbatch(
    tmp_path: Path, train_data: Path, timeout: int
) -> tuple[subprocess.CompletedProcess, float]:
    """torchrun, 2 gloo ranks, `tiny`, one pair per microbatch, --accum-freq 3; returns the result and seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "naflexclip",
           "train", "--model", "tiny", "--epochs", "1", "--accum-freq", "3", "--warmup", "1", "--device", "cpu",
           "--train-data", str(train_data), "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "16",
           "--workers", "0", "--zero-shot-samples", "8", "--no-plot", "--dist-timeout", str(timeout),
           "--precision", "fp32", "--naflex-batch-divisor", "1", "--log-metric-every-n-steps", "1",  # not OpenCLIP's
           "--logs-dir", str(tmp_path / "logs"), "--name", "run"]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * 3,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result, time.monotonic() - start


@pytest.mark.slow
def test_a_missing_image_on_one_rank_trains_its_7_pairs_in_seconds(tmp_path: Path) -> None:
    """The issue's reproduction: 2 ranks, 8 rows with one missing image, one pair per microbatch, --accum-freq 3.

    It used to hang: rank 0 in the size exchange, rank 1 in a barrier, until --dist-timeout. Now the epoch's
    plan gives both ranks the same microbatch count over the 7 usable pairs, and they all train (a
    disagreement, should the data ever produce one, is `RanksDisagree` on every rank: see scenario `agree`)."""
    timeout = 60
    train_data = _tsv_with_one_missing_image(tmp_path)
    result, elapsed = _train_two_ranks_one_pair_per_microbatch(tmp_path, train_data, timeout)
    assert elapsed < timeout, f"took {elapsed:.0f}s (--dist-timeout {timeout}):\n{result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "logs" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["train/window_examples"] for r in records if r["kind"] == "train") == 7
    # the epoch's data record and summary count the 7 pairs trained and the missing one skipped
    (data,) = [r for r in records if r["kind"] == "data"]
    assert data["data/trained_samples"] == 7 and data["data/skipped/missing_file"] == 1
    assert "epoch 1: trained 7 samples, skipped 1 bad (missing_file=1)" in result.stdout
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------- faults outside the step, real processes


@pytest.fixture(scope="module")
def trainer_faults(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("trainer_faults")
    return launch_results("trainer_faults", 2, Path(out_dir), timeout_s=120)


@pytest.mark.slow
def test_a_loader_error_on_one_rank_stops_every_rank_at_once_naming_it(trainer_faults: list[dict[str, Any]]) -> None:
    rank0, rank1 = (result["loader"] for result in trainer_faults)
    assert rank1["error"] == "OSError: unreadable shard on purpose"  # the failing rank raises its own error
    assert rank0["error"] == ("RankFailed: rank 1 raised OSError: unreadable shard on purpose "
                              "(while reading data for step 2)")
    # at the next size exchange, not at the collective timeout
    assert rank0["seconds"] < EVAL_TIMEOUT_S and rank1["seconds"] < EVAL_TIMEOUT_S, (rank0, rank1)


@pytest.mark.slow
def test_an_evaluation_longer_than_the_collective_timeout_is_waited_for(trainer_faults: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(trainer_faults):
        assert result["eval_slow"]["error"] is None, (rank, result["eval_slow"])
        assert result["eval_slow"]["seconds"] > EVAL_TIMEOUT_S
    assert [result["eval_slow"]["evals"] for result in trainer_faults] == [1, 0]  # rank 0 evaluated


@pytest.mark.slow
def test_an_evaluation_error_on_rank_0_reaches_the_others_at_once(trainer_faults: list[dict[str, Any]]) -> None:
    rank0, rank1 = (result["eval_raise"] for result in trainer_faults)
    assert rank0["error"] == "ValueError: evaluation failed on purpose"
    assert rank1["error"] == "RankFailed: rank 0 raised ValueError: evaluation failed on purpose (while evaluating)"
    assert rank1["seconds"] < EVAL_TIMEOUT_S / 2, rank1


def _tsv_with_one_corrupt_image(folder: Path) -> Path:
    rows = ["filepath\ttitle"]
    for index in range(8):
        path = folder / f"img{index}.png"
        # exists but does not decode: found while reading, so one rank is a microbatch short at its epoch's end
        path.write_bytes(b"not an image" if index == 5 else image_bytes(24, 16, "PNG", seed=index))
        rows.append(f"{path}\tcaption {index}")
    (folder / "train.tsv").write_text("\n".join(rows) + "\n")
    return folder / "train.tsv"


@pytest.mark.slow
def test_a_rank_whose_loader_raises_stops_every_rank_in_seconds_naming_it(tmp_path: Path) -> None:
    """2 ranks, one pair per microbatch, one image that does not decode: one rank's loader raises a DataError
    (it has fewer usable samples than microbatches) while the other waits at the next window's size exchange.
    The failing rank prints its own error; the other names it, in one line, long before --dist-timeout. Its 4
    microbatches at --accum-freq 3 are one window (the epoch's tail joins the last window), so it is step 1.
    The bound is half the timeout: a wait for the timeout would take all of it (35 s of start-up on a busy 2-core
    machine made a 60 s timeout too tight)."""
    timeout = 120
    train_data = _tsv_with_one_corrupt_image(tmp_path)
    result, elapsed = _train_two_ranks_one_pair_per_microbatch(tmp_path, train_data, timeout)
    assert result.returncode != 0 and elapsed < timeout / 2, f"{elapsed:.0f}s:\n{result.stderr[-3000:]}"
    # each rank's line, wherever it starts: rank 0's progress bar (no newline until it closes) may precede it
    ours = ["naflexclip train:" + rest.split("\n")[0] for rest in result.stderr.split("naflexclip train:")[1:]]
    own = [line for line in ours if line.startswith("naflexclip train: error: ")]
    assert len(own) == 1 and len(ours) == 2, result.stderr[-3000:]
    failed = int(own[0].split(": rank ")[1].split()[0])
    cause = own[0].removeprefix("naflexclip train: error: ")
    assert "fewer usable samples" in cause
    others = [line for line in ours if line not in own]
    assert others == [f"naflexclip train: rank {failed} raised DataError: {cause} (while reading data for step 1)"]


# ------------------------------------------------- what the loop needs from every rank rides the size exchange


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("loop")
    return launch_results("loop", 2, Path(out_dir), timeout_s=300)


@pytest.mark.slow
def test_a_ddp_training_step_makes_at_most_6_collectives(loop_run: list[dict[str, Any]]) -> None:
    # the window's: header, sizes, text features, column log-sum-exps (all-gathers), the loss sum (all-reduce), the
    # text-row gradients (reduce-scatter); the loop's stop request, non-finite check and token counts add none
    for rank, result in enumerate(loop_run):
        per_step = result["ddp"]["per_step"]
        assert len(per_step) == 3, (rank, per_step)
        for counts in per_step:
            assert sum(counts.values()) <= 6, (rank, per_step)


@pytest.mark.slow
def test_the_logged_loss_and_grad_norm_are_the_same_on_every_rank(loop_run: list[dict[str, Any]]) -> None:
    # every rank decides alike whether a step is skipped, without a collective of its own
    for wrapper in ("ddp", "fsdp"):
        first, second = (result[wrapper]["steps"] for result in loop_run)
        assert len(first) == 4 and first == second, (wrapper, first, second)


@pytest.mark.slow
@pytest.mark.parametrize(("when", "step"), [("before", 2), ("after", 3)])
def test_a_stop_signal_on_one_rank_stops_every_rank_after_the_same_step(loop_run: list[dict[str, Any]], when: str,
                                                                        step: int) -> None:
    # SIGTERM reaches rank 1 only, during step 2: before its size exchange it stops both ranks after step 2, after
    # it (the request travels with the next window's exchange) after step 3; each rank saves that step and ends
    for rank, result in enumerate(loop_run):
        stopped = result[f"stop_{when}"]
        assert stopped["step"] == step and stopped["saved"] == step, (rank, stopped)
        assert stopped["error"].startswith(f"stopped by SIGTERM after step {step}; saved "), (rank, stopped)


@pytest.mark.slow
def test_fsdp_through_the_library_recipe_refuses_unequal_microbatch_counts_in_one_line(tmp_path: Path) -> None:
    # window_exchange(env, model) knows the model is sharded: no flag for the caller to remember
    for result in launch_results("fsdp_uneven", 3, tmp_path, timeout_s=TIMEOUT_S + 90):
        assert result["error"] == (
            "RanksDisagree: ranks disagree at the window's size exchange: rank 0: 2 microbatches; "
            "rank 1: 1 microbatch; rank 2: 4 microbatches (FSDP needs the same number of microbatches on every rank)")
        assert result["seconds"] < TIMEOUT_S / 4


# ---------------------------------------------------------------- the settings every rank starts with


def _started_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank_0: dict[str, Any],
                  rank_1: dict[str, Any]) -> str | None:
    """The line every rank of a 2-rank job stops with when rank 0 and rank 1 were started with these settings
    (`tiny_config` overrides; `data=` a dict of DataConfig fields), None when they may run together."""
    from test_train_loop import tiny_config

    from naflexclip.data import DataConfig
    from naflexclip.train.config.rank_agreement import check_ranks_agree, settings_every_rank_shares

    def config(overrides: dict[str, Any]) -> Any:
        data = {"synthetic_train_size": 96, "synthetic_val_size": 24, "naflex_seq_lens": (16, 32),
                "naflex_max_tokens_per_batch": 256, "workers": 0, **overrides.pop("data", {})}
        return tiny_config(tmp_path, data=DataConfig(**data), **overrides)

    every = [settings_every_rank_shares(config(dict(rank_0))), settings_every_rank_shares(config(dict(rank_1)))]
    gathered = every if every[0] != every[1] else None
    monkeypatch.setattr(distributed, "gather_if_different", lambda env, values: gathered)
    env = DistributedEnv(0, 2, 0, torch.device("cpu"), "gloo", 5.0)
    try:
        check_ranks_agree(config(dict(rank_0)), env)
    except ValueError as error:
        assert "\n" not in str(error)
        return str(error)
    return None


def test_ranks_started_with_other_settings_stop_naming_the_first_flag_and_both_values(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The issue's cases: another --train-data, --lr, --wd, --accum-freq, --seed or token budget on rank 1 is one
    line naming the flag and the two values (before, rank 1 trained other data or another optimizer silently)."""
    tail = "; every rank of a job must be started with the same settings"
    cases = [
        ({"data": {"train_data": "a.tsv"}}, {"data": {"train_data": "b.tsv"}},
         "--train-data: rank 1 has b.tsv, rank 0 a.tsv"),
        ({}, {"lr": 2e-3}, "--lr: rank 1 has 0.002, rank 0 0.001"),
        ({}, {"wd": 0.0}, "--wd: rank 1 has 0.0, rank 0 0.1"),
        ({}, {"accum_freq": 4}, "--accum-freq: rank 1 has 4, rank 0 2"),
        ({}, {"data": {"naflex_max_tokens_per_batch": 512}},
         "--naflex-max-tokens-per-batch: rank 1 has 512, rank 0 256"),
    ]
    for rank_0, rank_1, expected in cases:
        assert _started_with(monkeypatch, tmp_path, rank_0, rank_1) == expected + tail
    # --seed is the model's and the data order's: one flag, named once with the count of every setting that differs
    assert _started_with(monkeypatch, tmp_path, {}, {"seed": 7, "lr": 2e-3}) == (
        "--lr: rank 1 has 0.002, rank 0 0.001" + tail + " (2 settings differ: --lr, --seed)")


def test_a_switch_that_differs_is_shown_as_its_flag_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An on/off setting is shown on or off as its flag reads: rank 1 started with --no-plot has the flag on
    (before, "--no-plot: rank 1 has False" read as if the flag were not given)."""
    tail = "; every rank of a job must be started with the same settings"
    assert _started_with(monkeypatch, tmp_path, {}, {"plot": False}) == "--no-plot: rank 1 has on, rank 0 off" + tail
    assert _started_with(monkeypatch, tmp_path, {}, {"lock_image": True}) == (
        "--lock-image: rank 1 has on, rank 0 off" + tail)


def test_settings_of_a_rank_of_its_own_may_differ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A node's own loader workers, device and collective timeout do not change what is trained."""
    assert _started_with(monkeypatch, tmp_path, {}, {"data": {"workers": 3}, "dist_timeout": 60.0,
                                                     "device": "cpu", "debug": True}) is None
    assert _started_with(monkeypatch, tmp_path, {}, {}) is None


@pytest.mark.slow
def test_a_rank_started_with_another_lr_stops_every_rank_before_the_first_step(tmp_path: Path) -> None:
    """torchrun, 2 processes; rank 1's command line says --lr 0.002: both stop at once with the one line, before
    anything is trained or written (without the check both trained to the end with two different optimizers)."""
    from test_train_torchrun import LAUNCHER, RUN_FLAGS

    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.replace("import dataclasses, sys", "import dataclasses, os, sys\n"
                                         "if os.environ['RANK'] == '1': sys.argv += ['--lr', '0.002']"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(launcher),
           "train", *RUN_FLAGS, "--lr", "0.001", "--logs-dir", str(tmp_path / "logs"), "--name", "run"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = ("naflexclip train: error: --lr: rank 1 has 0.002, rank 0 0.001; every rank of a job must be started with "
            "the same settings")
    assert result.returncode != 0 and result.stderr.count(line) == 2, result.stderr[-3000:]
    assert not (tmp_path / "logs" / "run" / "checkpoints").exists()
    assert not (tmp_path / "logs" / "run" / "metrics.jsonl").exists()

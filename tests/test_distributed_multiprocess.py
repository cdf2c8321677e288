"""Multi-process tests of naflexclip.parallel.process_group on gloo (CPU), with real processes.

Each world size is launched once (tests/distributed_workers.py loops over the configurations inside the
workers, because process start-up costs seconds) and the tests below read what every rank reported.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from distributed_workers import SHARD_SPLITS, SPLITS, TIMEOUT_S, launch, launch_results

from naflexclip.audit.gradient_audit import FLOAT64_TOLERANCE, POS_EMBED_TOLERANCE

pytestmark = pytest.mark.slow

# docs/accumulation.md's tolerances for float64: 1e-10 relative per parameter; pos_embed 1e-6 alone, because timm's
# NaFlexVit resamples its position table in float32 even in a float64 model (~1e-7 measured here)
assert FLOAT64_TOLERANCE == 1e-10 and POS_EMBED_TOLERANCE == 1e-6
# a wrong rule must miss by far more than rounding: the teeth variants are off by 9% to 160%
TEETH_MIN_ERROR = 1e-3


def _run(scenario: str, world_size: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp(f"{scenario}{world_size}")
    return launch_results(scenario, world_size, Path(out_dir))


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def exact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("exact", request.param, tmp_path_factory)


def test_averaged_gradient_equals_single_process_full_batch(exact: list[dict[str, Any]]) -> None:
    world_size = len(exact)
    for rank, result in enumerate(exact):
        cases = result["exact"]
        # cache and replay, CLIP and SigLIP, none/linear/sqrt, DDP (and FSDP2 when it runs)
        assert {name.split("/")[3] for name in cases} == {"cache", "replay"}
        assert {name.split("/")[4] for name in cases} == {"none", "linear", "sqrt"}
        assert {name.split("/")[1] for name in cases} == {"siglip=False", "siglip=True"}
        # invariance: different splits of the same ordered window across ranks, each equal to one reference
        assert {name.split("/")[2] for name in cases} == {f"split={i}" for i in range(len(SPLITS[world_size]) + 1)}
        for name, errors in cases.items():
            assert errors["missing"] == 0, f"rank {rank} {name}: gradients missing"
            assert errors["params"] <= FLOAT64_TOLERANCE, f"rank {rank} {name}: {errors}"
            assert errors["pos_embed"] <= POS_EMBED_TOLERANCE, f"rank {rank} {name}: {errors}"


def test_fsdp2_runs_on_gloo_cpu(exact: list[dict[str, Any]]) -> None:
    # FSDP2 (fully_shard) works on CPU with gloo in this torch: its cases are part of the exactness test
    assert exact[0]["fsdp_available"], exact[0]["fsdp_why"]
    assert any(name.startswith("fsdp/") for name in exact[0]["exact"])


def test_wrong_scale_rules_fail_the_same_comparison(exact: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(exact):
        assert len(result["teeth"]) == 6
        for name, errors in result["teeth"].items():
            assert errors["params"] > TEETH_MIN_ERROR, f"rank {rank}: wrong rule {name} passed: {errors}"


def test_one_gradient_sync_per_window(exact: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(exact):
        syncs = result["syncs"]
        for name, counts in syncs.items():
            if not isinstance(counts, dict):
                continue
            wrapper, siglip = name.split("/")[:2]
            per_sync = syncs[f"{wrapper}/{siglip}/collectives_per_sync"]
            assert per_sync >= 1
            # no_sync around every microbatch but the last; the collectives of exactly one sync
            assert counts["no_sync_entered"] == counts["num_local_microbatches"] - 1, (rank, name, counts)
            assert counts["gradient_collectives"] == per_sync, (rank, name, counts, per_sync)


def test_full_state_dict_round_trip(exact: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(exact):
        for name, state in result["state_dict"].items():
            if rank == 0:
                assert state["keys_match"] and state["max_diff"] == 0.0 and state["restored_max_diff"] == 0.0, name
            # loading on rank 0 restores the weights on every rank
            assert state["local_restored_max_diff"] == 0.0, (rank, name, state)
            # the optimizer state too: saved after step 1, restored after step 2
            assert state["optimizer"]["local_steps"] == [1.0], (rank, name, state)
            if rank == 0:
                assert state["optimizer"]["restored_max_diff"] == 0.0, (name, state)


def test_consistency_mismatch_names_the_rank(exact: list[dict[str, Any]]) -> None:
    last = len(exact) - 1
    for result in exact:
        consistency = result["consistency"]
        assert consistency["agree"] == "ok"
        # every rank raises the same error, so none is left waiting in a collective
        assert consistency["step_mismatch"] == f"ranks disagree: rank {last} has step=11 but rank 0 has 10"
        for rank in range(1, len(exact)):
            assert f"rank {rank} has schedule='hash{rank}' but rank 0 has 'hash0'" in consistency["schedule_mismatch"]


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_failed_rank_is_named_within_the_timeout(how: str, tmp_path: Path) -> None:
    start = time.monotonic()
    survivor, failed = launch(how, 2, tmp_path, timeout_s=TIMEOUT_S + 90)
    elapsed = time.monotonic() - start
    assert failed["returncode"] == (17 if how == "kill" else 1), failed["stderr"][-2000:]
    assert survivor["returncode"] != 0 and survivor["result"] is None
    expected = "rank 1 died or stopped responding" if how == "kill" else "rank 1 raised ValueError: bad microbatch"
    message = "DistributedFault: rank 0 stopped while window 0: " + expected
    assert message in survivor["stderr"], survivor["stderr"][-3000:]
    # within the collective timeout (+ the roll call's grace); a lost gloo peer is usually noticed at once
    step_seconds = float(survivor["stderr"].split("elapsed ")[1].split("s")[0])
    assert step_seconds < TIMEOUT_S + 12, survivor["stderr"][-2000:]
    if how == "raise":
        # an error inside a step (fault_guard records it; the roll call names it) ends the survivor's step long
        # before the collective timeout: the failed rank's exit closes its connections at once
        assert step_seconds < TIMEOUT_S / 2, survivor["stderr"][-2000:]
    assert elapsed < TIMEOUT_S + 80


# ----------------------------------------------------------------- the loss split over ranks (4 ranks)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("shard", 4, tmp_path_factory)


def test_sharded_loss_with_small_tiles_equals_single_process_full_batch(shard: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(shard):
        cases = result["exact"]
        # CLIP and SigLIP, cache and replay, every scale mode, ranks with different microbatch counts
        assert {name.split("/")[0] for name in cases} == {"siglip=False", "siglip=True"}
        assert {name.split("/")[1] for name in cases} == {f"split={i}" for i in range(len(SHARD_SPLITS[4]))}
        assert {name.split("/")[2] for name in cases} == {"cache", "replay"}
        assert {name.split("/")[3] for name in cases} == {"none", "linear", "sqrt"}
        for name, errors in cases.items():
            assert errors["missing"] == 0, f"rank {rank} {name}: gradients missing"
            assert errors["params"] <= FLOAT64_TOLERANCE, f"rank {rank} {name}: {errors}"
            assert errors["pos_embed"] <= POS_EMBED_TOLERANCE, f"rank {rank} {name}: {errors}"
            # WindowStats.loss is L(W) of the whole window on every rank, not this rank's part
            assert result["loss"][name] <= 1e-12, f"rank {rank} {name}: loss off by {result['loss'][name]}"


def test_dropping_the_reduce_scatter_or_the_scalar_sum_fails(shard: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(shard):
        teeth = result["teeth"]
        assert len(teeth) == 4
        for name, errors in teeth.items():
            assert errors["all"]["params"] > TEETH_MIN_ERROR, f"rank {rank}: wrong rule {name} passed: {errors}"
            if name.endswith("unsummed_scalars"):
                # the towers are right; logit_scale/logit_bias carry only one rank's block
                assert errors["scalars"]["params"] > TEETH_MIN_ERROR, (rank, name, errors)


def test_fsdp2_window_with_the_sharded_loss_is_exact(shard: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(shard):
        assert result["fsdp"]["missing"] == 0 and result["fsdp"]["params"] <= FLOAT64_TOLERANCE, (rank, result["fsdp"])
        assert result["fsdp"]["pos_embed"] <= POS_EMBED_TOLERANCE, (rank, result["fsdp"])


# ------------------------------------------------------------------------- locked towers (LiT), 2 ranks


def test_locked_towers_across_ranks_are_exact_and_a_locked_tower_runs_once(tmp_path_factory) -> None:
    """DDP and FSDP2, cache and replay, the sharded loss: the trainable parameters' gradients equal the single-process
    full batch's, locked ones have none, and a fully locked image tower runs once per local microbatch."""
    for rank, result in enumerate(_run("locked", 2, tmp_path_factory)):
        assert {name.split("/")[0] for name in result["exact"]} == {"ddp", "fsdp"}
        for name, errors in result["exact"].items():
            assert errors["missing"] == 0, f"rank {rank} {name}: gradients missing or unexpected"
            assert errors["params"] <= FLOAT64_TOLERANCE, f"rank {rank} {name}: {errors}"
            assert errors["pos_embed"] <= POS_EMBED_TOLERANCE, f"rank {rank} {name}: {errors}"
        for name, (forwards, microbatches) in result["forwards"].items():
            assert forwards == (microbatches if "/image/" in name else 2 * microbatches), (rank, name)


# ------------------------------------------------------------------------- distillation, 3 ranks


def test_distillation_across_three_ranks_is_exact_and_the_teacher_runs_once(tmp_path_factory) -> None:
    """DDP (equal and unequal microbatch counts) and FSDP2, cache and replay, the sharded DistillLoss with uneven
    sizes (the clip student's teacher reads its own inputs: 8-px patches, 24 tokens): every gradient equals the
    single-process full batch's s(W)·∇[contrastive + λ·distill]; the teacher runs once per local microbatch; without
    the teacher the full-batch gradient is another one (teeth)."""
    for rank, result in enumerate(_run("distill", 3, tmp_path_factory)):
        assert {name.split("/")[0] for name in result["exact"]} == {"ddp", "fsdp"}
        assert len(result["exact"]) == 10
        for name, errors in result["exact"].items():
            assert errors["missing"] == 0, f"rank {rank} {name}: gradients missing or unexpected"
            assert errors["params"] <= FLOAT64_TOLERANCE, f"rank {rank} {name}: {errors}"
            assert errors["pos_embed"] <= POS_EMBED_TOLERANCE, f"rank {rank} {name}: {errors}"
        for name, (forwards, microbatches) in result["forwards"].items():
            assert forwards == microbatches, (rank, name)
        for loss, errors in result["plain"].items():
            assert errors["params"] > TEETH_MIN_ERROR, (rank, loss, errors)


# ------------------------------------------------------------------------- self-distillation, 3 ranks


def test_self_distillation_across_three_ranks_is_exact_and_the_ema_teacher_runs_once(tmp_path_factory) -> None:
    """DDP, cache (uneven sizes) and replay (unequal microbatch counts): with the self-distillation and
    masked-prediction terms over the window's examples, every gradient equals the single-process full batch's; the EMA
    teacher runs once per local microbatch."""
    for rank, result in enumerate(_run("self_distill", 3, tmp_path_factory)):
        assert len(result["exact"]) == 2
        for name, errors in result["exact"].items():
            assert errors["missing"] == 0, f"rank {rank} {name}: gradients missing or unexpected"
            assert errors["params"] <= FLOAT64_TOLERANCE, f"rank {rank} {name}: {errors}"
            assert errors["pos_embed"] <= POS_EMBED_TOLERANCE, f"rank {rank} {name}: {errors}"
        for name, (forwards, microbatches) in result["forwards"].items():
            assert forwards == microbatches, (rank, name)


# ------------------------------------------------------------------------- several captions per image, 3 ranks


def test_multi_positive_across_three_ranks_is_exact(tmp_path_factory) -> None:
    """Images with 1-3 captions, group ids global over the window, texts per rank unlike images per rank: DDP (equal
    and unequal microbatch counts) and FSDP2, cache and replay, the sharded multi-positive losses in 2-row tiles,
    and with distillation too (DDP and FSDP2); every gradient equals the single-process full batch's."""
    results = _run("multi_positive", 3, tmp_path_factory)
    for rank, result in enumerate(results):
        assert {name.split("/")[0] for name in result["exact"]} == {"ddp", "fsdp"}
        assert len(result["exact"]) == 14 and sum("/distilled/" in name for name in result["exact"]) == 2
        for name, errors in result["exact"].items():
            assert errors["missing"] == 0, f"rank {rank} {name}: gradients missing or unexpected"
            assert errors["params"] <= FLOAT64_TOLERANCE, f"rank {rank} {name}: {errors}"
            assert errors["pos_embed"] <= POS_EMBED_TOLERANCE, f"rank {rank} {name}: {errors}"
    # the windows did hold more texts than images
    name = next(iter(results[0]["texts"]))
    assert sum(sum(result["texts"][name]) for result in results) > 10

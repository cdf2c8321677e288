"""Variable patch size (OpenCLIP's --naflex-patch-sizes / --naflex-patch-size-probs): one patch size per training
microbatch, drawn from (seed, epoch, rank, microbatch index) alone, its images patched at that size into timm's
unflattened [B, N, P, P, 3] patches; the flags, their one-line errors, the run config and the resume policy; a run
that trains with them and resumes exactly."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest_data import image_bytes, write_tar
from test_train_loop import tiny_config

from naflexclip.checkpoints import storage as ckpt
from naflexclip.cli import build_parser, main
from naflexclip.data import DataConfig, build_loader
from naflexclip.data.microbatch import MicrobatchBuilder
from naflexclip.data.schedule import PatchSizes
from naflexclip.processing.naflex_transform import Processing, collate, default_processing
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.config.openclip_flags import status
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.resume import POLICY, refusal

TINY_PATCH = 4  # the tiny preset's own patch size


def _data(**overrides) -> DataConfig:
    values = dict(synthetic_train_size=96, synthetic_val_size=24, naflex_seq_lens=(16, 32),
                  naflex_max_tokens_per_batch=256, workers=0, naflex_patch_sizes=(4, 8))
    values.update(overrides)
    return DataConfig(**values)


def _sizes(cfg: DataConfig, *, epoch: int = 0, start_batch: int = 0, rank: int = 0, world_size: int = 1
           ) -> dict[int, int]:
    """{microbatch index: its patch size} of one rank's epoch, from `start_batch` on."""
    loader = build_loader(cfg, split="train", patch_size=TINY_PATCH, context_length=16, epoch=epoch,
                          start_batch=start_batch, rank=rank, world_size=world_size)
    out = {}
    for item in loader:
        p = item["patch_size"]
        assert item["image"]["patches"].shape[2:] == (p, p, 3)
        out[item["batch_index"]] = p
    return out


def test_each_microbatchs_patch_size_is_the_same_for_any_workers_and_after_a_resume() -> None:
    whole = _sizes(_data())
    assert set(whole.values()) == {4, 8}  # both sizes occur in an epoch of 8 microbatches
    assert whole == {i: PatchSizes((4, 8)).draw(0, 0, 0, i) for i in whole}  # (seed, epoch, rank, index) alone
    assert _sizes(_data(workers=2)) == whole
    resumed = _sizes(_data(), start_batch=5)  # (start_batch: where a checkpoint's data position continues)
    assert resumed == {i: p for i, p in whole.items() if i >= 5}
    # another epoch, another rank: other draws
    assert _sizes(_data(), epoch=1) != whole
    assert _sizes(_data(), rank=1, world_size=2) != {i: p for i, p in whole.items() if i < len(whole) // 2}


def test_streamed_shards_draw_the_same_patch_size_per_microbatch_for_any_workers(tmp_path: Path) -> None:
    for s in range(2):
        write_tar(f"{tmp_path}/shard-{s}.tar", [m for j in range(24) for m in (
            (f"s{s}_{j}.png", image_bytes(20 + j, 30, "PNG", seed=j)), (f"s{s}_{j}.txt", f"shape {j}".encode()))])
    spec = f"pipe:cat {tmp_path}/shard-{{0..1}}.tar"  # not indexable: the streamed loader
    cfg = _data(train_data=spec, train_num_samples=48, shuffle_buffer=4)
    sizes = _sizes(cfg)
    assert sizes == _sizes(dataclasses.replace(cfg, workers=2))
    assert sizes == {i: PatchSizes((4, 8)).draw(0, 0, 0, i) for i in sizes} and set(sizes.values()) == {4, 8}


def test_a_first_patch_size_other_than_the_models_is_named_once_as_not_the_evaluations(caplog) -> None:
    build_loader(_data(naflex_patch_sizes=(8, 4)), split="train", patch_size=TINY_PATCH, context_length=16)
    assert [r.getMessage() for r in caplog.records] == [
        "--naflex-patch-sizes 8 4: evaluation runs at the model's own patch size 4 (OpenCLIP's at the first listed, 8)"]
    caplog.clear()
    build_loader(_data(naflex_patch_sizes=(4, 8)), split="train", patch_size=TINY_PATCH, context_length=16)
    assert caplog.records == []


def test_a_microbatch_at_a_drawn_size_is_the_models_processing_at_that_size() -> None:
    """The unflattened patches are exactly what our transform and collation give at that patch size, and each image
    keeps its planned sequence length (a smaller patch covers a smaller image, as in timm)."""
    cfg = _data(naflex_patch_sizes=(8, 16))
    loader = build_loader(cfg, split="train", patch_size=TINY_PATCH, context_length=16)
    item = next(iter(loader))
    p, seq_len = item["patch_size"], item["seq_len"]
    source = build_loader(_data(naflex_patch_sizes=None), split="train", patch_size=TINY_PATCH,
                          context_length=16).source
    processing = default_processing(p)
    images = [source.load(i).image for i in loader.order[: len(item["keys"])].tolist()]
    expected = collate([processing.transform(img, seq_len) for img in images], seq_len, p)
    assert torch.equal(item["image"]["patches"].flatten(2), expected["patches"])
    assert torch.equal(item["image"]["patch_coord"], expected["patch_coord"])
    assert item["image"]["patches"].shape[1] == seq_len and 0 < item["num_tokens"] <= seq_len * len(images)


def test_patch_size_probs_are_the_frequencies_of_the_draws() -> None:
    draws = PatchSizes((8, 14, 16, 32), (0.5, 0.0, 0.3, 0.2))
    counts = collections.Counter(draws.draw(0, epoch, 0, index) for epoch in range(4) for index in range(5000))
    n = sum(counts.values())
    assert counts[14] == 0  # a zero weight is never drawn
    for size, prob in ((8, 0.5), (16, 0.3), (32, 0.2)):
        assert abs(counts[size] / n - prob) < 0.015, counts  # ~6 standard errors; uniform would be 0.25 each
    # weights are normalised (OpenCLIP's rule): 5 3 2 means 0.5 0.3 0.2
    scaled = PatchSizes((8, 14, 16, 32), (5, 0, 3, 2))
    assert all(scaled.draw(0, 0, 0, i) == draws.draw(0, 0, 0, i) for i in range(200))


def test_uniform_patch_sizes_without_probs() -> None:
    draws = PatchSizes((8, 16))
    counts = collections.Counter(draws.draw(3, 0, 1, i) for i in range(8000))
    assert abs(counts[8] / 8000 - 0.5) < 0.03


def test_an_image_processor_with_one_patch_size_is_refused_in_one_line_before_any_worker_starts() -> None:
    class OneSizeTransform:  # like SigLIP 2's processor: patches at its model's size only
        patch_size = 16

    processing = Processing(OneSizeTransform(), collate, default_processing(16).tokenize)
    with pytest.raises(ValueError, match=r"^--naflex-patch-sizes 8: the model's image processor \(OneSizeTransform\) "
                                         r"patches at its own patch size only$"):
        MicrobatchBuilder(patch_size=16, context_length=16, processing=processing, patch_sizes=PatchSizes((16, 8)))


@pytest.mark.parametrize(("flags", "message"), [
    (["--naflex-patch-sizes", "8", "16", "--naflex-patch-size-probs", "1"],
     "--naflex-patch-size-probs needs one weight per --naflex-patch-sizes entry (2), got 1: 1"),
    (["--naflex-patch-sizes", "8", "16", "--naflex-patch-size-probs", "1", "-1"],
     "--naflex-patch-size-probs must be finite and >= 0 with a positive sum, got 1 -1"),
    (["--naflex-patch-sizes", "8", "16", "--naflex-patch-size-probs", "0", "0"],
     "--naflex-patch-size-probs must be finite and >= 0 with a positive sum, got 0 0"),
    (["--naflex-patch-sizes", "0", "16"], "--naflex-patch-sizes must be positive integers, got 0 16"),
    (["--naflex-patch-sizes", "16", "16"], "--naflex-patch-sizes must not repeat a size, got 16 16"),
    (["--naflex-patch-size-probs", "1"], "--naflex-patch-size-probs goes with --naflex-patch-sizes"),
    (["--naflex-patch-sizes", "8", "16", "--masked-prediction-loss-weight", "1"],
     "--naflex-patch-sizes 8 16 with --masked-prediction-loss-weight: the masked tokens need flattened patches"),
])
def test_bad_patch_size_flags_stop_with_one_line_naming_the_flag(flags, message, capsys) -> None:
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_patch_size_flags_are_openclips_saved_in_the_run_config_and_turn_the_interpolator_on() -> None:
    parser = build_parser()._subparsers._group_actions[0].choices["train"]
    assert status("--naflex-patch-sizes", parser) == status("--naflex-patch-size-probs", parser) == "accepted"
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--naflex-patch-sizes", "8", "16", "--naflex-patch-size-probs", "3", "1"]))
    assert cfg.data.naflex_patch_sizes == (8, 16) and cfg.data.naflex_patch_size_probs == (3.0, 1.0)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).data == cfg.data
    assert cfg.model_overrides(16)["patch_interpolator"] is True
    # only the model's own size: every microbatch as without the flag (flattened, no interpolator)
    assert "patch_interpolator" not in tiny_config(Path("."), data=_data(naflex_patch_sizes=(4,))).model_overrides(4)
    assert _data(naflex_patch_sizes=(4,)).patch_sizes(4) is None
    # without the flag: OpenCLIP's default, the model's own patch size
    assert config_from_args(build_parser().parse_args(["train"])).data.naflex_patch_sizes is None


def test_a_resume_with_other_patch_sizes_is_refused_in_one_line(tmp_path: Path) -> None:
    saved = tiny_config(tmp_path, data=_data(naflex_patch_sizes=(8, 16))).to_dict()
    for data in (_data(naflex_patch_sizes=(8, 32)), _data(naflex_patch_sizes=(8, 16),
                                                          naflex_patch_size_probs=(1, 3))):
        why = refusal(saved, tiny_config(tmp_path, data=data).to_dict())
        assert why is not None and why.startswith("--naflex-patch-size") and "\n" not in why
    assert POLICY["data.naflex_patch_sizes"][0] == "refuse"


@pytest.mark.slow
def test_a_run_with_two_patch_sizes_trains_and_resumes_exactly(tmp_path: Path, capsys: pytest.CaptureFixture
                                                               ) -> None:
    """`naflexclip train --naflex-patch-sizes 8 16` on the tiny preset (patch 4): stopped at step 1 and resumed to
    step 2, it ends bit-equal to the run that went straight to step 2; a resume with other sizes stops."""
    flags = ["--model", "tiny", "--epochs", "1", "--warmup", "2", "--device", "cpu", "--zero-shot-samples", "8",
             "--val-frequency", "0", "--no-plot", "--synthetic-train-size", "64", "--synthetic-val-size", "8",
             "--naflex-seq-lens", "16", "32", "--naflex-max-tokens-per-batch", "256", "--workers", "0",
             "--accum-freq", "2", "--logs", str(tmp_path), "--naflex-patch-sizes", "8", "16"]
    assert main(["train", *flags, "--name", "run", "--stop-after-steps", "1"]) == 0
    assert main(["train", *flags, "--name", "run", "--resume", "latest", "--stop-after-steps", "2"]) == 0
    assert main(["train", *flags, "--name", "straight", "--stop-after-steps", "2"]) == 0
    resumed = ckpt.load_checkpoint(tmp_path / "run" / "checkpoints")
    straight = ckpt.load_checkpoint(tmp_path / "straight" / "checkpoints").states["model"]
    assert resumed.step == 2 and all(torch.equal(resumed.states["model"][k], straight[k]) for k in straight)
    assert resumed.states["run"]["config"]["data"]["naflex_patch_sizes"] in ([8, 16], (8, 16))
    assert resumed.states["run"]["model_config"]["image"]["patch_interpolator"] is True
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # a resume with other sizes stops in one line
    capsys.readouterr()
    assert main(["train", *flags[:-3], "--naflex-patch-sizes", "8", "--name", "run", "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--naflex-patch-sizes: the checkpoint has (8, 16), this run (8,)" in err, err

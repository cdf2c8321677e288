"""On a CUDA device: the window is exact there too, and the job trains under fp16 amp (GradScaler) and bf16.

Skipped without CUDA (conftest); CI has no GPU, so these run where one is lent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_train_loop import TINY_DATA_FLAGS

from naflexclip import create_loss, create_model
from naflexclip.batch import to_device
from naflexclip.cli import main
from naflexclip.verify import random_naflex_batch, verify_window

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("siglip", [False, True])
def test_window_equals_full_batch_on_cuda_float64(siglip: bool) -> None:
    torch.manual_seed(0)
    model = create_model("tiny", siglip=siglip).to("cuda", torch.float64).eval()
    batch = random_naflex_batch(13, patch_size=model.image_patch_size, context_length=model.context_length,
                                generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch = to_device(batch, "cuda")
    result = verify_window(model, create_loss(siglip), batch, accum_freq=4, reference_batch_size=4,
                           loss_scale="linear", methods=("cache", "replay"), num_splits=3, seed=0)
    assert result.passed, [(g.group, g.worst_error) for g in result.groups if not g.passed]
    # teeth: OpenCLIP's per-microbatch rule is far off on the same windows
    assert max(g.legacy_error for g in result.groups) > 1e-2


@pytest.mark.parametrize("precision", ["amp", "amp_bf16"])
def test_train_runs_under_mixed_precision_on_cuda(tmp_path: Path, precision: str) -> None:
    code = main(["train", "--model", "tiny", "--epochs", "2", "--warmup", "2", "--device", "cuda",
                 "--precision", precision, "--logs", str(tmp_path), "--name", "run", "--zero-shot-samples", "16",
                 *TINY_DATA_FLAGS])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert train_records and all(math.isfinite(r["train/loss"]) for r in train_records)

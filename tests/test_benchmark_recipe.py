"""benchmarks/recipe.py, SigLIP 2's recipe window part by part against the sigmoid-only window: its crops-only cut
of the student terms computes the same self-distillation term, and the script runs at a tiny size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.models.naflex_clip import NaFlexClip, model_config
from naflexclip.objectives.self_distillation import SELF_DISTILL, EmaTeacher, attach_heads, head_config, student_terms

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from recipe import ROWS, crops_only, main  # noqa: E402


def test_the_crops_only_cut_gives_the_student_terms_self_distillation_term() -> None:
    torch.manual_seed(0)
    model = NaFlexClip(model_config("tiny", loss="siglip"))
    attach_heads(model, head_config(32, 3, 0.5))
    model = model.double().eval()
    teacher = EmaTeacher(model, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    batch = random_naflex_batch(5, patch_size=4, context_length=16, generator=gen)
    seeds = torch.randint(0, 2**31, (5,), generator=gen)
    targets = teacher(image=batch["image"])
    whole = student_terms(model.visual, model.self_distill, batch["image"], seeds, targets)
    cut = crops_only(model.visual, model.self_distill, batch["image"], seeds, targets)
    assert set(cut) == {SELF_DISTILL} and torch.equal(cut[SELF_DISTILL], whole[SELF_DISTILL])


class _Queue:
    def put(self, item: object) -> None:
        self.item = item


def _inline(target, *args):  # measure.in_subprocess, in this process (a spawned one imports torch again: minutes)
    queue = _Queue()
    target(*args, queue)
    return queue.item


def test_the_recipe_benchmark_runs_every_part_at_a_tiny_size(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    import recipe

    monkeypatch.setattr(recipe, "in_subprocess", _inline)
    threads = torch.get_num_threads()
    try:
        main(["--model", "tiny", "--num-examples", "4", "--splits", "2", "--seq-len", "16", "--local-crops", "2",
              "--repeats", "1", "--threads", "1", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in ROWS}
    assert list(rows) == list(ROWS)
    # the teacher runs once per microbatch from its row on, never before
    assert [int(cells[-1]) for cells in rows.values()] == [0, 0, 2, 2, 2]
    assert float(rows["sigmoid only"][1]) == 1.0 and all(float(cells[0]) > 0 for cells in rows.values())
    assert "teacher forwards per window 2 (= 2 microbatches)" in out


def test_the_recipe_benchmark_refuses_bad_sizes_in_one_line(capsys: pytest.CaptureFixture) -> None:
    for argv, message in ((["--splits", "9", "--num-examples", "8"], "--splits 9 is more microbatches than "
                                                                     "--num-examples 8"),
                          (["--local-crops", "0"], "--local-crops must be >= 1, got 0")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert message in capsys.readouterr().err

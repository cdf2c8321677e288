"""Training with a teacher (`--distill-model`, `--distill-pretrained`, `--distill-loss-weight`): the run logs
loss/contrastive and loss/distill (their sum is train/loss), the teacher stays frozen and never reaches the
optimizer, verify proves the distilled window, bad flags are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.cli import main
from naflexclip.distributed import init_distributed
from naflexclip.train.loop import Trainer, train


@pytest.mark.slow
def test_a_distilled_run_logs_both_terms_and_leaves_the_teacher_frozen(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    train(tiny_config(tmp_path, "teacher", stop_after_steps=1, val_frequency=0, seed=5))
    teacher_dir = str(tmp_path / "teacher" / "checkpoints")
    cfg = tiny_config(tmp_path, "student", stop_after_steps=2, val_frequency=0, distill_model="tiny",
                      distill_pretrained=teacher_dir, distill_loss_weight=0.5)
    trainer = Trainer(cfg, init_distributed("cpu"))
    teacher = trainer.window_step.teacher
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    trainer.fit()
    assert "distilling from --distill-model tiny" in capsys.readouterr().err
    assert all(torch.equal(before[n], p) and not p.requires_grad for n, p in teacher.named_parameters())
    assert not teacher.training
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}
    steps = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert len(steps) == 2
    for record in steps:
        assert record["loss/contrastive"] + record["loss/distill"] == pytest.approx(record["train/loss"], rel=1e-6)
        assert record["loss/distill"] > 0
    # verify proves the distilled window on the trained student with its teacher
    student_dir = str(tmp_path / "student" / "checkpoints")
    assert main(["verify", "--checkpoint", student_dir, "--splits", "1", "--accum-freq", "3",
                 "--distill-model", "tiny", "--distill-pretrained", teacher_dir]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "message"), [
    (["--distill-pretrained", "x"], "--distill-pretrained goes with --distill-model"),
    (["--distill-model", "tiny"], "--distill-model tiny is a preset: give the teacher's weights"),
    (["--distill-model", "tiny", "--distill-loss-weight", "-1"], "--distill-loss-weight must be a finite number"),
    (["--distill-model", "tiny", "--distill-pretrained", "nowhere"], "--distill-pretrained 'nowhere'"),
])
def test_bad_distill_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                        message: str) -> None:
    code = main(["train", "--model", "tiny", "--device", "cpu", "--logs", str(tmp_path), "--workers", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and err.count("\n") == 0, err


def test_verify_proves_a_distilled_window_and_refuses_a_clip_teacher_for_a_siglip_student(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--splits", "1", "--accum-freq", "3", "--batch-size", "2", "--distill-model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "contrastive + 1 · distill" in out
    assert main(["verify", "--siglip", "--distill-model", "tiny"]) == 2
    assert "has no logit_bias" in capsys.readouterr().out

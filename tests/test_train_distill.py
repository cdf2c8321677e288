"""Training with a teacher (`--distill-model`, `--distill-pretrained`, `--distill-loss-weight`): the run logs
loss/contrastive and loss/distill (their sum is train/loss), the teacher stays frozen and never reaches the
optimizer, verify proves the distilled window, bad flags are one line; a teacher with other patches and context
length trains a student on its own inputs of the same samples."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.cli import main
from naflexclip.parallel.process_group import init_distributed
from naflexclip.train.loop import Trainer, train
from naflexclip.window import TeacherFeatures


def _teacher(trainer: Trainer) -> torch.nn.Module:
    """The frozen teacher of a distilling run: the model of its `TeacherFeatures` term."""
    [teacher] = [term.model for term in trainer.window_step.terms if isinstance(term, TeacherFeatures)]
    return teacher


@pytest.mark.slow
def test_a_distilled_run_logs_both_terms_and_leaves_the_teacher_frozen(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    train(tiny_config(tmp_path, "teacher", stop_after_steps=1, val_frequency=0, seed=5))
    teacher_dir = str(tmp_path / "teacher" / "checkpoints")
    cfg = tiny_config(tmp_path, "student", stop_after_steps=2, val_frequency=0, distill_model="tiny",
                      distill_pretrained=teacher_dir, distill_loss_weight=0.5)
    trainer = Trainer(cfg, init_distributed("cpu"))
    teacher = _teacher(trainer)
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


def test_verify_proves_a_distilled_window_with_the_students_or_its_own_inputs_and_refuses_a_clip_teacher_for_siglip(
        capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--splits", "1", "--accum-freq", "3", "--batch-size", "2", "--distill-model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "contrastive + 1 · distill" in out
    assert main(["verify", "--siglip", "--distill-model", "tiny"]) == 2
    assert "has no logit_bias" in capsys.readouterr().out
    # a teacher with other patches and context length: its own random inputs of the window's rows
    assert main(["verify", "--splits", "1", "--accum-freq", "3", "--batch-size", "2", "--accum-method", "cache",
                 "--distill-model", "small"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "its own inputs of the same samples (patch size 16, context length 32)" in out
    # and with several captions per image: the teacher's own tokens of every caption
    assert main(["verify", "--splits", "1", "--accum-freq", "3", "--batch-size", "2", "--accum-method", "cache",
                 "--distill-model", "small", "--multi-positive"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.slow
def test_a_tiny_student_learns_from_a_teacher_with_other_patches_reading_its_own_inputs(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A `small` teacher (16-px patches, 32 tokens) for a `tiny` student (4 px, 16): every training microbatch carries
    the teacher's own inputs, the teacher runs once per microbatch on them, and verify proves the window on the
    loader's microbatches."""
    train(tiny_config(tmp_path, "teacher", model="small", stop_after_steps=1, val_frequency=0, seed=5))
    teacher_dir = str(tmp_path / "teacher" / "checkpoints")
    cfg = tiny_config(tmp_path, "student", stop_after_steps=2, val_frequency=0, distill_model="small",
                      distill_pretrained=teacher_dir)
    trainer = Trainer(cfg, init_distributed("cpu"))
    read: list[tuple[int, int]] = []  # (patch dim, text length) of each teacher forward
    _teacher(trainer).register_forward_hook(
        lambda module, args, kwargs, out: read.append((kwargs["image"]["patches"].shape[2], kwargs["text"].shape[1])),
        with_kwargs=True)
    trainer.fit()
    assert "it reads its own inputs of the same samples (patch size 16, context length 32)" in capsys.readouterr().err
    assert read == [(16 * 16 * 3, 32)] * (2 * cfg.accum_freq)  # once per microbatch: 2 steps of accum_freq
    steps = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert len(steps) == 2 and all(record["loss/distill"] > 0 for record in steps)
    assert main(["verify", "--checkpoint", str(tmp_path / "student" / "checkpoints"), "--splits", "1",
                 "--accum-freq", "3", "--accum-method", "cache", "--distill-model", "small",
                 "--distill-pretrained", teacher_dir]) == 0
    out = capsys.readouterr().out
    assert "window (loader)" in out and "its own inputs of the same samples (patch size 16" in out and "PASS" in out


@pytest.mark.slow
def test_a_student_with_patch_sizes_drawn_per_microbatch_learns_from_a_teacher_of_its_preset(tmp_path: Path) -> None:
    """--naflex-patch-sizes 4 8 with a `tiny` teacher: the student's patches vary per microbatch, so the teacher reads
    its own (4-px, flattened) inputs of the same samples."""
    train(tiny_config(tmp_path, "teacher", stop_after_steps=1, val_frequency=0, seed=5))
    cfg = tiny_config(tmp_path, "student", stop_after_steps=1, val_frequency=0, distill_model="tiny",
                      distill_pretrained=str(tmp_path / "teacher" / "checkpoints"))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, naflex_patch_sizes=(4, 8)))
    trainer = Trainer(cfg, init_distributed("cpu"))
    read: list[int] = []
    _teacher(trainer).register_forward_hook(
        lambda module, args, kwargs, out: read.append(kwargs["image"]["patches"].shape[-1]), with_kwargs=True)
    trainer.fit()
    assert read == [4 * 4 * 3] * cfg.accum_freq
    steps = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert len(steps) == 1 and steps[0]["loss/distill"] > 0


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from naflexclip.checkpoints.storage import find_latest, load_checkpoint

    return load_checkpoint(find_latest(run_dir / "checkpoints")).states["model"]


@pytest.mark.slow
def test_a_resumed_student_keeps_the_teacher_it_started_from_or_refuses_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--distill-pretrained naming a teacher run's checkpoints/ reads its latest, which moves while the teacher's run
    goes on: a resumed student keeps distilling from the step folder it started from, and refuses in one line when
    the teacher it names has other weights (that folder gone, or its contents replaced)."""
    train(tiny_config(tmp_path, "teacher", stop_after_steps=2, val_frequency=0, seed=5))
    teacher_dir = str(tmp_path / "teacher" / "checkpoints")

    def student(name: str, **overrides) -> None:
        train(tiny_config(tmp_path, name, val_frequency=0, distill_model="tiny", distill_pretrained=teacher_dir,
                          **overrides))

    student("straight", stop_after_steps=4)
    student("cut", stop_after_steps=2)
    student("replaced", stop_after_steps=2)
    # the teacher's run goes on: its latest moves to step 3
    train(tiny_config(tmp_path, "teacher", stop_after_steps=3, val_frequency=0, seed=5, resume="latest"))
    student("cut", stop_after_steps=4, resume="latest")
    straight, resumed = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "cut")
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)
    # the folder the students started from now holds other weights: the resume refuses, naming it
    step_2, step_3 = (tmp_path / "teacher" / "checkpoints" / f"step_0000000{i}" for i in (2, 3))
    shutil.rmtree(step_2)
    shutil.copytree(step_3, step_2)
    capsys.readouterr()
    assert main(["train", "--logs", str(tmp_path), "--name", "replaced", "--resume", "latest",
                 "--stop-after-steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--distill-pretrained" in err and str(step_2) in err and "weights" in err, err
    # and when it is gone, the teacher run's latest (step 3) is not the teacher the student started from
    shutil.rmtree(step_2)
    assert main(["train", "--logs", str(tmp_path), "--name", "replaced", "--resume", "latest",
                 "--stop-after-steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(step_3) in err and str(step_2) in err, err

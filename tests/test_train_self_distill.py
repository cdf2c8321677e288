"""`naflexclip train` with SigLIP 2's self-distillation and masked prediction: the terms switch on at
--self-distill-start (step k of T when (k − 1)/T >= start), the EMA teacher is built there and runs once per
microbatch, both terms are logged, the teacher is run state resumed bit-exactly on either side of the switch, its
centre is the whole window's over ranks, view seeds come from (seed, epoch, sample), and a locked image tower turns
the terms off in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.data import DataConfig, build_loader
from naflexclip.objectives.self_distillation import MASKED_PREDICTION, SELF_DISTILL, EmaTeacher, ViewSeeds
from naflexclip.parallel.process_group import init_distributed
from naflexclip.processing.view_seeds import VIEW_SEED
from naflexclip.train.loop import Trainer

# 48 pairs of 16 patches, 8 per microbatch: 6 microbatches an epoch, --accum-freq 2 → 3 optimizer steps
SMALL_DATA = ["--synthetic-train-size", "48", "--synthetic-val-size", "8", "--naflex-seq-lens", "16",
              "--naflex-max-tokens-per-batch", "128", "--workers", "0"]
TERMS = ["--self-distill-loss-weight", "1", "--masked-prediction-loss-weight", "0.25", "--local-crops", "2"]


def _small_config(tmp_path: Path, **overrides) -> object:
    data = DataConfig(synthetic_train_size=48, synthetic_val_size=8, naflex_seq_lens=(16,),
                      naflex_max_tokens_per_batch=128, workers=0)
    values = dict(data=data, epochs=1, self_distill_loss_weight=1.0, masked_prediction_loss_weight=0.25,
                  local_crops=2, self_distill_start=0.5)
    values.update(overrides)
    return tiny_config(tmp_path, **values)


@pytest.mark.slow
def test_the_terms_switch_on_at_self_distill_start_and_the_teacher_runs_once_per_microbatch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 steps, start 0.5: step 3 only ((3 - 1)/3 >= 0.5; step 2's (2 - 1)/3 is not; a k/T rule would switch at 2)
    forwards: list[int] = []
    real_forward = EmaTeacher.forward
    monkeypatch.setattr(EmaTeacher, "forward", lambda self, **kw: (forwards.append(1), real_forward(self, **kw))[1])
    trainer = Trainer(_small_config(tmp_path), init_distributed("cpu"))
    assert trainer.module.self_distill is not None  # the heads, from the start (the optimizer holds them)
    per_step = []
    real_step = trainer.train_step

    def train_step(microbatches):
        forwards.clear()
        result = real_step(microbatches)
        per_step.append((trainer.progress.step + 1, result.stats.num_microbatches, len(forwards),
                         sorted(result.stats.example_terms or {}),
                         ema_schedule(trainer).teacher is not None))
        return result

    trainer.train_step = train_step
    trainer.train_epoch()
    assert trainer.schedule.total_steps == 3
    assert per_step == [(1, 2, 0, [], False), (2, 2, 0, [], False),
                        (3, 2, 2, [MASKED_PREDICTION, SELF_DISTILL], True)]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["kind"] == "train"]
    assert ["loss/self_distill" in r for r in logged] == [False, False, True]
    assert logged[-1]["loss/self_distill"] > 0 and logged[-1]["loss/masked_prediction"] > 0
    # the teacher moved towards the student after step 3's update (momentum 0.996), and is not the student
    teacher = ema_schedule(trainer).teacher
    pairs = teacher.student_parameters(trainer.model)
    assert any(not torch.equal(t, s) for t, s in pairs)
    assert bool(teacher.global_center.abs().sum() > 0)


@pytest.mark.slow
def test_a_resume_before_and_after_the_switch_continues_bit_exactly(tmp_path: Path) -> None:
    """4 steps straight == stop at step 2 (before the switch: no teacher saved), resume and stop at step 3 (the
    teacher built at step 3 and saved), resume to the end: weights, optimizer state and teacher bit-equal."""
    from naflexclip.checkpoints.storage import find_latest, load_checkpoint
    from naflexclip.cli import main

    def run(name: str, *flags: str) -> dict:
        # 32 pairs, 8 per microbatch, --accum-freq 1: 4 steps, on from step 3 ((3 - 1)/4 >= 0.5)
        assert main(["train", "--model", "tiny", "--epochs", "1", "--accum-freq", "1", "--self-distill-start",
                     "0.5", "--device", "cpu", "--logs", str(tmp_path), "--name", name, "--val-frequency", "0",
                     "--zero-shot-samples", "8", *TERMS, *SMALL_DATA, "--synthetic-train-size", "32", *flags]) == 0
        return load_checkpoint(find_latest(tmp_path / name / "checkpoints")).states

    straight = run("straight")
    assert straight["progress"]["step"] == 4 and straight["ema_teacher"]["built"]
    before = run("split", "--stop-after-steps", "2")
    assert not before["ema_teacher"]["built"] and before["progress"]["next_batch"] == 2
    after = run("split", "--resume", "latest", "--stop-after-steps", "3")
    assert after["ema_teacher"]["built"] and after["progress"]["step"] == 3
    split = run("split", "--resume", "latest")
    for key, value in straight["model"].items():
        assert torch.equal(value, split["model"][key]), key
    for key, value in straight["ema_teacher"]["teacher"].items():
        assert torch.equal(value, split["ema_teacher"]["teacher"][key]), key
    for a, b in zip(straight["optimizer"]["state"].values(), split["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)

    def losses(name: str) -> list[float | None]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r.get("loss/self_distill") for r in map(json.loads, lines) if r["kind"] == "train"]

    assert losses("straight") == losses("split")
    assert losses("straight")[:2] == [None] * 2 and None not in losses("straight")[2:]


def test_the_centre_is_the_whole_windows_over_ranks() -> None:
    """A rank's teacher whose update adds the other rank's logit sums gets the centre of one teacher that saw both
    ranks' microbatches; without the sum it would follow its own rows."""

    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.models.naflex_clip import NaFlexClip, model_config
    from naflexclip.objectives.self_distillation import attach_heads, head_config

    torch.manual_seed(0)
    student = NaFlexClip(model_config("tiny"))
    attach_heads(student, head_config(32, 2, 0.5))
    student = student.double()
    images = [random_naflex_batch(n, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(n))
              ["image"] for n in (3, 2)]
    both, own, other = (EmaTeacher(student, momentum=0.9) for _ in range(3))
    for image in images:
        both(image=image)
    own(image=images[0])
    other(image=images[1])
    other_sums = {key: torch.stack(value).sum(0) for key, value in other._sums.items()}
    both.update(student)
    lonely = EmaTeacher(student, momentum=0.9)
    lonely(image=images[0])
    lonely.update(student)
    calls = iter([other_sums["global"], other_sums["patches"]])
    own.update(student, sum_over_ranks=lambda total: total + next(calls))
    assert torch.allclose(own.global_center, both.global_center, rtol=0, atol=1e-12)
    assert torch.allclose(own.patch_center, both.patch_center, rtol=0, atol=1e-12)
    assert not torch.allclose(lonely.global_center, both.global_center, rtol=0, atol=1e-6)


def test_view_seeds_are_a_function_of_seed_epoch_and_sample(tmp_path: Path) -> None:
    data = DataConfig(synthetic_train_size=24, synthetic_val_size=8, naflex_seq_lens=(16,),
                      naflex_max_tokens_per_batch=64, workers=0)

    def seeds(epoch: int, start_batch: int = 0, world_size: int = 1, rank: int = 0) -> dict[str, int]:
        loader = build_loader(data, split="train", patch_size=16, context_length=16, inputs=[ViewSeeds()],
                              rank=rank, world_size=world_size)
        loader.set_epoch(epoch, start_batch=start_batch)
        return {key: int(seed) for item in loader for key, seed in zip(item["keys"],
                                                                      item["example_inputs"][VIEW_SEED], strict=True)}

    epoch0 = seeds(0)
    assert len(epoch0) == 24 and len(set(epoch0.values())) == 24
    resumed = seeds(0, start_batch=1)
    assert resumed and all(epoch0[key] == value for key, value in resumed.items())  # a resume mid-epoch
    two_ranks = {**seeds(0, world_size=2, rank=0), **seeds(0, world_size=2, rank=1)}
    assert two_ranks == epoch0  # another world size: the same views of each sample
    epoch1 = seeds(1)
    assert all(epoch1[key] != value for key, value in epoch0.items())  # new views every epoch
    plain = build_loader(data, split="train", patch_size=16, context_length=16)
    assert "example_inputs" not in next(iter(plain))  # a run without the terms carries none


def test_a_locked_image_tower_turns_the_image_side_self_distillation_off_in_one_line(tmp_path: Path) -> None:
    trainer = Trainer(_small_config(tmp_path, lock_image=True), init_distributed("cpu"))
    assert trainer.module.self_distill is None and ema_schedule(trainer) is None
    assert "ema_teacher" not in trainer.checkpointer.components
    lines = [line for line in trainer.opening if "self-distillation" in line]
    assert lines == ["--lock-image: the image tower is locked, so self-distillation and masked prediction (both "
                     "image-side) are off"]
    microbatch = next(iter(trainer.loader))
    assert "example_inputs" not in microbatch


@pytest.mark.slow
def test_under_fsdp2_the_teacher_is_sharded_like_the_student_and_trains_as_under_ddp(tmp_path: Path) -> None:
    """2 ranks (gloo): under FSDP2 each teacher parameter is a DTensor placed as its student parameter; it runs once
    per local microbatch, its centres are the same on both ranks, its gathered state loads back into a fresh one, and
    after 2 steps it equals the DDP run's teacher (float32 tolerance: the gradient reductions differ in order)."""
    from distributed_workers import launch

    reports = launch("self_distill_train", 2, tmp_path)
    for rank, report in enumerate(reports):
        assert report["returncode"] == 0, f"rank {rank} exited {report['returncode']}:\n{report['stderr'][-4000:]}"
    results = [report["result"] for report in reports]
    for result in results:
        for wrapper in ("ddp", "fsdp"):
            steps = result[wrapper]["steps"]
            assert [(s["microbatches"], s["forwards"]) for s in steps] == [(2, 2), (2, 2)]
            assert all(set(s["terms"]) == {SELF_DISTILL, MASKED_PREDICTION} for s in steps)
            assert result[wrapper]["reloaded"]
        assert all(pair == ["whole", "whole"] for pair in result["ddp"]["placements"])
        sharded = result["fsdp"]["placements"]
        assert all(teacher == student and "Shard" in teacher for teacher, student in sharded)
    for wrapper in ("ddp", "fsdp"):
        assert results[0][wrapper]["center"] == results[1][wrapper]["center"]  # the window's, on every rank
    ddp, fsdp = (torch.load(tmp_path / f"teacher_{w}.pt", weights_only=True) for w in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys()
    for key, value in ddp.items():
        assert torch.allclose(value, fsdp[key], rtol=1e-4, atol=1e-6), key
    for a, b in zip(results[0]["ddp"]["steps"], results[0]["fsdp"]["steps"], strict=True):
        assert a["terms"][SELF_DISTILL] == pytest.approx(b["terms"][SELF_DISTILL], rel=1e-4)


def test_the_teacher_is_built_at_the_switch_and_a_skipped_step_leaves_it_as_it_was() -> None:
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.models.naflex_clip import NaFlexClip, model_config
    from naflexclip.objectives.self_distill_schedule import SelfDistillation
    from naflexclip.objectives.siglip2_recipe import Recipe

    torch.manual_seed(0)
    recipe = Recipe(self_distill_loss_weight=1.0, local_crops=2, self_distill_start=0.5)
    student = recipe.prepare(NaFlexClip(model_config("tiny")), self_distill=True).double()
    component = SelfDistillation(recipe, student, init_distributed("cpu"), None)
    batch = random_naflex_batch(2, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(1))
    batch["example_inputs"] = {VIEW_SEED: torch.tensor([3, 4])}
    terms = component.terms(2, 4)  # (2 - 1)/4 < 0.5: off
    assert component.teacher is None and not terms and component.state_dict() == {"built": False}
    terms = component.terms(3, 4)  # (3 - 1)/4 >= 0.5: on, built from the student
    teacher = component.teacher
    assert [part for term in terms for part in term.parts] == [SELF_DISTILL] and terms[0].teacher is teacher
    assert all(torch.equal(t, s) for t, s in teacher.student_parameters(student))
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    before = {key: value.clone() for key, value in teacher.state_dict().items()}
    teacher(image=batch["image"])
    component.after_step(skipped=True)
    assert all(torch.equal(value, teacher.state_dict()[key]) for key, value in before.items())
    component.after_step(skipped=False)  # the skipped step's logits are gone: only the EMA moves, not the centre
    assert not torch.equal(before["visual.embeds.proj.weight"], teacher.state_dict()["visual.embeds.proj.weight"])
    assert torch.equal(before["global_center"], teacher.global_center)


@pytest.mark.parametrize(("width", "depth", "size", "factor"), [
    (768, 12, "B", 0.25), (1024, 24, "L", 0.5), (1152, 27, "So400m", 1.0), (1536, 40, "g", 0.5)])
def test_the_recipe_reweights_self_distillation_by_the_papers_factor_for_each_model_size(
        width: int, depth: int, size: str, factor: float) -> None:
    from naflexclip.objectives.siglip2_recipe import Recipe

    scaled, note = Recipe(recipe="siglip2").for_model_size(width, depth)
    assert scaled.value("self_distill_loss_weight") == 1.0 * factor
    assert scaled.value("masked_prediction_loss_weight") == 0.25 * factor
    assert scaled.term_weights(progress=1.0) == {
        "locca": 1.0, SELF_DISTILL: factor, MASKED_PREDICTION: 0.25 * factor}  # the decoder's weight is not re-weighted
    assert note == (f"--recipe siglip2's weights × {factor:g}, SigLIP 2's factor for size {size} (image tower width "
                    f"{width}, depth {depth})")


def test_the_siglip2_presets_get_their_sizes_factor_and_other_sizes_1() -> None:
    from naflexclip.models.naflex_clip import PRESETS
    from naflexclip.objectives.siglip2_recipe import Recipe

    def weights(name: str) -> tuple[float, float]:
        image = PRESETS[name].image
        scaled, _ = Recipe(recipe="siglip2").for_model_size(image.width, image.depth)
        return scaled.value("self_distill_loss_weight"), scaled.value("masked_prediction_loss_weight")

    assert weights("siglip2-base") == (0.25, 0.0625) and weights("siglip2-so400m") == (1.0, 0.25)
    assert weights("tiny") == weights("small") == (1.0, 0.25)
    _, note = Recipe(recipe="siglip2").for_model_size(32, 2)
    assert note == ("--recipe siglip2's weights × 1, no paper value: the image tower width 32, depth 2 is none of "
                    "the paper's B / L / So400m / g")


def test_explicit_self_distillation_weights_are_not_reweighted() -> None:
    from naflexclip.objectives.siglip2_recipe import Recipe

    given = Recipe(recipe="siglip2", self_distill_loss_weight=0.7, masked_prediction_loss_weight=0.3)
    assert given.for_model_size(768, 12) == (given, None)
    one, note = Recipe(recipe="siglip2", self_distill_loss_weight=0.7).for_model_size(768, 12)
    assert (one.value("self_distill_loss_weight"), one.value("masked_prediction_loss_weight")) == (0.7, 0.0625)
    assert note.endswith("; --self-distill-loss-weight as given")
    plain = Recipe(self_distill_loss_weight=0.7)  # no recipe: the flags' weights as they are
    assert plain.for_model_size(768, 12) == (plain, None)


def test_a_recipe_run_trains_the_reweighted_weights_and_says_so_in_its_start_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from naflexclip.objectives import siglip2_recipe as recipe

    # the tiny tower taken for a B-size one: the run's terms are the recipe's weights × 0.25
    monkeypatch.setitem(recipe.SIZE_FACTORS, (32, 2), ("B", 0.25))
    trainer = Trainer(_small_config(tmp_path, recipe="siglip2", self_distill_loss_weight=None,
                                    masked_prediction_loss_weight=None), init_distributed("cpu"))
    terms = ema_schedule(trainer).recipe.term_weights(progress=1.0)
    assert terms == {"locca": 1.0, SELF_DISTILL: 0.25, MASKED_PREDICTION: 0.0625}
    [line] = [line for line in trainer.opening if "self-distillation" in line]
    assert ("+ 0.25 · self_distill + 0.0625 · masked_prediction (per example of the window; --recipe siglip2's "
            "weights × 0.25, SigLIP 2's factor for size B (image tower width 32, depth 2);") in line


def test_patch_dropout_with_masked_prediction_is_refused_in_one_line(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """Patch dropout drops a random subset of the student's masked-pass tokens, so its tokens no longer sit at the
    mask's positions (before: the targets were cut to the kept length and compared with other patches' tokens)."""
    from naflexclip.cli import main

    assert main(["train", "--model", "tiny", "--epochs", "1", "--self-distill-start", "0", "--device", "cpu",
                 "--logs", str(tmp_path), "--val-frequency", "0", *TERMS, *SMALL_DATA,
                 "--force-patch-dropout", "0.25"]) == 2
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip()
    assert out.count("\n") == 0, out
    assert "--force-patch-dropout 0.25 with masked prediction (--recipe siglip2 / --masked-prediction" in out


def test_the_masked_pass_refuses_a_tower_that_drops_patch_tokens() -> None:
    import dataclasses

    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.models.naflex_clip import NaFlexClip, model_config
    from naflexclip.objectives.self_distillation import attach_heads, head_config, student_terms

    torch.manual_seed(0)
    tiny = model_config("tiny")
    model = NaFlexClip(dataclasses.replace(tiny, image=dataclasses.replace(tiny.image, patch_drop_rate=0.5)))
    attach_heads(model, head_config(32, 2, 0.5))
    model = model.double().train()
    batch = random_naflex_batch(2, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(1))
    targets = EmaTeacher(model, momentum=0.9)(image=batch["image"])
    with pytest.raises(ValueError, match="patch dropout"):
        student_terms(model.visual, model.self_distill, batch["image"], torch.tensor([3, 4]), targets)


# the torchrun tests' stochastic tiny preset without its patch dropout (refused with masked prediction) and without
# their guard against pickled broadcasts (FSDP2's broadcast_from_rank0 sends the state's keys pickled)
FSDP2_SOURCE = ("import dataclasses, sys\nfrom naflexclip.cli import main\n"
                "from naflexclip.models.naflex_clip import PRESETS\n"
                "tiny = PRESETS['tiny']\nPRESETS['tiny'] = dataclasses.replace(tiny, image=dataclasses.replace("
                "tiny.image, drop_path_rate=0.2, proj_drop_rate=0.2))\nsys.exit(main(sys.argv[1:]))\n")
# 32 pairs, 4 per microbatch: 4 microbatches per rank, --accum-freq 1: 4 steps, on from step 3 ((3 - 1)/4 >= 0.5)
FSDP2_FLAGS = ["--fsdp", "--accum-freq", "1", "--self-distill-start", "0.5", *TERMS, "--synthetic-train-size", "32",
               "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "64", "--val-frequency", "0"]


def _fsdp2_run(logs: Path, name: str, *extra: str) -> dict:
    """Every state of the run's latest checkpoint, whole (a sharded one's shards read back whole)."""
    from test_train_torchrun import torchrun

    from naflexclip.checkpoints.storage import find_latest, load_checkpoint

    torchrun(logs, name, *FSDP2_FLAGS, *extra, source=FSDP2_SOURCE)
    found = load_checkpoint(find_latest(logs / name / "checkpoints"))
    return {**found.states, **{state: found.full_state(state) for state in found.sharded}}


def _one_process_resume(logs: Path, checkpoint: Path, *extra: str) -> subprocess.CompletedProcess:
    """`checkpoint` (a copy of it) resumed to the end in one process with the FSDP2 runs' flags and `extra`."""
    import shutil
    import sys

    from test_train_torchrun import RUN_FLAGS

    copy = logs / "one_process_from" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (logs / "launch.py").write_text(FSDP2_SOURCE)
    cmd = [sys.executable, str(logs / "launch.py"), "train", *RUN_FLAGS, "--logs-dir", str(logs), "--name", "one",
           *FSDP2_FLAGS, *extra, "--resume", str(copy)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def fsdp2_straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """torchrun, 2 gloo ranks, --fsdp, dropout and drop-path on (each rank its own stream), 4 steps straight with
    full saves: its logs folder and its last checkpoint's states."""
    logs = tmp_path_factory.mktemp("fsdp2_self_distill")
    return logs, _fsdp2_run(logs, "straight")


def _losses(run: Path) -> list[tuple[float, float | None]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [(r["train/loss"], r.get("loss/self_distill")) for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["full", "sharded"])
def test_an_fsdp2_run_resumed_before_and_after_the_switch_ends_as_a_straight_one(
        fsdp2_straight: tuple[Path, dict], tmp_path: Path, form: str) -> None:
    """4 steps straight == stopped at step 2 (before the switch), resumed and stopped at step 3 (the sharded teacher
    built at the switch and saved: gathered whole, or, with --fsdp-checkpoint sharded, as each rank's shards like
    the student's), resumed to the end (the teacher loaded back into shards): weights, optimizer state and teacher
    bit-equal, the same losses logged."""
    from naflexclip.checkpoints.storage import load_checkpoint

    straight_logs, straight = fsdp2_straight
    assert straight["progress"]["step"] == 4 and straight["ema_teacher"]["built"]
    assert straight["run"]["config"]["fsdp"] and straight["run"]["world_size"] == 2
    saves = ["--fsdp-checkpoint", form]
    before = _fsdp2_run(tmp_path, "split", *saves, "--stop-after-steps", "2")
    assert not before["ema_teacher"]["built"] and before["progress"]["step"] == 2
    after = _fsdp2_run(tmp_path, "split", *saves, "--resume", "latest", "--stop-after-steps", "3")
    assert after["ema_teacher"]["built"] and after["progress"]["step"] == 3
    step_3 = load_checkpoint(tmp_path / "split" / "checkpoints" / "step_00000003")
    if form == "sharded":  # no rank gathers the teacher: it is in the shards, not in rank 0's train_state.pt
        assert step_3.sharded == ("ema_teacher", "model", "optimizer") and "ema_teacher" not in step_3.states
        # resharded onto one process, the teacher continues from its shards, not built again from the student (the
        # switch kept before the checkpoint's step: one process re-plans the run to 8 steps)
        one = _one_process_resume(tmp_path, step_3.path, "--no-fsdp", "--fsdp-checkpoint", "full",
                                  "--self-distill-start", "0")
        assert "world size 2 -> 1" in one.stderr and "EMA teacher built from the student" not in one.stderr
        assert "Warning" not in one.stderr, one.stderr  # DCP's note that it loads in one process, which it does
    split = _fsdp2_run(tmp_path, "split", *saves, "--resume", "latest")
    assert split["progress"]["step"] == 4
    for key, value in straight["model"].items():
        assert torch.equal(value, split["model"][key]), key
    assert straight["ema_teacher"]["teacher"].keys() == split["ema_teacher"]["teacher"].keys()
    for key, value in straight["ema_teacher"]["teacher"].items():
        assert torch.equal(value, split["ema_teacher"]["teacher"][key]), key
    # keyed by parameter name; the heads' states, first made at the switch, come in another order after a resume
    assert straight["optimizer"]["state"].keys() == split["optimizer"]["state"].keys()
    for name, state in straight["optimizer"]["state"].items():
        assert all(torch.equal(value, split["optimizer"]["state"][name][k]) for k, value in state.items()), name
    assert _losses(straight_logs / "straight") == _losses(tmp_path / "split")
    assert [sd is None for _, sd in _losses(tmp_path / "split")] == [True, True, False, False]


def test_a_resume_that_moves_the_switch_later_drops_the_teacher_and_builds_it_again_at_the_new_switch() -> None:
    """A checkpoint taken after the switch, resumed with a later --self-distill-start: the steps before the new
    switch train no self-distillation, so the saved teacher is dropped (one line naming the flag and the step; before:
    it kept following the student by EMA through them) and built again from the student at the new switch."""
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.models.naflex_clip import NaFlexClip, model_config
    from naflexclip.objectives.self_distill_schedule import SelfDistillation
    from naflexclip.objectives.siglip2_recipe import Recipe

    torch.manual_seed(0)
    first = Recipe(self_distill_loss_weight=1.0, local_crops=2, self_distill_start=0.5)
    student = first.prepare(NaFlexClip(model_config("tiny")), self_distill=True).double()
    batch = random_naflex_batch(2, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(1))
    batch["example_inputs"] = {VIEW_SEED: torch.tensor([3, 4])}
    saved = SelfDistillation(first, student, init_distributed("cpu"), None)
    saved.terms(6, 10)
    assert saved.teacher is not None  # (6 - 1)/10 >= 0.5: built
    checkpoint = saved.state_dict()
    assert checkpoint["built"]

    lines: list[str] = []
    later = dataclasses.replace(first, self_distill_start=0.8)
    resumed = SelfDistillation(later, student, init_distributed("cpu"), None, notify=lines.append)
    resumed.load_state_dict(checkpoint)
    with torch.no_grad():  # the student trains on
        for p in student.parameters():
            p.add_(0.5)
    terms = resumed.terms(7, 10)  # (7 - 1)/10 < 0.8: off again
    assert not terms and resumed.teacher is None
    assert lines == ["step 7: --self-distill-start 0.8 of 10 steps puts the switch at step 9, after this one: the EMA "
                     "teacher the checkpoint holds is dropped and built again from the student there"]
    resumed.after_step(skipped=False)
    assert resumed.state_dict() == {"built": False}
    resumed.terms(8, 10)
    assert resumed.teacher is None and len(lines) == 1
    resumed.terms(9, 10)  # (9 - 1)/10 >= 0.8: built from the student as it is now
    teacher = resumed.teacher
    assert teacher is not None and all(torch.equal(t, s) for t, s in teacher.student_parameters(student))
    never = SelfDistillation(dataclasses.replace(first, self_distill_start=1.0), student, init_distributed("cpu"),
                             None, notify=lines.append)
    never.load_state_dict(checkpoint)
    never.terms(7, 10)
    assert lines[-1] == ("step 7: --self-distill-start 1 of 10 steps puts the switch after the run's last step: the "
                         "EMA teacher the checkpoint holds is dropped and the rest of the run trains no "
                         "self-distillation")


def test_every_openclip_siglip2_name_gets_the_factor_of_its_size() -> None:
    """OpenCLIP's SigLIP 2 configs (the paper's released towers): the size read from the image tower's width and
    depth is the one the name says, at every resolution and patch size."""
    from naflexclip.families.openclip_names import model_config, model_names
    from naflexclip.objectives.siglip2_recipe import Recipe

    by_name = {"ViT-B": ("B", 0.25), "ViT-L": ("L", 0.5), "ViT-SO400M": ("So400m", 1.0), "ViT-gopt": ("g", 0.5)}
    # tests/openclip_cases.py registers shrunken copies (`<name>-tiny`) in open_clip's registry: not the paper's sizes
    names = [name for name in model_names() if "SigLIP2" in name and not name.endswith("-tiny")]
    assert len(names) >= 4
    for name in names:
        size, factor = by_name["-".join(name.split("-")[:2])]
        image = model_config(name).image
        scaled, note = Recipe(recipe="siglip2").for_model_size(image.width, image.depth)
        assert scaled.value("self_distill_loss_weight") == factor and f"size {size} " in note, name


def ema_schedule(trainer):
    """The run's SigLIP 2 self-distillation schedule (its EMA teacher), or None."""
    return next(iter(trainer.window_step.term_schedules), None)

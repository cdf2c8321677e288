"""SigLIP 2's self-distillation and masked prediction in the window: the accumulated gradient equals
s(W)·∇[L(W) + Σ_k λ_k/N(W)·Σ_i ℓ_k(i)] of the whole window (N(W) its examples) for every split and method, the EMA
teacher running once per microbatch; normalising by a microbatch's own examples fails; crops and masks depend on the
example's seed alone; the EMA update and its state round-trip exactly."""

import dataclasses
import random

import pytest
import torch

from naflexclip.audit.gradient_audit import collect_gradients, full_batch_gradients
from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.audit.random_windows import random_naflex_batch, random_split_sizes
from naflexclip.batch import EXAMPLE_INPUTS, batch_size, concat_microbatches, split_batch
from naflexclip.loss import create_loss
from naflexclip.models.naflex_clip import NaFlexClip, model_config
from naflexclip.objectives.self_distillation import (
    MASKED_PREDICTION,
    SELF_DISTILL,
    EmaTeacher,
    SelfDistillTerm,
    attach_heads,
    head_config,
    local_crops,
    patch_mask,
)
from naflexclip.window import accumulate_gradients, window_loss_scale

WEIGHTS = {SELF_DISTILL: 0.7, MASKED_PREDICTION: 0.3}


def _terms(teacher: EmaTeacher) -> list[SelfDistillTerm]:
    return [SelfDistillTerm(teacher, WEIGHTS)]


def _model(loss: str, heads=None) -> NaFlexClip:
    torch.manual_seed(0)
    model = NaFlexClip(model_config("tiny", loss=loss))
    attach_heads(model, heads or head_config(32, 3, 0.5))
    return model.double().eval()


def _batch(n: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    batch = random_naflex_batch(n, patch_size=4, context_length=16, generator=gen)
    batch[EXAMPLE_INPUTS] = {"view_seed": torch.randint(0, 2**31, (n,), generator=gen)}
    return batch


def _teacher(model: NaFlexClip) -> EmaTeacher:
    teacher = EmaTeacher(model, momentum=0.9)
    with torch.no_grad():  # a teacher that differs from the student, as after some EMA steps
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        teacher.global_center.normal_()
    return teacher


def _worst(grads, reference):
    return max((grads[k] - reference[k]).norm().item() / reference[k].norm().item() for k in reference
               if "pos_embed" not in k)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("method", ["cache", "replay"])
def test_the_window_with_self_distillation_equals_the_full_batch_objective(loss, method):
    model = _model(loss)
    teacher = _teacher(model)
    loss_fn = create_loss(loss)
    batch = _batch(6)
    sizes = random_split_sizes(6, 3, random.Random(1))
    microbatches = split_batch(batch, sizes)
    scale = window_loss_scale(sizes, 4, "linear")
    reference = full_batch_gradients(model, loss_fn, concat_microbatches(microbatches), scale,
                                     terms=_terms(teacher))
    assert any(name.startswith("self_distill.") for name in reference)
    model.zero_grad(set_to_none=True)
    stats = accumulate_gradients(model, loss_fn, microbatches, loss_scale="linear", reference_batch_size=4,
                                 method=method, terms=_terms(teacher))
    assert _worst(collect_gradients(model), reference) < 1e-10
    assert set(stats.example_terms) == {SELF_DISTILL, MASKED_PREDICTION}
    assert all(value > 0 for value in stats.example_terms.values())


def test_normalising_by_each_microbatchs_own_examples_fails_the_same_comparison():
    model = _model("siglip")
    teacher = _teacher(model)
    loss_fn = create_loss("siglip")
    microbatches = split_batch(_batch(7), [1, 2, 4])
    scale = window_loss_scale([1, 2, 4], 4, "linear")
    reference = full_batch_gradients(model, loss_fn, concat_microbatches(microbatches), scale,
                                     terms=_terms(teacher))
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, microbatches, loss_scale="linear", reference_batch_size=4,
                                   terms=_terms(teacher))
    grads = collect_gradients(model)
    heads = {k: v for k, v in reference.items() if k.startswith("self_distill.")}
    assert _worst(grads, heads) > 1e-3


def test_the_teacher_runs_once_per_microbatch_and_never_in_a_replay():
    model = _model("clip")
    teacher = _teacher(model)
    calls = []
    teacher.register_forward_hook(lambda module, args, out: calls.append(torch.is_grad_enabled()))
    for method in ("cache", "replay"):
        calls.clear()
        accumulate_gradients(model, create_loss("clip"), split_batch(_batch(6), [1, 2, 3]), method=method,
                             terms=_terms(teacher))
        assert calls == [False, False, False]
    assert not any(p.grad is not None for p in teacher.parameters())


def test_crops_and_masks_depend_on_each_examples_seed_alone():
    batch = _batch(6, seed=3)
    whole_crops = local_crops(batch["image"], batch[EXAMPLE_INPUTS]["view_seed"], 3)
    whole_mask = patch_mask(batch["image"]["patch_valid"], batch[EXAMPLE_INPUTS]["view_seed"], 0.5)
    start = 0
    for piece in split_batch(batch, [2, 1, 3]):
        n = batch_size(piece)
        crops = local_crops(piece["image"], piece[EXAMPLE_INPUTS]["view_seed"], 3)
        rows = slice(3 * start, 3 * (start + n))
        for key in crops:
            width = crops[key].shape[1]
            assert torch.equal(crops[key], whole_crops[key][rows, :width])
            assert not whole_crops["patch_valid"][rows, width:].any()
        mask = patch_mask(piece["image"]["patch_valid"], piece[EXAMPLE_INPUTS]["view_seed"], 0.5)
        assert torch.equal(mask, whole_mask[start : start + n, : mask.shape[1]])
        start += n
    valid = batch["image"]["patch_valid"]
    assert not (whole_mask & ~valid).any()
    counts = whole_mask.sum(1).tolist()
    assert counts == [max(1, round(0.5 * int(v))) for v in valid.sum(1).tolist()]


def test_ema_update_math_and_state_dict_round_trip_are_exact():
    model = _model("siglip")
    teacher = EmaTeacher(model, momentum=0.75)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    before = [t.clone() for t, _ in teacher.student_parameters(model)]
    batch = _batch(4)
    logits = teacher.heads.global_head(teacher.visual.forward_head(teacher.visual.forward_features(
        batch["image"]["patches"].double(), patch_coord=batch["image"]["patch_coord"],
        patch_valid=batch["image"]["patch_valid"])["patches"], patch_valid=batch["image"]["patch_valid"]))
    teacher(image=batch["image"])
    teacher.update(model)
    for (t, s), old in zip(teacher.student_parameters(model), before, strict=True):
        assert torch.equal(t, 0.75 * old + 0.25 * s)
    assert torch.allclose(teacher.global_center, 0.1 * logits.mean(0).detach(), rtol=0, atol=1e-12)
    restored = EmaTeacher(_model("siglip"), momentum=0.75)
    restored.load_state_dict(teacher.state_dict())
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, restored.state_dict()[key])


def test_verify_self_distillation_passes_and_its_per_microbatch_column_fails(capsys):
    from naflexclip.cli import main

    argv = ["verify", "--self-distill-loss-weight", "1", "--masked-prediction-loss-weight", "0.25", "--local-crops",
            "2", "--splits", "1", "--accum-freq", "3", "--batch-size", "2", "--naflex-loss-scale", "none"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "2 local crops, --mask-ratio" in out
    head_rows = [line.split() for line in out.splitlines() if line.startswith("self_distill.")]
    assert len(head_rows) == 3 and all(row[-2] == "ok" and float(row[-1]) > 1e-3 for row in head_rows)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--mask-ratio", "1.5", "--mask-ratio must be in [0, 1], got 1.5"),
    ("--local-crops", "0", "--local-crops must be >= 1, got 0"),
    ("--self-distill-loss-weight", "-1", "--self-distill-loss-weight must be a finite number >= 0, got -1.0"),
])
def test_verify_refuses_bad_self_distillation_flags_in_one_line(capsys, flag, value, message):
    from naflexclip.cli import main

    assert main(["verify", flag, value]) == 2
    out = capsys.readouterr().out.strip()
    assert message in out and out.count("\n") == 0


def test_the_recipe_switches_the_terms_on_at_self_distill_start():
    from naflexclip.objectives.siglip2_recipe import Recipe

    recipe = Recipe(recipe="siglip2")
    assert list(recipe.term_weights(progress=0.79)) == ["locca"]
    assert recipe.term_weights(progress=0.8) == {"locca": 1.0, SELF_DISTILL: 1.0, MASKED_PREDICTION: 0.25}
    assert list(recipe.term_weights()) == ["locca"]  # a caller that does not schedule them
    parts = [part for term in recipe.terms(0.8, EmaTeacher(_model("siglip"), 0.9)) for part in term.parts]
    assert parts == ["locca", SELF_DISTILL, MASKED_PREDICTION]
    assert not Recipe().self_distill_enabled
    assert Recipe(self_distill_start=0.5, masked_prediction_loss_weight=0.1).self_distill_active(0.5)


def test_train_takes_the_recipe_flags_and_refuses_what_it_cannot_combine_in_one_line(capsys):
    # failed before the TrainConfig fields: every `naflexclip train` stopped on TrainConfig(**Recipe.as_dict())
    from naflexclip.cli import build_parser, main
    from naflexclip.train.config.flags import config_from_args, with_defaults
    from naflexclip.train.config.train_config import TrainConfig

    config = config_from_args(with_defaults(build_parser().parse_args(["train", "--model", "tiny", "--recipe",
                                                                        "siglip2"])))
    assert isinstance(config, TrainConfig) and config.self_distill_loss_weight is None
    assert main(["train", "--model", "tiny", "--masked-prediction-loss-weight", "0.25", "--multi-positive"]) == 2
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip()
    assert "--multi-positive with self-distillation or masked prediction" in out and out.count("\n") == 0


def test_the_window_holds_per_microbatch_teacher_features_not_prototype_distributions():
    """Per microbatch the window keeps the teacher's bottleneck features (`D` floats a patch), the prototypes and
    centres once per window: at P = 1024 prototypes ≫ D = 8 the bytes kept per patch stay far below P × 4 (before:
    P floats of every patch, 17 GB at 256 pairs × 256 patches × 65,536 prototypes)."""
    model = _model("siglip", dataclasses.replace(head_config(32, 2, 0.5), prototypes=1024))
    config = model.config
    teacher = _teacher(model)
    kept: list[dict[str, torch.Tensor]] = []
    teacher.register_forward_hook(lambda module, args, kwargs, out: kept.append(out), with_kwargs=True)
    microbatches = split_batch(_batch(6), [1, 2, 3])
    accumulate_gradients(model, create_loss("siglip"), microbatches, terms=_terms(teacher))
    assert len(kept) == 3
    storages = [{t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in out.values()} for out in kept]
    shared = set.intersection(*(set(s) for s in storages))  # held once per window, by every microbatch
    prototypes, bottleneck = config.self_distill.prototypes, config.self_distill.bottleneck
    assert sum(storages[0][ptr] for ptr in shared) <= 2 * (prototypes * bottleneck + prototypes) * 8
    for own, mb in zip(storages, microbatches, strict=True):
        patches = mb["image"]["patch_valid"].numel()
        per_patch = sum(nbytes for ptr, nbytes in own.items() if ptr not in shared) / patches
        assert per_patch < prototypes * 4
        assert per_patch <= 2 * bottleneck * 8  # a patch's features and its share of the image's


def test_the_windows_prototypes_and_centres_follow_an_update_a_load_and_a_move():
    model = _model("siglip")
    teacher = _teacher(model)
    image = _batch(2)["image"]
    first = teacher(image=image)
    assert teacher(image=image)["global_center"] is first["global_center"]  # one copy per window
    state = {key: value.clone() for key, value in teacher.state_dict().items()}
    for change in (lambda: teacher.update(model), lambda: teacher.load_state_dict(state),
                   lambda: teacher.to(torch.float64)):
        before = teacher(image=image)
        change()
        after = teacher(image=image)
        assert after["global_center"] is not before["global_center"]
        assert torch.equal(after["global_center"], teacher.global_center)


def test_masked_prediction_projects_only_the_masked_patches_of_student_and_teacher(monkeypatch):
    """The masked-prediction term is a sum over the masked patches: the student's patch head and the teacher's
    target distribution see the masked rows only (before: every patch of the sequence, then masked), and each
    example's term equals the dense computation masked afterwards."""
    import torch.nn.functional as F

    from naflexclip.objectives import self_distillation as selfdistill

    model = _model("siglip")
    teacher = _teacher(model)
    batch = _batch(3)
    image, seeds = batch["image"], batch[EXAMPLE_INPUTS]["view_seed"]
    targets = teacher(image=image)
    mask = patch_mask(image["patch_valid"], seeds, model.self_distill.config.mask_ratio)
    assert 0 < int(mask.sum()) < int(image["patch_valid"].sum())
    head_rows: list[int] = []
    model.self_distill.patch_head.register_forward_hook(
        lambda module, args, out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    target_rows: list[int] = []
    real = selfdistill.teacher_distribution

    def counted(targets, key):
        out = real(targets, key)
        if key == "patches":
            target_rows.append(out.reshape(-1, out.shape[-1]).shape[0])
        return out

    monkeypatch.setattr(selfdistill, "teacher_distribution", counted)
    terms = selfdistill.student_terms(model.visual, model.self_distill, image, seeds, targets)
    assert head_rows == [int(mask.sum())] and target_rows == [int(mask.sum())]
    # the dense reference: every patch projected, the cross-entropy averaged over each example's masked ones
    with selfdistill.masked_embeddings(model.visual, model.self_distill.mask_token, mask):
        _, patches = selfdistill._tower(model.visual, image)
    log_q = F.log_softmax(model.self_distill.patch_head(patches) / selfdistill.STUDENT_TEMPERATURE, dim=-1)
    dense = -(real(targets, "patches") * log_q).sum(-1)
    expected = (dense * mask).sum(1) / mask.sum(1)
    assert torch.allclose(terms[MASKED_PREDICTION], expected, rtol=1e-12, atol=0)

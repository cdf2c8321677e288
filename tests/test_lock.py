"""Locked towers (LiT): OpenCLIP's methods and flags, exactness of the window for the trainable parameters, one
forward of a fully locked tower per microbatch, locked parameters bit-unchanged by training, resume checks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config
from window_cases import failures, full_batch_gradients, loss_for, naflex_window

from naflexclip import accumulate_gradients, create_model, window_loss_scale
from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.audit.random_windows import random_split_sizes
from naflexclip.batch import split_batch
from naflexclip.cli import main
from naflexclip.parallel.process_group import init_distributed
from naflexclip.train.loop import Trainer, train


def _tiny(siglip: bool = False, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("tiny", loss="siglip" if siglip else "clip", **overrides).double()


def _trainable(module: torch.nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in module.named_parameters()}


# ------------------------------------------------------------------------------------------ the methods


def test_lock_image_tower_locks_the_whole_image_tower_only() -> None:
    model = _tiny()
    model.lock_image_tower()
    assert not any(_trainable(model.visual).values()) and not model.image_projection.weight.requires_grad
    assert all(_trainable(model.text).values()) and model.logit_scale.requires_grad
    assert model.locked_towers() == {"image"}


def test_unlocked_groups_count_from_the_output_end() -> None:
    model = _tiny()  # tiny: embeddings, block 0, block 1 + final norm, then the image projection
    model.lock_image_tower(unlocked_groups=1)
    assert [n for n, p in model.named_parameters() if p.requires_grad and n.startswith(("visual", "image"))] == [
        "image_projection.weight"]
    model.lock_image_tower(unlocked_groups=2)
    trainable = {n for n, p in model.visual.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.visual.named_parameters() if n.startswith(("blocks.1.", "norm."))}
    assert model.image_projection.weight.requires_grad and model.locked_towers() == set()
    model.lock_text_tower(unlocked_layers=2)  # text: embeddings, block 0, block 1 + ln_final, projection
    trainable = {n for n, p in model.text.named_parameters() if p.requires_grad}
    assert trainable == {"text_projection"} | {n for n, _ in model.text.named_parameters()
                                               if n.startswith(("transformer.resblocks.1.", "ln_final."))}
    with pytest.raises(ValueError, match="unlocked_groups=5: the tower has 4 layer groups"):
        model.lock_image_tower(unlocked_groups=5)


def test_freeze_layer_norm_false_leaves_the_locked_layer_norms_trainable() -> None:
    model = _tiny()
    model.lock_text_tower(freeze_layer_norm=False)
    trainable = {n for n, p in model.text.named_parameters() if p.requires_grad}
    assert trainable and all(".ln_" in f".{n}" for n in trainable)  # ln_1, ln_2, ln_final
    assert model.locked_towers() == set()  # not fully locked: the window replays it
    model.lock_text_tower(freeze_layer_norm=True)
    assert model.locked_towers() == {"text"}


def test_siglip2_import_locks_its_map_head_as_the_last_image_group(tmp_path: Path) -> None:
    from siglip2_cases import make_checkpoint

    model = create_model(str(make_checkpoint(tmp_path / "ck")))
    model.lock_image_tower(unlocked_groups=1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if n.startswith("visual.")} == {
        n for n, _ in model.named_parameters() if n.startswith("visual.attn_pool.")}
    model.lock_image_tower()
    model.lock_text_tower()
    assert model.locked_towers() == {"image", "text"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"logit_scale", "logit_bias"}


def test_the_logit_scale_clamp_leaves_a_locked_temperature_alone() -> None:
    model = _tiny()
    with torch.no_grad():
        model.logit_scale.fill_(6.0)  # above ln 100
    model.logit_scale.requires_grad_(False)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == 6.0
    model.logit_scale.requires_grad_(True)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() < 4.7


def test_a_fully_locked_tower_stays_in_eval_mode_when_the_model_trains() -> None:
    model = _tiny()
    model.lock_image_tower()
    model.train()
    assert not any(m.training for m in model.visual.modules()) and model.text.training
    model.lock_image_tower(unlocked_groups=1)  # partly locked: the model's mode
    assert model.train().visual.training
    model.eval()
    assert not model.text.training


# ------------------------------------------------------------------------------------------- the window


def _locked(siglip: bool, lock: str, **overrides) -> torch.nn.Module:
    model = _tiny(siglip, **overrides)
    if lock == "image":
        model.lock_image_tower()
    elif lock == "image+2":
        model.lock_image_tower(unlocked_groups=2)
    elif lock == "text":
        model.lock_text_tower()
    elif lock == "text+1":
        model.lock_text_tower(unlocked_layers=1, freeze_layer_norm=False)
    return model


@pytest.mark.parametrize(("lock", "method", "siglip"), [
    ("image", "cache", False), ("image", "replay", True), ("image+2", "cache", True), ("image+2", "replay", False),
    ("text", "cache", True), ("text", "replay", False), ("text+1", "cache", False), ("text+1", "replay", True),
])
def test_locked_window_is_exact_for_every_trainable_parameter(method: str, siglip: bool, lock: str) -> None:
    """float64, uneven split, train mode: the window equals s(W)·∇L of the full batch; locked parameters get no
    gradient. A fully locked image tower has drop-path on, which its eval mode turns off (else the full batch and
    the microbatches would draw different masks). The per-microbatch rule on the same split fails the comparison."""
    model = _locked(siglip, lock, drop_path_rate=0.5 if lock == "image" else 0.0).train()
    loss_fn = loss_for(siglip)
    batch = naflex_window(9, seed=1)
    sizes = random_split_sizes(9, 3, random.Random(0))
    assert len(set(sizes)) > 1
    scale = window_loss_scale(sizes, 2, "linear")
    reference = full_batch_gradients(model, loss_fn, batch, scale)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear", reference_batch_size=2,
                         method=method)
    assert failures(model, reference) == {}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert set(reference) == {n for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                   reference_batch_size=2)
    assert failures(model, reference)


def _image_forwards(model: torch.nn.Module, method: str, num_microbatches: int) -> int:
    calls = []
    handle = model.visual.register_forward_hook(lambda *_: calls.append(1))
    batch = naflex_window(8, seed=2)
    sizes = [2] * num_microbatches + [8 - 2 * num_microbatches]
    accumulate_gradients(model, loss_for(False), split_batch(batch, sizes), method=method)
    handle.remove()
    return len(calls)


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_a_locked_image_tower_runs_once_per_microbatch(method: str) -> None:
    model = _tiny().train()
    assert _image_forwards(model, method, 3) == 8  # 4 microbatches: cached and replayed
    model.lock_image_tower(unlocked_groups=1)
    assert _image_forwards(model, method, 3) == 8  # partly locked: replayed as before
    model.lock_image_tower()
    assert _image_forwards(model, method, 3) == 4  # a feature source: one no-grad forward each


# --------------------------------------------------------------------------------------- training runs


def test_training_leaves_locked_parameters_bit_unchanged_with_no_optimizer_state(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, lock_image=True, lock_text=True, lock_text_unlocked_layers=1,
                      lock_text_freeze_layer_norm=True, stop_after_steps=3, val_frequency=0, wd=0.5)
    trainer = Trainer(cfg, init_distributed("cpu"))
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trainable == {"text.text_projection", "logit_scale"}
    trainer.fit()
    after = dict(trainer.module.named_parameters())
    for name in before:
        assert torch.equal(before[name], after[name]) != (name in trainable), name
    by_id = {id(p): n for n, p in trainer.module.named_parameters()}
    assert {by_id[id(p)] for p in trainer.optimizer.state} == trainable
    assert {by_id[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]} == trainable


def test_lock_flags_reach_the_run_and_are_refused_on_resume_when_changed(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    train(tiny_config(tmp_path, "lit", lock_image=True, stop_after_steps=1, val_frequency=0))
    assert "locked: the image tower (30 tensors" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--lock-image: the checkpoint has on, this run off") as raised:
        train(tiny_config(tmp_path, "lit", stop_after_steps=2, val_frequency=0, resume="latest"))
    assert len(str(raised.value).splitlines()) == 1
    train(tiny_config(tmp_path, "lit", lock_image=True, stop_after_steps=2, val_frequency=0, resume="latest"))
    capsys.readouterr()
    # verify takes the run's own locks from its checkpoint
    assert main(["verify", "--checkpoint", str(tmp_path / "lit" / "checkpoints"), "--splits", "1"]) == 0
    assert "locked: the image tower" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "message"), [
    (["--lock-image-unlocked-groups", "2"], "--lock-image-unlocked-groups goes with --lock-image"),
    (["--lock-text-freeze-layer-norm"], "--lock-text-freeze-layer-norm goes with --lock-text"),
    (["--lock-text", "--lock-text-unlocked-layers", "-1"], "--lock-text-unlocked-layers must be >= 0, got -1"),
    (["--lock-image", "--lock-image-unlocked-groups", "9"],
     "--lock-image-unlocked-groups 9: the image tower has 4 layer groups"),
])
def test_bad_lock_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                     message: str) -> None:
    code = main(["train", "--model", "tiny", "--device", "cpu", "--logs", str(tmp_path), "--workers", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and err.count("\n") == 0


def test_verify_checks_a_locked_window(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--splits", "1", "--accum-freq", "3", "--batch-size", "2", "--lock-image",
                 "--lock-text", "--lock-text-unlocked-layers", "1", "--lock-text-freeze-layer-norm"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "locked: the image tower" in out and "visual.blocks" not in out
    assert "text.text_projection" in out
    assert main(["verify", "--lock-text-unlocked-layers", "1"]) == 2

"""OpenCLIP's optimizer and schedule flags: --opt (adamw, nadamw, timm/<name>), --opt-kwargs, --momentum,
--wd-exclude, layer-wise lr decay, --lr-scheduler cosine|const|const-cooldown with its cooldown flags,
--skip-scheduler; saved in the run config, continued or refused by a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.cli import build_parser
from naflexclip.families.factory import create_model
from naflexclip.models.lock import image_groups, text_groups
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.loop import train
from naflexclip.train.optim import LrSchedule, create_optimizer, scheduled_lr
from naflexclip.train.resume import refusal

BETAS = (0.9, 0.98)


def _config(*flags: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *flags]))


def test_opt_names_build_openclips_optimizers_with_their_kwargs() -> None:
    model = create_model("tiny")
    adamw = create_optimizer(model, lr=1e-3, weight_decay=0.1, betas=BETAS, eps=1e-6,
                             opt_kwargs={"amsgrad": True})
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["amsgrad"] is True
    nadamw = create_optimizer(model, lr=1e-3, weight_decay=0.1, betas=BETAS, eps=1e-6, opt="nadamw")
    assert type(nadamw) is torch.optim.NAdam and nadamw.param_groups[0]["decoupled_weight_decay"] is True
    sgd = create_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(None, None), eps=None, opt="timm/sgd",
                           momentum=0.5, opt_kwargs={"nesterov": False})
    assert sgd.param_groups[0]["momentum"] == 0.5 and sgd.param_groups[0]["nesterov"] is False
    lion = create_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(None, None), eps=None, opt="timm/lion")
    assert type(lion).__module__.startswith("timm.optim") and lion.param_groups[0]["betas"] == (0.9, 0.99)
    assert [g["weight_decay"] for g in lion.param_groups] == [0.1, 0.0]  # our groups, not timm's own split


def test_opt_flags_are_saved_and_betas_are_a_timm_optimizers_own() -> None:
    cfg = _config("--opt", "timm/lamb", "--opt-kwargs", "trust_clip=True", "max_grad_norm=2.5", "mode=x",
                  "--momentum", "0.8")
    assert (cfg.opt, cfg.opt_kwargs, cfg.momentum) == ("timm/lamb", {"trust_clip": True, "max_grad_norm": 2.5,
                                                                     "mode": "x"}, 0.8)
    assert (cfg.beta1, cfg.beta2, cfg.eps) == (None, None, None)
    assert (_config().beta1, _config().beta2, _config().eps) == (0.9, 0.98, 1e-6)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(("flags", "message"), [
    (["--opt", "sgd"], "--opt: 'sgd' is not one of"),
    (["--opt", "timm/nope"], "--opt timm/nope: timm has no optimizer 'nope'"),
    (["--momentum", "0.9"], "--momentum goes with a timm optimizer"),
    (["--image-layer-decay", "0"], "--image-layer-decay must be in (0, 1]"),
    (["--lr-scheduler", "const-cooldown"], "--lr-scheduler const-cooldown needs --epochs-cooldown"),
    (["--epochs-cooldown", "1"], "--epochs-cooldown goes with --lr-scheduler const-cooldown"),
    (["--opt-kwargs", "amsgrad"], "--opt-kwargs: 'amsgrad' is not key=value"),
])
def test_bad_optimizer_flags_name_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(*flags)


def test_layer_decay_scales_each_groups_step_as_openclip() -> None:
    """timm/sgd without momentum or decay: a parameter moves by lr · decay ** (groups above it) · grad."""
    torch.manual_seed(0)
    model = create_model("tiny").double()
    images, texts = image_groups(model), text_groups(model)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    optimizer = create_optimizer(model, lr=0.1, weight_decay=0.0, betas=(None, None), eps=None, opt="timm/sgd",
                                 momentum=0.0, opt_kwargs={"nesterov": False}, image_layer_decay=0.5,
                                 text_layer_decay=0.8)
    schedule = LrSchedule(optimizer, 0.1, 0, 10, kind="const")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    schedule.step()

    def moved(param: torch.nn.Parameter) -> float:
        return float((before[id(param)] - param.detach()).flatten()[0])

    for groups, decay in ((images, 0.5), (texts, 0.8)):
        for depth, group in enumerate(groups):
            assert moved(group[0]) == pytest.approx(0.1 * decay ** (len(groups) - 1 - depth), rel=1e-12)
    assert moved(model.logit_scale) == pytest.approx(0.1, rel=1e-12)  # outside both towers: full lr
    assert max(g["lr"] for g in optimizer.param_groups) == schedule.lr == 0.1  # the schedule keeps the scales
    assert min(g["lr"] for g in optimizer.param_groups) == pytest.approx(0.1 * 0.5 ** (len(images) - 1))


def test_wd_exclude_globs_take_parameters_out_of_weight_decay() -> None:
    model = create_model("tiny")
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = create_optimizer(model, lr=1e-3, weight_decay=0.1, betas=BETAS, eps=1e-6,
                                 wd_exclude=("visual.blocks.0.*", "*text_projection"))
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] for p in g["params"]}
    assert "visual.blocks.1.attn.qkv.weight" in decayed and "image_projection.weight" in decayed
    assert not {n for n in decayed if n.startswith("visual.blocks.0.") or n.endswith("text_projection")}


def test_schedules_equal_openclips_step_for_step() -> None:
    scheduler = pytest.importorskip("open_clip_train.scheduler")
    model = create_model("tiny")
    for kind, theirs in (("cosine", lambda o: scheduler.cosine_lr(o, 0.5, 3, 20)),
                         ("const", lambda o: scheduler.const_lr(o, 0.5, 3, 20)),
                         ("const-cooldown", lambda o: scheduler.const_lr_cooldown(o, 0.5, 3, 20, 8, 2.0, 0.01))):
        optimizer = create_optimizer(model, lr=0.5, weight_decay=0.0, betas=BETAS, eps=1e-6)
        schedule = LrSchedule(optimizer, 0.5, 3, 20, kind=kind, cooldown_steps=8, cooldown_power=2.0,
                              cooldown_end_lr=0.01)
        adjust = theirs(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5))
        for step in range(20):
            assert schedule.lr_at(step) == pytest.approx(adjust(step), abs=1e-15), (kind, step)
    skipped = {"base_lr": 0.5, "warmup_steps": 3, "total_steps": 20, "kind": "cosine", "skip": True}
    assert {scheduled_lr(step, skipped) for step in range(25)} == {0.5}


def _lrs(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/lr"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_const_cooldown_run_cools_down_over_the_last_epoch_and_resumes_it(tmp_path: Path) -> None:
    flags = dict(epochs=2, lr_scheduler="const-cooldown", epochs_cooldown=1, lr_cooldown_end=1e-4, warmup=1,
                 val_frequency=0, zero_shot_samples=8, plot=False)
    train(tiny_config(tmp_path, "straight", **flags))
    lrs = _lrs(tmp_path / "straight")
    total = max(lrs)
    first = json.loads((tmp_path / "straight" / "checkpoints" / "epoch_1" / "checkpoint.json").read_text())["step"]
    assert 0 < first < total and [lrs[s] for s in range(1, first + 1)] == [1e-3] * first
    cooled = [lrs[s] for s in range(first + 1, total + 1)]
    steps = total - first  # the last epoch's windows
    expected = [(1 - e / steps) * (1e-3 - 1e-4) + 1e-4 for e in range(steps)]
    assert cooled == pytest.approx(expected, rel=1e-12)
    train(tiny_config(tmp_path, "split", **flags, stop_after_steps=first + 1))
    train(tiny_config(tmp_path, "split", **flags, resume="latest"))
    assert _lrs(tmp_path / "split") == lrs


def test_a_resume_refuses_another_optimizer_and_reschedules_another_schedule() -> None:
    saved = TrainConfig(model="tiny", name="x").to_dict()
    for change, flag in (({"opt": "nadamw"}, "--opt"), ({"image_layer_decay": 0.7}, "--image-layer-decay"),
                         ({"wd_exclude": ("*bias",)}, "--wd-exclude")):
        message = refusal(saved, TrainConfig(model="tiny", name="x", **change).to_dict())
        assert message is not None and message.startswith(f"{flag}: the checkpoint has")
    const = TrainConfig(model="tiny", name="x", lr_scheduler="const", opt_kwargs={"amsgrad": True}).to_dict()
    assert refusal(saved, const) is None


def test_opt_fallback_list_routes_matching_parameters_to_a_muon_fallback() -> None:
    """timm/muon: parameters matching --opt-fallback-list are in groups flagged use_fallback (timm's AdamW
    fallback), the others not; a torch optimizer refuses the flag in one line."""
    model = create_model("tiny")
    names = {id(p): n for n, p in model.named_parameters()}
    patterns = ("visual.blocks.0.*", "*text_projection")
    optimizer = create_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(None, None), eps=None, opt="timm/muon",
                                 fallback=patterns)
    flagged = {names[id(p)] for g in optimizer.param_groups if g.get("use_fallback") for p in g["params"]}
    expected = {n for n in names.values() if n.startswith("visual.blocks.0.") or n.endswith("text_projection")}
    assert flagged == expected and expected
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert _config("--opt", "timm/muon", "--opt-fallback-list", "*bias").opt_fallback_list == ("*bias",)
    with pytest.raises(ValueError, match="--opt-fallback-list goes with a Muon-family timm optimizer"):
        _config("--opt-fallback-list", "*bias")

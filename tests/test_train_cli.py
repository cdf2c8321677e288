"""`naflexclip train` flag validation (one-line errors naming the flag), optimizer groups and the lr schedule."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from naflexclip.cli import build_parser, main
from naflexclip.families.factory import create_model
from naflexclip.models.lock import Locks
from naflexclip.objectives.distillation import Distill
from naflexclip.objectives.registry import ObjectiveFlags
from naflexclip.objectives.siglip2_recipe import Recipe
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.optim import LrSchedule, create_optimizer, param_groups


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--naflex-loss-scale", "linear"], "--batch-size"),
        (["--naflex-loss-scale", "sqrt"], "--batch-size"),
        (["--accum-freq", "0"], "--accum-freq"),
        (["--model", "huge"], "--model"),
        (["--batch-size", "0"], "--batch-size"),
        (["--epochs", "0"], "--epochs"),
        (["--lr", "-1"], "--lr"),
        (["--naflex-max-tokens-per-batch", "10"], "--naflex-max-tokens-per-batch"),
    ],
)
def test_bad_flags_give_one_line_errors(flags: list[str], names: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("naflexclip train: error:") and names in err


@pytest.mark.parametrize(("flags", "loss"), [
    ([], "clip"), (["--loss", "siglip"], "siglip"), (["--siglip"], "siglip"), (["--model", "siglip2-base"], "siglip"),
    (["--model", "siglip2-base", "--loss", "clip"], "clip"),
])
def test_loss_is_chosen_by_name_and_saved_as_loss(flags: list[str], loss: str) -> None:
    """--loss clip|siglip, --siglip as OpenCLIP's alias; without either, the model's own loss."""
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    assert cfg.to_dict()["loss"] == loss and "siglip" not in cfg.to_dict()


def test_unknown_loss_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--loss: 'sigmoid' is not one of \['clip', 'siglip'\]"):
        TrainConfig(loss="sigmoid")
    with pytest.raises(SystemExit):  # the CLI's choices
        build_parser().parse_args(["train", "--loss", "sigmoid"])


def test_linear_scale_with_batch_size_is_accepted() -> None:
    cfg = TrainConfig(naflex_loss_scale="linear", batch_size=32)
    assert cfg.batch_size == 32 and cfg.name is None  # named when the run starts (rank 0 decides)


def test_config_roundtrips_through_a_dict() -> None:
    cfg = TrainConfig(model="tiny", name="x", accum_freq=3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_run_config_keeps_the_flag_groups_fields_flat() -> None:
    """TrainConfig takes the lock fields from `Locks` and every registered objective's flags (`Distill`, `Recipe`,
    several captions per image): a saved run config lists them flat, the objectives' last, and one saved before
    loads into the groups."""
    keys = list(TrainConfig(model="tiny").to_dict())
    locks = [f.name for f in dataclasses.fields(Locks)]
    start = keys.index("cache_dir") + 1
    assert keys[start:start + len(locks) + 1] == [*locks, "openclip_built_in"]
    objectives = [f.name for f in dataclasses.fields(ObjectiveFlags)]
    assert keys[-len(objectives):] == objectives
    assert {"distill_model", "recipe", "multi_positive"} <= set(objectives)
    saved = json.loads(json.dumps(TrainConfig(model="tiny").to_dict()))  # as a checkpoint's run config holds it
    saved.update(recipe="siglip2", locca_loss_weight=0.5, mask_ratio=0.25, lock_text=True, lock_text_unlocked_layers=1,
                 distill_loss_weight=0.5)
    cfg = TrainConfig.from_dict(saved)
    assert Recipe.pick(cfg) == Recipe(recipe="siglip2", locca_loss_weight=0.5, mask_ratio=0.25)
    assert Locks.pick(cfg) == Locks(lock_text=True, lock_text_unlocked_layers=1)
    assert Distill.pick(cfg) == Distill(distill_loss_weight=0.5)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_weight_decay_only_on_matrices() -> None:
    model = create_model("tiny", loss="siglip")
    decayed, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert plain["weight_decay"] == 0.0 and decayed["weight_decay"] == 0.1
    assert {"logit_scale", "logit_bias", "visual.embeds.pos_embed", "text.token_embedding.weight",
            "text.positional_embedding", "text.ln_final.weight", "visual.norm.bias"} <= plain_names
    assert all(not n.endswith("bias") and "norm" not in n and "ln_" not in n for n in decayed_names)
    assert {"image_projection.weight", "text.text_projection", "visual.blocks.0.attn.qkv.weight"} <= decayed_names
    assert len(decayed_names) + len(plain_names) == len(list(model.parameters()))


def test_cosine_schedule_with_linear_warmup() -> None:
    optimizer = create_optimizer(create_model("tiny"), lr=1.0, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-6)
    schedule = LrSchedule(optimizer, base_lr=1.0, warmup_steps=4, total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[9] == pytest.approx(0.5)
    assert lrs[13] == pytest.approx(0.5 * (1 + math.cos(0.9 * math.pi)))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    restored = LrSchedule(optimizer, 1.0, 4, 14)
    restored.load_state_dict(schedule.state_dict())
    assert restored.last_step == 14 and optimizer.param_groups[1]["lr"] == restored.lr_at(14) == 0.0
    assert isinstance(optimizer, torch.optim.AdamW)


@pytest.mark.parametrize(("argv", "expected"), [
    (["train", "--lr", "abc"], "naflexclip train: error: argument --lr: invalid float value: 'abc'"),
    (["train", "--bogus-flag"], "naflexclip train: error: unrecognized arguments: --bogus-flag"),
    (["train", "--train-data-upsampling-factors", "1", "2"], "naflexclip train: error: unrecognized arguments: 2"),
    (["verify", "--accum-method", "nope"], "naflexclip verify: error: argument --accum-method: invalid choice"),
    (["nope"], "naflexclip: error: argument command: invalid choice: 'nope'"),
    (["data", "export", "--out", "x", "--bogus"], "naflexclip data export: error: unrecognized arguments: --bogus"),
])
def test_a_mistyped_flag_is_one_line_naming_the_command_not_a_usage_block(argv: list[str], expected: str,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """argparse printed the whole usage (over 100 lines for train) before its error; now the error alone, naming
    the command the flag belongs to and where its flags are listed."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected) and "--help" in err[0], err


def test_several_values_after_a_one_value_flag_say_how_to_give_them(capsys: pytest.CaptureFixture) -> None:
    """A shell glob (`--train-data shards/*.tar`) or OpenCLIP's factors given with spaces leave the extra values as
    "unrecognized arguments"; the line says which flag takes one value and how to give several."""
    for argv, flag in ((["train", "--train-data", "s/0.tar", "s/1.tar", "s/2.tar"], "--train-data"),
                       (["train", "--train-data-upsampling-factors", "1", "2"], "--train-data-upsampling-factors")):
        with pytest.raises(SystemExit):
            main(argv)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"{flag} takes one value" in line and "'::'" in line, line
    with pytest.raises(SystemExit):
        main(["train", "--lr", "0.1", "0.2"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--lr takes one value" in line and "'::'" not in line, line


@pytest.mark.parametrize(("argv", "first", "second"), [
    (["--siglip", "--loss", "clip"], "--siglip", "--loss clip"),
    (["--loss", "clip", "--siglip"], "--loss clip", "--siglip"),
    (["--loss", "siglip", "--no-siglip"], "--loss siglip", "--no-siglip"),
    (["--no-siglip", "--siglip", "--loss", "clip"], "--siglip", "--loss clip"),
])
def test_contradicting_flags_are_refused_in_one_line_naming_both(argv: list[str], first: str, second: str,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Two flags of one setting that say different things: the order decided silently which one trained (argparse's
    last one wins); now neither, in one line naming both as given (a flag and its --no- form: test below)."""
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--model", "tiny", "--epochs", "0", *argv])  # refused before --epochs is checked
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("naflexclip train: error:") and f"{first} and {second}" in line, line


@pytest.mark.parametrize(("flags", "key", "value"), [
    (["--siglip", "--loss", "siglip"], "loss", "siglip"),  # saying the same thing twice contradicts nothing
    (["--loss", "clip", "--loss", "siglip"], "loss", "siglip"),  # one flag given again: the last, as argparse's
    (["--model", "siglip2-base", "--no-siglip"], "loss", "clip"),
    (["--siglip", "--no-siglip"], "loss", "clip"),  # a flag's --no- form after it: the last, as argparse's
    (["--no-grad-clip-norm"], "grad_clip_norm", None),
    (["--grad-clip-norm", "2", "--no-grad-clip-norm"], "grad_clip_norm", None),
    (["--lock-image", "--no-lock-image"], "lock_image", False),
])
def test_agreeing_flags_and_the_no_forms_of_siglip_and_grad_clip_norm(flags: list[str], key: str, value) -> None:
    """OpenCLIP's --siglip is a switch: --no-siglip trains the softmax CLIP loss; --no-grad-clip-norm clips nothing
    (OpenCLIP's default, where the demo clips at 1). A flag's --no- form after it overrides it (a script appends it
    to its base flags), as every switch's does."""
    cfg = config_from_args(build_parser().parse_args(["train", *flags]))
    assert getattr(cfg, key) == value


@pytest.mark.parametrize(("argv", "hint"), [
    (["train", "--model", "tiny", "--grad-clip-nrom", "1"], "did you mean --grad-clip-norm?"),
    (["train", "--model", "tiny", "--no-sigilp"], "did you mean --no-siglip?"),
    (["train", "--lock-imagee"], "did you mean --lock-image?"),
    (["verify", "--accum-methd", "cache"], "did you mean --accum-method?"),
])
def test_an_unknown_flag_gets_the_nearest_real_flag_as_its_hint(argv: list[str], hint: str,
                                                                capsys: pytest.CaptureFixture) -> None:
    """Not "--model takes one value" (the flag before it takes one, but the unknown one is a flag, not a value)."""
    with pytest.raises(SystemExit):
        main(argv)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert hint in line and "takes one value" not in line, line

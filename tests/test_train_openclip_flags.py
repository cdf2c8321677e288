"""OpenCLIP's flags in `naflexclip train`: each accepted, built in or refused in one line; OpenCLIP's defaults with
--train-data, the demo's on the built-in dataset; --help grouped by origin; the run's first lines."""

from __future__ import annotations

import argparse
import json
from unittest import mock

import pytest

from naflexclip.cli import build_parser, main
from naflexclip.data.data_config import DataConfig
from naflexclip.settings import flat_config
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.config.openclip_flags import BUILT_IN, OPENCLIP_FLAGS, first_lines, status
from naflexclip.train.config.settings_display import openclip_differences
from naflexclip.train.config.train_config import DEMO_DEFAULTS, OPENCLIP_DEFAULTS, TrainConfig, flag_name
from naflexclip.train.resume import POLICY, changed_flags


def _train_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["train"]


def _openclip_train_flags() -> set[str]:
    """Every long flag of the installed open_clip_train's parser (empty when it is not installed)."""
    try:
        import open_clip_train.params as params
    except ImportError:
        return set()
    captured = {}

    def grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        captured["parser"] = self
        raise SystemExit

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab), pytest.raises(SystemExit):
        params.parse_args([])
    return {flag for action in captured["parser"]._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def _config(*flags: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *flags]))


def test_every_openclip_flag_is_accepted_built_in_or_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    parser = _train_parser()
    flags = sorted(set(OPENCLIP_FLAGS) | _openclip_train_flags())
    assert len(flags) >= 142
    statuses = {flag: status(flag, parser) for flag in flags}
    assert "missing" not in statuses.values(), [f for f, s in statuses.items() if s == "missing"]
    for flag in (f for f, s in statuses.items() if s == "refused"):
        assert main(["train", flag, "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"naflexclip train: error: {flag}: "), err
    for flag in ("--coca-caption-loss-weight", "--coca-contrastive-loss-weight", "--audio-fusion"):
        assert statuses[flag] == "refused"
    for flag in ("--local-loss", "--gather-with-grad", "--loss-dist-impl", "--use-naflex", "--force-naflex-vision"):
        assert statuses[flag] == "built in"
    for flag in ("--train-data", "--precision", "--warmup", "--naflex-max-tokens-per-batch", "--siglip",
                 "--naflex-patch-sizes", "--naflex-patch-size-probs"):
        assert statuses[flag] == "accepted"


def test_built_in_flags_are_accepted_saved_and_explained() -> None:
    cfg = _config("--local-loss", "--loss-dist-impl", "bidir", "--use-naflex", "--force-naflex-vision",
                  "--gather-with-grad")
    assert cfg.openclip_built_in == ("--local-loss", "--loss-dist-impl bidir", "--use-naflex",
                                     "--force-naflex-vision", "--gather-with-grad")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg and POLICY["openclip_built_in"][0] == "ignore"
    notes = first_lines(cfg.to_dict())[1:]
    assert notes[0] == f"--local-loss: OpenCLIP's flag is accepted; {BUILT_IN['--local-loss'][1]}"
    assert notes[1].startswith("--loss-dist-impl bidir: OpenCLIP's flag is accepted; ") and len(notes) == 5


def test_train_data_defaults_to_openclips_values_the_builtin_data_to_the_demos() -> None:
    ported = flat_config(_config("--train-data", "shards/{00000..00003}.tar").to_dict())
    demo = flat_config(_config().to_dict())
    for key, value in OPENCLIP_DEFAULTS.items():
        plain = tuple(ported[key]) if isinstance(ported[key], list) else ported[key]
        assert plain == value, key
    for key, value in DEMO_DEFAULTS.items():
        plain = tuple(demo[key]) if isinstance(demo[key], list) else demo[key]
        assert plain == value, key
        if "." not in key:  # TrainConfig's own defaults are the demo's
            assert TrainConfig.__dataclass_fields__[key].default == value, key
    # the list, spelled out: amp_bf16, warmup 10000, 16384 tokens, divisor 8, no clip, 32 epochs, accum 1
    assert (ported["precision"], ported["warmup"], ported["data.naflex_max_tokens_per_batch"],
            ported["data.naflex_batch_divisor"], ported["grad_clip_norm"], ported["epochs"],
            ported["accum_freq"]) == ("amp_bf16", 10000, 16384, 8, None, 32, 1)
    given = _config("--train-data", "x.csv", "--precision", "fp32", "--warmup", "5", "--grad-clip-norm", "2")
    assert (given.precision, given.warmup, given.grad_clip_norm, given.epochs) == ("fp32", 5, 2.0, 32)


def test_first_line_lists_the_settings_that_differ_from_openclips_defaults() -> None:
    assert first_lines(_config("--train-data", "x.csv").to_dict()) == []
    lines = first_lines(_config("--train-data", "x.csv", "--precision", "fp32", "--naflex-seq-lens", "256").to_dict())
    assert lines == ["settings that differ from OpenCLIP's defaults: --precision fp32 (OpenCLIP: amp_bf16), "
                     "--naflex-seq-lens 256 (OpenCLIP: 128 256 576 784 1024)"]
    demo = first_lines(_config().to_dict())[0]
    assert demo.startswith("built-in dataset: the demo's settings, which differ from OpenCLIP's defaults: ")
    assert "--precision fp32 (OpenCLIP: amp_bf16), --grad-clip-norm 1.0 (OpenCLIP: unset)" in demo
    assert "--warmup 20 (OpenCLIP: 10000)" in demo
    switched = first_lines(_config("--train-data", "x.csv", "--lock-image").to_dict())  # on/off as the flag reads
    assert switched == ["settings that differ from OpenCLIP's defaults: --lock-image on (OpenCLIP: off)"]


def test_batch_size_without_a_loss_scale_is_said_to_have_no_effect() -> None:
    """--batch-size sets rows per batch in OpenCLIP; here it only sets B_ref of --naflex-loss-scale: given without
    one, the run's first lines say in one line that it has no effect and what sets the rows, not a difference."""
    lines = first_lines(_config("--batch-size", "4096").to_dict())
    assert not any("--batch-size 4096 (OpenCLIP" in line or "--batch-size unset" in line for line in lines), lines
    note = [line for line in lines if line.startswith("--batch-size 4096: ")]
    assert note == ["--batch-size 4096: OpenCLIP's flag is accepted; with --naflex-loss-scale none (the default) it "
                    "has no effect: the rows of each microbatch come from the token budget "
                    "(--naflex-max-tokens-per-batch, --naflex-seq-lens)"]
    assert not any(line.startswith("--batch-size") for line in first_lines(_config("--train-data", "x.csv").to_dict()))
    scaled = first_lines(_config("--batch-size", "8", "--naflex-loss-scale", "linear").to_dict())
    assert "--batch-size 8 (OpenCLIP: 64)" in scaled[0] and not any(line.startswith("--batch-size") for line in scaled)


def test_openclips_precision_alias_is_accepted_its_other_values_refused_in_one_line(
        capsys: pytest.CaptureFixture) -> None:
    assert _config("--precision", "amp_bfloat16").precision == "amp_bf16"
    assert TrainConfig(precision="amp_bfloat16").precision == "amp_bf16"
    for value, advice in (("bf16", "--precision amp_bf16"), ("pure_bf16", "--precision amp_bf16"),
                          ("fp16", "--precision amp"), ("pure_fp16", "--precision amp"), ("fp8", "fp32")):
        assert main(["train", "--precision", value]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"naflexclip train: error: --precision {value}"), err
        assert advice in err, err
    assert main(["eval", "--checkpoint", "missing", "--precision", "pure_fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("naflexclip eval: error: --precision pure_fp16: "), err


def test_help_groups_the_flags_as_openclips_and_naflexclips() -> None:
    parser = _train_parser()
    groups = {g.title: g._group_actions for g in parser._action_groups if g.title and g._group_actions}
    openclip = set(OPENCLIP_FLAGS)
    theirs = [t for t in groups if t.startswith("OpenCLIP's flags: ")]
    ours = [t for t in groups if t.startswith("naflexclip's flags: ")]
    assert theirs and ours and list(groups).index(theirs[-1]) < list(groups).index(ours[0])
    for title in theirs:
        assert all(set(a.option_strings) & openclip for a in groups[title]), title
    for title in ours:
        assert not any(set(a.option_strings) & openclip for a in groups[title]), title
    text = " ".join(parser.format_help().split())
    assert "--warmup WARMUP" in text and "(default: 10000, OpenCLIP's; on the built-in dataset: 20)" in text
    assert "--coca-caption-loss-weight" in text.split("OpenCLIP's flags refused here")[1]


def test_force_flags_override_the_model_as_openclip(tmp_path) -> None:
    """--force-context-length: the text position table and the tokenized captions; --force-patch-dropout: the
    image tower drops patches while training (a resume may change it); --force-image-size: the NaFlex position
    grid (size // patch per side)."""
    import torch
    from test_train_loop import tiny_config

    from naflexclip.models.run_weights import architecture_changes
    from naflexclip.parallel.process_group import init_distributed
    from naflexclip.train.loop import Trainer

    cfg = tiny_config(tmp_path, force_context_length=12, force_patch_dropout=0.5, force_image_size=(64, 96))
    assert cfg.model_overrides(8) == {"context_length": 12, "patch_drop_rate": 0.5, "pos_embed_grid_size": (8, 12)}
    trainer = Trainer(cfg, init_distributed("cpu"))
    model = trainer.module
    assert model.context_length == 12 and model.text.positional_embedding.shape[0] == 12
    patch = model.image_patch_size
    assert tuple(model.visual.embeds.pos_embed.shape[1:3]) == (64 // patch, 96 // patch)
    batch = next(iter(trainer.loader))
    assert batch["text"].shape[1] == 12
    image = {k: v[:2] for k, v in batch["image"].items()}
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_image(image), model.encode_image(image))
        model.train()
        torch.manual_seed(0)
        dropped = model.encode_image(image)
        model.eval()
        assert not torch.allclose(dropped, model.encode_image(image))
    plain = trainer.checkpointer.run["model_config"]
    other = {**plain, "image": {**plain["image"], "patch_drop_rate": 0.0}}
    assert architecture_changes(plain, other) == []
    assert architecture_changes(plain, {**plain, "text": {**plain["text"], "context_length": 16}})
    with pytest.raises(ValueError, match="--force-image-size takes one size or height and width"):
        _config("--force-image-size", "1", "2", "3")
    assert _config("--force-context-length", "24").force_context_length == 24
    assert POLICY["force_context_length"][0] == POLICY["force_image_size"][0] == "refuse"


def test_image_mean_std_and_interpolation_reach_the_patches() -> None:
    """--image-mean/--image-std normalise every patch with the given values (one value: every channel);
    --image-interpolation resizes with timm's ResizeToSequence in that mode."""
    import numpy as np
    import torch
    from PIL import Image
    from timm.data.naflex_transforms import ResizeToSequence

    from naflexclip.families import data_processing

    cfg = _config("--image-mean", "0.5", "--image-std", "0.25", "0.5", "1", "--image-interpolation", "bilinear")
    assert (cfg.data.image_mean, cfg.data.image_std) == ((0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    processing = data_processing(None, 8, **cfg.data.image_overrides())
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8))
    patches, coord = processing.transform(image, 16)
    expected = np.asarray(ResizeToSequence(8, 16, interpolation="bilinear")(image))
    bicubic = np.asarray(ResizeToSequence(8, 16, interpolation="bicubic")(image))
    rows = torch.from_numpy(expected.copy()).reshape(expected.shape[0] // 8, 8, -1, 8, 3).permute(0, 2, 1, 3, 4)
    assert torch.equal(patches, rows.reshape(-1, 8 * 8 * 3)) and not np.array_equal(expected, bicubic)
    batch = processing.collate([(patches, coord)], 16, 8)
    raw = patches.double().view(patches.shape[0], -1, 3) / 255
    normalised = (raw - torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)) / torch.tensor([0.25, 0.5, 1.0],
                                                                                            dtype=torch.float64)
    assert torch.allclose(batch["patches"][0, :patches.shape[0]].double().view_as(normalised), normalised, atol=1e-6)
    assert data_processing(None, 8).collate([(patches, coord)], 16, 8)["patches"].abs().max() != batch[
        "patches"].abs().max()
    with pytest.raises(ValueError, match="--image-std takes 1 or 3 values > 0"):
        _config("--image-std", "0", "1", "1")


def test_image_interpolation_random_is_refused_in_one_line_naming_the_flag(tmp_path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """OpenCLIP's (timm's) `random` draws bilinear or bicubic per image at evaluation too; refused in one line, not
    argparse's usage block."""
    assert main(["train", "--logs", str(tmp_path), "--image-interpolation", "random"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("naflexclip train: error: --image-interpolation: 'random'"), err
    assert not any(tmp_path.iterdir())


def test_aug_cfg_shapes_the_train_crop_and_refuses_other_keys() -> None:
    """--aug-cfg scale=(.25, .25) ratio=(1, 1): every train crop is a square quarter of the image (drawn from the
    microbatch's rng as timm's RandomResizedCropToSequence draws); keys the NaFlex crop does not take: one line."""
    import math
    import random

    import numpy as np
    import torch
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    from naflexclip.families import data_processing

    cfg = _config("--aug-cfg", "scale=(0.25,0.25)", "ratio=(1,1)", "use_timm=True")
    assert cfg.data.augment and (cfg.data.aug_scale, cfg.data.aug_ratio) == ((0.25, 0.25), (1.0, 1.0))
    transform = data_processing(None, 8, augment=True, **cfg.data.image_overrides()).transform
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    patches, _ = transform(image, 16, random.Random(7))
    draws = random.Random(7)
    draws.uniform(0.25, 0.25), draws.uniform(math.log(1), math.log(1))
    top, left = draws.randint(0, 32), draws.randint(0, 32)
    crop = np.asarray(F.resized_crop(image, top, left, 32, 32, [32, 32], interpolation=InterpolationMode.BICUBIC,
                                     antialias=True))
    expected = torch.from_numpy(crop.copy()).reshape(4, 8, 4, 8, 3).permute(0, 2, 1, 3, 4).reshape(16, -1)
    assert torch.equal(patches, expected)
    assert not _config().data.augment and _config().data.aug_scale is None
    for item, message in (("color_jitter=0.4", "--aug-cfg color_jitter: not applied"),
                          ("re_prob=0.2", "--aug-cfg re_prob: not applied"),
                          ("scale=(0.5,2)", r"--aug-cfg scale=\(0.5, 2.0\): takes \(low, high\)")):
        with pytest.raises(ValueError, match=message):
            _config("--aug-cfg", item)


def test_the_settings_lines_name_aug_cfg_as_the_user_typed_it() -> None:
    cfg = TrainConfig(data=DataConfig(aug_scale=(0.5, 1.0), augment=True)).to_dict()
    line = " ".join(openclip_differences(cfg))
    assert "--aug-scale" not in line and "--aug-cfg scale=(0.5, 1.0) (OpenCLIP: unset)" in line
    other = TrainConfig(data=DataConfig(aug_scale=(0.3, 1.0), augment=True)).to_dict()
    notice = " ".join(changed_flags(cfg, other))
    assert "--aug-scale" not in notice and "--aug-cfg scale=(0.5, 1.0) -> (0.3, 1.0)" in notice


def test_every_data_setting_is_shown_with_a_flag_train_accepts() -> None:
    """The settings lines and resume notices name each data field by its flag; where that flag is not `--` + the
    field's name (--aug-cfg's items, --multi-positive, --pretrained), by the flag the user types."""
    import dataclasses

    accepted = {flag for action in _train_parser()._actions for flag in action.option_strings}
    for field in dataclasses.fields(DataConfig):
        flag = flag_name(f"data.{field.name}")
        assert flag.split(" ")[0] in accepted, (field.name, flag)
        if flag.endswith("="):  # an --aug-cfg item: the key train reads
            from naflexclip.data.data_config import AUG_CFG_KEYS
            assert flag.split(" ")[1][:-1] in AUG_CFG_KEYS, (field.name, flag)


def _train_steps(run_dir) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["kind"] == "train"]


@pytest.mark.slow
def test_metrics_reach_the_sinks_every_log_metric_every_n_steps_the_console_every_log_every_n_steps(
        tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--model", "tiny", "--device", "cpu", "--zero-shot-samples", "4", "--synthetic-train-size",
                 "64", "--synthetic-val-size", "4", "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "64",
                 "--workers", "0", "--accum-freq", "1", "--epochs", "1", "--no-plot", "--save-frequency", "0",
                 "--logs", str(tmp_path), "--name", "run", "--log-metric-every-n-steps", "3",
                 "--log-every-n-steps", "1000"]) == 0
    logged = _train_steps(tmp_path / "run")  # 16 steps of 4 images
    assert logged == [3, 6, 9, 12, 15], logged
    assert "loss=" not in capsys.readouterr().err  # no console line within the run's 16 steps
    # OpenCLIP's cadence with --train-data, the demo's (every step) on the built-in data; neither is a resume's concern
    assert _config("--train-data", "x.csv").log_metric_every_n_steps == 10 == OPENCLIP_DEFAULTS[
        "log_metric_every_n_steps"]
    assert _config().log_metric_every_n_steps == 1 and POLICY["log_metric_every_n_steps"][0] == "ignore"


def test_openclips_naflex_aug_cfg_without_scale_crops_as_openclip_does() -> None:
    """OpenCLIP's NaFlex commands pass `--aug-cfg use_timm=True naflex=True` and no scale: its AugmentationCfg's
    crop area range (0.9, 1.0) and timm's aspect range (3/4, 4/3) apply there, so they apply here."""
    from open_clip.transform import AugmentationCfg

    from naflexclip.families import data_processing

    cfg = _config("--aug-cfg", "use_timm=True", "naflex=True")
    transform = data_processing(None, 8, augment=cfg.data.augment, **cfg.data.image_overrides()).transform
    assert transform.augment
    assert transform.scale == tuple(AugmentationCfg().scale) and transform.ratio == (3 / 4, 4 / 3)

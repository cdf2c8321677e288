"""`naflexclip verify` passes every method × loss × mode, and fails (exit 1) when the rule is wrong."""

import math
import re
from pathlib import Path

import pytest

import naflexclip.audit.gradient_audit as window_audit
import naflexclip.audit.verify_command as verify
from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.cli import main


@pytest.mark.parametrize("mode", ["none", "linear", "sqrt"])
@pytest.mark.parametrize(("flags", "loss"), [([], "clip"), (["--loss", "siglip"], "siglip"), (["--siglip"], "siglip")])
def test_verify_passes_on_tiny(mode, flags, loss, capsys):
    argv = ["verify", "--model", "tiny", "--splits", "1", "--accum-freq", "3", "--batch-size", "2",
            "--naflex-loss-scale", mode, *flags]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "visual.blocks" in out and "FAIL" not in out and f"loss {loss}," in out
    assert ("logit_bias" in out) == (loss == "siglip")
    assert "within the tolerances of docs/accumulation.md" in out


def test_the_page_verify_cites_states_its_tolerances():
    page = (Path(__file__).parents[1] / "docs" / "accumulation.md").read_text()
    assert "\n## Tolerances\n" in page
    section = page.split("\n## Tolerances\n")[1].split("\n## ")[0]
    for tolerance in (window_audit.FLOAT64_TOLERANCE, window_audit.POS_EMBED_TOLERANCE, window_audit.FLOAT32_TOLERANCE):
        assert f"| 1e{round(math.log10(tolerance))} |" in section, tolerance


def test_verify_passes_on_small(capsys):
    assert main(["verify", "--model", "small", "--splits", "1", "--accum-freq", "2", "--batch-size", "3"]) == 0


def test_verify_fails_with_the_per_microbatch_rule(monkeypatch, capsys):
    def wrong_window(model, loss_fn, microbatches, **kwargs):
        stats = real(model, loss_fn, microbatches, **kwargs)
        model.zero_grad(set_to_none=True)
        per_microbatch_scale_gradients(model, loss_fn, microbatches, loss_scale=kwargs["loss_scale"],
                                       reference_batch_size=kwargs["reference_batch_size"])
        return stats

    real = window_audit.accumulate_gradients
    monkeypatch.setattr(window_audit, "accumulate_gradients", wrong_window)
    assert main(["verify", "--splits", "1", "--accum-freq", "2", "--batch-size", "3"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "named"), [
    (["--accum-freq", "0"], "--accum-freq must be ≥ 1, got 0"),
    (["--model", "huge"], "'huge'"),
    (["--num-examples", "2", "--accum-freq", "3"], "--num-examples 2"),
])
def test_verify_rejects_bad_flags_with_one_line(flags, named, capsys):
    assert main(["verify", *flags]) == 2
    out = capsys.readouterr().out.strip()
    assert named in out and out.count("\n") == 0


def test_verify_draws_a_real_window_from_exported_shards(tmp_path, capsys):
    from naflexclip.data.dataset_export import export_synthetic

    export_synthetic(str(tmp_path), fmt="webdataset", count=60, shard_size=30, image_format="png")
    argv = ["verify", "--train-data", str(tmp_path / "train-{00000..00001}.tar"), "--dataset-type", "webdataset",
            "--naflex-seq-lens", "16", "36", "--naflex-max-tokens-per-batch", "256", "--workers", "0",
            "--accum-freq", "3", "--splits", "1", "--accum-method", "cache"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "window (loader)" in out and "PASS" in out


def test_verify_audits_a_checkpoint_with_its_training_settings(tmp_path, capsys):
    import torch

    from naflexclip import create_model
    from naflexclip.checkpoints.storage import save_checkpoint
    from naflexclip.models.naflex_clip import config_to_dict

    torch.manual_seed(0)
    model = create_model("tiny", loss="siglip")
    config = {"model": "tiny", "loss": "siglip", "accum_freq": 2, "batch_size": 5, "naflex_loss_scale": "sqrt"}
    run = {"config": config, "model_config": config_to_dict(model.config), "world_size": 1}
    path = save_checkpoint(tmp_path, "epoch_1", {"model": model.state_dict(), "run": run}, step=1, epoch=1)
    argv = ["verify", "--checkpoint", str(path), "--dataset-type", "synthetic", "--naflex-seq-lens", "16",
            "--naflex-max-tokens-per-batch", "96", "--workers", "0", "--splits", "1", "--accum-method", "replay"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "loss siglip" in out and "scale sqrt" in out and "B_ref 5" in out and "accum-freq 2" in out
    assert "logit_bias" in out


def test_verify_names_a_missing_checkpoint(tmp_path, capsys):
    assert main(["verify", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().out


def test_verify_checks_a_checkpoints_model_on_a_random_multi_caption_window(tmp_path, capsys):
    """`--checkpoint RUN --multi-positive`: the trained model with its run's settings on a random window of several
    captions per image, said so; a data flag with --multi-positive is one line saying that the window is random."""
    import torch

    from naflexclip import create_model
    from naflexclip.checkpoints.storage import save_checkpoint
    from naflexclip.models.naflex_clip import config_to_dict

    torch.manual_seed(0)
    model = create_model("tiny", loss="siglip")
    config = {"model": "tiny", "loss": "siglip", "accum_freq": 2, "batch_size": 3, "naflex_loss_scale": "linear"}
    run = {"config": config, "model_config": config_to_dict(model.config), "world_size": 1}
    path = save_checkpoint(tmp_path, "epoch_1", {"model": model.state_dict(), "run": run}, step=1, epoch=1)
    assert main(["verify", "--checkpoint", str(path), "--multi-positive", "--splits", "1"]) == 0
    out = capsys.readouterr().out
    assert "window (random)" in out and "accum-freq 2" in out and "B_ref 3" in out and "SigLIP+" in out
    assert f"the model of --checkpoint {path}" in out and "PASS" in out
    assert main(["verify", "--multi-positive", "--dataset-type", "synthetic"]) == 2
    line = capsys.readouterr().out.strip()
    assert line.count("\n") == 0 and "--dataset-type synthetic" in line and "random window" in line, line


@pytest.mark.parametrize(("argv", "first", "second"), [
    (["--siglip", "--loss", "clip"], "--siglip", "--loss clip"),
    (["--loss", "clip", "--siglip"], "--loss clip", "--siglip"),
])
def test_verify_refuses_contradicting_loss_flags_in_one_line_as_train_does(argv, first, second, capsys):
    """`--siglip --loss clip`: the order decided silently which loss was audited; now neither, in train's line."""
    with pytest.raises(SystemExit) as stopped:
        main(["verify", "--splits", "1", *argv])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("naflexclip verify: error:") and f"{first} and {second}" in line, line


def test_verify_takes_trains_declarations_of_the_flags_they_share():
    """One declaration per flag: each flag verify shares with train has train's help text and choices; verify's own
    defaults are the ones `VERIFY_DEFAULTS` names (and says why)."""
    from naflexclip.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    train = commands["train"]._option_string_actions
    own = ("--checkpoint", "--splits", "--num-examples", "--dtype", "-h", "--help")
    shared = [flag for flag in commands["verify"]._option_string_actions if flag not in own]
    assert {"--model", "--loss", "--siglip", "--accum-freq", "--device", "--seed", "--lock-image"} <= set(shared)
    for flag in shared:
        action, trained = commands["verify"]._option_string_actions[flag], train[flag]
        declared = (trained.help or "").split("(default: ")[0].strip()  # each command says its default after it
        assert action.dest == trained.dest and (action.help or "").startswith(declared), flag
        if flag != "--accum-method":  # verify's `all`: every method against one reference
            assert action.choices == trained.choices, flag
    assert set(verify.VERIFY_DEFAULTS) <= {action.dest for action in commands["verify"]._actions}


def test_verify_prints_the_same_report_on_every_run(capsys):
    """`--seed` decides the model's initialisation too, not only the window and its splits: the README's report is
    what the command prints, whatever the process drew before."""
    import torch

    reports = []
    for state in (1, 2):
        torch.manual_seed(state)  # what the process drew before
        assert main(["verify", "--splits", "1", "--accum-freq", "2", "--batch-size", "3"]) == 0
        reports.append(capsys.readouterr().out)
    assert reports[0] == reports[1]


def test_the_readmes_report_is_what_verify_prints(capsys):
    """The README's `naflexclip verify` block is the command's report, line for line (a float64 round-off error, which
    the machine's thread count moves, compared to its order of magnitude)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("$ naflexclip verify ")[1].split("\n", 1)[1].split("```")[0]
    assert main(["verify"]) == 0
    round_off = re.compile(r"\d\.\d\de-1[0-9]")
    assert round_off.sub("<1e-9", capsys.readouterr().out) == round_off.sub("<1e-9", block)

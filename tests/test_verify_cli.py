"""`naflexclip verify` passes every method × loss × mode, and fails (exit 1) when the rule is wrong."""

import pytest

import naflexclip.verify as verify
from naflexclip.cli import main
from naflexclip.legacy import per_microbatch_scale_gradients


@pytest.mark.parametrize("mode", ["none", "linear", "sqrt"])
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_verify_passes_on_tiny(mode, loss, capsys):
    argv = ["verify", "--model", "tiny", "--splits", "1", "--accum-freq", "3", "--batch-size", "2",
            "--naflex-loss-scale", mode] + (["--siglip"] if loss == "siglip" else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "visual.blocks" in out and "FAIL" not in out


def test_verify_passes_on_small(capsys):
    assert main(["verify", "--model", "small", "--splits", "1", "--accum-freq", "2", "--batch-size", "3"]) == 0


def test_verify_fails_with_the_per_microbatch_rule(monkeypatch, capsys):
    def wrong_window(model, loss_fn, microbatches, **kwargs):
        stats = real(model, loss_fn, microbatches, **kwargs)
        model.zero_grad(set_to_none=True)
        per_microbatch_scale_gradients(model, loss_fn, microbatches, loss_scale=kwargs["loss_scale"],
                                       reference_batch_size=kwargs["reference_batch_size"])
        return stats

    real = verify.accumulate_gradients
    monkeypatch.setattr(verify, "accumulate_gradients", wrong_window)
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

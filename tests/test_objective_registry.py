"""An objective is one module plus its registration: `naflexclip verify` takes a registered objective's flags and
proves its term with no code of its own for it, and the same audit fails the objective when its term normalises by
each microbatch; every registered objective's flags are training settings."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from naflexclip.batch import batch_size
from naflexclip.cli import build_parser, main
from naflexclip.objectives import registry
from naflexclip.objectives.objective import Objective
from naflexclip.settings import APPLY, setting
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.window import Term


@dataclasses.dataclass
class AgreementFlags:
    agreement_loss_weight: float = setting(0.0, rule=APPLY, section="feature agreement",
                                           help="λ of the feature-agreement term")


class AgreementTerm(Term):
    """ℓ(i) = 1 − cos(image_i, text_i) per example, normalised by the window's examples (or, `per_microbatch`, as a
    per-microbatch mean: each example over its own microbatch's size, `Z` the number of microbatches)."""

    parts = ("agreement",)

    def __init__(self, weight: float, per_microbatch: bool) -> None:
        self.weights = {"agreement": weight}
        self.per_microbatch = per_microbatch

    def count(self, microbatch: dict[str, Any]) -> dict[str, float]:
        return {"agreement": 1.0 if self.per_microbatch else float(batch_size(microbatch))}

    def example_losses(self, model: nn.Module, microbatch: dict[str, Any], out: dict[str, Any],
                       constants: dict[str, Any]) -> dict[str, torch.Tensor]:
        loss = 1 - (out["image_features"] * out["text_features"]).sum(-1)
        return {"agreement": loss / loss.shape[0] if self.per_microbatch else loss}


class Agreement(Objective):
    name = "agreement"
    flags = AgreementFlags
    per_microbatch = False

    def __init__(self, values: Any) -> None:
        self.weight = getattr(values, "agreement_loss_weight", 0.0)

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    def terms(self) -> list[Term]:
        return [AgreementTerm(self.weight, self.per_microbatch)]

    def describe(self) -> list[str]:
        return [f"+ {self.weight:g} · feature agreement"]


class PerMicrobatchAgreement(Agreement):
    per_microbatch = True


ARGV = ["verify", "--agreement-loss-weight", "0.5", "--splits", "2", "--accum-freq", "3", "--batch-size", "3",
        "--accum-method", "cache"]


def test_verify_proves_a_newly_registered_objective_without_code_of_its_own(monkeypatch, capsys):
    monkeypatch.setattr(registry, "OBJECTIVES", (*registry.OBJECTIVES, Agreement))
    assert main(ARGV) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "objective: + 0.5 · feature agreement" in out


def test_verify_fails_a_registered_term_normalised_per_microbatch(monkeypatch, capsys):
    monkeypatch.setattr(registry, "OBJECTIVES", (*registry.OBJECTIVES, PerMicrobatchAgreement))
    assert main(ARGV) == 1
    assert "FAIL" in capsys.readouterr().out


def test_an_unregistered_objectives_flag_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(ARGV)


@pytest.mark.parametrize("objective", registry.OBJECTIVES, ids=lambda objective: objective.name)
def test_every_registered_objectives_flags_are_training_settings_and_verify_flags(objective):
    names = [field.name for field in dataclasses.fields(objective.flags)]
    assert set(names) <= {field.name for field in dataclasses.fields(registry.ObjectiveFlags)}
    assert set(names) <= {field.name for field in dataclasses.fields(TrainConfig)}
    verify = build_parser().parse_args(["verify"])
    assert all(hasattr(verify, name) for name in names)


def test_an_objectives_setting_without_the_flag_that_turns_it_on_is_said_to_change_nothing(tmp_path, capsys) -> None:
    """A setting of an objective that is off changes nothing: before, the run trained without a word (a
    --distill-loss-weight without a teacher, the recipe's --ema-momentum without the recipe). Now one line each
    names it and the flags that turn its objective on; with them on, nothing is said."""
    cases = [
        (["--distill-loss-weight", "3"], "--distill-loss-weight 3.0: changes nothing without --distill-model"),
        (["--self-distill-start", "0.3"], "--self-distill-start 0.3: changes nothing without --recipe siglip2"),
        (["--ema-momentum", "0.9"], "--ema-momentum 0.9: changes nothing without --recipe siglip2"),
        (["--local-crops", "4"], "--local-crops 4: changes nothing without --recipe siglip2"),
        (["--multi-positive-weighting", "soft"], "--multi-positive-weighting soft: changes nothing without "
                                                 "--multi-positive"),
    ]
    parser = build_parser()
    for flags, line in cases:
        from naflexclip.train.config.flags import config_from_args

        (said,) = registry.unused_settings(config_from_args(parser.parse_args(["train", *flags])))
        assert said.startswith(line), said
    assert registry.unused_settings(TrainConfig(multi_positive=True, multi_positive_weighting="soft")) == []
    assert registry.unused_settings(TrainConfig(recipe="siglip2", loss="siglip", ema_momentum=0.9)) == []
    # the run's opening says it
    assert main(["train", "--model", "tiny", "--logs", str(tmp_path), "--name", "r", "--synthetic-train-size", "32",
                 "--synthetic-val-size", "8", "--val-frequency", "0", "--zeroshot-frequency", "0", "--no-plot",
                 "--stop-after-steps", "1", "--distill-loss-weight", "3"]) == 0
    assert ("warning: --distill-loss-weight 3.0: changes nothing without --distill-model"
            in capsys.readouterr().err.splitlines())

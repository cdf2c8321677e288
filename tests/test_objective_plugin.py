"""An objective is one file: the objective below lives here alone and is registered as another package registers
one, an entry point of the group `naflexclip.objectives`, with no line of naflexclip's source naming it. It declares
its flag, the input it asks of each sample (its caption's words, a weight no model side has), its term of the
window objective and its evaluation. A run with it trains, stops, resumes and is evaluated (during the run and by
`naflexclip eval`), and `naflexclip verify` proves its term on the built-in data — and fails it when its term takes
each microbatch's weight instead of the window's.

Registered objectives are read when naflexclip is imported, so the run is a process of its own (`scenario`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.batch import EXAMPLE_INPUTS, to_device
from naflexclip.data.sample_inputs import DecodedSample, SampleInputs
from naflexclip.objectives.objective import EvalContext, EvalTask, Objective
from naflexclip.settings import APPLY, setting
from naflexclip.window import Term

CAPTION_WORDS = "caption_words"  # example_inputs column: each example's weight


@dataclass
class AgreementFlags:
    agreement_loss_weight: float = setting(0.0, rule=APPLY, section="feature agreement", help=(
        "λ of the feature-agreement term: 1 - cos(image, text) per example, weighted by its caption's words"))


class CaptionWords(SampleInputs):
    """Each sample's weight: the words of its caption."""

    def of_sample(self, sample: DecodedSample) -> float:
        return float(len(sample.captions[0].split()))

    def of_microbatch(self, values: list[Any], texts: list[str], seq_len: int) -> dict[str, dict[str, Any]]:
        return {EXAMPLE_INPUTS: {CAPTION_WORDS: torch.tensor(values)}}


class AgreementTerm(Term):
    """ℓ(i) = w_i · (1 − cos(image_i, text_i)), normalised by the window's Σ w_i (`per_microbatch`, the wrong
    coefficient: each microbatch by its own Σ w, `Z` the number of microbatches)."""

    parts = ("agreement",)
    per_microbatch = False

    def __init__(self, weight: float) -> None:
        self.weights = {"agreement": weight}

    def count(self, microbatch: dict[str, Any]) -> dict[str, float]:
        words = microbatch[EXAMPLE_INPUTS][CAPTION_WORDS]
        return {"agreement": 1.0 if self.per_microbatch else float(words.sum())}

    def example_losses(self, model: nn.Module, microbatch: dict[str, Any], out: dict[str, Any],
                       constants: dict[str, Any]) -> dict[str, torch.Tensor]:
        words = microbatch[EXAMPLE_INPUTS][CAPTION_WORDS].to(out["image_features"].dtype)
        loss = words * (1 - F.cosine_similarity(out["image_features"], out["text_features"]))
        return {"agreement": loss / words.sum() if self.per_microbatch else loss}

    def random_inputs(self, model: nn.Module, num_examples: int, seed: int) -> dict[str, torch.Tensor]:
        return {CAPTION_WORDS: torch.randint(1, 6, (num_examples,), generator=torch.Generator().manual_seed(seed))
                .float()}


def agreement_metrics(model: nn.Module, context: EvalContext, skips: list[dict[str, Any]]) -> dict[str, float]:
    """The validation split's caption-weighted mean cosine of each image and its caption."""
    from naflexclip.data.build import build_loader
    from naflexclip.families import data_processing

    data = context.data
    processing = data_processing(data.hf_processor, model.image_patch_size, **data.image_overrides())
    total, words = 0.0, 0.0
    with build_loader(data, split="val", patch_size=model.image_patch_size, context_length=model.context_length,
                      processing=processing, inputs=[CaptionWords()]) as val:
        for batch in val:
            batch = to_device(batch, context.device)
            with context.autocast():
                out = model(image=batch["image"], text=batch["text"])
            weight = batch[EXAMPLE_INPUTS][CAPTION_WORDS]
            total += float((weight * F.cosine_similarity(out["image_features"].float(),
                                                         out["text_features"].float())).sum())
            words += float(weight.sum())
    skips.extend(val.skip_records)
    return {"agreement/val_cosine": total / words}


class Agreement(Objective):
    name = "agreement"
    flags = AgreementFlags
    switch_flags = "--agreement-loss-weight"
    switch_fields = ("agreement_loss_weight",)

    def __init__(self, values: Any) -> None:
        self.weight = getattr(values, "agreement_loss_weight", 0.0)

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    def loader_inputs(self, student: nn.Module, processing: Any) -> list[SampleInputs]:
        return [CaptionWords()]

    def terms(self) -> list[Term]:
        return [AgreementTerm(self.weight)]

    def eval_tasks(self, model: nn.Module, context: EvalContext) -> list[EvalTask]:
        if context.data.source("val") is None:
            return []
        return [EvalTask("agreement", context.frequency,
                         lambda model, skips: agreement_metrics(model, context, skips),
                         brief=("agreement/val_cosine",))]

    def describe(self) -> list[str]:
        return [f"+ {self.weight:g} · feature agreement (per caption word of the window)"]


def scenario(tmp: Path) -> dict[str, Any]:
    """Train, stop, resume, evaluate and verify with the objective registered; what each said."""
    import contextlib
    import dataclasses
    import io

    from naflexclip.cli import main
    from naflexclip.evaluation import dense_probe
    from naflexclip.train.config.train_config import TrainConfig

    dense_probe.PROBE_SCENES.update(train=12, val=6)  # as conftest.py's small_dense_probe
    said: dict[str, Any] = {}

    def run(name: str, argv: list[str]) -> None:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as stop:  # --help
                code = stop.code
        said[name] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}

    said["fields"] = [f.name for f in dataclasses.fields(TrainConfig)]
    run("help", ["train", "--help"])
    logs = tmp / "logs"
    flags = ["--model", "tiny", "--logs", str(logs), "--name", "run", "--workers", "0", "--synthetic-train-size", "32",
             "--synthetic-val-size", "8", "--zero-shot-samples", "8", "--val-frequency", "0", "--zeroshot-frequency",
             "0", "--no-plot"]
    run("train", ["train", *flags, "--agreement-loss-weight", "0.5", "--stop-after-steps", "1"])
    run("resume", ["train", "--logs", str(logs), "--name", "run", "--resume", "latest", "--stop-after-steps", "2",
                   "--no-plot"])
    said["records"] = [json.loads(line) for line in (logs / "run" / "metrics.jsonl").read_text().splitlines()]
    run("eval", ["eval", "--checkpoint", str(logs / "run" / "checkpoints"), "--device", "cpu"])
    # the run's model on a window of the built-in data, its caption words from the loader
    verify = ["verify", "--checkpoint", str(logs / "run" / "checkpoints"), "--dataset-type", "synthetic",
              "--synthetic-train-size", "32", "--naflex-seq-lens", "16", "--naflex-max-tokens-per-batch", "96",
              "--workers", "0", "--agreement-loss-weight", "0.5", "--splits", "1", "--accum-freq", "3",
              "--accum-method", "cache"]
    run("verify", verify)
    AgreementTerm.per_microbatch = True
    run("verify_per_microbatch", verify)
    return said


@pytest.mark.slow
def test_an_objective_in_one_file_trains_resumes_evaluates_and_is_verified(tmp_path: Path) -> None:
    site = tmp_path / "site"
    dist = site / "agreement_objective-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: agreement-objective\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[naflexclip.objectives]\nagreement = {__name__}:Agreement\n")
    path = os.pathsep.join([str(site), str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    code = (f"import json, sys, pathlib; import {__name__} as plugin; "
            f"json.dump(plugin.scenario(pathlib.Path(sys.argv[1])), open(sys.argv[2], 'w'))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "said.json")],
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads((tmp_path / "said.json").read_text())

    # its setting is a training setting and a flag, after every built-in objective's, in its own --help section
    assert said["fields"][-1] == "agreement_loss_weight"
    shown = said["help"]["out"]
    assert shown.index("  --distill-loss-weight DISTILL") < shown.index("feature agreement:\n  --agreement-loss-weight")
    # it trains with its data input and its evaluation, stops and resumes with the run's saved setting
    assert said["train"]["code"] == 0, said["train"]["err"][-2000:]
    assert "+ 0.5 · feature agreement (per caption word of the window)" in said["train"]["err"]
    assert said["resume"]["code"] == 0, said["resume"]["err"][-2000:]
    train = [r for r in said["records"] if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["loss/agreement"] > 0 for r in train)
    evals = [r for r in said["records"] if r["kind"] == "eval"]
    assert evals and all(0 < r["agreement/val_cosine"] <= 1 for r in evals)
    assert "val_cosine=" in said["train"]["err"]  # its headline metric in the line after each evaluation
    # `naflexclip eval` of its checkpoint evaluates it too
    assert said["eval"]["code"] == 0, said["eval"]["err"][-2000:]
    assert "agreement/val_cosine" in json.loads(said["eval"]["out"])
    # verify proves its term on the built-in data, and fails it with the wrong coefficient
    assert said["verify"]["code"] == 0 and "PASS" in said["verify"]["out"], said["verify"]
    assert "objective: + 0.5 · feature agreement" in said["verify"]["out"]
    assert said["verify_per_microbatch"]["code"] == 1 and "FAIL" in said["verify_per_microbatch"]["out"]


def test_it_is_not_registered_without_its_entry_point() -> None:
    from naflexclip.objectives import registry

    assert Agreement not in registry.OBJECTIVES
    assert "agreement_loss_weight" not in {f for f in registry.ObjectiveFlags.__dataclass_fields__}

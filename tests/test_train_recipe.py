"""`naflexclip train --recipe siglip2`: the LocCa decoder trains beside the pair loss, is logged, checkpointed and
resumed bit-exactly; the towers export without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from siglip2_cases import make_checkpoint
from test_train_loop import TINY_DATA_FLAGS, tiny_config

from naflexclip.checkpoints.storage import find_latest, load_checkpoint, save_checkpoint
from naflexclip.cli import main
from naflexclip.families import export_family
from naflexclip.families.factory import create_model
from naflexclip.models.naflex_clip import config_to_dict
from naflexclip.models.run_weights import load_checkpoint_model, load_run_model
from naflexclip.objectives.siglip2_recipe import RECIPES, Recipe


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_recipe_run_logs_its_three_terms_and_resumes_bit_exactly(tmp_path: Path) -> None:
    """3 steps straight == 1 step, stop, resume, 2 more: weights (the decoder's and heads' too) and optimizer state;
    the LocCa term throughout, self-distillation and masked prediction at --self-distill-start (here step 3)."""
    def run(name: str, steps: int, *flags: str) -> None:
        assert main(["train", "--model", "tiny", "--recipe", "siglip2", "--epochs", "1", "--stop-after-steps",
                     str(steps), "--device", "cpu", "--logs", str(tmp_path), "--name", name, "--val-frequency", "0",
                     "--zero-shot-samples", "16", "--accum-freq", "2", "--local-crops", "2", "--self-distill-start",
                     "0.4", *flags, *TINY_DATA_FLAGS]) == 0

    run("straight", 3)
    records = [r for r in _records(tmp_path / "straight") if r["kind"] == "train"]
    assert len(records) == 3 and all(5 < r["loss/locca"] < 20 for r in records)  # ~ln(vocab) at the start
    assert ["loss/self_distill" in r and "loss/masked_prediction" in r for r in records] == [False, False, True]
    straight_state = load_checkpoint(find_latest(tmp_path / "straight" / "checkpoints")).states
    assert straight_state["lr_schedule"]["total_steps"] == 3  # step 3: (3 - 1)/3 >= 0.4 > (2 - 1)/3
    assert straight_state["ema_teacher"]["built"]
    assert any(key.startswith("decoder.") for key in straight_state["model"])
    assert any(key.startswith("self_distill.") for key in straight_state["model"])
    assert straight_state["run"]["config"]["recipe"] == "siglip2"
    assert straight_state["run"]["model_config"]["decoder"] is not None

    run("split", 1)
    halfway = load_checkpoint(find_latest(tmp_path / "split" / "checkpoints")).states
    assert halfway["progress"]["step"] == 1 and halfway["progress"]["next_batch"] > 0  # mid-epoch
    run("split", 3, "--resume", "latest")
    split_state = load_checkpoint(find_latest(tmp_path / "split" / "checkpoints")).states
    for key, value in straight_state["model"].items():
        assert torch.equal(value, split_state["model"][key]), key
    for a, b in zip(straight_state["optimizer"]["state"].values(), split_state["optimizer"]["state"].values(),
                    strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss/locca"] for r in _records(tmp_path / "split") if r["kind"] == "train"] == [
        r["loss/locca"] for r in records]
    assert all(torch.equal(value, split_state["ema_teacher"]["teacher"][key])
               for key, value in straight_state["ema_teacher"]["teacher"].items())


def test_changing_the_recipe_on_resume_is_refused(tmp_path: Path) -> None:
    from naflexclip.train.resume import refusal

    saved = tiny_config(tmp_path, recipe="siglip2", loss="clip").to_dict()
    current = tiny_config(tmp_path).to_dict()
    assert "--recipe" in refusal(saved, current)
    weighted = tiny_config(tmp_path, recipe="siglip2", loss="clip", locca_loss_weight=0.5).to_dict()
    assert refusal(saved, weighted) is None  # a weight: applied


@pytest.mark.parametrize("flags, message", [
    (["--lock-image"], "--lock-image with a LocCa term"),
    (["--augment"], "--augment with a LocCa term"),
    (["--locca-loss-weight", "-1"], "--locca-loss-weight must be a finite number >= 0"),
])
def test_recipe_combinations_it_cannot_train_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          flags: list[str], message: str) -> None:
    assert main(["train", "--model", "tiny", "--recipe", "siglip2", "--device", "cpu", "--logs", str(tmp_path),
                 *flags, *TINY_DATA_FLAGS]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_export_writes_the_towers_without_the_decoder_and_self_distillation_heads(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    source = make_checkpoint(tmp_path / "siglip2", seed=1)
    plain = create_model("tiny", pretrained=str(source))
    torch.manual_seed(0)
    with_decoder = Recipe(recipe="siglip2").prepare(create_model("tiny", pretrained=str(source)), self_distill=True)
    assert with_decoder.decoder is not None and with_decoder.self_distill is not None
    family = export_family("transformers")
    from safetensors.torch import load_file
    a = load_file(str(family.export(plain, tmp_path / "plain") / "model.safetensors"))
    b = load_file(str(family.export(with_decoder, tmp_path / "decoder") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    import naflexclip.models.run_weights as run_weights
    monkeypatch.setattr(run_weights, "load_checkpoint_model", lambda path: (with_decoder, {}))
    assert main(["export", "--checkpoint", "unused", "--format", "transformers", "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "the LocCa decoder is not exported" in out and "the self-distillation heads are not exported" in out


def test_a_checkpoints_decoder_and_heads_go_to_the_objectives_that_attach_them(tmp_path: Path) -> None:
    """A run checkpoint holds the objectives' heads under `decoder.` and `self_distill.` (the names checkpoints written
    before the model was plain used): loading it keeps their weights aside for the objective, which attaches them
    with those weights (a new run from it continues the trained decoder); the towers load alone too."""
    torch.manual_seed(0)
    recipe = Recipe(recipe="siglip2")
    trained = recipe.prepare(create_model("tiny", loss="siglip"), self_distill=True)
    with torch.no_grad():  # weights no fresh initialisation has
        for param in trained.parameters():
            param.add_(0.25)
    state = trained.state_dict()
    assert {"decoder.token_embedding.weight", "decoder.transformer.resblocks.0.attn.in_proj_weight",
            "self_distill.mask_token", "self_distill.global_head.prototypes"} <= set(state)
    run = {"config": {"model": "tiny", "loss": "siglip"}, "model_config": config_to_dict(trained.config)}
    assert run["model_config"]["decoder"]["width"] == 32 and run["model_config"]["self_distill"]["local_crops"] == 8
    save_checkpoint(tmp_path / "checkpoints", "step_00000001", {"model": state, "run": run}, step=1, epoch=0)
    for towers in (load_run_model(tmp_path / "checkpoints"), load_checkpoint_model(tmp_path / "checkpoints")[0]):
        assert towers.decoder is None and towers.self_distill is None
        assert sorted(towers.pending_heads) == ["decoder", "self_distill"]
        prepared = recipe.prepare(towers, self_distill=True)
        assert prepared.state_dict().keys() == state.keys()
        assert all(torch.equal(prepared.state_dict()[key], value) for key, value in state.items())
        assert config_to_dict(prepared.config) == run["model_config"] and not prepared.pending_heads


def test_a_pretrained_runs_heads_no_objective_attaches_are_named_not_dropped_silently(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--pretrained a recipe run without --recipe: the towers train on, and the start says in one line that the
    run's LocCa decoder and self-distillation heads are not part of this run (with the flag that would keep them)."""
    torch.manual_seed(0)
    trained = Recipe(recipe="siglip2").prepare(create_model("tiny", loss="siglip"), self_distill=True)
    run = {"config": {"model": "tiny", "loss": "siglip"}, "model_config": config_to_dict(trained.config)}
    save_checkpoint(tmp_path / "recipe_run" / "checkpoints", "step_00000001", {"model": trained.state_dict(),
                                                                              "run": run}, step=1, epoch=0)
    assert main(["train", "--model", "tiny", "--pretrained", str(tmp_path / "recipe_run" / "checkpoints"),
                 "--epochs", "1", "--stop-after-steps", "1", "--device", "cpu", "--logs", str(tmp_path), "--name",
                 "towers", "--val-frequency", "0", "--zero-shot-samples", "16", *TINY_DATA_FLAGS]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "not trained by this run" in line]
    assert len(lines) == 1 and "decoder" in lines[0] and "self_distill" in lines[0] and "--recipe" in lines[0]


def test_decoder_eval_scores_a_perfect_decoder_1_and_a_shifted_box_0(monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import nullcontext

    from naflexclip.data.data_config import DataConfig
    from naflexclip.objectives.locca_decoder import box_iou, decoder_metrics

    assert box_iou((0, 0, 1, 1), (0, 0, 1, 1)) == 1 and box_iou((0, 0, 0.5, 1), (0.5, 0, 1, 1)) == 0
    assert box_iou((0, 0, 1, 1), (0, 0, 0.5, 1)) == 0.5
    torch.manual_seed(0)
    model = Recipe(recipe="siglip2").prepare(create_model("tiny")).eval()
    vocab = model.decoder.vocab
    data = DataConfig(synthetic_val_size=6, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64, workers=0)
    seen: dict[str, list] = {}

    def oracle(shift: int):  # the true target of each example (read from the labels), boxes moved by `shift` bins
        def generate(image_tokens, image_valid, task, prefixes, max_new_tokens, stop_token=None):
            out = seen[task].pop(0)
            return [[t + shift if task == "aref" else t for t in row] for row in out]
        return generate

    original = decoder_metrics.__globals__["build_loader"]

    def recording_loader(*args, **kwargs):  # keep each example's target for the oracle
        loader = original(*args, **kwargs)
        (examples,) = kwargs["inputs"]
        task = examples.task
        from naflexclip.processing.decoder_tokens import IGNORE
        seen[task] = [[[t for t in row.tolist() if t != IGNORE]
                       for row, ids in zip(item["example_inputs"]["decoder_labels"],
                                           item["example_inputs"]["decoder_input_ids"], strict=True)
                       if int(ids[0]) == vocab.task(task)] for item in loader]
        return original(*args, **kwargs)

    monkeypatch.setitem(decoder_metrics.__globals__, "build_loader", recording_loader)
    monkeypatch.setattr(model.decoder, "generate", oracle(0))
    with torch.no_grad():
        perfect = decoder_metrics(model, data, torch.device("cpu"), nullcontext, [])
    assert perfect["decoder/caption_bleu4"] > 0.99 and perfect["decoder/aref_acc"] == 1
    assert perfect["decoder/aref_num"] == 6
    monkeypatch.setattr(model.decoder, "generate", oracle(600))  # every box moved by 0.6 of the image, or off the bins
    with torch.no_grad():
        assert decoder_metrics(model, data, torch.device("cpu"), nullcontext, [])["decoder/aref_acc"] == 0


def test_the_siglip2_recipe_trains_the_sigmoid_loss_unless_told_otherwise(tmp_path: Path) -> None:
    assert tiny_config(tmp_path, recipe="siglip2").loss == "siglip"
    assert tiny_config(tmp_path, recipe="siglip2", loss="clip").loss == "clip"
    assert tiny_config(tmp_path, locca_loss_weight=1.0).loss == "clip"  # the decoder alone keeps the model's own


def test_train_loss_is_the_whole_objective_with_each_term_beside_it_for_every_objective() -> None:
    """`train/loss` is the objective the step optimises, L(W) + Σ_k λ_k/Z_k Σ ℓ_k (before s(W)), and every term is
    logged beside it as its share (`loss/<term>`, weighted), so that the terms sum to it — for the recipe's decoder
    term as for the pair loss alone."""
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import EXAMPLE_INPUTS, split_batch
    from naflexclip.loss import create_loss
    from naflexclip.objectives.locca_decoder import LoccaTerm, random_decoder_inputs
    from naflexclip.train.step import StepResult, step_metrics
    from naflexclip.window import accumulate_gradients

    torch.manual_seed(0)
    model = Recipe(locca_loss_weight=0.5).prepare(create_model("tiny", loss="siglip")).double()
    batch = random_naflex_batch(4, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(0))
    batch[EXAMPLE_INPUTS] = random_decoder_inputs(4, model.decoder.vocab, model.decoder.config.max_length)
    for terms, names in (([], {"loss/contrastive"}), ([LoccaTerm(0.5)], {"loss/contrastive", "loss/locca"})):
        stats = accumulate_gradients(model, create_loss("siglip"), split_batch(batch, [1, 3]), terms=terms)
        metrics = step_metrics(StepResult(stats, grad_norm=1.0, skipped=False, lr=0.1), (10, 10), 1.0)
        shares = {key: value for key, value in metrics.items() if key.startswith("loss/")}
        assert set(shares) == names
        assert metrics["train/loss"] == pytest.approx(sum(shares.values()), rel=1e-12)
        if terms:
            assert shares["loss/locca"] == pytest.approx(0.5 * stats.example_terms["locca"], rel=1e-12)
            assert metrics["train/loss"] > stats.loss + 1  # the decoder's term (~ln of its vocabulary) is in it


def test_the_loss_plot_draws_the_objective_and_each_term_beside_it(tmp_path: Path) -> None:
    from naflexclip.train.report import loss_curves

    records = [{"kind": "train", "step": step, "train/loss": 3.0 - step, "loss/contrastive": 1.0 - step / 4,
                "loss/locca": 2.0 - 3 * step / 4} for step in (1, 2)]
    records.append({"kind": "train", "step": 3, "train/loss": 2.5, "loss/contrastive": 0.5, "loss/locca": 1.5,
                    "loss/self_distill": 0.5})
    curves = loss_curves(records)
    assert list(curves) == ["objective (train/loss)", "contrastive", "locca", "self_distill"]
    assert curves["objective (train/loss)"] == ([1, 2, 3], [2.0, 1.0, 2.5])
    assert curves["self_distill"] == ([3], [0.5])  # a term from its switch on


def test_the_recipe_page_states_the_recipes_values() -> None:
    """SigLIP 2's values are written once (`RECIPES`); the page's table of them states the same."""
    page = (Path(__file__).parents[1] / "docs" / "siglip2_recipe.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip() for line in page.splitlines()
            if line.startswith("| `--")}
    values = {f"--{key.replace('_', '-')}": f"{value:g}" for key, value in RECIPES["siglip2"].items()}
    assert rows == {flag: value for flag, value in values.items() if flag != "--locca-loss-weight"}
    assert f"(the recipe's is {values['--locca-loss-weight']};" in page

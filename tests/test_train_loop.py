"""The training job end to end on the tiny preset: outputs well formed, bit-exact resume, non-finite steps skipped."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from naflexclip.checkpoints.storage import find_latest, load_checkpoint
from naflexclip.cli import main
from naflexclip.data import DataConfig
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.parallel.process_group import init_distributed
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.loop import Trainer, train
from naflexclip.train.step import windows
from naflexclip.train.stop import TrainingStopped

TINY_DATA_FLAGS = [
    "--synthetic-train-size", "96", "--synthetic-val-size", "24", "--naflex-seq-lens", "16", "32",
    "--naflex-max-tokens-per-batch", "256", "--workers", "0",
]


def tiny_config(tmp_path: Path, name: str = "run", **overrides) -> TrainConfig:
    """A run of the tiny preset on a sliver of the built-in data: seconds on a CPU."""
    data = DataConfig(synthetic_train_size=96, synthetic_val_size=24, naflex_seq_lens=(16, 32),
                      naflex_max_tokens_per_batch=256, workers=0)
    values = dict(data=data, model="tiny", epochs=2, accum_freq=2, lr=1e-3, warmup=2, logs=str(tmp_path), name=name,
                  device="cpu", zero_shot_samples=16)
    values.update(overrides)
    return TrainConfig(**values)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_default_run_writes_well_formed_outputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["train", "--model", "tiny", "--epochs", "2", "--warmup", "2", "--logs", str(tmp_path),
                 "--name", "run", "--device", "cpu", "--zero-shot-samples", "16", "--report-to", "tensorboard",
                 "--save-every-n-steps", "3", *TINY_DATA_FLAGS])
    assert code == 0
    run_dir = tmp_path / "run"
    records = _records(run_dir)
    train_records = [r for r in records if r["kind"] == "train"]
    eval_records = [r for r in records if r["kind"] == "eval"]
    # one evaluation before the first step and one per epoch
    assert [r["step"] for r in eval_records][0] == 0 and len(eval_records) == 3
    assert [r["step"] for r in train_records] == list(range(1, len(train_records) + 1))
    for r in train_records:
        assert math.isfinite(r["train/loss"]) and r["train/window_examples"] >= 1
        assert 0 <= r["train/padding_fraction"] < 1 and r["train/samples_per_s"] > 0
        assert r["train/scale"] == 1.0  # --naflex-loss-scale none
    for key in ("val/image_to_text_R@1", "val/text_to_image_R@10", "val/image_to_text_median_rank",
                "zeroshot/shape_top1", "zeroshot/colour_top1"):
        assert all(key in r for r in eval_records), key
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((run_dir / "tensorboard").iterdir())
    checkpoints = run_dir / "checkpoints"
    assert {"epoch_1", "epoch_2", "step_00000003"} <= {p.name for p in checkpoints.iterdir()}
    assert find_latest(checkpoints).name == "epoch_2"
    model, config = load_checkpoint_model(checkpoints / "epoch_2")
    assert config["model"] == "tiny" and config["epochs"] == 2
    assert set(load_file(str(checkpoints / "epoch_2" / "model.safetensors"))) == set(model.state_dict())
    out = capsys.readouterr().out
    assert "val/image_to_text_R@1" in out and "skipped steps" in out
    # `naflexclip eval` reproduces the final evaluation from the checkpoint
    assert main(["eval", "--checkpoint", str(checkpoints / "epoch_2")]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["val/image_to_text_R@1"] == pytest.approx(eval_records[-1]["val/image_to_text_R@1"])


def _weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(find_latest(tmp_path / name / "checkpoints")).states["model"]


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path: Path) -> None:
    """2 steps, stop, resume, 2 more == 4 steps straight (fp32, CPU): weights and optimizer state."""
    train(tiny_config(tmp_path, "straight", stop_after_steps=4, val_frequency=0))
    train(tiny_config(tmp_path, "split", stop_after_steps=2, val_frequency=0))
    halfway = load_checkpoint(find_latest(tmp_path / "split" / "checkpoints")).states
    assert halfway["progress"]["step"] == 2 and halfway["progress"]["next_batch"] > 0  # stopped mid-epoch
    train(tiny_config(tmp_path, "split", stop_after_steps=4, val_frequency=0, resume="latest"))
    straight, split = _weights(tmp_path, "straight"), _weights(tmp_path, "split")
    assert straight.keys() == split.keys()
    for key in straight:
        assert torch.equal(straight[key], split[key]), key
    state_a = load_checkpoint(find_latest(tmp_path / "straight" / "checkpoints")).states
    state_b = load_checkpoint(find_latest(tmp_path / "split" / "checkpoints")).states
    assert state_a["progress"] == state_b["progress"] and state_a["progress"]["num_tokens_seen"] > 0
    for a, b in zip(state_a["optimizer"]["state"].values(), state_b["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _snapshot(trainer: Trainer) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    optim = [{k: v.clone() for k, v in s.items()} for s in trainer.optimizer.state.values()]
    return params, optim


def _poison(trainer: Trainer, poisoned: list[bool]):
    """A forward hook that turns the image features into NaN while `poisoned[0]` is set."""

    def hook(module, inputs, output):
        return output * float("nan") if poisoned[0] else output

    return trainer.module.image_projection.register_forward_hook(hook)


def test_non_finite_window_is_skipped_with_weights_untouched(tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tmp_path), init_distributed("cpu"))
    batches = windows(trainer.loader, 2)
    assert not trainer.train_step(next(batches)).skipped  # optimizer state exists from here on
    poisoned = [True]
    handle = _poison(trainer, poisoned)
    params_before, optim_before = _snapshot(trainer)
    result = trainer.train_step(next(batches))
    assert result.skipped and math.isnan(result.stats.loss)
    params_after, optim_after = _snapshot(trainer)
    assert all(torch.equal(params_before[k], params_after[k]) for k in params_before)
    for a, b in zip(optim_before, optim_after, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert trainer.progress.num_skipped_steps == 1 and trainer.progress.consecutive_skips == 1
    poisoned[0] = False
    assert not trainer.train_step(next(batches)).skipped
    assert trainer.progress.consecutive_skips == 0
    assert not torch.equal(trainer.module.image_projection.weight, params_before["image_projection.weight"])
    handle.remove()


def test_too_many_consecutive_skips_stop_the_run(tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tmp_path, max_skipped_steps=2), init_distributed("cpu"))
    _poison(trainer, [True])
    trainer.progress.epoch = 0
    with pytest.raises(TrainingStopped, match=r"2 consecutive steps.*--max-skipped-steps 2"):
        trainer.train_epoch()
    assert trainer.progress.step == 2 and trainer.progress.num_skipped_steps == 2


def test_amp_bf16_step_on_cpu(tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tmp_path, precision="amp_bf16", grad_clip_norm=0.5), init_distributed("cpu"))
    before = trainer.module.image_projection.weight.detach().clone()
    result = trainer.train_step(next(windows(trainer.loader, 2)))
    assert not result.skipped and math.isfinite(result.stats.loss) and result.grad_norm > 0
    assert trainer.module.image_projection.weight.dtype == torch.float32  # autocast, not a bf16 model
    assert not torch.equal(before, trainer.module.image_projection.weight)


def test_amp_needs_cuda(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("fp16 amp is valid on CUDA")
    assert main(["train", "--model", "tiny", "--precision", "amp", "--device", "cpu", "--logs", str(tmp_path),
                 *TINY_DATA_FLAGS]) == 2
    assert "--precision amp" in capsys.readouterr().err


def test_val_frequency_0_evaluates_before_training_and_at_the_end(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """`--val-frequency 0`: "only before training and at the end" — the summary's "after" column is the end's
    evaluation, not the one before the first step."""
    train(tiny_config(tmp_path, "run", epochs=1, val_frequency=0, plot=False))
    records = _records(tmp_path / "run")
    last = max(r["step"] for r in records if r["kind"] == "train")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, last]
    table = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()
             if line.startswith(("val/", "zeroshot/"))}
    key = "val/image_to_text_median_rank"
    assert table[key] == [f"{evals[0][key]:.3f}", f"{evals[-1][key]:.3f}"]


def test_the_run_folder_is_named_before_the_first_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run without --name learns its folder at its start, not at its first save."""
    assert main(["train", "--model", "tiny", *TINY_DATA_FLAGS, "--logs", str(tmp_path), "--epochs", "1",
                 "--val-frequency", "0", "--zeroshot-frequency", "0", "--stop-after-steps", "1", "--no-plot"]) == 0
    err = capsys.readouterr().err
    (run,) = tmp_path.iterdir()
    named = err.index(f"run folder: {run}")
    assert named < err.index("epoch 1:") and named < err.index("saved ")

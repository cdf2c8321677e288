"""A run's own checkpoint as the weights of a new run (`--pretrained logs/run/checkpoints`, OpenCLIP's
`--pretrained epoch_K.pt` habit): the model only, a new schedule from step 0; the staged LiT unlock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_loop import TINY_DATA_FLAGS, tiny_config

from naflexclip import create_model
from naflexclip.cli import main
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.parallel.process_group import init_distributed
from naflexclip.train.loop import Trainer, train


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run stopped after 2 steps with the image tower locked (LiT): its checkpoints folder."""
    logs = tmp_path_factory.mktemp("logs")
    train(tiny_config(logs, "first", lock_image=True, save_every_n_steps=1, stop_after_steps=2, val_frequency=0))
    return logs / "first" / "checkpoints"


def _saved_weights(checkpoints: Path, name: str = "step_00000002") -> dict[str, torch.Tensor]:
    return load_file(str(checkpoints / name / "model.safetensors"))


def test_a_new_run_from_a_runs_checkpoints_starts_at_step_0_with_its_weights(first_run: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tmp_path, "second", pretrained=str(first_run), val_frequency=0),
                      init_distributed("cpu"))
    saved = _saved_weights(first_run)
    state = trainer.module.state_dict()
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    # weights only: step 0, a fresh optimizer and the whole schedule ahead, nothing locked unless asked
    assert trainer.resume() is False
    assert (trainer.progress.step, trainer.progress.epoch, trainer.progress.next_batch) == (0, 0, 0)
    assert trainer.optimizer.state == {} and trainer.schedule.last_step == 0
    assert trainer.schedule.total_steps == trainer.windows_left(0, 0)
    assert all(p.requires_grad for p in trainer.module.parameters())
    assert trainer.cfg.pretrained == str((first_run / "step_00000002").resolve())


def test_a_step_directory_inside_works_and_create_model_takes_both_forms(first_run: Path) -> None:
    saved = _saved_weights(first_run)
    for model in (create_model("tiny", pretrained=str(first_run / "step_00000001")),
                  create_model(str(first_run / "step_00000001" / "model.safetensors"))):
        state = model.state_dict()
        assert not all(torch.equal(state[k], saved[k]) for k in saved)  # step 1's weights, not the newest
        assert all(torch.equal(state[k], v) for k, v in _saved_weights(first_run, "step_00000001").items())
    model = create_model(str(first_run), drop_path_rate=0.1)  # an override that keeps the weights
    assert model.config.image.drop_path_rate == 0.1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_staged_lit_unlock_trains_the_last_image_groups_from_the_locked_runs_weights(first_run: Path,
                                                                                      tmp_path: Path,
                                                                                      capsys: pytest.CaptureFixture
                                                                                      ) -> None:
    code = main(["train", "--pretrained", str(first_run), "--lock-image", "--lock-image-unlocked-groups", "2",
                 "--logs", str(tmp_path), "--name", "unlock", "--device", "cpu", "--epochs", "2", "--warmup", "2",
                 "--stop-after-steps", "2", "--val-frequency", "0", "--zero-shot-samples", "16", *TINY_DATA_FLAGS])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "locked: the image tower" in err
    before, after = _saved_weights(first_run), _saved_weights(tmp_path / "unlock" / "checkpoints")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # the locked run's image tower is where the second starts; its two last groups (last block, head) train now
    first_block = next(k for k in before if k.startswith("visual.blocks.0."))
    assert first_block not in changed and "visual.embeds.pos_embed" not in changed
    assert any(k.startswith("visual.blocks.1.") for k in changed) and any(k.startswith("text.") for k in changed)
    # the model is the checkpoint's without --model; the run counts its own steps from 0
    _, config = load_checkpoint_model(tmp_path / "unlock" / "checkpoints")
    assert config["model"] == "tiny" and config["pretrained"] == str((first_run / "step_00000002").resolve())
    assert (tmp_path / "unlock" / "checkpoints" / "step_00000002").is_dir()


def test_model_and_loss_that_do_not_fit_the_checkpoint_are_one_line(first_run: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    base = ["train", "--pretrained", str(first_run), "--logs", str(tmp_path), "--device", "cpu", *TINY_DATA_FLAGS]
    for flags, message in ((["--model", "small"], "--model small: the --pretrained checkpoint"),
                           (["--loss", "siglip"], "--loss siglip: the --pretrained checkpoint")):
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and err.count("\n") == 0, err
    with pytest.raises(ValueError, match="--model small: .*architecture is not the checkpoint's"):
        create_model("small", pretrained=str(first_run))


def test_a_bad_pretrained_path_is_one_line_naming_pretrained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty_run" / "checkpoints"
    empty.mkdir(parents=True)
    for path in (str(tmp_path / "missing" / "checkpoints"), str(empty)):
        assert main(["train", "--pretrained", path, "--logs", str(tmp_path), "--device", "cpu",
                     *TINY_DATA_FLAGS]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("naflexclip train: error: --pretrained") and path in err and err.count("\n") == 0, err


def test_export_of_a_presets_run_says_a_new_run_needs_no_export(first_run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    assert main(["export", "--checkpoint", str(first_run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.endswith(f"no export is needed: train --pretrained {first_run}"), err

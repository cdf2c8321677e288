"""The dense-feature probe (`naflexclip.evaluation.dense_probe`): the built-in scenes' per-pixel shape classes, each
patch's
majority class, a linear probe whose mIoU is high on features that encode the classes and at chance on random ones;
`naflexclip eval` prints the probe's and, for a checkpoint with a LocCa decoder, the decoder's metrics."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.checkpoints.storage import save_checkpoint
from naflexclip.cli import main
from naflexclip.data.synthetic import COLOUR_RGB, COLOURS, SEGMENTATION_CLASSES, _scene, synthetic_segmentation
from naflexclip.evaluation import dense_probe as probe
from naflexclip.families.factory import create_model
from naflexclip.models.naflex_clip import config_to_dict
from naflexclip.objectives.siglip2_recipe import Recipe


def test_scene_labels_mark_the_pixels_drawn_in_each_objects_colour() -> None:
    checked = 0
    for index in range(12):
        img, labels = synthetic_segmentation(0, "val", index)
        _, (_, objects, _, _) = _scene(0, "val", index, 1)
        pixels = np.asarray(img)
        assert labels.shape == pixels.shape[:2] and labels.max() < len(SEGMENTATION_CLASSES)
        for obj in objects:
            if [o.shape for o in objects].count(obj.shape) > 1:
                continue  # two objects of one shape share its class
            drawn = labels == 1 + obj.shape
            assert drawn.sum() > 0
            assert (pixels[drawn] == COLOUR_RGB[COLOURS[obj.colour]]).all()
            x0, y0, x1, y1 = obj.box
            ys, xs = drawn.nonzero()
            assert xs.min() >= int(x0) - 1 and xs.max() <= x1 and ys.min() >= int(y0) - 1 and ys.max() <= y1
            checked += 1
    assert checked >= 12


def test_a_patch_takes_the_class_of_most_of_its_pixels() -> None:
    labels = np.zeros((4, 6), dtype=np.uint8)
    labels[0:2, 0:3] = 2  # the top-left patch entirely
    labels[2, 3:6] = 5
    labels[2:4, 4:6] = 7  # the bottom-right patch: 4 pixels of 7, 1 of 5, 1 of background
    coord = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    assert probe.patch_labels(labels, coord, 9).tolist() == [2, 0, 0, 7]
    # a grid that does not divide the image: each pixel goes to the patch holding its centre
    assert probe.patch_labels(np.array([[1, 1, 2, 2, 2]], dtype=np.uint8), torch.tensor([[0, 0], [0, 1]]),
                              3).tolist() == [1, 2]


def _labels(n: int, gen: torch.Generator) -> torch.Tensor:
    """Patch classes as in the built-in scenes: mostly background, the shapes in the rest."""
    labels = torch.randint(1, len(SEGMENTATION_CLASSES), (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.7] = 0
    return labels


def test_probe_miou_is_high_on_features_that_encode_the_classes_and_at_chance_on_random_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    classes = len(SEGMENTATION_CLASSES)
    train, val = _labels(3000, gen), _labels(1500, gen)

    def encoding(labels: torch.Tensor) -> torch.Tensor:  # the class, one-hot in 9 of 24 noisy dimensions
        noise = 0.1 * torch.randn(len(labels), 24, generator=gen, dtype=torch.float64)
        noise[:, :classes] += torch.nn.functional.one_hot(labels, classes)
        return noise

    encoded = probe.linear_probe_metrics((encoding(train), train), (encoding(val), val), classes)
    assert encoded["probe/miou"] > 0.95 and encoded["probe/patch_acc"] > 0.95
    random = probe.linear_probe_metrics((torch.randn(3000, 24, generator=gen, dtype=torch.float64), train),
                                        (torch.randn(1500, 24, generator=gen, dtype=torch.float64), val), classes)
    chance = random["probe/miou_chance"]
    assert 0.02 < chance < 0.1 and abs(random["probe/miou"] - chance) < 0.03
    assert probe.mean_iou(val, val, classes) == 1.0


def test_the_probe_of_a_tiny_model_reads_its_patch_tokens_of_the_built_in_scenes() -> None:
    from naflexclip.data import DataConfig

    torch.manual_seed(0)
    model = create_model("tiny").eval()
    data = DataConfig(naflex_seq_lens=(16, 32), workers=0)
    features, labels = probe.scene_patch_features(model, data, "val", 6, torch.device("cpu"), nullcontext)
    first, first_labels = probe.scene_patch_features(model, data, "val", 1, torch.device("cpu"), nullcontext)
    assert features.shape == (len(labels), model.config.image.width) and labels.max() < len(SEGMENTATION_CLASSES)
    # the first scene's tokens alone equal its rows in the batch of six (padding rows are not read)
    assert torch.allclose(first, features[: len(first)], atol=1e-5) and torch.equal(first_labels,
                                                                                     labels[: len(first)])
    assert (labels > 0).any() and (labels == 0).any()
    metrics = probe.dense_probe_metrics(model, data, torch.device("cpu"), nullcontext, {"train": 12, "val": 6})
    assert set(metrics) == {"probe/miou", "probe/patch_acc", "probe/miou_chance"}
    assert all(0 <= value <= 1 for value in metrics.values())


def _checkpoint(tmp_path: Path, recipe: str | None) -> Path:
    torch.manual_seed(0)
    model = Recipe(recipe=recipe).prepare(create_model("tiny"))
    config = tiny_config(tmp_path, recipe=recipe, zero_shot_samples=8)
    run = {"config": config.to_dict(), "model_config": config_to_dict(model.config)}
    return save_checkpoint(tmp_path / "checkpoints", "epoch_1", {"model": model.state_dict(), "run": run}, step=1,
                           epoch=1)


def test_eval_prints_the_decoder_metrics_for_a_decoder_checkpoint_and_the_probe_for_every_built_in_run(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # the probe at conftest.py's small size (small_dense_probe)
    assert main(["eval", "--checkpoint", str(_checkpoint(tmp_path / "recipe", "siglip2")), "--device", "cpu"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {"decoder/caption_bleu4", "decoder/aref_acc", "probe/miou", "val/image_to_text_R@1"} <= set(metrics)
    assert metrics["decoder/aref_num"] > 0 and 0 <= metrics["decoder/caption_bleu4"] <= 1
    assert main(["eval", "--checkpoint", str(_checkpoint(tmp_path / "plain", None)), "--device", "cpu"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "probe/miou" in plain and not any(key.startswith("decoder/") for key in plain)

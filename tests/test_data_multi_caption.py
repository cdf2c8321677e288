"""Several captions per image in the data: the built-in multi-caption mode (2-5 captions per scene), a WebDataset
`.json` list field (`--json-text-key`): with `--multi-positive` every caption is a text row with its image's group
id (global: a hash of the sample key); without it each image takes one caption per epoch, deterministically; a
grouped microbatch cut in parts keeps each image's captions; a short training run with --multi-positive."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_train_loop import tiny_config

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.microbatch import group_id, split_rows
from naflexclip.data.samples import JsonCaption, one_caption
from naflexclip.data.synthetic import synthetic_captions, synthetic_sample
from naflexclip.train.loop import train

DATA = dict(synthetic_train_size=24, synthetic_val_size=8, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=128,
            workers=0, synthetic_multi_caption=True)


def test_built_in_scenes_have_two_to_five_captions_and_keep_their_image():
    for index in range(20):
        image, captions = synthetic_captions(0, "train", index)
        plain_image, caption = synthetic_sample(0, "train", index)
        assert 2 <= len(captions) <= 5 and captions[0] == caption
        assert image.tobytes() == plain_image.tobytes()


def test_multi_caption_microbatches_are_grouped_and_one_caption_otherwise():
    grouped = build_loader(DataConfig(**DATA, multi_caption=True), split="train", patch_size=4, context_length=16)
    items = list(grouped)
    assert sum(len(item["keys"]) for item in items) == 24
    for item in items:
        assert item["image_group"].tolist() == [group_id(key) for key in item["keys"]]
        counts = [len(synthetic_captions(0, "train", int(key))[1]) for key in item["keys"]]
        assert item["text"].shape[0] == sum(counts) == item["text_group"].shape[0]
        groups = item["image_group"].tolist()
        assert item["text_group"].tolist() == [g for g, k in zip(groups, counts, strict=True) for _ in range(k)]
        pieces = split_rows(item, 2)
        assert [p["text_group"].tolist() for p in pieces] == [
            [g for g in item["text_group"].tolist() if g in p["image_group"].tolist()] for p in pieces]
    single = list(build_loader(DataConfig(**DATA), split="train", patch_size=4, context_length=16))
    assert all("image_group" not in item and item["text"].shape[0] == len(item["keys"]) for item in single)
    # one caption per image per epoch: the same on a re-read, drawn again in another epoch
    again = list(build_loader(DataConfig(**DATA), split="train", patch_size=4, context_length=16))
    assert all(torch.equal(a["text"], b["text"]) for a, b in zip(single, again, strict=True))
    picks = {one_caption(["a", "b", "c", "d"], 0, epoch, "key") for epoch in range(20)}
    assert len(picks) > 1


def test_a_json_list_field_gives_every_caption():
    data = json.dumps({"captions": ["one", " ", "two"], "alt": "three"})
    assert JsonCaption(("captions",))(data, 0, 0, "k") == ["one", "two"]
    assert JsonCaption(("alt", "captions"))(data, 0, 0, "k") == "three"


@pytest.mark.slow
def test_a_multi_positive_run_trains_on_grouped_windows(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "mp", stop_after_steps=2, val_frequency=0, multi_positive=True, loss="siglip",
                      multi_positive_weighting="asymmetric")
    cfg.data = dataclasses.replace(cfg.data, synthetic_multi_caption=True, multi_caption=True)
    train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "mp" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert len(steps) == 2 and all(record["train/loss"] > 0 for record in steps)

"""Regions of a sample (boxes with captions) and the LocCa decoder examples the data pipeline builds from them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from naflexclip.batch import EXAMPLE_INPUTS
from naflexclip.data import build_loader
from naflexclip.data.data_config import DataConfig
from naflexclip.data.dataset_export import export_synthetic
from naflexclip.data.folders import FolderSource
from naflexclip.data.microbatch import MicrobatchBuilder
from naflexclip.data.regions import CaptionTokens, DecoderExamples, parse_regions
from naflexclip.data.schedule import ScheduledBatch
from naflexclip.data.shard_sources import IndexedShardSource
from naflexclip.data.source import RawSample
from naflexclip.data.synthetic import COLOUR_RGB, COLOURS, SHAPES, _scene, synthetic_scene
from naflexclip.data.tables import CsvSource
from naflexclip.processing.decoder_tokens import IGNORE, TASKS, Vocabulary
from naflexclip.processing.naflex_transform import NaFlexTransform, default_processing, tokenize

CONTEXT = 16


def _decoder_examples() -> DecoderExamples:
    return DecoderExamples(Vocabulary(49408, 1000), 48, CaptionTokens(tokenize, CONTEXT))


def test_regions_are_normalised_by_the_original_size_and_bad_ones_skipped_by_name():
    meta = {"regions": [
        {"bbox": [10, 20, 30, 40], "caption": " a red circle "},
        {"bbox": [-1, 0, 5, 5], "caption": "left of the image"},
        {"bbox": [0, 0, 101, 5], "caption": "right of the image"},
        {"bbox": [30, 0, 30, 5], "caption": "zero width"},
        {"bbox": [0, 9, 5, 5], "caption": "upside down"},
        {"bbox": [0, 0, 5, 5], "caption": ""},
        {"bbox": [0, 0, 5, 5]},
        {"bbox": [0, 0, 5], "caption": "three numbers"},
        "not a region",
    ]}
    regions, skipped = parse_regions(json.dumps(meta).encode(), 100, 50)
    assert [(r.box, r.caption) for r in regions] == [((0.1, 0.4, 0.3, 0.8), "a red circle")]
    assert [reason for reason, _ in skipped] == [
        "region_outside_image", "region_outside_image", "region_empty_box", "region_empty_box", "region_no_caption",
        "region_no_caption", "region_malformed", "region_malformed"]
    assert parse_regions(b"{not json", 10, 10) == ([], [("region_malformed", "the .json is not JSON")])
    assert parse_regions({"caption": "no regions"}, 10, 10) == ([], [])


def test_a_synthetic_box_through_the_naflex_resize_lands_on_its_object():
    checked = 0
    for index in range(40):
        _, (_, objects, _, _) = _scene(0, "train", index, 1)
        img, _, regions = synthetic_scene(0, "train", index)
        for obj, region in zip(objects, regions, strict=True):
            if SHAPES[obj.shape] in ("ring", "triangle"):  # hollow / off-centre: the box centre is not drawn
                continue
            assert region["caption"] == obj.phrase()
            (box,), skipped = parse_regions({"regions": [region]}, *img.size)
            assert not skipped
            transform = NaFlexTransform(16)
            patches, coord = transform(img, 256)
            rows, cols = int(coord[:, 0].max()) + 1, int(coord[:, 1].max()) + 1
            resized = patches.view(rows, cols, 16, 16, 3).permute(0, 2, 1, 3, 4).reshape(rows * 16, cols * 16, 3)
            x = (box.box[0] + box.box[2]) / 2 * resized.shape[1]
            y = (box.box[1] + box.box[3]) / 2 * resized.shape[0]
            pixel = resized[int(y), int(x)].double()
            want = torch.tensor(COLOUR_RGB[COLOURS[obj.colour]], dtype=torch.double)
            assert (pixel - want).abs().max() < 40, (index, region, pixel, want)
            checked += 1
    assert checked >= 20


def test_decoder_examples_are_a_function_of_seed_epoch_and_sample():
    examples = _decoder_examples()
    regions, _ = parse_regions({"regions": synthetic_scene(0, "train", 3)[2]}, *synthetic_scene(0, "train", 3)[0].size)
    first = [examples.example("a caption", regions, 0, epoch, f"key{k}") for epoch in range(3) for k in range(30)]
    again = [examples.example("a caption", regions, 0, epoch, f"key{k}") for epoch in range(3) for k in range(30)]
    assert first == again
    draws = [examples.draw(0, epoch, f"key{k}", True, 3) for epoch in range(3) for k in range(200)]
    assert {task for task, _, _ in draws} == set(TASKS)
    assert 0.4 < np.mean([parallel for _, _, parallel in draws]) < 0.6
    assert {region for _, region, _ in draws} == {0, 1, 2}
    assert [examples.draw(0, 0, f"key{k}", True, 3) for k in range(30)] != [
        examples.draw(0, 1, f"key{k}", True, 3) for k in range(30)]
    # without regions: the caption task only
    assert {examples.draw(0, e, f"k{k}", False, 0)[0] for e in range(3) for k in range(30)} == {"caption"}


def test_caption_targets_are_the_words_then_the_end_token():
    examples = _decoder_examples()
    words = CaptionTokens(tokenize, CONTEXT)(["a small red circle"])[0]
    for epoch in range(20):  # both modes
        ids, labels, parallel = examples.example("a small red circle", [], 0, epoch, "k")
        target = [t for t in labels if t != IGNORE]
        assert target == [*words, 49407]
        assert ids[0] == examples.vocab.task("caption")


def _loader(epoch: int, workers: int) -> list[dict]:
    cfg = DataConfig(dataset_type="synthetic", synthetic_train_size=24, naflex_seq_lens=(64,),
                     naflex_max_tokens_per_batch=64 * 8, workers=workers)
    loader = build_loader(cfg, split="train", patch_size=16, context_length=CONTEXT, epoch=epoch,
                          inputs=[_decoder_examples()])
    return list(loader)


def test_the_loader_builds_each_samples_decoder_example_into_its_microbatch():
    by_key = {}
    for item in _loader(0, 0):
        inputs = item[EXAMPLE_INPUTS]
        assert inputs["decoder_input_ids"].shape == (len(item["keys"]), 48)
        for row, key in enumerate(item["keys"]):
            by_key[key] = [inputs[name][row] for name in sorted(inputs)]
    assert len(by_key) == 24
    tasks = {int(row[0][0]) for row in by_key.values()}
    assert len(tasks) == 3  # synthetic scenes have regions: every task is drawn
    for item in _loader(0, 2):  # other workers, the same examples per sample
        for row, key in enumerate(item["keys"]):
            for name, value in zip(sorted(item[EXAMPLE_INPUTS]), by_key[key], strict=True):
                assert torch.equal(item[EXAMPLE_INPUTS][name][row], value)
    changed = sum(not torch.equal(item[EXAMPLE_INPUTS]["decoder_input_ids"][row], by_key[key][0])
                  for item in _loader(1, 0) for row, key in enumerate(item["keys"]))
    assert changed > 0  # a new epoch draws again


def test_a_bad_region_is_a_named_skip_and_its_sample_trains():
    builder = MicrobatchBuilder(patch_size=16, context_length=CONTEXT, processing=default_processing(16),
                                inputs=[_decoder_examples()])
    image = Image.new("RGB", (64, 32), (200, 10, 10))
    raw = RawSample(image, "a red image", None, "k0",
                    json.dumps({"regions": [{"bbox": [0, 0, 65, 10], "caption": "too wide"}]}).encode())
    planned = ScheduledBatch(index=0, seq_len=64, batch_size=1, offset=0)
    item = builder.build(planned, [(raw, ("src", "k0", None))], [], (0, 0, 0))
    assert item["keys"] == ["k0"]
    assert [r["reason"] for r in item["skips"]] == ["region_outside_image"]
    assert int(item[EXAMPLE_INPUTS]["decoder_input_ids"][0, 0]) == _decoder_examples().vocab.task("caption")


def test_a_locca_term_refuses_crop_augmentation():
    with pytest.raises(ValueError, match="--augment"):
        MicrobatchBuilder(patch_size=16, context_length=CONTEXT, processing=default_processing(16, augment=True),
                          augment=True, inputs=[_decoder_examples()])


@pytest.mark.parametrize("fmt", ["webdataset", "csv", "folder"])
def test_exported_regions_are_read_back(tmp_path, fmt):
    paths = export_synthetic(str(tmp_path), fmt=fmt, count=3, image_format="png")
    if fmt == "webdataset":
        source = IndexedShardSource(paths[0], paths)
    elif fmt == "csv":
        source = CsvSource(paths[0], "filepath", "title", "\t")
    else:
        source = FolderSource(paths[0])
    for i in range(3):
        raw = source.load(i)
        index = int(raw.key.rsplit("train", 1)[1].split(".")[0])
        assert json.loads(raw.regions)["regions"] == synthetic_scene(0, "train", index)[2]


def test_a_tokenizer_without_start_or_end_tokens_ends_targets_with_its_padding():
    def padded_only(texts: list[str], context_length: int) -> torch.Tensor:  # SigLIP 2's: words, then padding 0
        rows = torch.zeros(len(texts), context_length, dtype=torch.long)
        for r, text in enumerate(texts):
            ids = [len(word) + 2 for word in text.split()][:context_length]
            rows[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return rows

    tokens = CaptionTokens(padded_only, 8)
    assert (tokens.start, tokens.end, tokens(["a red circle"])) == ([], 0, [[3, 5, 8]])


@pytest.mark.parametrize("meta", [[{"bbox": [0, 0, 5, 5], "caption": "a box"}], "a string", 7, None])
def test_a_region_json_that_is_not_an_object_is_a_named_skip_and_its_sample_trains(meta):
    builder = MicrobatchBuilder(patch_size=16, context_length=CONTEXT, processing=default_processing(16),
                                inputs=[_decoder_examples()])
    raw = RawSample(Image.new("RGB", (64, 32), (200, 10, 10)), "a red image", None, "k0", json.dumps(meta).encode())
    item = builder.build(ScheduledBatch(index=0, seq_len=64, batch_size=1, offset=0), [(raw, ("src", "k0", None))],
                         [], (0, 0, 0))
    assert item["keys"] == ["k0"]
    assert [(r["reason"], r["key"]) for r in item["skips"]] == [("region_malformed", "k0")]
    assert "not an object" in item["skips"][0]["detail"]

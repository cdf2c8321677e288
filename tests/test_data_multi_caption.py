"""Several captions per image in the data: the built-in multi-caption mode (2-5 captions per scene), a WebDataset
`.json` list field (`--json-text-key`), CSV rows naming the same image, a folder's `.txt` with one caption per line
(`--caption-per-line`): with `--multi-positive` every caption is a text row with its image's group
id (global: a hash of the sample key); without it each image takes one caption per epoch, deterministically; a
grouped microbatch cut in parts keeps each image's captions; a short training run with --multi-positive."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest_data import image_bytes
from test_train_loop import tiny_config

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.microbatch import group_id, split_rows
from naflexclip.data.samples import JsonCaption, one_caption
from naflexclip.data.synthetic import synthetic_captions, synthetic_sample
from naflexclip.processing.naflex_transform import tokenize
from naflexclip.train.loop import train

DATA = dict(synthetic_train_size=24, synthetic_val_size=8, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=128,
            workers=0, synthetic_multi_caption=True, synthetic_shape_group_size=1)


def test_built_in_scenes_have_two_to_five_captions_and_keep_their_image():
    for index in range(20):
        image, captions = synthetic_captions(0, "train", index)
        plain_image, caption = synthetic_sample(0, "train", index)
        assert 2 <= len(captions) <= 5 and captions[0] == caption
        assert image.tobytes() == plain_image.tobytes()


def test_a_scenes_captions_are_distinct_partial_views_that_each_fit_it():
    # several captions of one image say different things (as COCO's annotators do): identical strings would make
    # the extra captions carry nothing, and a caption naming an absent colour or shape would be a wrong positive
    from naflexclip.data.synthetic import COLOURS, SHAPES, _scene

    partial = 0
    for index in range(60):
        _, captions = synthetic_captions(0, "train", index)
        assert len(set(captions)) == len(captions), captions
        _, (_, objects, _, _) = _scene(0, "train", index, 1)
        for caption in captions[1:]:
            words = set(caption.replace(",", " ").replace(".", " ").split())
            assert words & set(COLOURS) <= {COLOURS[o.colour] for o in objects}, caption
            assert words & set(SHAPES) <= {SHAPES[o.shape] for o in objects}, caption
            partial += not all(o.phrase() in caption for o in objects)
    assert partial > 60  # most extra captions name only part of their scene


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


CONTEXT = 16
# image -> its captions in table order; the rows of a.png are not adjacent
TABLE = [("a.png", "a red circle"), ("b.png", "a blue square"), ("a.png", "a circle in red"), ("c.png", "a tree"),
         ("a.png", "red round shape"), ("b.png", "a square in blue")]


def table_captions() -> dict[str, list[str]]:
    captions: dict[str, list[str]] = {}
    for image, caption in TABLE:
        captions.setdefault(image, []).append(caption)
    return captions


def write_table(root: Path) -> str:
    for i, name in enumerate(sorted(table_captions())):
        (root / name).write_bytes(image_bytes(24 + 4 * i, 20, seed=i))
    (root / "data.csv").write_text("filepath,title\n" + "".join(f"{i},{c}\n" for i, c in TABLE))
    return str(root / "data.csv")


def write_folder(root: Path) -> dict[str, list[str]]:
    """A folder whose a.txt holds three captions (one per line, a blank line between) and b.txt one."""
    root.mkdir()
    texts = {"a": "one red circle\nthe circle is red\n\n  a round red thing  \n", "b": "a blue square\n"}
    for i, (stem, text) in enumerate(texts.items()):
        (root / f"{stem}.png").write_bytes(image_bytes(24, 20 + 4 * i, seed=i))
        (root / f"{stem}.txt").write_text(text)
    return {str(root / f"{stem}.png"): [line.strip() for line in text.splitlines() if line.strip()]
            for stem, text in texts.items()}


def epoch_items(cfg: DataConfig, epoch: int) -> list[dict]:
    return list(build_loader(cfg, split="train", patch_size=4, context_length=CONTEXT, epoch=epoch))


def check_grouped(items: list[dict], expected: dict[str, list[str]]) -> None:
    """Every image once, as one image row, and all its captions as text rows carrying its group id."""
    keys = [key for item in items for key in item["keys"]]
    assert sorted(keys) == sorted(expected)
    for item in items:
        assert item["image"]["patches"].shape[0] == len(item["keys"])
        want = [caption for key in item["keys"] for caption in expected[key]]
        assert torch.equal(item["text"], tokenize(want, CONTEXT))
        assert item["text_group"].tolist() == [group_id(key) for key in item["keys"] for _ in expected[key]]


def picked(items: list[dict], expected: dict[str, list[str]]) -> dict[str, str]:
    """Each image's caption of this epoch (one text row per image row)."""
    out = {}
    for item in items:
        assert "image_group" not in item and item["text"].shape[0] == len(item["keys"])
        for key, text in zip(item["keys"], item["text"], strict=True):
            [out[key]] = [c for c in expected[key] if torch.equal(tokenize([c], CONTEXT)[0], text)]
    return out


def check_one_caption_per_epoch(cfg: DataConfig, expected: dict[str, list[str]], seed_key: str) -> None:
    """One caption per image per epoch: every image once, the draw of (seed, epoch, key), the same on a re-read,
    and another caption in some other epoch."""
    draws = []
    for epoch in range(6):
        items = epoch_items(cfg, epoch)
        got = picked(items, expected)
        assert sorted(got) == sorted(expected)
        assert got == {key: one_caption(expected[key], cfg.seed, epoch, key) if len(expected[key]) > 1
                       else expected[key][0] for key in expected}
        draws.append(got[seed_key])
    assert picked(epoch_items(cfg, 2), expected) == picked(epoch_items(cfg, 2), expected)
    assert len(set(draws)) > 1


def test_csv_rows_of_one_image_are_one_sample_with_its_captions(tmp_path: Path) -> None:
    spec = write_table(tmp_path)
    expected = {image: captions for image, captions in table_captions().items()}
    cfg = DataConfig(train_data=spec, csv_separator=",", naflex_seq_lens=(16,), naflex_max_tokens_per_batch=32,
                     workers=0, seed=5)
    check_grouped(epoch_items(dataclasses.replace(cfg, multi_caption=True), 0), expected)
    check_one_caption_per_epoch(cfg, expected, "a.png")


def test_a_bad_row_of_an_image_is_left_out_and_an_image_with_none_usable_is_skipped(tmp_path: Path) -> None:
    for name in ("c.png", "d.png"):
        (tmp_path / name).write_bytes(image_bytes(20, 20))
    rows = [("c.png", " "), ("c.png", "a tree"), ("d.png", " "), ("d.png", "  ")]
    (tmp_path / "data.csv").write_text("filepath,title\n" + "".join(f"{i},{c}\n" for i, c in rows))
    cfg = DataConfig(train_data=str(tmp_path / "data.csv"), csv_separator=",", naflex_seq_lens=(16,),
                     naflex_max_tokens_per_batch=32, workers=0)
    loader = build_loader(cfg, split="train", patch_size=4, context_length=CONTEXT)
    assert picked(list(loader), {"c.png": ["a tree"]}) == {"c.png": "a tree"}
    # each bad row counted once, by its line: c's at index time, d's second at index time, d's first when read
    assert sorted((r["key"], r["line"]) for r in loader.skip_records) == [("c.png", 2), ("d.png", 4), ("d.png", 5)]
    assert dict(loader.skip_counts) == {"empty_caption": 3}


def test_a_folder_txt_is_one_caption_per_line_with_caption_per_line(tmp_path: Path) -> None:
    expected = write_folder(tmp_path / "folder")
    cfg = DataConfig(train_data=str(tmp_path / "folder"), naflex_seq_lens=(16,), naflex_max_tokens_per_batch=32,
                     workers=0, seed=1)
    # without the flag a file is one caption, as before (even under --multi-positive): its lines are not split
    whole = {key: [open(key[:-3] + "txt").read().strip()] for key in expected}
    check_grouped(epoch_items(dataclasses.replace(cfg, multi_caption=True), 0), whole)
    per_line = dataclasses.replace(cfg, caption_per_line=True)
    check_grouped(epoch_items(dataclasses.replace(per_line, multi_caption=True), 0), expected)
    check_one_caption_per_epoch(per_line, expected, str(tmp_path / "folder" / "a.png"))


def test_caption_per_line_with_json_text_key_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="--caption-per-line .*--json-text-key"):
        DataConfig(caption_per_line=True, json_text_key="captions")


@pytest.mark.slow
def test_a_multi_positive_run_trains_on_grouped_windows(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "mp", stop_after_steps=2, val_frequency=0, multi_positive=True, loss="siglip",
                      multi_positive_weighting="asymmetric")
    cfg.data = dataclasses.replace(cfg.data, synthetic_multi_caption=True, multi_caption=True)
    train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "mp" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert len(steps) == 2 and all(record["train/loss"] > 0 for record in steps)

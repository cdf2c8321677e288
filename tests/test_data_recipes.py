"""OpenCLIP's WebDataset recipes: member keys, JSON captions, the pixel cap, resampled shards and weighted mixtures."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest_data import image_bytes, write_tar

from naflexclip.data import DataConfig, build_loader, tokenize

PATCH, CONTEXT = 8, 16


def cfg_for(path: str, **kwargs) -> DataConfig:
    base = dict(train_data=path, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=64, workers=0)
    base.update(kwargs)
    return DataConfig(**base)


def captions_by_key(loader) -> dict[str, list[int]]:
    return {k.rsplit(":", 1)[-1]: t.tolist() for b in loader for k, t in zip(b["keys"], b["text"], strict=True)}


@pytest.mark.parametrize("streamed", [False, True])
def test_image_and_text_keys_pick_members_in_priority_order(tmp_path, streamed):
    write_tar(str(tmp_path / "k.tar"), [
        ("a.webp", image_bytes(16, 16, "WEBP")), ("a.caption", b"from caption"), ("a.txt", b"from txt"),
        ("b.tif", image_bytes(16, 16, "TIFF")), ("b.txt", b"b txt"),  # .tif is not an --image-key
        ("c.png", image_bytes(16, 16, "PNG")), ("c.caption", b"c caption"),
    ])
    spec = f"pipe:cat {tmp_path}/k.tar" if streamed else str(tmp_path / "k.tar")
    num = 3 if streamed else None
    default = build_loader(cfg_for(spec, dataset_type="webdataset", train_num_samples=num), split="train",
                           patch_size=PATCH, context_length=CONTEXT)
    got = captions_by_key(default)  # OpenCLIP's defaults: jpg;png;jpeg;webp and txt
    assert sorted(got) == ["a"] and got["a"] == tokenize(["from txt"], CONTEXT)[0].tolist()
    assert dict(default.skip_counts) == {"missing_image": 1, "missing_caption": 1}
    keyed = build_loader(cfg_for(spec, dataset_type="webdataset", train_num_samples=num, image_key="tif;webp;png",
                                 text_key="caption;txt"), split="train", patch_size=PATCH, context_length=CONTEXT)
    got = captions_by_key(keyed)
    assert sorted(got) == ["a", "b", "c"] and not keyed.skip_counts
    assert got["a"] == tokenize(["from caption"], CONTEXT)[0].tolist()


def _json_shard(path, n: int) -> None:
    members = []
    for i in range(n):
        meta = {"short": f"short {i}", "long": f"a long caption {i}", "empty": " "}
        if i == 0:
            meta = {"short": "", "long": "only long"}
        members += [(f"s{i}.jpg", image_bytes(16, 16, "JPEG", seed=i)), (f"s{i}.json", json.dumps(meta).encode())]
    members += [("nojson.jpg", image_bytes(16, 16, "JPEG")), ("nojson.txt", b"text, no json")]
    write_tar(str(path), members)


def test_json_text_key_takes_the_first_non_empty_field(tmp_path):
    _json_shard(tmp_path / "j.tar", 6)
    loader = build_loader(cfg_for(str(tmp_path / "j.tar"), json_text_key="short;long"), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
    got = captions_by_key(loader)
    assert got["s3"] == tokenize(["short 3"], CONTEXT)[0].tolist()
    assert got["s0"] == tokenize(["only long"], CONTEXT)[0].tolist()  # "short" is empty: the next key
    assert "nojson" not in got and dict(loader.skip_counts) == {"missing_caption": 1}


def test_json_text_key_probs_draw_one_field_per_sample_and_epoch_deterministically(tmp_path):
    _json_shard(tmp_path / "j.tar", 40)
    cfg = cfg_for(str(tmp_path / "j.tar"), json_text_key="short;long;empty", json_text_key_probs=(1.0, 3.0))
    short = {f"s{i}": tokenize([f"short {i}"], CONTEXT)[0].tolist() for i in range(40)}

    def picks(epoch: int, workers: int) -> dict[str, str]:
        loader = build_loader(DataConfig(**{**cfg.__dict__, "workers": workers}), split="train", patch_size=PATCH,
                              context_length=CONTEXT, epoch=epoch)
        return {k: "short" if t == short.get(k) else "long" for k, t in captions_by_key(loader).items()}

    first = picks(0, 0)
    assert first == picks(0, 2)  # the same in any worker and order
    counts = Counter(v for k, v in first.items() if k != "s0")
    assert 3 <= counts["short"] <= 20 and counts["long"] > counts["short"]  # weights 1:3 over 39 samples
    assert first["s0"] == "long"  # "short" is empty there: the drawn order falls through to "long"
    assert picks(1, 0) != first  # a new draw each epoch


def test_max_image_pixels_skips_large_images_by_header(tmp_path):
    write_tar(str(tmp_path / "p.tar"), [
        ("big.png", image_bytes(64, 64, "PNG")), ("big.txt", b"4096 pixels"),
        ("small.png", image_bytes(16, 16, "PNG")), ("small.txt", b"256 pixels"),
    ])
    loader = build_loader(cfg_for(str(tmp_path / "p.tar"), max_image_pixels=1000), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
    assert sorted(captions_by_key(loader)) == ["small"]
    assert dict(loader.skip_counts) == {"over_max_image_pixels": 1}
    assert "64x64" in loader.skip_records[0]["detail"]
    unlimited = build_loader(cfg_for(str(tmp_path / "p.tar"), max_image_pixels=0), split="train",
                             patch_size=PATCH, context_length=CONTEXT)
    assert sorted(captions_by_key(unlimited)) == ["big", "small"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json_text_key_probs": (1.0,)}, "--json-text-key-probs goes with --json-text-key"),
    ({"json_text_key": "a;b", "json_text_key_probs": (1.0, 1.0, 1.0)}, "3 weights for the 2 keys"),
    ({"json_text_key": "a", "json_text_key_probs": (-1.0,)}, "--json-text-key-probs must be finite and >= 0"),
    ({"image_key": " ; "}, "--image-key needs at least one name"),
    ({"max_image_pixels": -1}, "--max-image-pixels must be >= 0"),
    ({"train_data_upsampling_factors": "1::2"}, "2 factors for the 1 `::`-joined sources"),
    ({"train_data_upsampling_factors": "x"}, "each `::`-separated factor must be a number"),
    ({"train_data": "a.tar::b.tar", "train_data_upsampling_factors": "0::0"}, "not all 0"),
    ({"train_data": "data.csv", "dataset_resampled": True}, "--dataset-resampled applies to WebDataset"),
    ({"train_data": None, "dataset_resampled": True}, "the built-in dataset"),
])
def test_recipe_flags_refuse_bad_values_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        DataConfig(**{"train_data": "shards/a.tar", **kwargs})

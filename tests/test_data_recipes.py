"""OpenCLIP's WebDataset recipes: member keys, JSON captions, the pixel cap, resampled shards and weighted mixtures."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
from conftest_data import image_bytes, write_tar

from naflexclip.data import DataConfig, build_loader
from naflexclip.processing.naflex_transform import tokenize

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
        ("d.jpg", image_bytes(16, 16, "JPEG")), ("d.txt", b"d txt"),
    ])
    spec = f"pipe:cat {tmp_path}/k.tar" if streamed else str(tmp_path / "k.tar")
    num = 4 if streamed else None
    default = build_loader(cfg_for(spec, dataset_type="webdataset", train_num_samples=num), split="train",
                           patch_size=PATCH, context_length=CONTEXT)
    got = captions_by_key(default)  # OpenCLIP's defaults: jpg;png;jpeg;webp and txt
    assert sorted(got) == ["a", "d"] and got["a"] == tokenize(["from txt"], CONTEXT)[0].tolist()
    assert dict(default.skip_counts) == {"missing_image": 1, "missing_caption": 1}
    keyed = build_loader(cfg_for(spec, dataset_type="webdataset", train_num_samples=num, image_key="tif;webp;png",
                                 text_key="caption;txt"), split="train", patch_size=PATCH, context_length=CONTEXT)
    got = captions_by_key(keyed)
    assert sorted(got) == ["a", "b", "c"] and dict(keyed.skip_counts) == {"missing_image": 1}  # d.jpg
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


def _shards(root, prefix: str, num_shards: int, per_shard: int, sizes_json: bool = True) -> str:
    """`num_shards` shards of `per_shard` tiny samples keyed `{prefix}{shard}_{i}`; returns their brace spec."""
    root.mkdir(parents=True, exist_ok=True)
    img = image_bytes(8, 8, "PNG")
    for s in range(num_shards):
        write_tar(str(root / f"{prefix}-{s}.tar"), [m for i in range(per_shard) for m in (
            (f"{prefix}{s}_{i}.png", img), (f"{prefix}{s}_{i}.txt", f"{prefix} {s} {i}".encode()))])
    if sizes_json:
        (root / "sizes.json").write_text(json.dumps({f"{prefix}-{s}.tar": per_shard for s in range(num_shards)}))
    return f"{root}/{prefix}-{{0..{num_shards - 1}}}.tar"


def keys_in_order(loader) -> list[str]:
    return [k.rsplit(":", 1)[-1] for b in loader for k in b["keys"]]


def _resumed(cfg: DataConfig, stop_after: int, world_size: int = 1, rank: int = 0, workers_after: int = 0
             ) -> tuple[list[str], list[str]]:
    """(keys of an uninterrupted epoch 1, keys of epoch 1 stopped after `stop_after` microbatches and resumed in a
    new loader with `workers_after` workers)."""
    kwargs = dict(split="train", patch_size=PATCH, context_length=CONTEXT, epoch=1, rank=rank, world_size=world_size)
    whole = keys_in_order(build_loader(cfg, **kwargs))
    first = build_loader(cfg, **kwargs)
    head = []
    for i, batch in enumerate(first):
        head += [k.rsplit(":", 1)[-1] for k in batch["keys"]]
        if i + 1 == stop_after:
            state = first.state_dict()
            break
    again = build_loader(DataConfig(**{**cfg.__dict__, "workers": workers_after}), **kwargs)
    again.load_state_dict(state)
    again.set_epoch(state["epoch"], state["position"])
    return whole, head + keys_in_order(again)


@pytest.mark.parametrize("streamed", [False, True])
def test_resampled_epoch_is_train_num_samples_drawn_with_replacement_and_a_resume_continues_it(tmp_path, streamed):
    spec = _shards(tmp_path / "a", "a", 4, 6)
    if streamed:
        spec = "::".join(f"pipe:cat {tmp_path}/a/a-{s}.tar" for s in range(4))
    cfg = cfg_for(spec, dataset_type="webdataset", dataset_resampled=True, train_num_samples=60, seed=3,
                  shuffle_buffer=4)
    whole, resumed = _resumed(cfg, stop_after=5, workers_after=0 if streamed else 2)
    assert len(whole) == 60 and resumed == whole  # the same stream, continued mid-epoch (any workers when indexed)
    assert max(Counter(whole).values()) > 1  # with replacement: 60 draws from 24 samples repeat some
    other_epoch = keys_in_order(build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=2))
    assert other_epoch != whole and len(other_epoch) == 60


def test_resampled_shards_follow_the_upsampling_factors(tmp_path):
    a = _shards(tmp_path / "a", "a", 4, 5)
    b = _shards(tmp_path / "b", "b", 4, 5)
    cfg = cfg_for(f"{a}::{b}", dataset_resampled=True, train_data_upsampling_factors="1::3", train_num_samples=400)
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    counts = Counter(k[0] for k in keys_in_order(loader))
    assert sum(counts.values()) == 400 and 2.2 < counts["b"] / counts["a"] < 4.5  # shard weights 1:3
    assert loader.planned_sources == {a: counts["a"], b: counts["b"]}
    only_a = build_loader(cfg_for(f"{a}::{b}", dataset_resampled=True, train_data_upsampling_factors="1::0",
                                  train_num_samples=40), split="train", patch_size=PATCH, context_length=CONTEXT)
    assert {k[0] for k in keys_in_order(only_a)} == {"a"}


@pytest.mark.parametrize("sizes_json", [True, False])
def test_a_mixture_without_resampling_gives_each_source_its_exact_share_of_every_epoch(tmp_path, sizes_json):
    a = _shards(tmp_path / "a", "a", 3, 4, sizes_json)
    b = _shards(tmp_path / "b", "b", 2, 5, sizes_json)
    cfg = cfg_for(f"{a}::{b}", train_data_upsampling_factors="1::2", workers=0)
    for epoch in (0, 1):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=epoch)
        counts = Counter(keys_in_order(loader))
        # factor 1: every sample of a once; factor 2: every sample of b twice
        assert {k for k in counts if k[0] == "a"} == {f"a{s}_{i}" for s in range(3) for i in range(4)}
        assert {v for k, v in counts.items() if k[0] == "a"} == {1}
        assert {v for k, v in counts.items() if k[0] == "b"} == {2}
        assert loader.planned_sources == {a: 12, b: 20} and loader.num_samples == 32
    shares = build_loader(DataConfig(**{**cfg.__dict__, "train_num_samples": 16}), split="train", patch_size=PATCH,
                          context_length=CONTEXT)
    counts = Counter(k[0] for k in keys_in_order(shares))
    assert counts == {"a": 6, "b": 10} and shares.planned_sources == {a: 6, b: 10}  # 12:20 scaled to 16


def test_a_mixture_resumes_exactly_at_the_same_and_at_another_world_size(tmp_path):
    a = _shards(tmp_path / "a", "a", 3, 4)
    b = _shards(tmp_path / "b", "b", 2, 5)
    cfg = cfg_for(f"{a}::{b}", train_data_upsampling_factors="1::2")
    whole, resumed = _resumed(cfg, stop_after=3, workers_after=2)
    assert resumed == whole
    # two ranks stop after 2 microbatches each; three ranks read the rest: every planned sample once in all
    two = [build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r, world_size=2)
           for r in range(2)]
    head, states = [], []
    for loader in two:
        for i, batch in enumerate(loader):
            head += [k.rsplit(":", 1)[-1] for k in batch["keys"]]
            if i == 1:
                states.append(loader.state_dict())
                break
    rest = []
    for r in range(3):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r, world_size=3)
        loader.load_state_dict(states)
        loader.set_epoch(0, states[0]["position"])
        rest += keys_in_order(loader)
    assert Counter(head + rest) == Counter(whole)  # (every epoch of this mixture is the same multiset)


def test_sized_shards_are_scanned_once_at_startup_and_read_from_their_cached_index(tmp_path, monkeypatch):
    """sizes.json is checked against each shard's tar headers at startup; the index that scan caches is what the
    reads use, so a shard's headers are read once in all."""
    from naflexclip.data import shard_index

    spec = _shards(tmp_path / "s", "s", 3, 4)
    scanned = []
    real = shard_index.scan_shard
    monkeypatch.setattr(shard_index, "scan_shard", lambda url, *a: scanned.append(url) or real(url, *a))
    loader = build_loader(cfg_for(spec), split="train", patch_size=PATCH, context_length=CONTEXT)
    assert sorted(scanned) == [str(tmp_path / "s" / f"s-{s}.tar") for s in range(3)] and len(loader.source) == 12
    assert sorted(keys_in_order(loader)) == sorted(f"s{s}_{i}" for s in range(3) for i in range(4))
    assert len(scanned) == 3 and not loader.skip_counts


def test_trusted_sizes_json_reads_no_shard_at_startup_and_names_a_surplus_when_read(tmp_path, monkeypatch):
    """--trust-sizes-json plans from sizes.json alone: no shard is read at startup, each is scanned once by the read
    that first needs it, and the samples a shard holds past its listed count are named, not trained."""
    from naflexclip.data import shard_index

    spec = _shards(tmp_path / "s", "s", 3, 4)
    sizes = json.loads((tmp_path / "s" / "sizes.json").read_text())
    sizes["s-0.tar"], sizes["s-2.tar"] = 2, 6  # 2 fewer than shard 0 holds, 2 more than shard 2 holds
    (tmp_path / "s" / "sizes.json").write_text(json.dumps(sizes))
    scanned = []
    real = shard_index.scan_shard
    monkeypatch.setattr(shard_index, "scan_shard", lambda url, *a: scanned.append(url) or real(url, *a))
    loader = build_loader(cfg_for(spec, trust_sizes_json=True), split="train", patch_size=PATCH,
                          context_length=CONTEXT)
    assert scanned == [] and len(loader.source) == 12  # 2 + 4 + 6, as listed
    assert sorted(keys_in_order(loader)) == sorted(["s0_0", "s0_1"] + [f"s{s}_{i}" for s in (1, 2) for i in range(4)])
    assert sorted(scanned) == [str(tmp_path / "s" / f"s-{s}.tar") for s in range(3)]  # each once, when read
    surplus = sorted(r["key"] for r in loader.skip_records if r["source"].endswith("s-0.tar"))
    assert surplus == ["s0_2", "s0_3"] and dict(loader.skip_counts) == {"shard_size_mismatch": 4}
    assert all("--trust-sizes-json" in r["detail"] for r in loader.skip_records if r["source"].endswith("s-0.tar"))


@pytest.mark.parametrize("factors", [None, "1::1"])
@pytest.mark.parametrize("sizes_json", [True, False])
def test_a_source_of_a_mixture_with_nothing_usable_stops_in_one_line_naming_it(tmp_path, factors, sizes_json):
    from naflexclip.data import DataError

    a = _shards(tmp_path / "a", "a", 2, 4, sizes_json)
    (tmp_path / "e").mkdir()
    write_tar(str(tmp_path / "e" / "empty.tar"), [])
    if sizes_json:
        (tmp_path / "e" / "sizes.json").write_text(json.dumps({"empty.tar": 0}))
    empty = str(tmp_path / "e" / "empty.tar")
    with pytest.raises(DataError) as error:
        build_loader(cfg_for(f"{a}::{empty}", train_data_upsampling_factors=factors), split="train",
                     patch_size=PATCH, context_length=CONTEXT)
    message = str(error.value)
    assert "\n" not in message and f"{empty!r}" in message and "no usable samples" in message


def _disagreeing_sizes(root) -> str:
    """Four shards of 16 whose sizes.json lists 20 / 16 / 10 / 16."""
    spec = _shards(root, "s", 4, 16)
    (root / "sizes.json").write_text(json.dumps({"s-0.tar": 20, "s-1.tar": 16, "s-2.tar": 10, "s-3.tar": 16}))
    return spec


@pytest.mark.parametrize(("workers", "world_size"), [(0, 1), (2, 2)])
def test_a_sizes_json_that_disagrees_with_a_shard_either_way_trains_what_it_holds_and_names_it(tmp_path, workers,
                                                                                               world_size):
    """Four shards of 16, sizes.json lists 20 / 16 / 10 / 16: every sample the shards hold trains once per epoch,
    every rank plans as many microbatches. Shard 2 (6 past its listed 10) is named once per epoch with both counts;
    each of the 4 listed samples shard 0 lacks is counted, as a missing sample of a shard is."""
    spec = _disagreeing_sizes(tmp_path / "s")
    for epoch in (0, 1):
        keys, records, planned = [], [], set()
        for rank in range(world_size):
            loader = build_loader(cfg_for(spec, workers=workers), split="train", patch_size=PATCH,
                                  context_length=CONTEXT, rank=rank, world_size=world_size, epoch=epoch)
            planned.add(len(loader))
            keys += keys_in_order(loader)
            records += loader.skip_records
        assert len(planned) == 1
        assert sorted(keys) == sorted(f"s{s}_{i}" for s in range(4) for i in range(16))
        assert {r["reason"] for r in records} == {"shard_size_mismatch", "shard_holds_more"}
        assert {r["epoch"] for r in records} == {epoch + 1}
        under = [r for r in records if r["source"].endswith("s-2.tar")]
        assert len(under) == 1 and under[0]["key"] is None
        assert "sizes.json lists 10 samples, the shard holds 16" in under[0]["detail"]
        over = [r for r in records if r["source"].endswith("s-0.tar")]
        assert len(over) == 4 and all("sizes.json lists 20 samples, the shard holds 16" in r["detail"] for r in over)
        assert len(records) == 5
        # the under-listed shard is a note (all its samples trained): only the 4 missing samples count as skipped
        assert under[0]["reason"] == "shard_holds_more" and {r["reason"] for r in over} == {"shard_size_mismatch"}
        if world_size == 1:
            assert "skipped 4 (shard_size_mismatch=4); noted: shard_holds_more=1" in loader.summary()


@pytest.mark.parametrize(("workers", "world_size"), [(0, 1), (2, 2)])
def test_with_trusted_sizes_json_the_disagreeing_shards_train_what_it_lists_and_name_the_rest(tmp_path, workers,
                                                                                              world_size):
    """Four shards of 16 listed 20 / 16 / 10 / 16 with --trust-sizes-json, planned from the list: 58 samples train.
    Shard 2's 6 samples past its listed 10 are named by key, shard 0's 4 missing listed samples counted, once per
    epoch on one rank."""
    spec = _disagreeing_sizes(tmp_path / "s")
    for epoch in (0, 1):
        keys, records, planned = [], [], set()
        for rank in range(world_size):
            loader = build_loader(cfg_for(spec, workers=workers, trust_sizes_json=True), split="train",
                                  patch_size=PATCH, context_length=CONTEXT, rank=rank, world_size=world_size,
                                  epoch=epoch)
            planned.add(len(loader))
            keys += keys_in_order(loader)
            records += loader.skip_records
        assert len(planned) == 1 and len(keys) == 58
        assert sorted(keys) == sorted([f"s{s}_{i}" for s in (0, 1, 3) for i in range(16)]
                                      + [f"s2_{i}" for i in range(10)])
        assert {r["reason"] for r in records} == {"shard_size_mismatch"} and {r["epoch"] for r in records} == {
            epoch + 1}
        surplus = [r for r in records if r["source"].endswith("s-2.tar")]
        assert sorted(r["key"] for r in surplus) == [f"s2_{i}" for i in range(10, 16)]
        assert all("sizes.json lists 10 samples, the shard holds 16" in r["detail"] for r in surplus)
        over = [r for r in records if r["source"].endswith("s-0.tar")]
        assert len(over) == 4 and all("sizes.json lists 20 samples, the shard holds 16" in r["detail"] for r in over)
        assert len(records) == 10


def test_trusted_sizes_json_resumes_mid_epoch_exactly(tmp_path):
    cfg = cfg_for(_disagreeing_sizes(tmp_path / "s"), seed=5, trust_sizes_json=True)
    whole, resumed = _resumed(cfg, stop_after=3, workers_after=2)
    assert resumed == whole and len(whole) == 58


@pytest.mark.parametrize(("listing", "named"), [
    ("{not json", "not JSON"),
    ("[16, 16, 16]", "not an object of shard name -> sample count"),
    ('{"s-0.tar": 16, "s-1.tar": "x", "s-2.tar": 16}', "'s-1.tar': 'x' is not a sample count"),
    ('{"s-0.tar": 16, "s-1.tar": -3, "s-2.tar": 16}', "'s-1.tar': -3 is not a sample count"),
    ('{"s-0.tar": 16, "s-1.tar": 15.5, "s-2.tar": 16}', "'s-1.tar': 15.5 is not a sample count"),
    ('{"s-0.tar": 16, "s-2.tar": 16}', "lists no 's-1.tar'"),
])
@pytest.mark.parametrize("trusted", [False, True])
def test_a_sizes_json_that_cannot_be_used_is_named_and_every_shard_trains(tmp_path, caplog, listing, named, trusted):
    """A sizes.json beside the shards that is not JSON, not an object, holds a count that is not one or leaves a
    shard out: one line names the file and why, and every shard is indexed instead (before: ignored without a
    word, or a bare `invalid literal for int()` that named neither the file nor the shard)."""
    spec = _shards(tmp_path / "s", "s", 3, 16)
    (tmp_path / "s" / "sizes.json").write_text(listing)
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        loader = build_loader(cfg_for(spec, trust_sizes_json=trusted), split="train", patch_size=PATCH,
                              context_length=CONTEXT)
    assert sorted(keys_in_order(loader)) == sorted(f"s{s}_{i}" for s in range(3) for i in range(16))
    lines = [r.getMessage() for r in caplog.records if "sizes.json" in r.getMessage()]
    assert lines and "\n" not in lines[0] and str(tmp_path / "s" / "sizes.json") in lines[0], lines
    assert named in lines[0] and "every shard is indexed instead" in lines[0], lines[0]
    assert len(lines) == 1 + trusted  # with --trust-sizes-json, its own line that it changes nothing


@pytest.mark.parametrize("streamed", [False, True])
def test_a_shuffle_buffer_for_data_that_is_not_streamed_says_it_changes_nothing(tmp_path, caplog, streamed):
    """--shuffle-buffer shapes only streamed shards' order; given for indexed shards (shuffled over the whole
    epoch) it changed nothing without a word. Now one line says so; streamed shards take it and nothing is said."""
    spec = _shards(tmp_path / "s", "s", 2, 8, sizes_json=False)
    if streamed:
        spec = "::".join(f"pipe:cat {tmp_path}/s/s-{s}.tar" for s in range(2))
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        build_loader(cfg_for(spec, shuffle_buffer=10, train_num_samples=16 if streamed else None), split="train",
                     patch_size=PATCH, context_length=CONTEXT)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--shuffle-buffer")]
    if streamed:
        assert lines == []
    else:
        assert len(lines) == 1 and "--shuffle-buffer 10" in lines[0] and spec in lines[0], lines
        assert "changes nothing" in lines[0] and "\n" not in lines[0]


def test_a_sizes_json_count_written_as_a_whole_number_is_read_as_openclip_reads_it(tmp_path, caplog):
    """OpenCLIP reads each count with int(): "16" and 16.0 are 16, planned from the list and said nothing about."""
    spec = _shards(tmp_path / "s", "s", 2, 16)
    (tmp_path / "s" / "sizes.json").write_text('{"s-0.tar": "16", "s-1.tar": 16.0}')
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        loader = build_loader(cfg_for(spec, trust_sizes_json=True), split="train", patch_size=PATCH,
                              context_length=CONTEXT)
    assert len(keys_in_order(loader)) == 32 and not caplog.records


def _tiny_csv(root) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (root / f"{i}.png").write_bytes(image_bytes(8, 8, "PNG", seed=i))
    (root / "data.tsv").write_text("filepath\ttitle\n" + "".join(f"{i}.png\tcaption {i}\n" for i in range(4)))
    return str(root / "data.tsv")


@pytest.mark.parametrize("data", ["shards without sizes.json", "csv"])
def test_trust_sizes_json_without_a_sizes_json_to_trust_says_so_in_one_line(tmp_path, caplog, data):
    """A harmless flag: the data trains as without it, and one line names the flag and the data."""
    if data == "csv":
        spec, expected = _tiny_csv(tmp_path / "c"), 4
    else:
        spec, expected = _shards(tmp_path / "s", "s", 2, 4, sizes_json=False), 8
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        loader = build_loader(cfg_for(spec, trust_sizes_json=True), split="train", patch_size=PATCH,
                              context_length=CONTEXT)
    lines = [r.getMessage() for r in caplog.records if "--trust-sizes-json" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and spec in lines[0] and "changes nothing" in lines[0]
    assert len(keys_in_order(loader)) == expected
    caplog.clear()
    with caplog.at_level("WARNING", logger="naflexclip.data"):  # shards beside a sizes.json: nothing to say
        build_loader(cfg_for(_shards(tmp_path / "z", "z", 2, 4), trust_sizes_json=True), split="train",
                     patch_size=PATCH, context_length=CONTEXT)
    assert not any("--trust-sizes-json" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("trusted", ["validation", "training"])
def test_the_trust_sizes_json_notice_names_the_validation_data_too(tmp_path, caplog, trusted):
    """The flag plans --val-data shards from their sizes.json as well: its one line at the start names what it
    changes nothing for, training or validation data, and the validation data it trusts."""
    shards, csv = _shards(tmp_path / "s", "s", 2, 4), _tiny_csv(tmp_path / "c")
    train, val = (csv, shards) if trusted == "validation" else (shards, csv)
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        build_loader(cfg_for(train, val_data=val, trust_sizes_json=True), split="train", patch_size=PATCH,
                     context_length=CONTEXT)
    (line,) = [r.getMessage() for r in caplog.records if "--trust-sizes-json" in r.getMessage()]
    if trusted == "validation":
        assert f"the training data {csv!r}" in line and "changes nothing for it" in line, line
        assert f"the validation data {shards!r} from its sizes.json" in line, line
    else:
        assert f"the validation data {csv!r}" in line and "changes nothing for it" in line, line
        assert "training data" not in line, line


def test_a_shard_listed_with_0_samples_trains_what_it_holds_and_is_named(tmp_path):
    spec = _shards(tmp_path / "s", "s", 3, 4)
    (tmp_path / "s" / "sizes.json").write_text(json.dumps({"s-0.tar": 4, "s-1.tar": 0, "s-2.tar": 4}))
    loader = build_loader(cfg_for(spec), split="train", patch_size=PATCH, context_length=CONTEXT)
    assert sorted(keys_in_order(loader)) == sorted(f"s{s}_{i}" for s in range(3) for i in range(4))
    [record] = loader.skip_records
    assert record["source"].endswith("s-1.tar") and record["reason"] == "shard_holds_more"
    assert "sizes.json lists 0 samples, the shard holds 4" in record["detail"]


def test_an_epoch_of_miscounted_shards_resumes_mid_way_exactly(tmp_path):
    cfg = cfg_for(_disagreeing_sizes(tmp_path / "s"), seed=5)
    whole, resumed = _resumed(cfg, stop_after=3, workers_after=2)
    assert resumed == whole and sorted(whole) == sorted(f"s{s}_{i}" for s in range(4) for i in range(16))


def test_a_mixture_that_copies_a_source_says_in_one_line_that_copies_can_meet(tmp_path, caplog):
    a = _shards(tmp_path / "a", "a", 3, 4)
    b = _shards(tmp_path / "b", "b", 2, 5)
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        build_loader(cfg_for(f"{a}::{b}", train_data_upsampling_factors="1::2"), split="train", patch_size=PATCH,
                     context_length=CONTEXT)
    lines = [r.getMessage() for r in caplog.records if "--train-data-upsampling-factors" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "1::2" in lines[0] and b in lines[0]
    assert "same window" in lines[0] and "negatives" in lines[0] and a not in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="naflexclip.data"):  # no source read twice: nothing to say
        build_loader(cfg_for(f"{a}::{b}", train_data_upsampling_factors="1::0.5"), split="train", patch_size=PATCH,
                     context_length=CONTEXT)
    assert not any("--train-data-upsampling-factors" in r.getMessage() for r in caplog.records)


def test_a_local_shard_deleted_mid_epoch_skips_each_unread_sample_by_its_key_also_after_a_resume(tmp_path):
    """Shards with a sizes.json; one goes after the epoch's first microbatch: each of its samples not yet read is
    `missing_shard`, named by its key (never a crash, never `#j`), and a resume from that microbatch names the
    samples it has not trained the same way."""
    from naflexclip.data.dataset_export import export_synthetic

    export_synthetic(str(tmp_path), count=40, shard_size=10, image_format="png")
    cfg = cfg_for(str(tmp_path / "train-{00000..00003}.tar"), naflex_max_tokens_per_batch=128, seed=3)
    kwargs = dict(split="train", patch_size=PATCH, context_length=CONTEXT)
    gone = str(tmp_path / "train-00002.tar")
    kept = gone + ".kept"
    shutil.copy(gone, kept)
    lost = {f"train{i:08d}" for i in range(20, 30)}
    loader = build_loader(cfg, **kwargs)
    batches = iter(loader)
    head = [k.rsplit(":", 1)[-1] for k in next(batches)["keys"]]
    state = loader.state_dict()
    os.remove(gone)
    rest = [k.rsplit(":", 1)[-1] for b in batches for k in b["keys"]]
    skipped = [r for r in loader.skip_records if r["reason"] == "missing_shard"]
    assert {r["reason"] for r in loader.skip_records} == {"missing_shard"}
    assert len(skipped) == len({r["key"] for r in skipped}) == len(lost - set(head + rest)) > 0
    assert {r["key"] for r in skipped} == lost - set(head + rest)
    shutil.copy(kept, gone)  # as it was at the checkpoint
    resumed = build_loader(DataConfig(**{**cfg.__dict__, "workers": 2}), **kwargs)
    os.remove(gone)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"], state["position"])
    after = [k.rsplit(":", 1)[-1] for b in resumed for k in b["keys"]]
    again = [r for r in resumed.skip_records if r["reason"] == "missing_shard"]
    assert {r["key"] for r in again} == lost - set(head + after) and len(again) == len(lost - set(head + after))

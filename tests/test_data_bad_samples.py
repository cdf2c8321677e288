"""Bad samples never stop a run: each kind is skipped, named and counted exactly, every good sample still arrives."""

from __future__ import annotations

import pytest
from conftest_data import write_tar, write_wds_corpus

from naflexclip.data import DataConfig, DataError, build_loader

PATCH, CONTEXT = 8, 16


def cfg_for(path: str, **kwargs) -> DataConfig:
    base = dict(train_data=path, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=64, workers=0)
    base.update(kwargs)
    return DataConfig(**base)


def keys_of(loader) -> list[str]:
    return [k.rsplit(":", 1)[-1] for b in loader for k in b["keys"]]


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_bad_kind_is_named_and_every_good_sample_arrives(tmp_path, split, caplog):
    spec, usable, skips = write_wds_corpus(tmp_path)
    loader = build_loader(cfg_for(spec, val_data=spec), split=split, patch_size=PATCH, context_length=CONTEXT)
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        got = [k for b in loader for k in b["keys"]]
    assert sorted(got) == sorted(usable)
    assert dict(loader.skip_counts) == skips
    assert "skipped 12" in caplog.text and "missing_shard=1" in loader.summary()
    by_reason = {r["reason"]: r for r in loader.skip_records}
    # a user can find each one: the shard and the sample key (or the shard alone for shard problems)
    assert by_reason["missing_shard"]["source"].endswith("shard-3.tar") and by_reason["missing_shard"]["key"] is None
    assert by_reason["truncated_shard"]["source"].endswith("shard-1.tar")
    cut = by_reason["truncated_sample"]  # the sample whose caption the truncation cut
    assert cut["source"].endswith("shard-1.tar") and cut["key"] == "t3"
    assert by_reason["corrupt_image"]["key"] == "b_truncated" and by_reason["missing_image"]["key"] == "b_noimage"
    assert by_reason["caption_not_utf8"]["source"].endswith("shard-0.tar")
    assert all(r["epoch"] == 1 for r in loader.skip_records)


def test_dotted_keys_are_samples_not_missing_images(tmp_path):
    from conftest_data import image_bytes

    members = []
    for key in ("img.v2.3", "img.v2.4", "plain"):
        members += [(f"{key}.jpg", image_bytes(16, 16, "JPEG")), (f"{key}.txt", f"caption {key}".encode())]
    members += [("plain.seg.png", image_bytes(16, 16))]  # WebDataset's multi-part extension still joins `plain`
    write_tar(str(tmp_path / "d.tar"), members)
    for spec in (str(tmp_path / "d.tar"), f"pipe:cat {tmp_path}/d.tar"):  # indexed and streamed alike
        loader = build_loader(cfg_for(spec, dataset_type="webdataset", train_num_samples=3), split="train",
                              patch_size=PATCH, context_length=CONTEXT)
        assert sorted(keys_of(loader)) == ["img.v2.3", "img.v2.4", "plain"] and not loader.skip_counts


def test_csv_and_folder_bad_rows(tmp_path):
    from conftest_data import image_bytes

    (tmp_path / "ok.png").write_bytes(image_bytes(30, 20, "PNG"))
    (tmp_path / "ok2.webp").write_bytes(image_bytes(20, 30, "WEBP"))
    (tmp_path / "fake.jpg").write_bytes(b"<html>not found</html>")
    rows = b"filepath\ttitle\nok.png\tfine\nmissing.png\tgone\nok2.webp\t\nok2.webp\tcaf\xe9\nfake.jpg\tfake\n" \
           b"ok2.webp\talso fine\n"
    (tmp_path / "data.tsv").write_bytes(rows)
    loader = build_loader(cfg_for(str(tmp_path / "data.tsv"), dataset_type="csv", workers=2), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
    assert sorted(keys_of(loader)) == ["ok.png", "ok2.webp"]
    assert dict(loader.skip_counts) == {"missing_file": 1, "empty_caption": 1, "caption_not_utf8": 1,
                                        "not_an_image": 1}
    lines = {r["reason"]: r["line"] for r in loader.skip_records}
    assert lines == {"missing_file": 3, "empty_caption": 4, "caption_not_utf8": 5, "not_an_image": 6}
    (tmp_path / "ok.txt").write_text("a caption")  # one usable sample: read as a validation split
    loader = build_loader(cfg_for(str(tmp_path), val_data=str(tmp_path)), split="val", patch_size=PATCH,
                          context_length=CONTEXT)
    assert keys_of(loader) == [str(tmp_path / "ok.png")]
    assert dict(loader.skip_counts) == {"missing_caption": 2}
    assert sorted(r["key"] for r in loader.skip_records) == [str(tmp_path / "fake.jpg"), str(tmp_path / "ok2.webp")]


@pytest.mark.parametrize("workers", [0, 2])
def test_nothing_usable_is_one_clear_error(tmp_path, workers):
    write_tar(str(tmp_path / "junk-0.tar"), [(f"k{i}.jpg", b"junk") for i in range(5)])
    write_tar(str(tmp_path / "junk-1.tar"), [(f"j{i}.png", b"") for i in range(5)])
    spec = f"{tmp_path}/junk-{{0..1}}.tar"
    with pytest.raises(DataError, match=r"junk-\{0\.\.1\}\.tar.*no usable samples.*missing_caption=5"):
        build_loader(cfg_for(spec, workers=workers), split="train", patch_size=PATCH, context_length=CONTEXT)
    write_tar(str(tmp_path / "bad-0.tar"), [m for i in range(3) for m in ((f"k{i}.jpg", b"junk"), (f"k{i}.txt", b"c"))])
    loader = build_loader(cfg_for(str(tmp_path / "bad-0.tar"), workers=workers), split="train", patch_size=PATCH,
                          context_length=CONTEXT)
    with pytest.raises(DataError, match=r"no usable samples in data source .*bad-0\.tar.*not_an_image=3"):
        list(loader)
    (tmp_path / "bad.csv").write_text("filepath\ttitle\nnope.png\tx\n")
    with pytest.raises(DataError, match="bad.csv.*missing_file=1"):
        build_loader(cfg_for(str(tmp_path / "bad.csv"), workers=workers), split="train", patch_size=PATCH,
                     context_length=CONTEXT)


def test_unreadable_shard_stream_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "empty-0.tar").write_bytes(b"")
    with pytest.raises(DataError, match="empty-0.tar.*truncated_shard=1"):
        build_loader(cfg_for(str(tmp_path / "empty-0.tar")), split="train", patch_size=PATCH, context_length=CONTEXT)
    loader = build_loader(cfg_for(f"pipe:cat {tmp_path}/empty-0.tar", dataset_type="webdataset",
                                  train_num_samples=10), split="train", patch_size=PATCH, context_length=CONTEXT)
    with pytest.raises(DataError, match="empty-0.tar"):
        list(loader)


def test_worker_exception_surfaces_as_data_error(tmp_path, monkeypatch):
    from naflexclip.data import readers

    def broken(self, index):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(readers.SyntheticSource, "load", broken)
    loader = build_loader(DataConfig(synthetic_train_size=8, workers=2), split="train", patch_size=PATCH,
                          context_length=CONTEXT)
    with pytest.raises(DataError, match="synthetic:train.*disk on fire"):
        list(loader)


def cut_inside_a_sample_start(root) -> tuple[str, list[str], str]:
    """Two shards, 27 samples; the second is cut inside the image of its last sample (`s1-06`), whose caption
    was never written: 26 usable samples, `s1-06` cut. Returns (spec, usable keys, the cut shard)."""
    from conftest_data import image_bytes, truncate_inside_last_member

    for shard, count in ((0, 20), (1, 7)):
        members = [m for j in range(count) for m in (
            (f"s{shard}-{j:02d}.png", image_bytes(16, 16 + j, seed=10 * shard + j)),
            (f"s{shard}-{j:02d}.txt", f"caption {shard} {j}".encode()))]
        write_tar(f"{root}/shard-{shard}.tar", members[:-1] if shard else members)  # s1-06: no caption
    truncate_inside_last_member(f"{root}/shard-1.tar")  # ... and its image is cut half-way
    usable = [f"s0-{j:02d}" for j in range(20)] + [f"s1-{j:02d}" for j in range(6)]
    return f"{root}/shard-{{0..1}}.tar", usable, f"{root}/shard-1.tar"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_shard_cut_inside_its_last_sample_loses_that_sample_only_and_names_it(tmp_path, workers, world_size):
    """The sample before the cut is whole (image and caption): it trains; the cut one is a named, counted skip."""
    spec, usable, cut_shard = cut_inside_a_sample_start(tmp_path)
    cfg = cfg_for(spec, workers=workers)
    trained, records = [], []
    for rank in range(world_size):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=rank,
                              world_size=world_size)
        trained += keys_of(loader)
        records += loader.skip_records
    assert sorted(trained) == usable
    assert sorted(((r["source"], r["key"], r["reason"]) for r in records), key=repr) == [
        (cut_shard, "s1-06", "truncated_sample"), (cut_shard, None, "truncated_shard")]


def test_a_streamed_shard_cut_inside_its_last_sample_loses_that_sample_only(tmp_path):
    spec, usable, cut_shard = cut_inside_a_sample_start(tmp_path)
    stream = "::".join(f"pipe:cat {tmp_path}/shard-{s}.tar" for s in range(2))
    loader = build_loader(cfg_for(stream, dataset_type="webdataset", train_num_samples=26, shuffle_buffer=0),
                          split="train", patch_size=PATCH, context_length=CONTEXT)
    assert sorted(keys_of(loader)) == usable  # one pass over the shards is the epoch: nothing repeated
    assert sorted(((r["key"], r["reason"]) for r in loader.skip_records), key=repr) == [
        ("s1-06", "truncated_sample"), (None, "truncated_shard")]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_repeated_key_trains_each_of_its_samples_and_is_named_adjacent_or_not(tmp_path, streamed):
    from conftest_data import image_bytes

    keys = [f"k{i}" for i in range(16)]
    keys.insert(6, "k5")  # k5.jpg k5.txt k5.jpg k5.txt: adjacent
    keys.append("k2")  # and k2 again at the end of the shard
    members = []
    for i, key in enumerate(keys):
        members += [(f"{key}.jpg", image_bytes(16, 16, "JPEG", seed=i)), (f"{key}.txt", f"caption {i}".encode())]
    write_tar(str(tmp_path / "d.tar"), members)
    spec = f"pipe:cat {tmp_path}/d.tar" if streamed else str(tmp_path / "d.tar")
    loader = build_loader(cfg_for(spec, dataset_type="webdataset", train_num_samples=len(keys) if streamed else None),
                          split="train", patch_size=PATCH, context_length=CONTEXT)
    got = keys_of(loader)
    assert len(keys) == 18 and sorted(got) == sorted(keys)  # every pair trains, both copies of k5 and of k2
    named = sorted(r["key"] for r in loader.skip_records if r["reason"] == "duplicate_key")
    assert named == ["k2", "k5"] and dict(loader.skip_counts) == {"duplicate_key": 2}
    # a note, not a skip: nothing was lost
    assert "no samples skipped" in loader.summary() and "noted: duplicate_key=2" in loader.summary()


def test_a_one_patch_wide_image_makes_no_numpy_warning(tmp_path):
    from conftest_data import image_bytes

    members = [("tall.png", image_bytes(2, 4000, "PNG")), ("tall.txt", b"a very tall image"),
               ("thin.png", image_bytes(1, 4000, "PNG")), ("thin.txt", b"one pixel wide")]
    write_tar(str(tmp_path / "w.tar"), members)
    loader = build_loader(cfg_for(str(tmp_path / "w.tar")), split="train", patch_size=PATCH, context_length=CONTEXT)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "The given NumPy array is not writable" fails the test
        assert keys_of(loader) == ["tall"]
    assert dict(loader.skip_counts) == {"degenerate_image": 1}


def test_a_skipped_sample_crosses_to_a_loader_worker_whole() -> None:
    """A chunk fetched by the main process that failed hands its samples' skips to the workers in their tasks."""
    import pickle

    from naflexclip.data.samples import SkipSample

    sent = SkipSample("unreachable_shard", "s3://b/x.tar: OSError", [{"reason": "read_retry"}])
    skip = pickle.loads(pickle.dumps(sent))
    assert (skip.reason, str(skip), skip.notes) == ("unreachable_shard", "unreachable_shard: s3://b/x.tar: OSError",
                                                    [{"reason": "read_retry"}])

"""Bad samples never stop a run: each kind is skipped and counted exactly, every good sample still arrives."""

from __future__ import annotations

import pytest
from conftest_data import bomb_png, image_bytes, truncate_inside_last_member, write_tar

from naflexclip.data import DataConfig, DataError, build_loader

PATCH, CONTEXT = 8, 16


def cfg_for(path: str, **kwargs) -> DataConfig:
    base = dict(train_data=path, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=64, workers=0)
    base.update(kwargs)
    return DataConfig(**base)


def keys_of(loader) -> list[str]:
    return [k.rsplit(":", 1)[-1] for b in loader for k in b["keys"]]


def bad_corpus(tmp_path) -> tuple[str, list[str], dict[str, int], int]:
    """Two shards: one with every bad kind among good samples, one truncated inside its last sample."""
    jpg = image_bytes(40, 30, "JPEG")
    good: list[tuple[str, str, bytes]] = [
        ("good_rgb", "jpg", jpg), ("good_palette", "png", image_bytes(30, 50, "PNG", "P")),
        ("good_cmyk", "jpg", image_bytes(33, 21, "JPEG", "CMYK")),
        ("good_grey", "png", image_bytes(24, 24, "PNG", "L")),
        ("good_16bit", "png", image_bytes(20, 40, "PNG", "I;16")),
        ("good_alpha", "webp", image_bytes(50, 20, "WEBP", "RGBA")),
    ]
    members: list[tuple[str, bytes]] = []
    for key, ext, data in good:
        members += [(f"{key}.{ext}", data), (f"{key}.txt", f"caption of {key}".encode())]
    bad = [
        [("bad_truncated.jpg", jpg[: len(jpg) // 2]), ("bad_truncated.txt", b"cut")],
        [("bad_text.jpg", b"this is not an image at all"), ("bad_text.txt", b"text file")],
        [("bad_zero.png", b""), ("bad_zero.txt", b"zero bytes")],
        [("bad_thin.png", image_bytes(1, 40, "PNG")), ("bad_thin.txt", b"one pixel wide")],
        [("bad_bomb.png", bomb_png()), ("bad_bomb.txt", b"bomb")],
        [("bad_nocap.jpg", jpg)],
        [("bad_emptycap.jpg", jpg), ("bad_emptycap.txt", b"  \n")],
        [("bad_latin1.jpg", jpg), ("bad_latin1.txt", "caf\xe9".encode("latin-1"))],
        [("bad_noimage.txt", b"caption without an image")],
    ]
    # interleave bad samples between good ones
    mixed: list[tuple[str, bytes]] = []
    for i in range(max(len(good), len(bad))):
        mixed += members[2 * i: 2 * i + 2] if i < len(good) else []
        mixed += bad[i] if i < len(bad) else []
    write_tar(str(tmp_path / "shard-0.tar"), mixed)
    tail = []
    for j in range(4):
        tail += [(f"tail{j}.png", image_bytes(16, 24, "PNG", seed=j)), (f"tail{j}.txt", b"tail sample")]
    write_tar(str(tmp_path / "shard-1.tar"), tail)
    truncate_inside_last_member(str(tmp_path / "shard-1.tar"))  # tail3's caption is cut: tail0..2 survive
    expected_good = [k for k, _, _ in good] + ["tail0", "tail1", "tail2"]
    expected_skips = {"corrupt_image": 1, "not_an_image": 1, "empty_image": 1, "degenerate_image": 1,
                      "decompression_bomb": 1, "missing_caption": 1, "empty_caption": 1, "caption_not_utf8": 1,
                      "missing_image": 1, "truncated_shard": 1}
    raw_count = len(good) + len(bad) + 3
    return f"{tmp_path}/shard-{{0..1}}.tar", expected_good, expected_skips, raw_count


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_bad_kind_is_counted_and_every_good_sample_arrives(tmp_path, split, caplog):
    spec, expected_good, expected_skips, raw_count = bad_corpus(tmp_path)
    cfg = cfg_for(spec, val_data=spec, train_num_samples=raw_count, val_num_samples=raw_count)
    loader = build_loader(cfg, split=split, patch_size=PATCH, context_length=CONTEXT)
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        got = keys_of(loader)
    assert sorted(got) == sorted(expected_good)
    assert dict(loader.skip_counts) == expected_skips
    assert "skipped 10 bad samples" in caplog.text and "truncated_shard=1" in loader.summary()


def test_bad_samples_counted_across_workers(tmp_path):
    spec, expected_good, expected_skips, raw_count = bad_corpus(tmp_path)
    # two shards, two workers: each worker reads one shard, cycling it to fill its planned batches
    loader = build_loader(cfg_for(spec, workers=2, train_num_samples=raw_count), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
    got = keys_of(loader)
    assert set(got) <= set(expected_good) and loader.skip_counts["truncated_shard"] == 1
    assert sum(loader.skip_counts.values()) + len(got) >= raw_count


def test_csv_and_folder_bad_rows(tmp_path):
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
    (tmp_path / "ok.txt").write_text("a caption")
    loader = build_loader(cfg_for(str(tmp_path)), split="train", patch_size=PATCH, context_length=CONTEXT)
    assert keys_of(loader) == [str(tmp_path / "ok.png")]
    assert dict(loader.skip_counts) == {"not_an_image": 1, "missing_caption": 1}


@pytest.mark.parametrize("workers", [0, 2])
def test_nothing_usable_is_one_clear_error(tmp_path, workers):
    write_tar(str(tmp_path / "junk-0.tar"), [(f"k{i}.jpg", b"junk") for i in range(5)])
    write_tar(str(tmp_path / "junk-1.tar"), [(f"j{i}.png", b"") for i in range(5)])
    spec = f"{tmp_path}/junk-{{0..1}}.tar"
    loader = build_loader(cfg_for(spec, workers=workers), split="train", patch_size=PATCH, context_length=CONTEXT)
    with pytest.raises(DataError, match=r"no usable samples in data source .*junk-\{0\.\.1\}\.tar"):
        list(loader)
    (tmp_path / "bad.csv").write_text("filepath\ttitle\nnope.png\tx\n")
    loader = build_loader(cfg_for(str(tmp_path / "bad.csv"), workers=workers), split="train", patch_size=PATCH,
                          context_length=CONTEXT)
    with pytest.raises(DataError, match="bad.csv.*missing_file=1"):
        list(loader)


def test_unreadable_shard_stream_is_an_error_not_a_hang(tmp_path):
    (tmp_path / "empty-0.tar").write_bytes(b"")
    loader = build_loader(cfg_for(str(tmp_path / "empty-0.tar"), train_num_samples=10), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
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

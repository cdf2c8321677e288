"""Real formats: export -> read -> batches round trips (WebDataset, CSV, folder), and PIL image kinds."""

from __future__ import annotations

import os

import pytest
import torch
from conftest_data import image_bytes, write_tar

from naflexclip.cli import main as cli_main
from naflexclip.data import DataConfig, DataError, build_loader
from naflexclip.data.dataset_export import export_synthetic, shard_spec
from naflexclip.data.synthetic import synthetic_sample
from naflexclip.processing.naflex_transform import tokenize

PATCH, CONTEXT = 8, 24


def cfg_for(path: str, **kwargs) -> DataConfig:
    base = dict(train_data=path, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=128, workers=0)
    base.update(kwargs)
    return DataConfig(**base)


def captions_by_key(loader) -> dict[str, torch.Tensor]:
    out = {}
    for b in loader:
        for key, tokens in zip(b["keys"], b["text"], strict=True):
            assert key not in out
            out[key] = tokens
    return out


@pytest.mark.parametrize(("fmt", "image_format"), [("webdataset", "jpg"), ("csv", "png"), ("folder", "webp")])
def test_export_read_round_trip(tmp_path, fmt, image_format):
    paths = export_synthetic(str(tmp_path), fmt=fmt, count=14, start=5, shard_size=4, image_format=image_format)
    spec = shard_spec(paths) if fmt == "webdataset" else paths[0]
    if fmt == "webdataset":
        assert spec.endswith("train-{00000..00003}.tar") and len(paths) == 4
    loader = build_loader(cfg_for(spec, workers=2), split="train", patch_size=PATCH, context_length=CONTEXT)
    assert loader.num_samples == 14
    got = captions_by_key(loader)
    assert len(got) == 14 and not loader.skip_counts
    for i in range(5, 19):
        key = next(k for k in got if f"train{i:08d}" in k)
        caption = synthetic_sample(0, "train", i)[1]
        assert torch.equal(got[key], tokenize([caption], CONTEXT)[0])


def test_cli_export_writes_shards(tmp_path, capsys):
    out = tmp_path / "shards"
    assert cli_main(["data", "export", "--out", str(out), "--count", "6", "--shard-size", "3",
                     "--split", "val", "--image-format", "png"]) == 0
    assert sorted(os.listdir(out)) == ["sizes.json", "val-00000.tar", "val-00001.tar"]
    printed = capsys.readouterr().out  # a validation split is read back as --val-data
    assert f"--val-data '{out}/val-{{00000..00001}}.tar'" in printed and "--train-data" not in printed
    assert cli_main(["data", "export", "--out", str(tmp_path / "t"), "--count", "2"]) == 0
    assert "--train-data" in capsys.readouterr().out


def test_local_shards_are_indexed_and_split_by_sample(tmp_path):
    paths = export_synthetic(str(tmp_path), count=24, shard_size=3)  # 8 shards
    spec = shard_spec(paths)
    for workers, world_size in ((0, 2), (2, 2), (3, 3)):
        seen = []
        for rank in range(world_size):
            loader = build_loader(cfg_for(spec, workers=workers), split="train", patch_size=PATCH,
                                  context_length=CONTEXT, rank=rank, world_size=world_size)
            assert loader.indexed
            seen += [k for b in loader for k in b["keys"]]
        assert len(seen) == 24 and len(set(seen)) == 24
    assert all(os.path.isfile(p + ".naflexclip-index.json") for p in paths)  # cached beside each shard


def test_streamed_shards_split_by_rank_and_worker_slot(tmp_path):
    """`pipe:` shards cannot be indexed: each (rank, worker) slot streams only its own shards."""
    paths = export_synthetic(str(tmp_path), count=24, shard_size=3)
    spec = "::".join(f"pipe:cat {p}" for p in paths)
    shards_of_slot: dict[tuple[int, int], set[str]] = {}
    for rank in range(2):
        loader = build_loader(cfg_for(spec, workers=2, dataset_type="webdataset", train_num_samples=24),
                              split="train", patch_size=PATCH, context_length=CONTEXT, rank=rank, world_size=2)
        assert not loader.indexed
        for b in loader:
            slot = (rank, b["batch_index"] % 2)
            shards_of_slot.setdefault(slot, set()).update(k.rsplit(":", 1)[0] for k in b["keys"])
    assert len(shards_of_slot) == 4 and all(len(s) <= 2 for s in shards_of_slot.values())
    all_shards = [s for shards in shards_of_slot.values() for s in shards]
    assert len(all_shards) == len(set(all_shards))


@pytest.mark.parametrize("streamed", [False, True])
def test_webdataset_resume_is_exact(tmp_path, streamed):
    paths = export_synthetic(str(tmp_path), count=30, shard_size=5)
    spec = "::".join(f"pipe:cat {p}" for p in paths) if streamed else shard_spec(paths)
    cfg = cfg_for(spec, workers=2, shuffle_buffer=8, dataset_type="webdataset", train_num_samples=30)
    full = [b["keys"] for b in build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)]
    assert len(full) == 4
    for start in (1, 2, 3, 4):
        resumed = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, start_batch=start)
        assert [b["keys"] for b in resumed] == full[start:]


def test_image_modes_and_formats_are_converted(tmp_path):
    """JPEG/PNG/WebP in RGB, greyscale, palette, CMYK, 16-bit, alpha: all decode to RGB, none skipped."""
    kinds = [("jpg", "JPEG", "RGB"), ("jpg", "JPEG", "L"), ("jpg", "JPEG", "CMYK"), ("png", "PNG", "P"),
             ("png", "PNG", "RGBA"), ("png", "PNG", "LA"), ("png", "PNG", "I;16"), ("webp", "WEBP", "RGB"),
             ("webp", "WEBP", "RGBA"), ("png", "PNG", "1")]
    rows = ["filepath\ttitle"]
    for i, (ext, fmt, mode) in enumerate(kinds):
        name = f"img{i}.{ext}"
        (tmp_path / name).write_bytes(image_bytes(20 + 7 * i, 60 - 3 * i, fmt, mode, seed=i))
        rows.append(f"{name}\tan image in mode {mode}")
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    loader = build_loader(cfg_for(str(tmp_path / "data.csv")), split="train", patch_size=PATCH,
                          context_length=CONTEXT)
    got = [k for b in loader for k in b["keys"]]
    assert sorted(got) == sorted(f"img{i}.{kinds[i][0]}" for i in range(len(kinds)))
    assert not loader.skip_counts


def test_brace_expansion_and_multiple_sources(tmp_path):
    for shard in range(3):
        write_tar(str(tmp_path / f"s{shard}.tar"),
                  [m for j in range(2) for m in ((f"k{shard}{j}.png", image_bytes(16, 16)),
                                                  (f"k{shard}{j}.txt", b"caption"))])
    spec = f"{tmp_path}/s{{0..1}}.tar::{tmp_path}/s2.tar"
    loader = build_loader(cfg_for(spec), split="train", patch_size=PATCH, context_length=CONTEXT)
    assert loader.num_samples == 6
    assert len({k for b in loader for k in b["keys"]}) == 6


def test_missing_sources_fail_with_one_clear_error(tmp_path):
    for spec in (f"{tmp_path}/nope-{{000..003}}.tar", f"{tmp_path}/nope.csv", f"{tmp_path}/nodir"):
        with pytest.raises(DataError, match="nope|nodir"):
            build_loader(cfg_for(spec), split="train", patch_size=PATCH, context_length=CONTEXT)
    (tmp_path / "t.csv").write_text("path\tcaption\nx.png\thi\n")
    with pytest.raises(DataError, match="--csv-img-key 'filepath'"):
        build_loader(cfg_for(str(tmp_path / "t.csv")), split="train", patch_size=PATCH, context_length=CONTEXT)
    with pytest.raises(ValueError, match="--val-data"):
        build_loader(cfg_for(str(tmp_path / "t.csv")), split="val", patch_size=PATCH, context_length=CONTEXT)


def test_missing_shards_name_the_flag_of_their_split(tmp_path):
    """Shards that do not exist are named with the flag that gave them, not "--train-data/--val-data"."""
    spec = f"{tmp_path}/nope-{{0..1}}.tar"
    for split, flag in (("train", "--train-data"), ("val", "--val-data")):
        cfg = DataConfig(train_data=spec, val_data=spec, naflex_seq_lens=(16, 32), workers=0)
        with pytest.raises(DataError) as raised:
            build_loader(cfg, split=split, patch_size=PATCH, context_length=CONTEXT)
        assert f"{flag} {spec!r}" in str(raised.value) and "/--" not in str(raised.value), raised.value


def test_csv_settings_where_no_split_reads_a_csv_are_said_to_change_nothing():
    """--csv-img-key, --csv-caption-key and --csv-separator other than their defaults with no CSV to read changed
    nothing without a word; one line each now says so. A CSV in either split takes them; defaults say nothing."""
    shards = "s/{0..1}.tar"
    assert DataConfig(train_data=shards, csv_img_key="path", csv_separator=",").unused_settings() == [
        "--csv-img-key path: changes nothing, neither --train-data nor --val-data is a CSV",
        "--csv-separator ,: changes nothing, neither --train-data nor --val-data is a CSV"]
    assert DataConfig(train_data=shards, val_data="v.csv", csv_img_key="path").unused_settings() == []
    assert DataConfig(train_data=shards).unused_settings() == []


def test_val_num_samples_without_validation_data_is_said_to_change_nothing():
    """--val-num-samples sizes the validation split; with --train-data and no --val-data there is none."""
    assert DataConfig(train_data="s/{0..1}.tar", val_num_samples=100).unused_settings() == [
        "--val-num-samples 100: changes nothing without --val-data"]
    assert DataConfig(train_data="s/{0..1}.tar", val_data="v.csv", val_num_samples=100).unused_settings() == []
    assert DataConfig(val_num_samples=100).unused_settings() == []  # the built-in dataset's validation split


def test_dataset_type_csv_reads_webdataset_validation_shards_as_shards(tmp_path):
    """`--dataset-type csv` for a CSV --train-data with WebDataset --val-data: the shards' type is inferred from
    their names (as `--dataset-type parquet` does for shards beside Parquet), not read as a table; a tar archive
    named as a table is said to be no CSV, in one short line, not a line of its header's bytes."""
    table = export_synthetic(str(tmp_path / "csv"), fmt="csv", count=8, image_format="png")[0]
    shards = export_synthetic(str(tmp_path / "wds"), count=6, shard_size=3, split="val", image_format="png")
    for val_data in (shards[0], shard_spec(shards)):
        cfg = cfg_for(table, val_data=val_data, dataset_type="csv")
        assert cfg.source("val") == ("webdataset", val_data)
        val = build_loader(cfg, split="val", patch_size=PATCH, context_length=CONTEXT)
        assert val.num_samples == (3 if val_data == shards[0] else 6)
    named_as_table = tmp_path / "val.csv"
    named_as_table.write_bytes(open(shards[0], "rb").read())
    with pytest.raises(DataError) as error:
        build_loader(cfg_for(table, val_data=str(named_as_table), dataset_type="csv"), split="val",
                     patch_size=PATCH, context_length=CONTEXT)
    message = str(error.value)
    assert f"{named_as_table} is not a CSV/TSV table" in message and "tar archive" in message, message
    assert len(message) < 300 and "\\x00" not in message and "\x00" not in message, message

"""Parquet files (`--dataset-type parquet`): the Hub's layout, read by row group, every row once per epoch for any
workers and ranks, resumable; several captions per row; `::` mixtures with WebDataset shards; `data export`."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from conftest_data import image_bytes  # noqa: E402

from naflexclip.cli import main  # noqa: E402
from naflexclip.data import DataConfig, DataError, build_loader  # noqa: E402
from naflexclip.data.dataset_export import export_synthetic, shard_spec  # noqa: E402

PATCH, CONTEXT = 8, 16


def write_table(path: Path, rows: int, start: int = 0, *, struct: bool = True, captions: int = 1,
                row_group_size: int = 4) -> None:
    """`rows` images in the Hub's layout (an image struct {bytes, path}, or plain binary), captions a string or a
    list of `captions` strings, in row groups of `row_group_size`."""
    images = [image_bytes(12 + i % 5, 10, "PNG", seed=start + i) for i in range(rows)]
    image = pa.array([{"bytes": b, "path": f"{start + i}.png"} for i, b in enumerate(images)]) if struct \
        else pa.array(images, pa.binary())
    text = [f"picture {start + i}" if captions == 1 else [f"picture {start + i} take {c}" for c in range(captions)]
            for i in range(rows)]
    pq.write_table(pa.table({"image": image, "text": text}), path, row_group_size=row_group_size)


def config(spec: str, **overrides) -> DataConfig:
    values = dict(train_data=spec, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=128, workers=0, seed=3)
    values.update(overrides)
    return DataConfig(**values)


def epoch(cfg: DataConfig, world_size: int = 1, epoch: int = 0) -> tuple[list[str], Counter]:
    keys: list[str] = []
    skips: Counter = Counter()
    for rank in range(world_size):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=rank,
                              world_size=world_size, epoch=epoch)
        keys += [key for batch in loader for key in batch["keys"]]
        skips.update(loader.skip_counts)
    return keys, skips


@pytest.fixture
def tables(tmp_path: Path) -> str:
    """Three files of 10, 7 and 13 rows in row groups of 4 (struct images in two, plain binary in one)."""
    for n, (rows, start, struct) in enumerate(((10, 0, True), (7, 10, False), (13, 17, True))):
        write_table(tmp_path / f"part-{n}.parquet", rows, start, struct=struct)
    return str(tmp_path / "part-{0..2}.parquet")


def test_every_row_once_per_epoch_for_any_workers_and_ranks(tables: str) -> None:
    rows = {f"part-{f}.parquet:row{r}" for f, n in enumerate((10, 7, 13)) for r in range(n)}
    orders = []
    for workers, world_size in ((0, 1), (2, 1), (0, 3)):
        keys, skips = epoch(config(tables, workers=workers), world_size)
        assert Counter(k.rpartition("/")[2] for k in keys) == Counter(rows) and not skips
        orders.append(keys)
    assert orders[0] == orders[1]  # the workers build the same order
    again, _ = epoch(config(tables), epoch=1)
    assert again != orders[0] and sorted(again) == sorted(orders[0])  # a new order each epoch


def test_a_parquet_epoch_resumed_mid_way_continues_exactly(tables: str) -> None:
    whole = [batch["keys"] for batch in build_loader(config(tables), split="train", patch_size=PATCH,
                                                      context_length=CONTEXT)]
    first = build_loader(config(tables), split="train", patch_size=PATCH, context_length=CONTEXT)
    head = []
    for batch in first:
        head.append(batch["keys"])
        if len(head) == 2:
            break
    state = first.state_dict()
    resumed = build_loader(config(tables, workers=2), split="train", patch_size=PATCH, context_length=CONTEXT)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"], state["position"])
    assert head + [batch["keys"] for batch in resumed] == whole


def test_a_list_of_captions_is_several_positives_with_multi_positive(tmp_path: Path) -> None:
    write_table(tmp_path / "multi.parquet", 12, captions=3)
    loader = build_loader(config(str(tmp_path / "multi.parquet"), multi_caption=True), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
    batches = list(loader)
    assert sum(b["text"].shape[0] for b in batches) == 3 * sum(len(b["keys"]) for b in batches) == 36
    one = build_loader(config(str(tmp_path / "multi.parquet")), split="train", patch_size=PATCH,
                       context_length=CONTEXT)
    assert sum(b["text"].shape[0] for b in one) == 12  # without the flag: one caption per image per epoch


def test_a_mixture_of_shards_and_parquet_plans_each_sources_exact_share(tmp_path: Path, tables: str) -> None:
    shards = export_synthetic(str(tmp_path / "wds"), count=20, shard_size=5, image_format="png")
    spec = f"{shard_spec(shards)}::{tables}"
    keys, skips = epoch(config(spec, train_data_upsampling_factors="1::2"))
    parquet = Counter(k for k in keys if ".parquet:" in k)
    assert len(keys) - sum(parquet.values()) == 20 and len({k for k in keys if ".tar:" in k}) == 20
    assert len(parquet) == 30 and set(parquet.values()) == {2} and not skips  # every row exactly twice


def test_a_column_that_is_not_there_is_one_line_naming_the_flag(tables: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(DataError, match="--image-key 'picture'"):
        build_loader(config(tables, image_key="picture"), split="train", patch_size=PATCH, context_length=CONTEXT)
    code = main(["train", "--model", "tiny", "--device", "cpu", "--workers", "0", "--logs", str(tmp_path),
                 "--train-data", tables, "--text-key", "title"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert "--text-key 'title'" in err[-1] and "its columns: image, text" in err[-1]


def test_data_export_parquet_writes_the_hub_layout_that_trains(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["data", "export", "--out", str(tmp_path), "--format", "parquet", "--count", "30",
                 "--shard-size", "12", "--image-format", "png"]) == 0
    spec = str(tmp_path / "train-{00000..00002}.parquet")
    assert capsys.readouterr().out.strip().endswith(f"use --train-data '{spec}' --dataset-type parquet")
    table = pq.read_table(tmp_path / "train-00000.parquet")
    assert table.column_names == ["image", "caption"] and table.num_rows == 12
    assert set(table.schema.field("image").type.names) == {"bytes", "path"}
    assert b'"_type": "Image"' in table.schema.metadata[b"huggingface"]  # what the `datasets` library reads
    keys, skips = epoch(config(spec))
    assert len(set(keys)) == len(keys) == 30 and not skips


def test_a_parquet_file_that_cannot_be_read_is_one_line_naming_it(tables: str, tmp_path: Path) -> None:
    (tmp_path / "part-1.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"cannot read .*part-1\.parquet"):
        build_loader(config(tables), split="train", patch_size=PATCH, context_length=CONTEXT)


@pytest.mark.parametrize(("column", "values", "named"), [
    ("text", lambda rows: pa.array(list(range(rows))), "column 'text' (--text-key) is int64; expected a string"),
    ("image", lambda rows: pa.array(list(range(rows))), "column 'image' (--image-key) is int64; expected binary"),
    ("image", lambda rows: pa.array([str(i) for i in range(rows)]),
     "column 'image' (--image-key) is string; expected binary"),
])
def test_a_column_of_the_wrong_type_is_one_line_naming_it_its_type_and_the_type_expected(
        tmp_path: Path, capsys: pytest.CaptureFixture, column: str, values, named: str) -> None:
    """Before: a TypeError or AttributeError mid-epoch (`object of type 'int' has no len()`) naming no column, or
    every row skipped as a corrupt image. Now the file's schema is checked when it is opened."""
    path = tmp_path / "bad.parquet"
    write_table(path, 8)
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index(column), column, values(8)), path)
    with pytest.raises(DataError, match=rf"{path}: {re.escape(named)}"):
        build_loader(config(str(path)), split="train", patch_size=PATCH, context_length=CONTEXT)
    code = main(["train", "--model", "tiny", "--device", "cpu", "--workers", "0", "--logs", str(tmp_path / "logs"),
                 "--train-data", str(path), "--naflex-batch-divisor", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err) and named in err[-1], err


def test_each_row_group_is_read_once_per_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 row groups of 4 rows: an epoch reads each once (a row group is the large request Parquet is read by),
    alone and in a mixture with shards; it is not re-read for each row the order takes from it."""
    from naflexclip.data import parquet_source

    for n in range(4):
        write_table(tmp_path / f"big-{n}.parquet", 40, 40 * n)
    export_synthetic(str(tmp_path / "shards"), count=40, shard_size=10, image_format="png")
    reads: Counter = Counter()
    read = parquet_source.ParquetSource._table

    def counted(self, g):  # noqa: ANN001, ANN202
        reads[g] += g not in self._tables or self._pid != parquet_source.os.getpid()
        return read(self, g)

    monkeypatch.setattr(parquet_source.ParquetSource, "_table", counted)
    tables = str(tmp_path / "big-{0..3}.parquet")
    for spec in (tables, f"{tmp_path / 'shards' / 'train-{00000..00003}.tar'}::{tables}"):
        reads.clear()
        keys, _ = epoch(config(spec))
        assert len(keys) == 160 + 40 * ("::" in spec)
        assert sorted(reads.values()) == [1] * 40, spec

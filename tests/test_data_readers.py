"""Readers that don't guess: table quoting and headers, separator hints, folders with links, 16-bit images,
and the shard index cache."""

from __future__ import annotations

import os
import shlex

import numpy as np
import pytest
import torch
from conftest_data import image_bytes, write_csv_corpus, write_tar
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from naflexclip.cli import main as cli_main
from naflexclip.data import DataConfig, DataError, build_loader
from naflexclip.data.samples import to_rgb
from naflexclip.data.tables import CsvSource, split_row
from naflexclip.processing.naflex_transform import tokenize

PATCH, CONTEXT = 8, 24


def captions(loader) -> dict[str, torch.Tensor]:
    return {k: t for b in loader for k, t in zip(b["keys"], b["text"], strict=True)}


@pytest.mark.parametrize(("line", "fields"), [
    ("a\tb", ["a", "b"]),
    ('a\t"The Best" of summer', ["a", '"The Best" of summer']),  # quotes inside text are text
    ('a\t"unbalanced start', ["a", '"unbalanced start']),
    ('a\t"a ""quoted"" word"', ["a", 'a "quoted" word']),  # RFC 4180
    ('"x\ty"\tz', ["x\ty", "z"]),  # a wholly quoted field may hold the separator
    ("a\t", ["a", ""]),
    ("a\t\tb", ["a", "", "b"]),
])
def test_split_row(line, fields):
    assert split_row(line, "\t") == fields


@given(st.lists(st.text(alphabet='ab" ,\t', max_size=6), min_size=1, max_size=4))
def test_split_row_reads_back_what_quoting_wrote(fields):
    line = ",".join('"' + f.replace('"', '""') + '"' for f in fields)
    assert split_row(line, ",") == fields


def test_quotes_never_eat_rows_and_the_bom_is_ignored(tmp_path):
    spec, usable, skips = write_csv_corpus(tmp_path)
    source = CsvSource(spec, "filepath", "title", "\t")
    assert source.keys == ["ok0.png", "ok1.png", "ok2.png", "ok3.png", "ok4.png", "fake.jpg", "cut.jpg", "ok6.png",
                           "dark16.png", "ok7.png", "ok8.png"]
    assert {(r["reason"], r["line"]) for r in source.index_skips} == {("missing_file", 7), ("malformed_row", 8)}
    loader = build_loader(DataConfig(train_data=spec, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64,
                                     workers=0), split="train", patch_size=PATCH, context_length=CONTEXT)
    got = captions(loader)
    assert sorted(got) == sorted(usable) and dict(loader.skip_counts) == skips
    for key, caption in (("ok1.png", '"The Best" of summer'), ("ok2.png", '"unbalanced start of a caption'),
                         ("ok4.png", 'a "quoted" word'), ("ok3.png", "a caption")):
        assert torch.equal(got[key], tokenize([caption], CONTEXT)[0]), key


def test_a_csv_read_with_the_tab_default_says_which_separator_to_pass(tmp_path):
    (tmp_path / "x.png").write_bytes(image_bytes(16, 16))
    (tmp_path / "y.png").write_bytes(image_bytes(16, 16))
    (tmp_path / "data.csv").write_text("filepath,title\nx.png,a caption\nx.png,another caption\ny.png,a third\n")
    with pytest.raises(DataError, match=r"splits on ',': pass --csv-separator ,"):
        build_loader(DataConfig(train_data=str(tmp_path / "data.csv")), split="train", patch_size=PATCH,
                     context_length=CONTEXT)
    (tmp_path / "other.csv").write_text("path,caption\nx.png,a caption\n")
    with pytest.raises(DataError, match=r"--csv-img-key 'filepath'.*pass --csv-separator , for a \.csv"):
        build_loader(DataConfig(train_data=str(tmp_path / "other.csv")), split="train", patch_size=PATCH,
                     context_length=CONTEXT)
    loader = build_loader(DataConfig(train_data=str(tmp_path / "data.csv"), csv_separator=",", workers=0),
                          split="train", patch_size=PATCH, context_length=CONTEXT)
    assert sorted(k for b in loader for k in b["keys"]) == ["x.png", "y.png"]  # x.png's two rows: one sample


def test_export_hint_round_trips_the_separator(tmp_path, capsys):
    out = tmp_path / "exported"
    assert cli_main(["data", "export", "--out", str(out), "--format", "csv", "--count", "3",
                     "--csv-separator", ","]) == 0
    hint = capsys.readouterr().out.split("use ", 1)[1].split()
    assert hint[hint.index("--csv-separator") + 1] == ","
    train_data = shlex.split(" ".join(hint))[1]
    cfg = DataConfig(train_data=train_data, csv_separator=",", naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64,
                     workers=0)
    assert len([k for b in build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
                for k in b["keys"]]) == 3


def test_folders_follow_links_once_and_keep_same_stem_images(tmp_path):
    from conftest_data import write_folder_corpus

    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    spec, usable, skips = write_folder_corpus(tmp_path / "root", tmp_path / "outside")
    loader = build_loader(DataConfig(train_data=spec, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64,
                                     workers=0), split="train", patch_size=PATCH, context_length=CONTEXT)
    keys = [k for b in loader for k in b["keys"]]
    assert sorted(keys) == sorted(usable)  # dup.jpg and dup.png both, link/ followed, sub/loop not looped
    assert dict(loader.skip_counts) == skips


def test_16_bit_images_are_scaled_by_bit_depth_not_content():
    dark = Image.fromarray(np.full((4, 4), 200, dtype=np.uint16))  # a dark 16-bit image: 200 of 65535
    assert dark.mode == "I;16"
    assert np.asarray(to_rgb(dark)).max() == 1  # 200 / 257, not 200 (the content-based rule made it 257x brighter)
    bright = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    assert np.asarray(to_rgb(bright)).min() == 255
    mid = Image.fromarray(np.full((4, 4), 257 * 100, dtype=np.int32))  # mode "I" holding 16-bit values
    assert np.asarray(to_rgb(mid)).max() == 100


def test_shard_index_is_cached_and_rebuilt_when_the_shard_changes(tmp_path, monkeypatch):
    from naflexclip.data import shard_index

    shard = str(tmp_path / "s.tar")
    write_tar(shard, [("a.png", image_bytes(16, 16)), ("a.txt", b"a")])
    scans = []
    real_scan = shard_index.scan_shard
    monkeypatch.setattr(shard_index, "scan_shard", lambda url, *keys: scans.append(url) or real_scan(url, *keys))
    cfg = DataConfig(val_data=shard, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64, workers=0)

    def keys() -> list[str]:  # (one sample: read as a validation split)
        return [k.rsplit(":", 1)[-1] for b in build_loader(cfg, split="val", patch_size=PATCH,
                                                           context_length=CONTEXT) for k in b["keys"]]

    assert keys() == ["a"] and len(scans) == 1
    assert keys() == ["a"] and len(scans) == 1  # the cached index is used
    write_tar(shard, [("a.png", image_bytes(16, 16)), ("a.txt", b"a"), ("b.png", image_bytes(16, 16)),
                      ("b.txt", b"b")])
    os.utime(shard, ns=(1, 1))  # even a shard rewritten within the mtime's resolution has a new size
    assert sorted(keys()) == ["a", "b"] and len(scans) == 2
    # a read-only data folder: the index goes to --shard-index-dir instead, copied from the one beside the shard
    cfg.shard_index_dir = str(tmp_path / "cache")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert sorted(keys()) == ["a", "b"] and len(scans) == 2 and len(os.listdir(tmp_path / "cache")) == 1
    os.remove(shard + shard_index.INDEX_SUFFIX)
    assert sorted(keys()) == ["a", "b"] and len(scans) == 2  # read from --shard-index-dir

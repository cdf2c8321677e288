"""An epoch is every usable sample exactly once, for any workers and ranks, with every skip named the same way.

Ranks are simulated by building one loader per (rank, world_size) in this process: the data layer
knows nothing else about ranks. The real two-process run is in test_data_torchrun.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest_data import write_csv_corpus, write_folder_corpus, write_wds_corpus

from naflexclip.data import DataConfig, DataError, NaFlexLoader, build_loader

PATCH, CONTEXT = 8, 16


def corpus(kind: str, tmp_path) -> tuple[DataConfig, list[str], dict[str, int]]:
    if kind == "webdataset":
        spec, usable, skips = write_wds_corpus(tmp_path)
    elif kind == "csv":
        spec, usable, skips = write_csv_corpus(tmp_path)
    else:
        (tmp_path / "root").mkdir()
        (tmp_path / "outside").mkdir()
        spec, usable, skips = write_folder_corpus(tmp_path / "root", tmp_path / "outside")
    cfg = DataConfig(train_data=spec, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=64, workers=0, seed=3)
    return cfg, usable, skips


def run_epoch(cfg: DataConfig, world_size: int, epoch: int = 0) -> tuple[Counter, list[tuple], Counter]:
    """(keys trained by all ranks, skip log, skip counts) of one epoch; checks equal, non-empty microbatches."""
    keys: Counter = Counter()
    records: list[tuple] = []
    counts: Counter = Counter()
    num_batches = set()
    for rank in range(world_size):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=epoch,
                              rank=rank, world_size=world_size)
        batches = list(loader)
        assert len(batches) == len(loader) and all(b["text"].shape[0] >= 1 for b in batches)
        assert [b["batch_index"] for b in batches] == list(range(len(loader)))
        num_batches.add(len(batches))
        keys.update(k for b in batches for k in b["keys"])
        records += [tuple(sorted(r.items())) for r in loader.skip_records]
        counts.update(loader.skip_counts)
    assert len(num_batches) == 1, f"ranks ran different numbers of microbatches: {num_batches}"
    return keys, sorted(records, key=repr), counts


@pytest.mark.parametrize("kind", ["webdataset", "csv", "folder"])
def test_every_usable_sample_once_for_any_workers_and_ranks(tmp_path, kind):
    cfg, usable, skips = corpus(kind, tmp_path)
    baseline = None
    for workers in (0, 2, 4):
        for world_size in (1, 2, 3):
            cfg.workers = workers
            keys, records, counts = run_epoch(cfg, world_size)
            assert keys == Counter(usable), (workers, world_size)
            assert dict(counts) == skips, (workers, world_size)
            if baseline is None:
                baseline = records
                assert len(records) == sum(skips.values())
                assert all(r["epoch"] == 1 and r["reason"] and r["source"] for r in map(dict, records))
            assert records == baseline, (workers, world_size)  # the same skip log, entry for entry


def test_skip_counts_do_not_change_from_epoch_to_epoch(tmp_path):
    cfg, usable, skips = corpus("webdataset", tmp_path)
    cfg.workers = 2
    for epoch in (0, 1, 2):
        keys, records, counts = run_epoch(cfg, 2, epoch)
        assert keys == Counter(usable) and dict(counts) == skips
        assert {dict(r)["epoch"] for r in records} == {epoch + 1}  # the record numbers epochs from 1


def test_fewer_shards_than_workers_times_ranks(tmp_path):
    from conftest_data import image_bytes, write_tar

    for s in range(3):
        write_tar(str(tmp_path / f"s{s}.tar"), [m for j in range(2) for m in (
            (f"k{s}{j}.png", image_bytes(16, 16, seed=s * 2 + j)), (f"k{s}{j}.txt", b"caption"))])
    cfg = DataConfig(train_data=f"{tmp_path}/s{{0..2}}.tar", naflex_seq_lens=(16,), naflex_max_tokens_per_batch=16,
                     workers=3)
    keys, _, counts = run_epoch(cfg, 2)  # 6 slots, 3 shards: every shard read, every sample once
    assert keys == Counter(f"{tmp_path}/s{s}.tar:k{s}{j}" for s in range(3) for j in range(2)) and not counts


def test_the_streaming_split_fails_the_same_test(tmp_path):
    """Teeth: shards that cannot be indexed (`pipe:`) are streamed, split by (rank, worker) slot; that split
    reads some samples twice and others never, which is why local shards are indexed."""
    _, usable, _ = write_wds_corpus(tmp_path)
    spec = "::".join(f"pipe:cat {tmp_path}/shard-{s}.tar" for s in range(3))
    cfg = DataConfig(train_data=spec, dataset_type="webdataset", naflex_seq_lens=(16, 32),
                     naflex_max_tokens_per_batch=64, workers=2, train_num_samples=25, shuffle_buffer=0)
    keys = Counter()
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    assert not loader.indexed
    for batch in loader:
        keys.update(k.rsplit(":", 1)[-1] for k in batch["keys"])
    assert keys != Counter(k.rsplit(":", 1)[-1] for k in usable)
    assert max(keys.values()) > 1  # a sample trained twice in one epoch


def planned_all_broken(loader: NaFlexLoader, broken) -> list[bool]:
    return [all(broken(int(loader.order[i])) for i in range(b.offset, b.offset + b.batch_size))
            for b in loader.schedule]


@pytest.mark.parametrize("world_size", [1, 2])
def test_broken_samples_never_leave_a_rank_short(tmp_path, world_size):
    """A third of the rows are broken at decode time and two rows fit a microbatch: some planned microbatches
    come out empty; a neighbour on the same rank is split instead, so each rank still runs len() microbatches."""
    from conftest_data import image_bytes

    rows, usable = ["filepath\ttitle"], []
    for i in range(18):
        good = i % 3 != 0
        (tmp_path / f"i{i}.png").write_bytes(image_bytes(16, 16, seed=i) if good else b"broken")
        rows.append(f"i{i}.png\tcaption {i}")
        usable += [f"i{i}.png"] if good else []
    (tmp_path / "t.tsv").write_text("\n".join(rows) + "\n")
    exercised = 0
    for seed in range(6):
        cfg = DataConfig(train_data=str(tmp_path / "t.tsv"), naflex_seq_lens=(16,), naflex_max_tokens_per_batch=32,
                         workers=2, seed=seed)
        loaders = [build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r,
                                world_size=world_size) for r in range(world_size)]
        if not any(any(planned_all_broken(ld, lambda i: i % 3 == 0)) for ld in loaders):
            continue
        exercised += 1
        keys, _, counts = run_epoch(cfg, world_size)
        assert keys == Counter(usable) and counts == {"not_an_image": 6}
    assert exercised  # the corpus does plan all-broken microbatches


def test_epoch_remainder_is_folded_in(tmp_path):
    from conftest_data import image_bytes

    rows = ["filepath\ttitle"] + [f"i{i}.png\tcaption {i}" for i in range(7)]
    for i in range(7):
        (tmp_path / f"i{i}.png").write_bytes(image_bytes(16, 16, seed=i))
    (tmp_path / "t.tsv").write_text("\n".join(rows) + "\n")
    # one row per microbatch at 32 patches, two at 16: the odd sample out is folded into a 16-patch step
    cfg = DataConfig(train_data=str(tmp_path / "t.tsv"), naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=32,
                     naflex_seq_len_probs=(0.0, 1.0), workers=0)
    keys, records, _ = run_epoch(cfg, 2)
    assert keys == Counter(f"i{i}.png" for i in range(7)) and not records
    # only one-row microbatches exist: the last step's first rank takes a second row, over the budget by one,
    # rather than leave a sample out of the epoch
    cfg = DataConfig(train_data=str(tmp_path / "t.tsv"), naflex_seq_lens=(32,), naflex_max_tokens_per_batch=32,
                     workers=0)
    keys, records, counts = run_epoch(cfg, 2)
    assert keys == Counter(f"i{i}.png" for i in range(7)) and not counts
    # fewer samples than ranks: nobody can read them without leaving a rank empty; training refuses such an
    # epoch (it would train nothing), a split read on several ranks names them
    with pytest.raises(DataError, match="7 usable samples for 8 ranks"):
        build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=0, world_size=8)
    cfg.val_data, cfg.val_num_samples = cfg.train_data, 2
    loaders = [build_loader(cfg, split="val", patch_size=PATCH, context_length=CONTEXT, rank=r, world_size=3)
               for r in range(3)]
    assert [len(ld) for ld in loaders] == [0, 0, 0] and all(list(ld) == [] for ld in loaders)
    assert [r["reason"] for ld in loaders for r in ld.skip_records] == ["epoch_remainder", "epoch_remainder"]


def test_train_num_samples_means_what_it_says(tmp_path):
    cfg, usable, _ = corpus("folder", tmp_path)
    cfg.train_num_samples = 4
    seen = []
    for epoch in (0, 1):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=epoch)
        assert loader.num_samples == 4
        keys = [k for b in loader for k in b["keys"]]
        assert len(set(keys)) == len(keys) and set(keys) <= set(usable)
        seen.append(set(loader.order.tolist()))
    assert seen[0] != seen[1]  # a fresh subset each epoch
    from naflexclip.data import DataError

    cfg.train_num_samples = 100  # more than there is: copies would meet in a window, so it is refused
    with pytest.raises(DataError, match=r"--train-num-samples 100 is more than the 8 usable samples"):
        build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)


def test_train_num_samples_on_a_csv_is_ignored_as_openclip_does(tmp_path, caplog):
    """OpenCLIP's CSV epoch is the whole file (its map-style NaFlex loader never reads --train-num-samples); a
    smaller value here trained a random subset. Now the whole file, every epoch, with one line saying so."""
    cfg, usable, _ = corpus("csv", tmp_path)
    rows = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT).num_samples
    for requested in (3, 100):
        cfg.train_num_samples = requested
        with caplog.at_level("WARNING", logger="naflexclip.data"):
            loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
        assert loader.num_samples == rows
        assert sorted(k for b in loader for k in b["keys"]) == sorted(usable)
        notes = [r.getMessage() for r in caplog.records if "--train-num-samples" in r.getMessage()]
        assert notes == [f"--train-num-samples {requested}: ignored for a CSV, as OpenCLIP does (an epoch is the "
                         f"whole file, its {rows} samples)"], notes
        caplog.clear()


# -- resume ---------------------------------------------------------------------------------------


def take(loader: NaFlexLoader, n: int) -> list[list[str]]:
    out = []
    for batch in loader:
        out.append(batch["keys"])
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize(("before", "after"), [(0, 2), (2, 4), (4, 0)])
def test_resume_mid_epoch_with_other_workers_is_exact(tmp_path, before, after):
    cfg, _, _ = corpus("webdataset", tmp_path)
    cfg.workers = 0
    full = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=1, rank=1, world_size=2)
    full_keys = [b["keys"] for b in full]
    full_log = full.skip_records
    for stop in sorted({1, len(full_keys) // 2, len(full_keys) - 1}):
        cfg.workers = before
        first = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=1, rank=1,
                             world_size=2)
        head = take(first, stop)
        state = first.state_dict()
        cfg.workers = after
        second = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=1, world_size=2)
        second.load_state_dict(state)
        second.set_epoch(state["epoch"], state["position"])
        tail = [b["keys"] for b in second]
        assert head + tail == full_keys
        assert first.skip_records + second.skip_records == full_log  # nothing logged twice or lost


def test_resume_inside_a_split_microbatch_is_exact(tmp_path):
    from conftest_data import image_bytes

    rows = ["filepath\ttitle"]
    for i in range(16):
        (tmp_path / f"i{i}.png").write_bytes(image_bytes(16, 16, seed=i) if i % 2 else b"broken")
        rows.append(f"i{i}.png\tcaption {i}")
    (tmp_path / "t.tsv").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(train_data=str(tmp_path / "t.tsv"), naflex_seq_lens=(8,), naflex_max_tokens_per_batch=24,
                     workers=0, seed=0)
    full_loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    assert any(planned_all_broken(full_loader, lambda i: i % 2 == 0))
    full = [b["keys"] for b in full_loader]
    assert len(full) == len(full_loader) and sorted(k for keys in full for k in keys) == sorted(
        f"i{i}.png" for i in range(1, 16, 2))
    mid_split = 0
    for stop in range(1, len(full)):
        first = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
        head = take(first, stop)
        state = first.state_dict()
        mid_split += state["sample_position"] is None
        second = build_loader(DataConfig(**{**cfg.__dict__, "workers": 2}), split="train", patch_size=PATCH,
                              context_length=CONTEXT)
        second.load_state_dict(state)
        second.set_epoch(0, state["position"])
        assert head + [b["keys"] for b in second] == full, stop
    assert mid_split  # some stops fell inside a split, where the position is not a plain global one


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2)])
def test_resume_at_another_world_size_continues_exactly(tmp_path, old, new):
    """The saved position is global (a place in the epoch's one order), so another world size re-plans the
    rest of the epoch from it: together the two parts train every usable sample once."""
    cfg, usable, skips = corpus("webdataset", tmp_path)
    cfg.naflex_seq_lens, cfg.naflex_max_tokens_per_batch = (16,), 48  # three rows per microbatch: several steps
    for cut in range(1, 8):  # the first cut where no rank is inside a split
        loaders = [build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r,
                                world_size=old) for r in range(old)]
        keys = Counter(k for ld in loaders for batch in take(ld, cut) for k in batch)
        states = [ld.state_dict() for ld in loaders]
        if NaFlexLoader.can_remap(states):
            break
    else:
        raise AssertionError("no cut could be re-mapped")
    assert len({s["sample_position"] for s in states}) == 1
    counts = sum((Counter(ld.skip_counts) for ld in loaders), Counter())
    for rank in range(new):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=rank,
                              world_size=new)
        loader.load_state_dict(states)
        loader.set_epoch(0, states[0]["position"])
        batches = list(loader)
        assert len(batches) == len(loader) - states[0]["position"]
        keys.update(k for b in batches for k in b["keys"])
        counts.update(Counter(r["reason"] for r in loader.skip_records))
    assert keys == Counter(usable)
    assert dict(counts) == skips


def test_resume_refuses_a_world_size_it_cannot_remap(tmp_path):
    cfg, _, _ = corpus("csv", tmp_path)
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=0, world_size=2)
    state = {**loader.state_dict(), "pieces": 1, "sample_position": None}
    other = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=0, world_size=3)
    with pytest.raises(ValueError, match="world size 2 .* world size 3"):
        other.load_state_dict([state, {**state, "rank": 1}])

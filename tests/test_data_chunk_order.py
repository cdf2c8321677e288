"""The chunked epoch order (`naflexclip.data.chunk_order`): a permutation of the epoch's samples from (seed, epoch),
made of chunks read in one piece, with exact mixture shares, and exact at any world size."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
from conftest_data import write_wds_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.chunk_order import ChunkedRecipe, same_chunk_pairs, shard_chunks
from naflexclip.data.schedule import TokenBudget, build_global_plan, epoch_order
from naflexclip.data.shard_order import ShardRecipe, ShardSet

BUDGET = TokenBudget((16, 32), 96)


def _recipe(sizes: list[int], sources: list[int], chunks: list[int], streams: int, **kwargs) -> ChunkedRecipe:
    names = tuple(f"s{i}" for i in range(max(sources) + 1))
    shards = ShardSet(np.asarray(sizes, np.int64), np.asarray(sources, np.int64), names)
    return ChunkedRecipe(ShardRecipe(shards, **kwargs), np.minimum(np.asarray(chunks), np.maximum(sizes, 1)), streams)


shard_sets = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 40), min_size=n, max_size=n).filter(lambda s: sum(s) > 0),
    st.lists(st.integers(0, 1), min_size=n, max_size=n),
    st.lists(st.integers(1, 6), min_size=n, max_size=n),
    st.integers(1, 16)))


def _rank_positions(plan, rank: int) -> list[int]:
    return [int(p) for b in plan.rank_batches(rank) for p in range(b.offset, b.offset + b.batch_size * b.stride,
                                                                   b.stride)]


@settings(max_examples=60, deadline=None)
@given(shard_sets, st.integers(0, 3), st.integers(0, 2))
def test_an_epoch_is_a_permutation_of_its_samples_from_seed_and_epoch(shard_set, seed, epoch):
    sizes, sources, chunks, streams = shard_set
    recipe = _recipe(sizes, [0] * len(sizes), chunks, streams)
    order = recipe.order(seed=seed, epoch=epoch)
    ids = order[0:len(order)]
    assert sorted(ids.tolist()) == list(range(sum(sizes)))
    again = recipe.order(seed=seed, epoch=epoch)  # a fresh object, positions asked in another order
    positions = np.random.default_rng(7).permutation(len(order))
    assert again.take(positions).tolist() == ids[positions].tolist()
    if sum(sizes) > 20:
        assert recipe.order(seed=seed, epoch=epoch + 1)[0:len(order)].tolist() != ids.tolist()


@settings(max_examples=40, deadline=None)
@given(shard_sets, st.sampled_from([(1.0, 2.0), (0.5, 1.0), (1.0, 0.0), (3.0, 1.0)]), st.integers(0, 2))
def test_mixtures_keep_their_exact_shares_and_resampling_its_count(shard_set, factors, epoch):
    sizes, sources, chunks, streams = shard_set
    sources[0] = 0
    if len(sources) > 1:
        sources[-1] = 1
    else:
        return
    source_sizes = np.bincount(sources, weights=sizes, minlength=2)
    if not all(source_sizes) or not source_sizes @ np.asarray(factors) > 0:
        return
    mixed = _recipe(sizes, sources, chunks, streams, factors=factors)
    block = mixed.recipe.order(seed=1, epoch=epoch, shuffle=True)
    order = mixed.order(seed=1, epoch=epoch)
    assert len(order) == mixed.epoch_samples() == len(block)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    def source_of(ids: np.ndarray) -> Counter:
        return Counter(np.asarray(sources)[np.searchsorted(starts, ids, side="right") - 1].tolist())

    assert source_of(order[0:len(order)]) == source_of(block[0:len(block)])
    assert order.source_counts() == block.source_counts()
    resampled = _recipe(sizes, sources, chunks, streams, resampled=True, num_samples=37)
    assert len(resampled.order(seed=1, epoch=epoch)[0:37]) == 37


@settings(max_examples=40, deadline=None)
@given(shard_sets, st.integers(1, 5), st.integers(1, 5), st.integers(1, 6))
def test_a_position_resumes_exactly_at_any_world_size(shard_set, old, new, stop):
    """The plan deals a step's positions to the ranks by stride; a resume at another world size re-plans from the
    global sample position: the two parts together read every position once."""
    sizes, _, chunks, streams = shard_set
    order = _recipe(sizes, [0] * len(sizes), chunks, streams).order(seed=3, epoch=0)
    n = len(order)
    whole = build_global_plan(n, old, BUDGET, seed=3, interleaved=True)
    assert sorted(p for r in range(old) for p in _rank_positions(whole, r)) == list(range(n - whole.dropped))
    stop = min(stop, whole.num_steps)
    position = whole.step_start(stop)
    before = [p for r in range(old) for p in _rank_positions(whole, r) if p < position]
    rest = build_global_plan(n, new, BUDGET, seed=3, start_step=stop, start_sample=position, interleaved=True)
    after = [p for r in range(new) for p in _rank_positions(rest, r)]
    assert sorted(before + after) == list(range(n - rest.dropped))
    if old == new:
        assert [_rank_positions(rest, r) for r in range(new)] == [
            [p for p in _rank_positions(whole, r) if p >= position] for r in range(new)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4, 8]), st.integers(0, 3))
def test_a_rank_whose_world_size_divides_the_streams_reads_only_its_own_chunks(shards, world, seed):
    sizes = [int(s) for s in np.random.default_rng(seed).integers(20, 60, shards)]
    recipe = _recipe(sizes, [0] * shards, [4] * shards, 8)
    order = recipe.order(seed=seed, epoch=0)
    plan = build_global_plan(len(order), world, BUDGET, seed=seed, interleaved=True)
    readers: dict[int, set[int]] = {}
    for r in range(world):
        for c in order.chunk_of(np.asarray(_rank_positions(plan, r), np.int64)).tolist():
            readers.setdefault(c, set()).add(r)
    assert set(readers) == set(range(len(order.chunk_count)))
    if order.streams % world == 0:  # extra reads only where a stream boundary cuts a chunk
        assert sum(len(ranks) - 1 for ranks in readers.values()) <= order.streams - 1


def test_chunks_are_cut_by_bytes_and_never_below_a_sample():
    assert shard_chunks(np.asarray([100, 100, 3, 0]), np.asarray([8 << 20, 40 << 20, 40 << 20, 10]), 16 << 20
                        ).tolist() == [1, 3, 3, 1]
    assert shard_chunks(np.asarray([5, 6]), None, 1).tolist() == [1, 1]


def _same_chunk_share(order, world: int, chunk_of) -> float:
    plan = build_global_plan(len(order), world, BUDGET, seed=0, interleaved=True)
    shares = [same_chunk_pairs(chunk_of(np.asarray(_rank_positions_batch(b), np.int64)))
              for b in plan.rank_batches(0) if b.batch_size > 1]
    return float(np.mean(shares))


def _rank_positions_batch(b) -> list[int]:
    return list(range(b.offset, b.offset + b.batch_size * b.stride, b.stride))


def test_shuffle_quality_two_samples_of_a_microbatch_rarely_share_a_chunk():
    """Measured (and documented in docs/data.md): with 64 streams a rank's microbatch draws each row from another
    stream while the world size is at most 64 / rows; only then does it share chunks, and never much more than a
    full permutation would at the same chunk count."""
    sizes = [1000] * 100  # 100 shards of 1000 samples, 10 chunks each: 1000 chunks of 100
    recipe = _recipe(sizes, [0] * 100, [10] * 100, 64)
    order = recipe.order(seed=0, epoch=0)
    full = epoch_order(sum(sizes), seed=0, epoch=0, shuffle=True)
    chunk_of_full = (lambda positions: full[positions] // 100)
    baseline = _same_chunk_share(order, 1, chunk_of_full)
    assert baseline < 0.01
    for world in (1, 8):  # 64 / world streams per rank >= the 6 rows of a microbatch: each row its own stream
        assert _same_chunk_share(order, world, order.chunk_of) < max(0.02, 2 * baseline), world
    # more ranks: a microbatch's rows come from 64 / world streams, a stream's from a window of WINDOW_CHUNKS chunks
    for world in (32, 64):
        assert 0.02 < _same_chunk_share(order, world, order.chunk_of) < 0.75, world


def _keys(loader, n: int | None = None) -> list[list[str]]:
    out = []
    for batch in loader:
        out.append(batch["keys"])
        if n is not None and len(out) == n:
            break
    return out


def test_shards_train_in_the_chunked_order_and_an_older_checkpoint_resumes_on_its_own(tmp_path):
    """Shard sources read in chunks with --fetch-chunk-size (the state says which order); a checkpoint written
    before (no `order_version`) continues on the order it was written with: the one --fetch-chunk-size 0 gives."""
    spec, usable, _ = write_wds_corpus(tmp_path)
    cfg = DataConfig(train_data=spec, naflex_seq_lens=(16,), naflex_max_tokens_per_batch=48, workers=0, seed=3,
                     fetch_chunk_size=8)
    build = (lambda c: build_loader(c, split="train", patch_size=8, context_length=16))
    chunked, old = build(cfg), build(dataclasses.replace(cfg, fetch_chunk_size=0))
    assert chunked.state_dict()["order_version"] == 2 and old.state_dict()["order_version"] == 1
    new_keys, old_keys = _keys(chunked), _keys(old)
    assert sorted(k for b in new_keys for k in b) == sorted(k for b in old_keys for k in b) == sorted(usable)
    assert new_keys != old_keys
    stopped = build(dataclasses.replace(cfg, fetch_chunk_size=0))
    head = _keys(stopped, 2)
    state = {k: v for k, v in stopped.state_dict().items() if k != "order_version"}
    resumed = build(cfg)  # today's settings, a checkpoint of before
    resumed.load_state_dict(state)
    resumed.set_epoch(0, 2)
    assert head + _keys(resumed) == old_keys
    assert resumed.state_dict()["order_version"] == 1


def test_a_memory_budget_below_one_chunk_is_refused_in_one_line():
    import pytest

    with pytest.raises(ValueError, match=r"^--fetch-memory 4 MiB holds less than one chunk of --fetch-chunk-size 8"):
        DataConfig(fetch_memory=4, fetch_chunk_size=8)
    DataConfig(fetch_memory=4, fetch_chunk_size=0)  # no chunks: nothing to hold

"""Token-budget schedule: budget, divisor, coverage, determinism across epochs, workers and ranks."""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import pytest

from naflexclip.data import DataConfig, add_data_args, data_config_from_args
from naflexclip.data.schedule import (
    batch_size_for,
    build_schedule,
    rank_sample_order,
    samples_per_rank,
    worker_batches,
)

SEQ_LENS = (64, 128, 256, 576)


@pytest.mark.parametrize("divisor", [1, 4, 8])
def test_batch_sizes_respect_budget_and_divisor(divisor):
    schedule = build_schedule(1000, SEQ_LENS, 4096, divisor=divisor, seed=3)
    assert sum(b.batch_size for b in schedule) == 1000
    for b in schedule[:-1]:  # only the epoch's last batch may be cut short
        assert b.batch_size == batch_size_for(b.seq_len, 4096, divisor)
        assert b.batch_size * b.seq_len <= 4096
        assert b.batch_size % divisor == 0 or b.batch_size == 1
    assert [b.offset for b in schedule] == list(np.cumsum([0] + [b.batch_size for b in schedule[:-1]]))


def test_batch_size_rounds_down_to_divisor_but_at_least_one():
    assert batch_size_for(576, 4096, 1) == 7
    assert batch_size_for(576, 4096, 4) == 4
    assert batch_size_for(576, 4096, 8) == 1  # 7 rounds down to 0 -> at least 1
    assert batch_size_for(100, 100, 1) == 1


def test_schedule_deterministic_from_seed_and_epoch():
    a = build_schedule(500, SEQ_LENS, 4096, seed=1, epoch=2)
    assert a == build_schedule(500, SEQ_LENS, 4096, seed=1, epoch=2)
    assert a != build_schedule(500, SEQ_LENS, 4096, seed=1, epoch=3)
    assert a != build_schedule(500, SEQ_LENS, 4096, seed=2, epoch=2)


def test_seq_len_probs_weight_the_draw():
    schedule = build_schedule(20000, SEQ_LENS, 4096, probs=(0.0, 1.0, 3.0, 0.0), seed=0)
    counts = Counter(b.seq_len for b in schedule)
    assert set(counts) == {128, 256}
    assert 2.5 < counts[256] / counts[128] < 3.5


def test_fixed_seq_len_for_eval():
    schedule = build_schedule(100, SEQ_LENS, 4096, fixed_seq_len=256)
    assert {b.seq_len for b in schedule} == {256}
    assert [b.batch_size for b in schedule] == [16] * 6 + [4]


@pytest.mark.parametrize("num_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("start_batch", [0, 3])
def test_workers_split_batches_without_duplicates_or_gaps(num_workers, start_batch):
    schedule = build_schedule(300, SEQ_LENS, 2048, seed=7)
    per_worker = [worker_batches(schedule, w, num_workers, start_batch) for w in range(num_workers)]
    # torch's DataLoader takes one item from each live worker in turn: that round-robin is the plan order
    queues, merged = [list(p) for p in per_worker], []
    while any(queues):
        for queue in queues:
            if queue:
                merged.append(queue.pop(0))
    assert [b.index for b in merged] == list(range(start_batch, len(schedule)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_share_schedule_and_partition_the_samples(world_size):
    num = 103
    orders = [rank_sample_order(num, rank=r, world_size=world_size, seed=5, epoch=1, shuffle=True)
              for r in range(world_size)]
    per_rank = samples_per_rank(num, world_size)
    assert all(len(o) == per_rank for o in orders)
    seen = Counter(np.concatenate(orders).tolist())
    assert set(seen) == set(range(num))  # every sample on some rank
    assert sum(seen.values()) - num == per_rank * world_size - num < world_size  # only wrap-around repeats
    schedules = [build_schedule(per_rank, SEQ_LENS, 2048, seed=5, epoch=1) for _ in range(world_size)]
    assert all(s == schedules[0] for s in schedules)  # every rank steps the same plan


def test_epoch_permutation_changes_with_epoch_but_not_rank_view():
    a = rank_sample_order(50, rank=0, world_size=1, seed=0, epoch=0, shuffle=True)
    b = rank_sample_order(50, rank=0, world_size=1, seed=0, epoch=1, shuffle=True)
    assert sorted(a) == sorted(b) == list(range(50)) and list(a) != list(b)
    assert list(rank_sample_order(5, rank=0, world_size=1, seed=0, epoch=0, shuffle=False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"naflex_seq_lens": ()}, "--naflex-seq-lens"),
        ({"naflex_seq_lens": (64, 0)}, "--naflex-seq-lens"),
        ({"naflex_seq_len_probs": (1.0,)}, "--naflex-seq-len-probs"),
        ({"naflex_seq_len_probs": (1.0, -1.0, 1.0)}, "--naflex-seq-len-probs"),
        ({"naflex_max_tokens_per_batch": 100}, "--naflex-max-tokens-per-batch"),
        ({"naflex_batch_divisor": 0}, "--naflex-batch-divisor"),
        ({"dataset_type": "parquet"}, "--dataset-type"),
        ({"dataset_type": "csv"}, "--dataset-type"),
        ({"workers": -1}, "--workers"),
        ({"train_num_samples": 0}, "--train-num-samples"),
        ({"synthetic_shape_group_size": 9}, "--synthetic-shape-group-size must be in \\[1, 8\\], got 9"),
        ({"synthetic_shape_group_size": 0}, "--synthetic-shape-group-size"),
    ],
)
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DataConfig(**kwargs)


def test_flags_map_onto_config():
    parser = argparse.ArgumentParser()
    add_data_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args([
        "--train-data", "shards/{00000..00003}.tar", "--naflex-seq-lens", "128", "256",
        "--naflex-seq-len-probs", "1", "2", "--naflex-max-tokens-per-batch", "8192",
        "--naflex-batch-divisor", "4", "--workers", "3", "--seed", "9", "--train-num-samples", "1000",
    ])
    cfg = data_config_from_args(args)
    assert cfg.naflex_seq_lens == (128, 256) and cfg.naflex_seq_len_probs == (1.0, 2.0)
    assert (cfg.naflex_max_tokens_per_batch, cfg.naflex_batch_divisor, cfg.workers, cfg.seed) == (8192, 4, 3, 9)
    assert cfg.source("train") == ("webdataset", "shards/{00000..00003}.tar")
    assert cfg.source("val") is None
    assert DataConfig().source("val") == ("synthetic", None)
    assert DataConfig(train_data="x/train.csv").source("train") == ("csv", "x/train.csv")


@pytest.mark.parametrize(("num_samples", "group_size"), [(12, 2), (11, 3), (40, 4)])
def test_grouped_order_shuffles_whole_groups_and_keeps_each_together(num_samples, group_size):
    order = rank_sample_order(num_samples, rank=0, world_size=1, seed=3, epoch=1, shuffle=True, group_size=group_size)
    assert sorted(order.tolist()) == list(range(num_samples))  # a permutation: nothing lost or repeated
    starts = [i for i, index in enumerate(order) if index % group_size == 0]
    for start in starts:  # each group's members follow its first, in order
        group = order[start] // group_size
        members = [m for m in range(group * group_size, min((group + 1) * group_size, num_samples))]
        assert order[start:start + len(members)].tolist() == members
    assert order[0] != 0 or order[group_size] != group_size  # groups are shuffled
    plain = rank_sample_order(num_samples, rank=0, world_size=1, seed=3, epoch=1, shuffle=True)
    assert not all(abs(int(a) - int(b)) == 1 for a, b in zip(plain[::2], plain[1::2], strict=False))


def test_group_size_one_keeps_the_ungrouped_order():
    assert np.array_equal(
        rank_sample_order(50, rank=1, world_size=2, seed=0, epoch=2, shuffle=True, group_size=1),
        rank_sample_order(50, rank=1, world_size=2, seed=0, epoch=2, shuffle=True),
    )

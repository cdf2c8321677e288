"""Token-budget schedule: budget, divisor, coverage, determinism across epochs, workers and ranks."""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from naflexclip.data import DataConfig, TokenBudget, add_data_args, data_config_from_args
from naflexclip.data.schedule import build_global_plan, build_schedule, epoch_order, worker_batches

SEQ_LENS = (64, 128, 256, 576)


def budget(max_tokens: int, divisor: int = 1, probs=None, seq_lens=SEQ_LENS) -> TokenBudget:
    return TokenBudget(seq_lens, max_tokens, probs, divisor)


@pytest.mark.parametrize("divisor", [1, 4, 8])
def test_batch_sizes_respect_budget_and_divisor(divisor):
    schedule = build_schedule(1000, budget(4096, divisor), seed=3)
    assert sum(b.batch_size for b in schedule) == 1000
    for b in schedule[:-1]:  # only the epoch's last batch may be cut short
        assert b.batch_size == budget(4096, divisor).batch_size(b.seq_len)
        assert b.batch_size * b.seq_len <= 4096
        assert b.batch_size % divisor == 0 or b.batch_size == 1
    assert [b.offset for b in schedule] == list(np.cumsum([0] + [b.batch_size for b in schedule[:-1]]))


def test_batch_size_rounds_down_to_divisor_but_at_least_one():
    assert budget(4096, 1).batch_size(576) == 7
    assert budget(4096, 4).batch_size(576) == 4
    assert budget(4096, 8).batch_size(576) == 1  # 7 rounds down to 0 -> at least 1
    assert budget(576, 1).batch_size(576) == 1


def test_schedule_deterministic_from_seed_and_epoch():
    a = build_schedule(500, budget(4096), seed=1, epoch=2)
    assert a == build_schedule(500, budget(4096), seed=1, epoch=2)
    assert a != build_schedule(500, budget(4096), seed=1, epoch=3)
    assert a != build_schedule(500, budget(4096), seed=2, epoch=2)


def test_seq_len_probs_weight_the_draw():
    schedule = build_schedule(20000, budget(4096, probs=(0.0, 1.0, 3.0, 0.0)), seed=0)
    counts = Counter(b.seq_len for b in schedule)
    assert set(counts) == {128, 256}
    assert 2.5 < counts[256] / counts[128] < 3.5


def test_evaluation_budget_is_the_longest_length_only():
    schedule = build_schedule(100, budget(4096, probs=(1.0, 1.0, 1.0, 0.0), seq_lens=(64, 128, 256, 512)).at_longest())
    assert {b.seq_len for b in schedule} == {512}
    assert [b.batch_size for b in schedule] == [8] * 12 + [4]


@pytest.mark.parametrize("num_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("start_batch", [0, 3])
def test_workers_split_batches_without_duplicates_or_gaps(num_workers, start_batch):
    schedule = build_schedule(300, budget(2048), seed=7)
    per_worker = [worker_batches(schedule, w, num_workers, start_batch) for w in range(num_workers)]
    # torch's DataLoader takes one item from each live worker in turn: that round-robin is the plan order
    queues, merged = [list(p) for p in per_worker], []
    while any(queues):
        for queue in queues:
            if queue:
                merged.append(queue.pop(0))
    assert [b.index for b in merged] == list(range(start_batch, len(schedule)))


@given(num=st.integers(0, 300), world_size=st.integers(1, 5), seq_lens=st.sets(st.sampled_from(SEQ_LENS), min_size=1),
       max_tokens=st.sampled_from([576, 1024, 2048]), divisor=st.sampled_from([1, 2, 4]), seed=st.integers(0, 3))
def test_global_plan_reads_every_position_once_with_equal_microbatch_counts(num, world_size, seq_lens, max_tokens,
                                                                            divisor, seed):
    seq_lens = tuple(sorted(seq_lens))
    sizes = TokenBudget(seq_lens, max_tokens, None, divisor)
    plan = build_global_plan(num, world_size, sizes, seed=seed)
    read = [p for r in range(world_size) for b in plan.rank_batches(r)
            for p in range(b.offset, b.offset + b.batch_size)]
    assert sorted(read) == list(range(num - plan.dropped))  # every position once, no wrap-around repeat
    assert [s.index for s in plan.steps] == list(range(len(plan.steps)))  # each step: one microbatch per rank
    single_row = all(sizes.batch_size(s) == 1 for s in seq_lens)
    for step in plan.steps:
        assert len(step.sizes) == world_size
        # over the budget only by one row, only in the last step, only when no length allows a second row
        over = 1 if single_row and step is plan.steps[-1] else 0
        assert all(1 <= size <= sizes.batch_size(step.seq_len) + over for size in step.sizes)
    assert plan.dropped == (num if num < world_size else 0)  # only an epoch with fewer samples than ranks


def test_global_plan_resumed_at_another_world_size_covers_the_rest():
    plan = build_global_plan(203, 2, budget(2048), seed=5)
    position = plan.step_start(2)
    rest = build_global_plan(203, 3, budget(2048), seed=5, start_step=2, start_sample=position)
    assert rest.steps[0].index == 2 and rest.steps[0].offset == position
    assert rest.steps[0].seq_len == plan.steps[2].seq_len  # a step's length depends on its index only
    read = [p for r in range(3) for b in rest.rank_batches(r) for p in range(b.offset, b.offset + b.batch_size)]
    assert sorted(read) == list(range(position, 203))


def test_epoch_order_changes_with_epoch():
    a = epoch_order(50, seed=0, epoch=0, shuffle=True)
    b = epoch_order(50, seed=0, epoch=1, shuffle=True)
    assert sorted(a) == sorted(b) == list(range(50)) and list(a) != list(b)
    assert list(epoch_order(5, seed=0, epoch=0, shuffle=False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"naflex_seq_lens": ()}, "--naflex-seq-lens"),
        ({"naflex_seq_lens": (64, 0)}, "--naflex-seq-lens"),
        ({"naflex_seq_len_probs": (1.0,)}, "--naflex-seq-len-probs"),
        ({"naflex_seq_len_probs": (1.0, -1.0, 1.0)}, "--naflex-seq-len-probs"),
        ({"naflex_max_tokens_per_batch": 50}, "--naflex-max-tokens-per-batch"),
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
    assert cfg.token_budget() == TokenBudget((128, 256), 8192, (1.0, 2.0), 4)
    assert cfg.source("train") == ("webdataset", "shards/{00000..00003}.tar")
    assert cfg.source("val") is None
    assert DataConfig().source("val") == ("synthetic", None)
    assert DataConfig(train_data="x/train.csv").source("train") == ("csv", "x/train.csv")


@pytest.mark.parametrize(("num_samples", "group_size"), [(12, 2), (11, 3), (40, 4)])
def test_grouped_order_shuffles_whole_groups_and_keeps_each_together(num_samples, group_size):
    order = epoch_order(num_samples, seed=3, epoch=1, shuffle=True, group_size=group_size)
    assert sorted(order.tolist()) == list(range(num_samples))  # a permutation: nothing lost or repeated
    starts = [i for i, index in enumerate(order) if index % group_size == 0]
    for start in starts:  # each group's members follow its first, in order
        group = order[start] // group_size
        members = [m for m in range(group * group_size, min((group + 1) * group_size, num_samples))]
        assert order[start:start + len(members)].tolist() == members
    assert order[0] != 0 or order[group_size] != group_size  # groups are shuffled
    plain = epoch_order(num_samples, seed=3, epoch=1, shuffle=True)
    assert not all(abs(int(a) - int(b)) == 1 for a, b in zip(plain[::2], plain[1::2], strict=False))


def test_group_size_one_keeps_the_ungrouped_order():
    assert np.array_equal(epoch_order(50, seed=0, epoch=2, shuffle=True, group_size=1),
                          epoch_order(50, seed=0, epoch=2, shuffle=True))

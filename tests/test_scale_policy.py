"""window_loss_scale: one coefficient per window, from every microbatch size (docs/accumulation.md, The rule)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from naflexclip import window_loss_scale


def test_worked_example_is_half_for_both_orders():
    assert window_loss_scale([1, 2], 3, "linear") == 0.5
    assert window_loss_scale([2, 1], 3, "linear") == 0.5


def test_modes_on_one_window():
    assert window_loss_scale([2, 6], 8, "none") == 1.0
    assert window_loss_scale([2, 6], 8, "linear") == 0.5
    assert window_loss_scale([2, 6], 8, "sqrt") == math.sqrt(0.5)


def test_single_microbatch_is_the_familiar_rule_and_full_microbatches_are_one():
    assert window_loss_scale([5], 10, "linear") == 0.5
    assert window_loss_scale([10, 10, 10], 10, "linear") == 1.0


@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=16),
    reference=st.integers(1, 64),
    mode=st.sampled_from(["none", "linear", "sqrt"]),
    data=st.data(),
)
def test_scale_depends_only_on_count_and_total(sizes, reference, mode, data):
    permuted = data.draw(st.permutations(sizes))
    assert window_loss_scale(permuted, reference, mode) == pytest.approx(window_loss_scale(sizes, reference, mode))
    linear = sum(sizes) / (len(sizes) * reference)
    expected = {"none": 1.0, "linear": linear, "sqrt": math.sqrt(linear)}[mode]
    assert window_loss_scale(sizes, reference, mode) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("sizes", "reference", "mode", "named"),
    [
        ([1, 2], 3, "cubic", "'cubic'"),
        ([1, 2], None, "linear", "None"),
        ([1, 2], 0, "sqrt", "0"),
        ([1, 2], -4, "linear", "-4"),
        ([], 3, "linear", "[]"),
        ([3, 0], 3, "linear", "size 0"),
        ([3, -2], 3, "none", "size -2"),
    ],
)
def test_errors_name_the_offending_value(sizes, reference, mode, named):
    with pytest.raises(ValueError) as info:
        window_loss_scale(sizes, reference, mode)
    message = str(info.value)
    assert named in message and "\n" not in message


def test_none_mode_needs_no_reference():
    assert window_loss_scale([1, 2], None, "none") == 1.0

"""The tiled losses equal the dense formulas (loss and every gradient), never build an N×N tensor, and their
per-rank form splits the loss exactly: per-rank values sum to L, per-rank gradients sum to ∇L, and a rank's
FLOPs fall as 1/R."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from window_cases import failures, full_batch_gradients, naflex_window, tiny_model

from naflexclip import ClipLoss, SigLipLoss, accumulate_gradients, create_loss
from naflexclip.batch import split_batch
from naflexclip.loss import clip_loss_dense, pairwise_logits, siglip_loss_dense

LOSSES = {"clip": (ClipLoss, clip_loss_dense), "siglip": (SigLipLoss, siglip_loss_dense)}
PRIMES_AND_EDGES = [1, 2, 3, 5, 7, 11, 13, 17, 31, 37]


def _inputs(n: int, d: int, scale: float, bias: float | None, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    text = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    tensors = [image, text, torch.tensor(scale, dtype=dtype)]
    tensors.append(None if bias is None else torch.tensor(bias, dtype=dtype))
    return [t.requires_grad_() if t is not None else None for t in tensors]


def _loss_and_grads(loss_fn, inputs):
    loss = loss_fn(*inputs)
    live = [t for t in inputs if t is not None]
    return [loss.detach(), *torch.autograd.grad(loss, live)]


def _floors(inputs, n: int) -> list[float]:
    """Per output (loss, image, text, logit_scale, logit_bias gradients): the size below which its error is judged
    absolutely. Rounding a logit of size `L = t·|f|² + |b|` moves its probability by ~eps·max(L, 1), in the dense
    formula as in the tiled one, so an output that cancels to ~0 (CLIP's bias gradient, every CLIP output at N = 1,
    symmetric inputs) is judged on 1e-3 of what such a shift gives: loss L, feature gradients L·t·|f|/N,
    logit_scale L·|f|², logit_bias L·N (a sum of N² probabilities, block by block, that cancels to 0 for CLIP)."""
    scale = float(inputs[2].detach())
    size = max(float(inputs[0].detach().abs().max()), float(inputs[1].detach().abs().max()))
    logit = max(scale * size * size + (abs(float(inputs[3].detach())) if inputs[3] is not None else 0.0), 1.0)
    floors = [logit, logit * scale * size / n, logit * scale * size / n, logit * size * size]
    if inputs[3] is not None:
        floors.append(logit * n)
    return [1e-3 * floor for floor in floors]


def _worst_relative_error(ours, reference, scales) -> float:
    return max(
        float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), floor)
        for a, b, floor in zip(ours, reference, scales, strict=True)
    )


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(sorted(LOSSES)),
    n=st.one_of(st.sampled_from(PRIMES_AND_EDGES), st.integers(1, 40)),
    tile=st.integers(1, 48),
    d=st.integers(1, 8),
    scale=st.floats(0.5, 100.0),
    bias=st.one_of(st.none(), st.floats(-15.0, 5.0)),
    seed=st.integers(0, 2**16),
)
def test_tiled_equals_dense_in_float64(kind, n, tile, d, scale, bias, seed):
    tiled, dense = LOSSES[kind]
    inputs = _inputs(n, d, scale, bias, torch.float64, seed)
    ours, reference = _loss_and_grads(tiled(tile), inputs), _loss_and_grads(dense, inputs)
    assert _worst_relative_error(ours, reference, _floors(inputs, n)) <= 1e-12


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize(("n", "tile"), [(1, 64), (97, 16), (256, 64), (300, 1024)])
def test_tiled_float32_equals_float64_dense(kind, n, tile):
    tiled, dense = LOSSES[kind]
    bias = -10.0 if kind == "siglip" else None
    inputs32, inputs64 = (_inputs(n, 16, 50.0, bias, dtype, seed=n) for dtype in (torch.float32, torch.float64))
    ours, reference = _loss_and_grads(tiled(tile), inputs32), _loss_and_grads(dense, inputs64)
    assert _worst_relative_error(ours, reference, _floors(inputs64, n)) <= 1e-5


def test_shuffled_pairs_change_the_tiled_loss():
    # teeth for the comparisons above: a tiled loss that ignored which text belongs to which image
    image, text, scale, bias = _inputs(9, 4, 20.0, -5.0, torch.float64)
    for kind in LOSSES:
        tiled = LOSSES[kind][0](2)
        assert not torch.allclose(tiled(image, text, scale, bias), tiled(image, text.flip(0), scale, bias))


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates while the mode is on (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


class _PeakLiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops create while the mode is on (forward and backward), each counted
    while a tensor on it is alive. It sees op outputs, not a kernel's internal scratch."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, int] = {}  # storage address -> live tensors on it
        self.nbytes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, address: int) -> None:
        self.tensors[address] -= 1
        if not self.tensors[address]:
            del self.tensors[address]
            self.live -= self.nbytes.pop(address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made_outside = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            address = leaf.untyped_storage().data_ptr()
            if address not in self.tensors:
                if address in made_outside:
                    continue  # a view or in-place result of a tensor made before the mode
                self.tensors[address], self.nbytes[address] = 0, leaf.untyped_storage().nbytes()
                self.live += self.nbytes[address]
                self.peak = max(self.peak, self.live)
            self.tensors[address] += 1
            weakref.finalize(leaf, self._release, address)
        return out


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_no_tensor_has_n_times_n_elements(kind):
    n, d, tile = 600, 8, 64
    tiled, dense = LOSSES[kind]
    inputs = _inputs(n, d, 14.0, -10.0, torch.float64)
    sizes = {}
    for name, loss_fn in (("tiled", tiled(tile)), ("dense", dense)):
        with _LargestTensor() as mode:
            loss_fn(*inputs).backward()
        sizes[name] = mode.largest
    # O(N·D + tile²): the largest is a tile block or a feature matrix
    assert sizes["tiled"] <= max(tile * tile, n * d) < n * n // 50, sizes
    # teeth: the dense formula does build the N×N logits, and the mode sees it
    assert sizes["dense"] >= n * n, sizes


def _shard_sizes(n: int, ranks: int) -> list[int]:
    return [len(part) for part in torch.arange(n).tensor_split(ranks)]


def _sharded_parts(kind: str, inputs, rows_per_rank: list[int], tile: int) -> list[list[torch.Tensor]]:
    """Every rank's part of the loss and its gradients, computed in one process, with the column log-sum-exp
    over all ranks' rows supplied as the window's exchange would (here: the dense one)."""
    image, text, scale, bias = inputs
    full_column_lse = pairwise_logits(image, text, scale, bias).detach().logsumexp(dim=0)
    loss_fn = LOSSES[kind][0](tile)
    offset, per_rank = 0, []
    for rows in rows_per_rank:
        rank_rows = slice(offset, offset + rows)
        # the partial this rank hands to the exchange covers its own rows only
        expected_partial = pairwise_logits(image[rank_rows], text, scale, bias).detach().logsumexp(dim=0)

        def reduce_column_lse(partial, expected=expected_partial):
            assert torch.allclose(partial, expected, rtol=1e-13, atol=0)
            return full_column_lse

        part = loss_fn.sharded(image[rank_rows], text, scale, bias, row_offset=offset,
                               reduce_column_lse=reduce_column_lse)
        per_rank.append([part.detach(), *torch.autograd.grad(part, [t for t in inputs if t is not None])])
        offset += rows
    return per_rank


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("rows_per_rank", [[1, 1], [3, 1, 5], [4, 4, 4, 4], [1, 6, 2, 3]])
def test_sharded_parts_sum_to_the_whole_loss_and_gradient(kind, rows_per_rank):
    n = sum(rows_per_rank)
    inputs = _inputs(n, 5, 3.0, -1.0, torch.float64, seed=n)  # soft probabilities: every rank's block matters
    reference = _loss_and_grads(LOSSES[kind][1], inputs)
    scales = _floors(inputs, n)
    per_rank = _sharded_parts(kind, inputs, rows_per_rank, tile=3)
    offsets = [sum(rows_per_rank[:r]) for r in range(len(rows_per_rank) + 1)]
    for rank, (_, image_grad, *_) in enumerate(per_rank):
        # a rank's block touches only its own image rows, and gives them their whole gradient
        assert not image_grad[: offsets[rank]].any() and not image_grad[offsets[rank + 1] :].any()
    # what the window does: loss values and scalar gradients summed over ranks, text rows reduce-scattered
    summed = [sum(values) for values in zip(*per_rank, strict=True)]
    assert _worst_relative_error(summed, reference, scales) <= 1e-12
    # teeth: a rank keeping its own block's gradient for its text rows (no reduce-scatter), and a rank
    # keeping its own block's logit_scale gradient (not summed), each miss the window's gradient
    own_text = torch.cat([grads[2][offsets[r] : offsets[r + 1]] for r, grads in enumerate(per_rank)])
    assert _worst_relative_error([own_text], [reference[2]], [0.0]) > 1e-3
    assert _worst_relative_error([per_rank[0][3]], [reference[3]], [0.0]) > 1e-3


def _loss_flops(kind: str, inputs, rows_per_rank: list[int]) -> int:
    """FLOPs of rank 0's part of the loss, forward and backward."""
    image, text, scale, bias = inputs
    loss_fn = LOSSES[kind][0](64)
    full_column_lse = pairwise_logits(image, text, scale, bias).detach().logsumexp(dim=0)
    with FlopCounterMode(display=False) as counter:
        part = loss_fn.sharded(image[: rows_per_rank[0]], text, scale, bias, row_offset=0,
                               reduce_column_lse=lambda _: full_column_lse)
        part.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_rank_s_loss_flops_fall_as_one_over_r(kind):
    n = 512
    inputs = _inputs(n, 16, 14.0, -10.0, torch.float64)
    whole = _loss_flops(kind, inputs, [n])
    for ranks in (2, 4):
        ratio = _loss_flops(kind, inputs, _shard_sizes(n, ranks)) / whole
        assert ratio == pytest.approx(1 / ranks, rel=0.02), (ranks, ratio)


@pytest.mark.parametrize("siglip", [False, True], ids=["clip", "siglip"])
@pytest.mark.parametrize("method", ["cache", "replay"])
def test_window_with_small_tiles_equals_dense_full_batch(siglip, method):
    # tiles of 2 rows over 7 examples: several tiles, an uneven last one, the diagonal across tile borders
    model, batch = tiny_model(siglip), naflex_window(7, seed=11)
    reference = full_batch_gradients(model, siglip_loss_dense if siglip else clip_loss_dense, batch, scale=1.0)
    for sizes, mode, reference_batch_size, scale in (([3, 1, 3], "linear", 2, 7 / 6), ([2, 5], "sqrt", 5, 0.7**0.5)):
        model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(model, create_loss("siglip" if siglip else "clip", tile_size=2),
                                     split_batch(batch, sizes),
                                     loss_scale=mode, reference_batch_size=reference_batch_size, method=method)
        assert stats.scale == pytest.approx(scale)
        assert not failures(model, {name: grad * scale for name, grad in reference.items()}), sizes


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_tile_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=f"tile_size must be a positive integer, got {bad!r}"):
        create_loss("clip", tile_size=bad)


def test_mismatched_rows_are_named():
    image, text, scale, _ = _inputs(4, 3, 10.0, None, torch.float64)
    with pytest.raises(ValueError, match="4 image rows but 3 text rows"):
        ClipLoss()(image, text[:3], scale)
    with pytest.raises(ValueError, match=r"image rows \[2, 6\) are not a non-empty part of the 4 text rows"):
        SigLipLoss().sharded(image, text, scale, row_offset=2)


def test_loss_tile_size_flag_in_train_and_verify(capsys):
    from naflexclip.cli import main

    assert main(["train", "--loss-tile-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "naflexclip train: error: --loss-tile-size must be >= 1, got 0"
    assert main(["verify", "--loss-tile-size", "0"]) == 2
    assert capsys.readouterr().out.strip() == (
        "naflexclip verify: error: --loss-tile-size / tile_size must be a positive integer, got 0"
    )
    # several tiles over the verify window (8 examples in tiles of 3): still exact, cache and replay
    assert main(["verify", "--loss-tile-size", "3", "--splits", "1", "--accum-freq", "2", "--batch-size", "4"]) == 0
    assert "FAIL" not in capsys.readouterr().out

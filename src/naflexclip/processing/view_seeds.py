"""Each example's `view_seed`: the seed of its self-distillation crops and mask, drawn by the data pipeline and
read by the objective, so every split, replay and resume sees the same views."""

from __future__ import annotations

import hashlib

VIEW_SEED = "view_seed"  # example_inputs column: each example's seed of its crops and mask


def sample_view_seed(seed: int, epoch: int, sample_key: str) -> int:
    """A sample's `view_seed` in an epoch: a function of (seed, epoch, key) alone, as a sample's decoder example and
    caption choice are, so every split, rank count, replay and resume sees the same crops and mask (62 bits: the mask
    stream's offset stays inside torch's seed range)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{sample_key}:views".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2

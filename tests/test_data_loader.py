"""Loader on the built-in dataset: batch format, NaFlexVit forward, workers, ranks, resume, val, zero-shot."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from timm.models.naflexvit import NaFlexVit

from naflexclip.data import DataConfig, build_loader, build_zero_shot_loader
from naflexclip.data.synthetic import (
    COLOURS,
    SHAPES,
    SIZES,
    synthetic_sample,
    zero_shot_prompt_ensemble,
    zero_shot_prompts,
)
from naflexclip.processing.naflex_transform import tokenize

PATCH, CONTEXT = 8, 16


def small_cfg(**kwargs) -> DataConfig:
    base = dict(naflex_seq_lens=(16, 32, 64), naflex_max_tokens_per_batch=256, synthetic_train_size=40,
                synthetic_val_size=20, workers=0, seed=1)
    base.update(kwargs)
    return DataConfig(**base)


def batches(cfg: DataConfig, **kwargs) -> list[dict]:
    return list(build_loader(cfg, patch_size=PATCH, context_length=CONTEXT, **{"split": "train", **kwargs}))


def iter_epoch_indices(loader) -> list[list[int]]:
    """The dataset indices each planned microbatch of a map-style loader's epoch reads, in order."""
    return [loader.order[b.offset: b.offset + b.batch_size].tolist() for b in loader.schedule]


def test_batch_format_and_budget():
    cfg = small_cfg()
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    got = list(loader)
    assert len(got) == len(loader) == loader.num_batches
    assert sum(b["text"].shape[0] for b in got) == loader.num_samples == 40
    for b, planned in zip(got, loader.schedule, strict=True):
        image = b["image"]
        B, L = planned.batch_size, planned.seq_len
        assert image["patches"].shape == (B, L, PATCH * PATCH * 3) and image["patches"].dtype == torch.float32
        assert image["patch_coord"].shape == (B, L, 2) and image["patch_coord"].dtype == torch.long
        assert image["patch_valid"].shape == (B, L) and image["patch_valid"].dtype == torch.bool
        assert b["text"].shape == (B, CONTEXT) and b["text"].dtype == torch.long
        assert B * L <= cfg.naflex_max_tokens_per_batch
        assert b["num_tokens"] == int(image["patch_valid"].sum()) <= B * L
        assert (image["patches"][~image["patch_valid"]] == 0).all()
        assert image["patch_valid"][:, 0].all()  # every image has at least one patch


def test_patches_match_timm_layout_and_run_through_naflexvit():
    """Our batch equals timm's own Patchify output, and NaFlexVit embeds it."""
    from timm.data.naflex_transforms import Patchify, ResizeToSequence
    from torchvision.transforms import functional as F

    cfg = small_cfg(synthetic_val_size=3)
    batch = next(iter(build_loader(cfg, split="val", patch_size=PATCH, context_length=CONTEXT)))
    img, _ = synthetic_sample(cfg.synthetic_seed, "val", 0)
    resized = ResizeToSequence(PATCH, 64, interpolation="bicubic")(img)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    ref = Patchify(PATCH)(F.normalize(F.to_tensor(resized), mean, std))
    n = ref["patches"].shape[0]
    assert torch.equal(batch["image"]["patch_coord"][0, :n], ref["patch_coord"])
    assert int(batch["image"]["patch_valid"][0].sum()) == n
    torch.testing.assert_close(batch["image"]["patches"][0, :n], ref["patches"], atol=1e-5, rtol=0)

    model = NaFlexVit(patch_size=PATCH, embed_dim=32, depth=1, num_heads=2, num_classes=0).eval()
    with torch.no_grad():
        features = model(batch["image"])
    assert features.shape == (batch["text"].shape[0], 32) and torch.isfinite(features).all()


def test_workers_yield_the_same_batches_as_one_process():
    one = batches(small_cfg(workers=0))
    three = batches(small_cfg(workers=2))
    assert [b["keys"] for b in one] == [b["keys"] for b in three]
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a["image"]["patches"], b["image"]["patches"])
        assert torch.equal(a["text"], b["text"])
    keys = [k for b in one for k in b["keys"]]
    assert sorted(keys, key=int) == [str(i) for i in range(40)]  # each sample exactly once


def test_epochs_reshuffle_and_repeat_deterministically():
    cfg = small_cfg()
    e0 = [b["keys"] for b in batches(cfg, epoch=0)]
    assert e0 == [b["keys"] for b in batches(cfg, epoch=0)]
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    assert [b["keys"] for b in loader] == [b["keys"] for b in loader] == e0  # iterating again replays the epoch
    assert e0 != [b["keys"] for b in batches(cfg, epoch=1)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_sees_exactly_the_remaining_batches(workers):
    cfg = small_cfg(workers=workers, augment=True)
    full = batches(cfg, epoch=1)
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=1)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    state = loader.state_dict()
    assert state["position"] == 3 and state["epoch"] == 1
    resumed = batches(cfg, epoch=1, start_batch=state["position"])
    assert [b["keys"] for b in resumed] == [b["keys"] for b in full[3:]]
    for a, b in zip(resumed, full[3:], strict=True):  # augmentation replays too
        assert torch.equal(a["image"]["patches"], b["image"]["patches"])


@pytest.mark.parametrize("workers", [0, 2])
def test_loading_leaves_the_training_process_random_streams_alone(workers):
    """The augment crops draw from their own generator and the DataLoader from its own: the model's dropout,
    init and the like in the training process never depend on the data pipeline."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    augmented = batches(small_cfg(workers=workers, augment=True))
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])
    plain = batches(small_cfg(workers=workers))
    assert any(not torch.equal(a["image"]["patches"], b["image"]["patches"]) for a, b in zip(augmented, plain,
                                                                                            strict=True))


def test_simulated_ranks_share_batch_count_and_cover_the_epoch():
    cfg = small_cfg(synthetic_train_size=41)
    loaders = [build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r, world_size=3)
               for r in range(3)]
    assert len({len(ld) for ld in loaders}) == 1
    assert [[b.seq_len for b in ld.schedule] for ld in loaders] == [[b.seq_len for b in loaders[0].schedule]] * 3
    seen = Counter(k for ld in loaders for idx in iter_epoch_indices(ld) for k in idx)
    assert seen == Counter(range(41))  # one global permutation: every sample once, no wrap-around repeat
    keys = Counter(k for ld in loaders for b in ld for k in b["keys"])
    assert keys == Counter(str(i) for i in range(41))


def test_val_split_is_deterministic_fixed_length_and_disjoint_from_train():
    cfg = small_cfg()
    val = list(build_loader(cfg, split="val", patch_size=PATCH, context_length=CONTEXT))
    assert {b["seq_len"] for b in val} == {64}
    assert [k for b in val for k in b["keys"]] == [str(i) for i in range(20)]
    again = list(build_loader(cfg, split="val", patch_size=PATCH, context_length=CONTEXT, epoch=5))
    assert all(torch.equal(a["image"]["patches"], b["image"]["patches"]) for a, b in zip(val, again, strict=True))
    train_pixels = {synthetic_sample(0, "train", i)[0].tobytes() for i in range(200)}
    assert not any(synthetic_sample(0, "val", i)[0].tobytes() in train_pixels for i in range(200))


def test_synthetic_dataset_is_deterministic_and_varied():
    sizes, captions = [], set()
    for i in range(60):
        img, caption = synthetic_sample(3, "train", i)
        again, caption2 = synthetic_sample(3, "train", i)
        assert img.tobytes() == again.tobytes() and caption == caption2
        w, h = img.size
        assert 40 <= w <= 520 and 40 <= h <= 520 and 0.24 <= w / h <= 4.1
        sizes.append((w, h))
        captions.add(caption)
        named = [s for s in SHAPES if s in caption]
        assert named and any(c in caption for c in COLOURS) and any(s in caption for s in SIZES)
    assert len(captions) == 60 and len(set(sizes)) > 50
    assert max(w / h for w, h in sizes) > 2 and min(w / h for w, h in sizes) < 0.5


def test_zero_shot_prompts_and_loader():
    assert len(zero_shot_prompts("shape")) == len(SHAPES) >= 6
    assert len(zero_shot_prompts("colour")) == len(COLOURS) >= 8
    assert all(SHAPES[k] in p for k, p in enumerate(zero_shot_prompts("shape")))
    ensemble = zero_shot_prompt_ensemble("colour")
    assert all(all(COLOURS[k] in t for t in texts) for k, texts in enumerate(ensemble))
    with pytest.raises(ValueError, match="texture"):
        zero_shot_prompts("texture")
    loader = build_zero_shot_loader(small_cfg(), patch_size=PATCH, context_length=CONTEXT, num_samples=12)
    got = list(loader)
    labels = torch.cat([b["labels"]["shape"] for b in got])
    assert labels.shape == (12,) and labels.max() < len(SHAPES)
    assert torch.cat([b["labels"]["colour"] for b in got]).max() < len(COLOURS)
    assert sum(b["image"]["patches"].shape[0] for b in got) == 12


def test_tokenize_uses_open_clip_vocab():
    tokens = tokenize(["a small red circle", "x " * 100], context_length=CONTEXT)
    assert tokens.shape == (2, CONTEXT) and tokens.dtype == torch.long
    assert tokens[0, 0] == 49406 and 49407 in tokens[0].tolist()  # <start_of_text> ... <end_of_text>
    assert tokens[1, -1] == 49407  # truncated, still ends with EOT
    assert int(tokens.max()) < 49408


def test_shape_groups_differ_only_in_their_shapes():
    for group in range(6):
        members = [synthetic_sample(0, "train", 3 * group + j, shape_group_size=3) for j in range(3)]
        sizes = {img.size for img, _ in members}
        assert len(sizes) == 1  # same canvas, so same aspect and sequence layout
        masked = []
        for _, caption in members:
            for shape in SHAPES:
                caption = caption.replace(shape, "<shape>")
            masked.append(caption)
        assert len(set(masked)) == 1, masked  # same template, colours, sizes and order
        slots = [[s for s in caption.split() if s.strip(".,") in SHAPES] for _, caption in members]
        for slot in zip(*slots, strict=True):  # every object slot has a different shape in each member
            assert len(set(slot)) == 3
        assert len({img.tobytes() for img, _ in members}) == 3
    assert synthetic_sample(0, "train", 7, shape_group_size=1)[1] == synthetic_sample(0, "train", 7)[1]


def test_shape_groups_reach_the_loader_together_in_train_only():
    cfg = small_cfg(synthetic_shape_group_size=2, synthetic_train_size=40)
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    flat = [i for batch in iter_epoch_indices(loader) for i in batch]
    assert sorted(flat) == list(range(40))
    assert all(flat[k] // 2 == flat[k + 1] // 2 for k in range(0, 40, 2))
    val = build_loader(cfg, split="val", patch_size=PATCH, context_length=CONTEXT)
    assert val.source.group_size == 1


def test_a_sigterm_while_workers_start_does_not_kill_one(monkeypatch) -> None:
    """A SIGTERM to the process group (torchrun's agent stopping a run) can reach a DataLoader worker before its
    worker_init_fn makes it ignore SIGTERM; torch's worker handler then exits, and the loader fails with "worker
    exited unexpectedly" (seen when the signal came while an evaluation started its workers). Workers start with
    SIGTERM blocked, so the early signal is dropped. Here each worker signals itself before its init runs."""
    import os
    import signal

    import naflexclip.data.loader as loader_module

    init = loader_module._worker_init

    def signalled_first(worker_id: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        init(worker_id)

    monkeypatch.setattr(loader_module, "_worker_init", signalled_first)
    assert len(batches(small_cfg(workers=2))) == len(batches(small_cfg(workers=0)))


class _PidSource:
    """A map-style source whose samples are named by the process that read them."""

    name, index_skips, group_size = "pid source", [], 1

    def __len__(self) -> int:
        return 24

    def load(self, index: int):
        import os

        from naflexclip.data.source import RawSample
        from naflexclip.data.synthetic import synthetic_sample

        image, caption = synthetic_sample(0, "train", index)
        return RawSample(image, caption, None, f"{os.getpid()}:{index}")

    def describe(self, index: int) -> tuple[str, str, None]:
        return self.name, str(index), None


def test_workers_are_kept_from_one_epoch_to_the_next_and_each_epoch_stays_exact():
    """Worker processes start once per loader, not once per epoch (OpenCLIP's persistent workers), and a stop
    mid-epoch and a new epoch still read every sample once."""
    from naflexclip.data.map_loader import MapLoader
    from naflexclip.data.microbatch import MicrobatchBuilder
    from naflexclip.processing.naflex_transform import default_processing

    cfg = small_cfg()
    loader = MapLoader(_PidSource(), split="train", budget=cfg.token_budget(), seed=0, shuffle=True, workers=2,
                       builder=MicrobatchBuilder(patch_size=PATCH, context_length=CONTEXT,
                                                 processing=default_processing(PATCH)))
    pids, per_epoch = set(), []
    for epoch in range(3):
        loader.set_epoch(epoch)
        keys = [k for b in loader for k in b["keys"]]
        pids |= {k.split(":")[0] for k in keys}
        per_epoch.append(sorted(int(k.split(":")[1]) for k in keys))
        if epoch == 1:  # stopped after one microbatch, then the epoch again from its start
            loader.set_epoch(epoch)
            next(iter(loader))
    assert per_epoch == [list(range(24))] * 3
    assert len(pids) == 2, pids

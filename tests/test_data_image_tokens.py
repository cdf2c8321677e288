"""OpenCLIP's --naflex-num-train-image-tokens: an epoch is sized by an image-token budget instead of a sample count.
The samples per epoch are those whose planned microbatches (sequence lengths drawn from --seed, rows from the token
budget, the last microbatch trimmed to what is left, as OpenCLIP's NaFlexBatchScheduler plans) reach the budget;
every epoch is that many samples at any world size, so a resume continues it."""

from __future__ import annotations

import pytest

from naflexclip.data import DataConfig, DataError, build_loader
from naflexclip.data.schedule import SeqLenDraws, TokenBudget, build_schedule, samples_for_image_tokens

PATCH, CONTEXT = 8, 16
BUDGET = TokenBudget((16, 32, 48), 96, (1.0, 2.0, 1.0), 2)


def _openclip_token_walk(num_tokens: int, budget: TokenBudget, seed: int) -> int:
    """OpenCLIP's `_create_schedule_from_num_tokens` (one process) over our sequence-length draws."""
    draws, remaining, samples, i = SeqLenDraws(budget, seed, 0), num_tokens, 0, 0
    while remaining > 0:
        seq_len = draws(i)
        rows = min(budget.max_tokens, remaining) // seq_len // budget.divisor * budget.divisor
        rows = max(1, rows)
        samples, remaining, i = samples + rows, remaining - rows * seq_len, i + 1
    return samples


@pytest.mark.parametrize("num_tokens", [1, 95, 96, 1000, 12345])
def test_image_token_budget_gives_the_samples_whose_planned_microbatches_reach_it(num_tokens: int) -> None:
    num = samples_for_image_tokens(num_tokens, BUDGET, seed=3)
    assert num == _openclip_token_walk(num_tokens, BUDGET, 3)
    assert num != num_tokens // 32 or num_tokens < 96  # not the budget at the mean length
    plan = list(build_schedule(num, BUDGET, seed=3, epoch=0))  # the epoch planned of them: about the budget
    assert abs(sum(b.seq_len * b.batch_size for b in plan) - num_tokens) < BUDGET.max_tokens
    assert samples_for_image_tokens(num_tokens, BUDGET, seed=3) == num  # deterministic


def _folder(tmp_path, n: int) -> str:
    from conftest_data import image_bytes

    for i in range(n):
        (tmp_path / f"{i}.png").write_bytes(image_bytes(16 + i % 5, 20, seed=i))
        (tmp_path / f"{i}.txt").write_text(f"caption {i}")
    return str(tmp_path)


def test_image_token_budget_sizes_every_epoch_at_any_world_size(tmp_path) -> None:
    cfg = DataConfig(train_data=_folder(tmp_path, 40), naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=64,
                     workers=0, seed=1, naflex_num_train_image_tokens=600)
    num = samples_for_image_tokens(600, cfg.token_budget(), seed=1)
    assert 600 // 32 <= num <= 600 // 16 + 4
    for world_size in (1, 2):
        for epoch in (0, 1):
            loaders = [build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=epoch,
                                    rank=r, world_size=world_size) for r in range(world_size)]
            keys = [k for loader in loaders for batch in loader for k in batch["keys"]]
            assert loaders[0].samples_per_epoch == num and len(keys) == len(set(keys)) == num
    # a resume mid-epoch continues the same microbatches
    whole = [b["keys"] for b in build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=1)]
    rest = [b["keys"] for b in build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, epoch=1,
                                            start_batch=2)]
    assert rest == whole[2:] and len(rest) > 0


@pytest.mark.parametrize(("fields", "message"), [
    ({"naflex_num_train_image_tokens": 0}, "--naflex-num-train-image-tokens must be >= 1, got 0"),
    ({"naflex_num_train_image_tokens": 100, "train_num_samples": 10},
     "--naflex-num-train-image-tokens 100: sizes the epoch by image tokens; drop --train-num-samples 10"),
])
def test_bad_image_token_budgets_are_one_line(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


def test_an_image_token_budget_beyond_the_data_is_one_line(tmp_path) -> None:
    cfg = DataConfig(train_data=_folder(tmp_path, 6), naflex_seq_lens=(16,), naflex_max_tokens_per_batch=64,
                     workers=0, naflex_num_train_image_tokens=16 * 100)
    with pytest.raises(DataError, match=r"--naflex-num-train-image-tokens 1600 plans 100 samples, more than the 6 "
                                        r"usable samples"):
        build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)


def test_openclips_image_token_flag_is_accepted_saved_and_refused_on_resume_change() -> None:
    """OpenCLIP main's own NaFlex parse test passes `--naflex-num-train-image-tokens 1024`."""
    from naflexclip.cli import build_parser
    from naflexclip.train.config.flags import config_from_args
    from naflexclip.train.config.train_config import OPENCLIP_DEFAULTS, TrainConfig
    from naflexclip.train.resume import POLICY, refusal

    def config(tokens: str) -> TrainConfig:
        return config_from_args(build_parser().parse_args(["train", "--model", "tiny",
                                                           "--naflex-num-train-image-tokens", tokens]))

    cfg = config("1024")
    assert cfg.data.naflex_num_train_image_tokens == 1024
    assert cfg.to_dict()["data"]["naflex_num_train_image_tokens"] == 1024
    assert OPENCLIP_DEFAULTS["data.naflex_num_train_image_tokens"] is None
    assert POLICY["data.naflex_num_train_image_tokens"][0] == "refuse"
    assert refusal(cfg.to_dict(), config("2048").to_dict()).startswith("--naflex-num-train-image-tokens: ")

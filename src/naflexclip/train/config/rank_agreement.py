"""Before the first step every rank of a job compares the whole config: ranks started with different settings
stop at once, each with one line naming the first flag that differs."""

from __future__ import annotations

from typing import Any

from naflexclip.parallel import process_group
from naflexclip.settings import flat_config
from naflexclip.train.config.settings_display import shown_setting_value
from naflexclip.train.config.train_config import SETTINGS, TrainConfig, flag_name

__all__ = ["check_ranks_agree", "settings_every_rank_shares"]


def settings_every_rank_shares(cfg: TrainConfig) -> dict[str, Any]:
    """The run's settings (data fields as `data.<name>`) that every rank of a job must be started with: all but
    those declared `per_rank` (a process's device, loader workers, timeout, logging). The data sources, the
    optimizer, the seed and the token budget among them: ranks that differ would train other data in place of
    the job's, apply other updates, or run out of data at different points."""
    return {key: value for key, value in flat_config(cfg.to_dict()).items() if not SETTINGS[key].setting.per_rank}


def check_ranks_agree(cfg: TrainConfig, env: process_group.DistributedEnv) -> None:
    """Before the first step: every rank was started with the same settings (`settings_every_rank_shares`), else
    ValueError on every rank at once: the first flag that differs, with rank 0's value and the other rank's."""
    every = process_group.gather_if_different(env, settings_every_rank_shares(cfg))
    if every is None:
        return
    reference = every[0]
    differing = [key for key in SETTINGS if key in reference
                 and any(repr(other.get(key)) != repr(reference[key]) for other in every[1:])]
    if not differing:
        return
    key = differing[0]
    rank = next(rank for rank, other in enumerate(every) if repr(other.get(key)) != repr(reference[key]))
    flags = list(dict.fromkeys(flag_name(k) for k in differing))
    more = f" ({len(flags)} settings differ: {', '.join(flags)})" if len(flags) > 1 else ""
    shown = [shown_setting_value(key, values.get(key)) for values in (every[rank], reference)]
    raise ValueError(f"{flag_name(key)}: rank {rank} has {shown[0]}, rank 0 {shown[1]}; every rank of a job must be "
                     f"started with the same settings{more}")

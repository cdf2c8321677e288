"""The NaFlex data pipeline: sources, timm NaFlex transform, open_clip tokenizer, token-budget loader.

Public API: `DataConfig`, `add_data_args`, `data_config_from_args`, `build_loader`,
`build_zero_shot_loader`, `tokenize`, `DataError`, and the built-in dataset in
`naflexclip.data.synthetic`.
"""

from naflexclip.data.config import DataConfig, add_data_args, data_config_from_args
from naflexclip.data.loader import NaFlexLoader, build_loader, build_zero_shot_loader
from naflexclip.data.readers import DataError
from naflexclip.data.samples import SKIP_REASONS
from naflexclip.data.schedule import batch_size_for, build_schedule
from naflexclip.data.transform import tokenize

__all__ = [
    "SKIP_REASONS",
    "DataConfig",
    "DataError",
    "NaFlexLoader",
    "add_data_args",
    "batch_size_for",
    "build_loader",
    "build_schedule",
    "build_zero_shot_loader",
    "data_config_from_args",
    "tokenize",
]

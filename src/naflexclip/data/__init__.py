"""The NaFlex data pipeline: sources, timm NaFlex transform, open_clip tokenizer, token-budget loader.

Public API: `DataConfig`, `add_data_args`, `data_config_from_args`, `build_loader`, `build_zero_shot_loader`,
`TeacherInputs`, `DataError`; the built-in dataset is `naflexclip.data.synthetic`. The package knows no pretrained
family: the caller hands the loaders a model's tokenizer and patching as a `Processing`
(`naflexclip.processing.naflex_transform`; a model's own: `naflexclip.families.data_processing`). docs/data.md.
"""

from naflexclip.data.build import build_loader, build_zero_shot_loader
from naflexclip.data.data_config import DataConfig, add_data_args, data_config_from_args
from naflexclip.data.loader import NaFlexLoader
from naflexclip.data.map_loader import MapLoader
from naflexclip.data.microbatch import TeacherInputs
from naflexclip.data.samples import SKIP_REASONS
from naflexclip.data.schedule import TokenBudget, build_schedule
from naflexclip.data.source import DataError, Source
from naflexclip.data.stream_loader import StreamLoader

__all__ = [
    "SKIP_REASONS",
    "DataConfig",
    "DataError",
    "MapLoader",
    "NaFlexLoader",
    "Source",
    "StreamLoader",
    "TeacherInputs",
    "TokenBudget",
    "add_data_args",
    "build_loader",
    "build_schedule",
    "build_zero_shot_loader",
    "data_config_from_args",
]

"""How a setting is shown: its value as typed (`shown_setting`), the settings that differ from OpenCLIP's defaults
(`openclip_differences`). The declarations' tables (`OPENCLIP_DEFAULTS`, `DEMO_DEFAULTS`, `flag_name`) are generated
from `TrainConfig` in `train.config.train_config`.
"""

from __future__ import annotations

from typing import Any

from naflexclip.settings import flat_config, shown_value
from naflexclip.train.config.train_config import OPENCLIP_DEFAULTS, SETTINGS, flag_name

__all__ = ["openclip_differences", "shown_setting", "shown_setting_value"]


def shown_setting_value(key: str, value: Any) -> str:
    """A config value as typed after its flag (`--aug-cfg`'s items as the Python literal OpenCLIP reads); an on/off
    setting as its flag reads, `on` where the flag is given (`--no-plot on` is plotting off)."""
    if isinstance(value, bool) and key in SETTINGS:
        return "on" if value != SETTINGS[key].default else "off"
    if flag_name(key).endswith("=") and isinstance(value, (list, tuple)):
        return repr(tuple(value))
    return shown_value(value)


def shown_setting(key: str, value: Any) -> str:
    """A config setting as typed: `--naflex-seq-lens 128 256`, `--aug-cfg scale=(0.5, 1.0)`."""
    flag = flag_name(key)
    return f"{flag}{'' if flag.endswith('=') else ' '}{shown_setting_value(key, value)}"


def openclip_differences(config: dict[str, Any]) -> list[str]:
    """The settings of `config` (`TrainConfig.to_dict()`) that differ from OpenCLIP's defaults, as
    `--flag value (OpenCLIP: value)`."""
    flat = flat_config(config)
    plain = {key: tuple(v) if isinstance(v, list) else v for key, v in flat.items()}
    defaults = dict(OPENCLIP_DEFAULTS)
    if str(flat.get("opt", "")).startswith("timm/"):  # OpenCLIP leaves a timm optimizer its own betas and eps
        defaults.update(beta1=None, beta2=None, eps=None)
    if flat.get("naflex_loss_scale") == "none":  # --batch-size then changes nothing (a note says so when given)
        defaults.pop("batch_size", None)
    return [f"{shown_setting(key, flat[key])} (OpenCLIP: {shown_setting_value(key, default)})"
            for key, default in defaults.items() if key in plain and plain[key] != default]

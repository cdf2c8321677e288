"""OpenCLIP's defaults and how a setting is shown: `OPENCLIP_DEFAULTS` (open_clip_train's, for every flag naflexclip
shares with it), `DEMO_DEFAULTS` (the built-in dataset's), a config key's flag (`flag_name`) and its value as typed
(`shown_setting`), the settings that differ from OpenCLIP's (`openclip_differences`), OpenCLIP's `key=value` flags
(`parse_kwargs`).
"""

from __future__ import annotations

import ast
import re
import shlex
from typing import Any

# open_clip_train/params.py (and get_default_params for a ViT) for every flag naflexclip shares with it, as config
# keys (data fields as `data.<name>`). The CLI defaults to them with --train-data; the run's first lines name the
# settings that differ from them. --model (RN50 there) and where logs go are not compared.
OPENCLIP_DEFAULTS: dict[str, Any] = {
    "precision": "amp_bf16", "warmup": 10000, "epochs": 32, "accum_freq": 1, "grad_clip_norm": None,
    "lr": 5e-4, "wd": 0.2, "beta1": 0.9, "beta2": 0.98, "eps": 1e-6, "batch_size": 64, "seed": 0,
    "log_every_n_steps": 100, "log_metric_every_n_steps": 10, "save_frequency": 1, "val_frequency": 1,
    "zeroshot_frequency": 2,
    "naflex_loss_scale": "none", "fsdp": False, "grad_checkpointing": False, "torchcompile": False,
    "lock_image": False, "lock_image_unlocked_groups": 0, "lock_text": False, "lock_text_unlocked_layers": 0,
    "lock_text_freeze_layer_norm": False,
    "data.naflex_seq_lens": (128, 256, 576, 784, 1024), "data.naflex_seq_len_probs": None,
    "data.naflex_max_tokens_per_batch": 16384, "data.naflex_batch_divisor": 8, "data.workers": 4,
    "data.train_num_samples": None, "data.naflex_num_train_image_tokens": None, "data.dataset_type": "auto",
    "data.csv_img_key": "filepath",
    "data.csv_caption_key": "title", "data.csv_separator": "\t",
    "opt": "adamw", "opt_kwargs": {}, "momentum": None, "wd_exclude": (), "opt_fallback_list": (),
    "image_layer_decay": None,
    "text_layer_decay": None, "lr_scheduler": "cosine", "epochs_cooldown": None, "lr_cooldown_end": 0.0,
    "lr_cooldown_power": 1.0, "skip_scheduler": False,
    "save_most_recent": False, "delete_previous_checkpoint": False, "remote_sync": None,
    "remote_sync_frequency": 300, "remote_sync_protocol": "s3", "log_local": False, "debug": False,
    "force_context_length": None, "force_patch_dropout": None, "force_image_size": None,
    "data.image_mean": None, "data.image_std": None, "data.image_interpolation": None, "data.aug_scale": None,
    "data.aug_ratio": None, "data.naflex_patch_sizes": None, "data.naflex_patch_size_probs": None,
}
# the built-in dataset's own values where they differ from OpenCLIP's (the demo: docs/demo.md); TrainConfig's
# field defaults are these, the data ones are the CLI's defaults without --train-data
DEMO_DEFAULTS: dict[str, Any] = {
    "precision": "fp32", "warmup": 20, "epochs": 3, "accum_freq": 2, "grad_clip_norm": 1.0, "lr": 1e-3, "wd": 0.1,
    "batch_size": None, "log_every_n_steps": 1, "log_metric_every_n_steps": 1,
    "data.naflex_seq_lens": (36, 64, 100), "data.naflex_max_tokens_per_batch": 1024, "data.naflex_batch_divisor": 1,
    "data.workers": 2,
}


def shown_value(value: Any) -> str:
    """A flag's value as typed on the command line (`unset` for None, a list space-separated, a string quoted
    where it holds a space or comma)."""
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return " ".join(shown_value(v) for v in value)
    text = str(value)
    return shlex.quote(text) if isinstance(value, str) and (not text or re.search(r"[\s,']", text)) else text


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict with its data fields as `data.<name>`."""
    flat = {key: value for key, value in config.items() if key != "data"}
    flat.update({f"data.{key}": value for key, value in config.get("data", {}).items()})
    return flat


# config keys whose flag is not `--` + the field's name (an `--aug-cfg` item ends in `=`: its value follows it)
FLAG_NAMES: dict[str, str] = {"data.aug_scale": "--aug-cfg scale=", "data.aug_ratio": "--aug-cfg ratio=",
                              "data.multi_caption": "--multi-positive", "data.hf_processor": "--pretrained"}


def flag_name(key: str) -> str:
    """The flag of a config key (`data.naflex_seq_lens` -> `--naflex-seq-lens`, `data.aug_scale` ->
    `--aug-cfg scale=`)."""
    return FLAG_NAMES.get(key) or "--" + key.rsplit(".", 1)[-1].replace("_", "-")


def shown_setting_value(key: str, value: Any) -> str:
    """A config value as typed after its flag (`--aug-cfg`'s items as the Python literal OpenCLIP reads)."""
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
    return [f"{shown_setting(key, flat[key])} (OpenCLIP: {shown_setting_value(key, default)})"
            for key, default in defaults.items() if key in plain and plain[key] != default]


def parse_kwargs(items: list[str] | None, flag: str) -> dict[str, Any]:
    """OpenCLIP's `key=value ...` flags (--opt-kwargs, --aug-cfg): each value a Python literal, else a string."""
    values: dict[str, Any] = {}
    for item in items or []:
        if not item:
            continue
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag}: {item!r} is not key=value")
        try:
            values[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            values[key] = text  # OpenCLIP's fallback: a string needs no quotes on the command line
    return values

"""Each setting declared once (`naflexclip.settings`): every flag of `naflexclip train` reaches the config, every
config field has a resume rule, the Python API and the command line share defaults, and a config saved before the
declarations resumes unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from naflexclip.cli import build_parser
from naflexclip.data.data_config import DataConfig
from naflexclip.families.factory import ModelSettings
from naflexclip.models.lock import Locks
from naflexclip.objectives.distillation import Distill
from naflexclip.objectives.siglip2_recipe import Recipe
from naflexclip.parallel.process_group import DeviceSettings
from naflexclip.rng import Seed
from naflexclip.settings import RULES, declared, flat_config, setting, settings_of, undeclared_destinations
from naflexclip.train.config.flags import config_from_args
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.resume import POLICY, changed_flags, refusal
from naflexclip.window.window_settings import WindowSettings

# what `train` reads itself besides the settings: the refused OpenCLIP flags (the first one stops the run)
COMMAND_DESTINATIONS = ("openclip_refused",)


def _train_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["train"]


def _config(line: str = "") -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *shlex.split(line)]))


def test_every_flag_of_train_reaches_the_config() -> None:
    assert undeclared_destinations(_train_parser(), TrainConfig, COMMAND_DESTINATIONS) == []


def test_a_flag_no_setting_reads_is_found() -> None:
    """Teeth: a flag added to the parser by hand, not declared, is named."""
    parser = _train_parser()
    parser.add_argument("--fsdp-something", type=int, default=1)
    assert undeclared_destinations(parser, TrainConfig, COMMAND_DESTINATIONS) == ["--fsdp-something (fsdp_something)"]


def test_every_config_field_has_a_resume_rule() -> None:
    keys = set(flat_config(TrainConfig().to_dict()))
    assert set(POLICY) == keys, sorted(set(POLICY) ^ keys)
    assert all(rule in RULES for rule, _ in POLICY.values())


def test_a_field_without_a_declaration_or_a_rule_is_refused() -> None:
    """Teeth: a plain field (a new data-order setting added without its rule) is a TypeError naming it, and a
    setting cannot be declared without a rule."""

    @dataclasses.dataclass
    class Grown(DataConfig):
        shard_shuffle: bool = False

    with pytest.raises(TypeError, match="Grown.shard_shuffle is not declared as a setting"):
        settings_of(Grown)
    with pytest.raises(TypeError, match="rule"):
        setting(False)  # type: ignore[call-arg]


@pytest.mark.parametrize("group", [ModelSettings, WindowSettings, DeviceSettings, Seed, Locks, Distill, Recipe])
def test_the_shared_groups_are_kept_flat_in_the_train_config_as_declared(group: type) -> None:
    """Verify takes the model, window, device, seed, lock, distillation and recipe flags too: TrainConfig keeps each
    of their fields with the group's own annotation, default and declaration."""
    train = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(group):
        assert (train[f.name].type, train[f.name].default, train[f.name].metadata) == (f.type, f.default, f.metadata)


def test_the_python_api_and_the_command_line_share_their_defaults() -> None:
    assert TrainConfig().to_dict() == _config().to_dict()
    assert DataConfig().synthetic_train_size == 3072 == _config().data.synthetic_train_size


def test_a_config_saved_before_the_declarations_resumes_unchanged() -> None:
    """A run config written by the hand-mapped flags (every key, a locked tower, --aug-cfg, --opt-kwargs) loads, and
    the same flags today give the same config: nothing refused, nothing applied."""
    saved = json.loads((Path(__file__).parent / "saved_run_config.json").read_text())
    config = _config(saved["flags"]).to_dict()
    # settings declared since the file was written (--fsdp-checkpoint, --trust-sizes-json, ...) are there at their
    # defaults
    added = set(config) - set(saved["config"])
    added_data = set(config["data"]) - set(saved["config"]["data"])
    defaults = TrainConfig().to_dict()
    assert {key: config[key] for key in added} == {key: defaults[key] for key in added}
    assert {key: config["data"][key] for key in added_data} == {key: defaults["data"][key] for key in added_data}

    def as_saved(values: dict) -> dict:
        kept = {key: value for key, value in values.items() if key not in added}
        kept["data"] = {key: value for key, value in kept["data"].items() if key not in added_data}
        return json.loads(json.dumps(kept))

    assert as_saved(config) == saved["config"]
    assert as_saved(TrainConfig.from_dict(saved["config"]).to_dict()) == saved["config"]
    assert refusal(saved["config"], config) is None and changed_flags(saved["config"], config) == []
    other = _config(saved["flags"].replace("--lock-image-unlocked-groups 1", "--lock-image-unlocked-groups 2"))
    assert "--lock-image-unlocked-groups: the checkpoint has 1, this run 2" in refusal(saved["config"], other.to_dict())


def _switches(config: type) -> list:
    """The settings a flag switches on (store_true), but for the negative flags themselves (--no-plot)."""
    return [d for d in declared(config) if d.has_flag and d.annotation == "bool" and d.default is False
            and d.setting.action is None and not d.flag.startswith("--no-")]


def test_every_switch_of_train_has_a_no_form_that_turns_it_off() -> None:
    """A run started with a switch on can be resumed with it off: `--no-<flag>` after `--<flag>` gives False, for
    every switch declared; OpenCLIP's spelling still switches on, --no-plot stays as it was (no --no-no-plot)."""
    switches = _switches(TrainConfig)
    assert {"multi_positive", "grad_checkpointing", "lock_text_freeze_layer_norm", "skip_scheduler",
            "save_most_recent", "debug", "data.dataset_resampled"} <= {d.key for d in switches}
    for d in switches:
        negative = "--no-" + d.flag[2:]
        on = build_parser().parse_args(["train", d.flag])
        off = build_parser().parse_args(["train", d.flag, negative])
        assert (getattr(on, d.dest), getattr(off, d.dest)) == (True, False), d.flag
    flags = {flag for action in _train_parser()._actions for flag in action.option_strings}
    assert "--no-plot" in flags and "--no-no-plot" not in flags and "--no-no-set-device-rank" not in flags
    assert _config("--no-plot").plot is False and _config().plot is True


def test_help_shows_each_switch_with_its_no_form_on_one_line() -> None:
    text = _train_parser().format_help()
    assert "[--multi-positive | --no-multi-positive]" in " ".join(text.split())
    (line,) = [line for line in text.splitlines() if line.strip().startswith("--multi-positive,")]
    assert line.split() == ["--multi-positive,", "--no-multi-positive"]  # its help on the lines below


def test_verify_takes_the_no_form_of_the_switches_it_shares_with_train() -> None:
    """Verify's lock flags are unset unless given (a --checkpoint's own are taken): --no-lock-image says off."""
    assert build_parser().parse_args(["verify"]).lock_image is None
    args = build_parser().parse_args(["verify", "--no-lock-image", "--no-augment"])
    assert (args.lock_image, args.augment) == (False, False)


def test_a_resume_cannot_change_trust_sizes_json() -> None:
    """--trust-sizes-json plans another epoch where sizes.json under-counts a shard: a resume keeps it as it was."""
    saved = _config("--train-data shards/{0..3}.tar").to_dict()
    trusted = _config("--train-data shards/{0..3}.tar --trust-sizes-json").to_dict()
    message = refusal(saved, trusted)
    assert message is not None and "--trust-sizes-json: the checkpoint has off, this run on" in message
    assert refusal(trusted, trusted) is None


def test_the_code_maps_example_declaration_is_train_configs_own() -> None:
    """docs/code_map.md shows how a flag is declared with a field of `TrainConfig`: that field, as it is written."""
    root = Path(__file__).resolve().parents[1]
    example = (root / "docs" / "code_map.md").read_text().split("```python\n")[1].split("```")[0]
    source = (root / "src" / "naflexclip" / "train" / "config" / "train_config.py").read_text()
    assert "".join(example.split()) in "".join(source.split()), example

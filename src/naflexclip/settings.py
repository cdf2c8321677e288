"""Run settings, each declared once: a config dataclass field made with `setting(...)` carries its flag, help,
argparse type, OpenCLIP's default and its resume rule; the field's own default is the built-in dataset's (the
Python API's and the command line's without `--train-data`).

From those declarations come the parsers and their --help (`add_arguments`), the config a command line gives
(`values_from_args`), the resume policy, the defaults tables and the flag a saved key is shown with
(`settings_of`). `undeclared_destinations` finds a parser flag no setting reads; a config field declared without
`setting(...)` is a TypeError naming it. Adding a setting: docs/code_map.md, "Declaring a setting".
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# what a resume does with a setting whose value differs from the checkpoint's (`naflexclip.train.resume`)
APPLY = "apply"  # applied and named in the resume notice
REFUSE = "refuse"  # another value would be another run: the resume stops (`why` says what it would change)
RESCHEDULE = "reschedule"  # applied; defines the lr schedule, which is then re-planned over the steps left
IGNORE = "ignore"  # not compared: where a run writes, when it stops, on which devices, how it logs
RULES = (APPLY, REFUSE, RESCHEDULE, IGNORE)


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NOT_OPENCLIP = _Marker("NOT_OPENCLIP")  # naflexclip's own setting: no OpenCLIP default to compare with
FIELD_DEFAULT = _Marker("FIELD_DEFAULT")  # the parser's default is the field's
NO_FLAG = _Marker("NO_FLAG")  # the setting has no flag of its own (another flag, or the config's checks, set it)

# --help's sections of the settings several commands share (each group declared where its concept lives)
MODEL_SECTION = "model and window"
OPTIMIZATION_SECTION = "optimization"
DEVICES_SECTION = "devices"

_METADATA_KEY = "naflexclip.setting"
_NESTED_KEY = "naflexclip.nested"


@dataclass(frozen=True)
class Setting:
    """A setting's declaration (a field's metadata). `flag`: "" for `--` + the field's name; `NO_FLAG` when another
    flag sets it (`shown_as` then names that flag, `from_args` reads it). `type`, `nargs`, `choices`, `metavar`,
    `action`: add_argument's, where the field's annotation does not say them. `per_rank`: why the ranks of a job may
    differ in it (most settings must agree). `convert`: the flag's value to the field's. `reads`: the parser
    destinations `from_args` reads."""

    rule: str
    why: str = ""
    help: str | None = None
    section: str = ""
    flag: Any = ""
    aliases: tuple[str, ...] = ()
    dest: str = ""
    shown_as: str = ""
    openclip: Any = NOT_OPENCLIP
    # add_argument's, where the field's annotation does not say them
    type: Any = None
    nargs: str | None = None
    choices: Any = None
    metavar: str | None = None
    action: str | None = None
    flag_default: Any = FIELD_DEFAULT
    convert: Callable[[Any], Any] | None = None
    from_args: Callable[[argparse.Namespace], Any] | None = None
    reads: tuple[str, ...] = ()
    # more flags for the same destination, each (option strings, add_argument's kwargs): `--siglip` of --loss
    also: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = ()
    # why each rank of a job may have its own value (its device, its loader processes); "": every rank must agree,
    # checked before the first step (`train.config.rank_agreement.check_ranks_agree`)
    per_rank: str = ""
    # how this job runs on its hardware, not what it trains (--fsdp: exact either way): a resume takes the command
    # line's value, not the run's saved one (a flag that is only switched on could not be switched off)
    runtime: bool = False
    # how --help states the default where the flag's default does not (None resolved later): "(default: ...)"
    default_help: str = ""

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"resume rule {self.rule!r} is not one of {RULES}")
        if self.rule == REFUSE and not self.why:
            raise ValueError("a refused setting says what a change would change (why=...)")


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, rule: str,
            **declaration: Any) -> Any:
    """A config field declared as a setting: its default (the built-in dataset's), its resume `rule` and the rest
    of `Setting`."""
    if "argparse" in declaration:  # the first form of these declarations
        raise TypeError(f"setting(argparse={declaration['argparse']}): give add_argument's keywords themselves "
                        f"(choices=, nargs=, metavar=, type=, action=)")
    metadata = {_METADATA_KEY: Setting(rule=rule, **declaration)}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def nested(config: type) -> Any:
    """A field holding another config dataclass (its settings are `<field>.<name>`)."""
    return field(default_factory=config, metadata={_NESTED_KEY: config})


def same_as(config: type, name: str) -> Any:
    """A field declared as `config`'s field `name` is (a group of settings another command shares, such as the
    lock flags, kept flat in a larger config): the same default and declaration."""
    original = {f.name: f for f in dataclasses.fields(config)}[name]
    if original.default_factory is not dataclasses.MISSING:
        return field(default_factory=original.default_factory, metadata=original.metadata)
    return field(default=original.default, metadata=original.metadata)


@dataclass(frozen=True)
class Declared:
    """A setting as declared on its config: `key` (`name`, or `data.<name>` in a nested config), the field's
    annotation and default, its `Setting`."""

    key: str
    name: str
    annotation: str
    default: Any
    setting: Setting

    @property
    def dest(self) -> str:
        return self.setting.dest or self.name

    @property
    def has_flag(self) -> bool:
        return self.setting.flag is not NO_FLAG

    @property
    def flag(self) -> str:
        """The flag that sets it, as the run's lines show it (`--aug-cfg scale=` for an --aug-cfg item)."""
        if self.setting.shown_as:
            return self.setting.shown_as
        return self.setting.flag if self.has_flag and self.setting.flag else "--" + self.name.replace("_", "-")

    @property
    def openclip(self) -> Any:
        return self.setting.openclip

    @property
    def reads(self) -> tuple[str, ...]:
        """The parser destinations this setting's value comes from."""
        return ((self.dest,) if self.has_flag else ()) + self.setting.reads


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _declared_field(config: type, f: dataclasses.Field, prefix: str = "") -> Declared:
    if _METADATA_KEY not in f.metadata:
        raise TypeError(f"{config.__name__}.{f.name} is not declared as a setting (flag, help, defaults, resume "
                        f"rule): make it with naflexclip.settings.setting(...)")
    return Declared(prefix + f.name, f.name, str(f.type), _default(f), f.metadata[_METADATA_KEY])


def declared(config: type, prefix: str = "") -> Iterator[Declared]:
    """Every setting of `config` in field order, nested configs' as `<field>.<name>` in their place; a field that
    is not declared is a TypeError naming it."""
    for f in dataclasses.fields(config):
        if _NESTED_KEY in f.metadata:
            yield from declared(f.metadata[_NESTED_KEY], f"{prefix}{f.name}.")
            continue
        yield _declared_field(config, f, prefix)


def settings_of(config: type) -> dict[str, Declared]:
    """`declared(config)` by key."""
    return {d.key: d for d in declared(config)}


# ---- the parser ----
_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def _argparse_kwargs(d: Declared) -> dict[str, Any]:
    s = d.setting
    kwargs = {key: value for key, value in (("type", s.type), ("nargs", s.nargs), ("choices", s.choices),
                                            ("metavar", s.metavar), ("action", s.action)) if value is not None}
    base = d.annotation.replace(" | None", "").replace("None | ", "").strip()
    if "action" not in kwargs:
        if base == "bool":
            kwargs["action"] = "store_false" if d.default else "store_true"
        elif base.startswith("tuple["):
            kwargs.setdefault("nargs", "+")
            inner = base[len("tuple["):].split(",")[0].strip()
            if inner in _TYPES and inner != "str":
                kwargs.setdefault("type", _TYPES[inner])
        elif base in _TYPES and base != "str":
            kwargs.setdefault("type", _TYPES[base])
    default = d.default if d.setting.flag_default is FIELD_DEFAULT else d.setting.flag_default
    if isinstance(default, tuple):
        default = list(default)
    kwargs["default"] = default
    return kwargs


@dataclass(frozen=True)
class CommandDefault:
    """A command's own default for a setting it shares with another (verify's `tiny` model), and why that command
    needs it; --help says both. `shown`: how --help names a default the command resolves later (None: a
    checkpoint's value, else ...); `more_choices`: values only this command takes (verify's `--accum-method all`)."""

    value: Any
    why: str
    shown: str = ""
    more_choices: tuple[Any, ...] = ()


# the namespace's record of which flag gave each destination of several flags its value (`_OneOfFlags`)
_GIVEN_AS = "_flags_given"


def _stem(flag: str) -> str:
    """`--x` of `--x` and of its `--no-x` form."""
    return "--" + flag[len("--no-"):] if flag.startswith("--no-") else flag


class _OneOfFlags(argparse.Action):
    """A flag of a destination that several flags set (--loss, --siglip and --no-siglip; --fsdp and --no-fsdp): it
    stores its value (its `const` when it takes none). Two flags of other names that give one destination different
    values on one command line (--siglip --loss clip) are refused in one line naming both: argparse would let the
    last one win, and the order would decide silently. A flag given again, or its `--no-` form after it, is an
    override (the last one wins, as argparse's BooleanOptionalAction; a script appends `--no-x` to its flags)."""

    def value(self, values: Any, option_string: str | None) -> Any:
        return self.const if self.nargs == 0 else values

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        value = self.value(values, option_string)
        shown = f"{option_string}{'' if self.nargs == 0 else ' ' + shown_value(values)}"
        given = namespace.__dict__.setdefault(_GIVEN_AS, {})
        earlier = given.get(self.dest)
        if earlier is not None and _stem(earlier[0]) != _stem(str(option_string)) and earlier[2] != value:
            parser.error(f"{earlier[1]} and {shown} contradict each other: give one of them")
        given[self.dest] = (option_string, shown, value)
        setattr(namespace, self.dest, value)


class _Switch(_OneOfFlags):
    """A store_true flag with its generated `--no-` form: both set the destination, so a resume that is given
    `--no-<flag>` switches off what the run started with (a flag that can only be switched on could not be)."""

    def __init__(self, option_strings: list[str], dest: str, negative: str, default: Any = False,
                 help: str | None = None) -> None:
        super().__init__([*option_strings, negative], dest, nargs=0, default=default, help=help)
        self.negative = negative

    def value(self, values: Any, option_string: str | None) -> Any:
        return option_string != self.negative

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _negative_flag(flag: str, kwargs: dict[str, Any], taken: Any) -> str | None:
    """`--no-<flag>` for a store_true flag, unless the flag already is a negative one (--no-plot) or the parser
    (`taken`: its option strings) already has that name."""
    negative = "--no-" + flag[2:]
    if kwargs.get("action") != "store_true" or flag.startswith("--no-") or negative in taken:
        return None
    return negative


def _with(text: str | None, more: str) -> str:
    """A help text with `more` after it."""
    return ((text + " ") if text else "") + more


def add_arguments(parser: argparse.ArgumentParser, config: type, *, keys: tuple[str, ...] | None = None,
                  skip_sections: tuple[str, ...] = (), defaults: Mapping[str, Any] | None = None,
                  openclip_with_data: bool = False) -> dict[str, argparse._ArgumentGroup]:
    """Add `config`'s flags to `parser` (`keys`: only these settings), one argument group per section in
    declaration order (the parser's group of that title where it has one: several configs share a section); the
    groups by section. `defaults`: another parser default per key (a command with its own
    sizes), a `CommandDefault` where --help should say it and why. `openclip_with_data`: a flag whose OpenCLIP
    default differs from the built-in dataset's gets no parser default (`resolve_defaults` fills it) and says both."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for d in declared(config):
        if not d.has_flag or d.setting.section in skip_sections or (keys is not None and d.key not in keys):
            continue
        section = d.setting.section
        if section not in groups:
            titled = [group for group in parser._action_groups if section and group.title == section]
            groups[section] = titled[0] if titled else (
                parser.add_argument_group(section) if section else parser.add_argument_group())
        kwargs = _argparse_kwargs(d)
        text = d.setting.help
        own = defaults.get(d.key) if defaults else None
        if isinstance(own, CommandDefault):
            kwargs["default"] = list(own.value) if isinstance(own.value, tuple) else own.value
            if own.more_choices:
                kwargs["choices"] = (*kwargs["choices"], *own.more_choices)
            text = _with(text, f"(default: {own.shown or shown_value(own.value)}: {own.why})")
        elif defaults and d.key in defaults:
            kwargs["default"] = list(own) if isinstance(own, tuple) else own
        elif openclip_with_data and switches_with_data(d):
            kwargs["default"] = argparse.SUPPRESS
            text = _with(text, f"(default: {shown_value(d.openclip)}, OpenCLIP's; on the built-in dataset: "
                               f"{shown_value(d.default)})")
        elif d.setting.default_help:
            text = _with(text, f"(default: {d.setting.default_help})")
        flag = d.setting.flag or d.flag
        also_flags = {f for flags, _ in d.setting.also for f in flags}
        negative = _negative_flag(flag, kwargs, {*parser._option_string_actions, *also_flags})
        if negative is not None:
            kwargs.update(action=_Switch, negative=negative)
        elif d.setting.also and "action" not in kwargs:  # one of several flags (`_OneOfFlags`)
            kwargs["action"] = _OneOfFlags
        groups[section].add_argument(flag, *d.setting.aliases, dest=d.dest, help=text, **kwargs)
        for flags, more in d.setting.also:
            const = {"action": _OneOfFlags, "nargs": 0} if more.get("action") == "store_const" else {}
            groups[section].add_argument(*flags, dest=d.dest, **{**more, **const})
    return groups


def switches_with_data(d: Declared) -> bool:
    """With --train-data the command line takes OpenCLIP's default for this setting (it differs from the demo's)."""
    return d.openclip is not NOT_OPENCLIP and _plain(d.openclip) != _plain(d.default)


def default_with_data(d: Declared, with_data: bool) -> Any:
    """The default of a setting of `switches_with_data`: OpenCLIP's with --train-data, the built-in dataset's
    without (a tuple as the list argparse gives)."""
    value = d.openclip if with_data else d.default
    return list(value) if isinstance(value, tuple) else value


def resolve_defaults(args: argparse.Namespace, config: type) -> argparse.Namespace:
    """`args` with every flag of `switches_with_data` not given at its default (`default_with_data`)."""
    with_data = bool(getattr(args, "train_data", None))
    defaults = {d.dest: default_with_data(d, with_data) for d in declared(config) if switches_with_data(d)}
    return argparse.Namespace(**{**defaults, **vars(args)})


def values_from_args(config: type, args: argparse.Namespace) -> dict[str, Any]:
    """`config`'s keyword arguments from a parsed command line (nested configs built); a setting whose flag was
    not given (an `argparse.SUPPRESS` default) or that has none keeps the field's default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if _NESTED_KEY in f.metadata:
            inner = f.metadata[_NESTED_KEY]
            values[f.name] = inner(**values_from_args(inner, args))
            continue
        d = _declared_field(config, f)
        if d.setting.from_args is not None:
            values[f.name] = d.setting.from_args(args)
        elif d.has_flag and d.dest in args:
            value = getattr(args, d.dest)
            if d.setting.convert is not None:
                value = d.setting.convert(value)
            elif isinstance(value, list):
                value = tuple(value)
            values[f.name] = value
    return values


def given_destinations(parser: argparse.ArgumentParser, arg_strings: list[str]) -> set[str]:
    """The destinations `arg_strings` set themselves, not by a default (a resume keeps the run's saved value of
    every other setting): the command line parsed again with every default of `parser` and its sub-parsers
    suppressed, then restored."""
    saved: list[tuple[argparse.ArgumentParser, dict[str, Any], list[Any]]] = []
    todo = [parser]
    while todo:
        current = todo.pop()
        saved.append((current, dict(current._defaults), [action.default for action in current._actions]))
        current._defaults.clear()
        for action in current._actions:
            action.default = argparse.SUPPRESS
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    try:
        namespace, _ = parser.parse_known_args(arg_strings)
    finally:
        for current, defaults, action_defaults in saved:
            current._defaults.update(defaults)
            for action, default in zip(current._actions, action_defaults, strict=True):
                action.default = default
    return set(vars(namespace)) - {_GIVEN_AS}


def undeclared_destinations(parser: argparse.ArgumentParser, config: type,
                            besides: tuple[str, ...] = ()) -> list[str]:
    """The flags of `parser` whose value no setting of `config` reads (`besides`: destinations the command reads
    itself), as `--flag (dest)`."""
    read = {dest for d in declared(config) for dest in d.reads} | set(besides) | {"help"}
    return sorted(f"{action.option_strings[0] if action.option_strings else action.dest} ({action.dest})"
                  for action in parser._actions
                  if action.dest not in read and not isinstance(action, argparse._SubParsersAction))


# ---- how a setting's value is shown and read ----
def _plain(value: Any) -> Any:
    """Lists and tuples compare alike (a config may come back from a checkpoint with either)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict with its data fields as `data.<name>`."""
    flat = {key: value for key, value in config.items() if key != "data"}
    flat.update({f"data.{key}": value for key, value in config.get("data", {}).items()})
    return flat


def shown_value(value: Any) -> str:
    """A flag's value as typed on the command line (`unset` for None, a list space-separated, a string quoted
    where it holds a space or comma)."""
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return " ".join(shown_value(v) for v in value)
    text = str(value)
    return shlex.quote(text) if isinstance(value, str) and (not text or re.search(r"[\s,']", text)) else text


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

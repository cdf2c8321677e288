"""Locked towers (LiT) with OpenCLIP's flags and methods: the towers' layer groups, locking, the `Locks` settings.

`lock_image_tower` / `lock_text_tower` set `requires_grad` False on every layer group of a tower but the last N
(`unlocked_groups` / `unlocked_layers`, counted from the output as OpenCLIP counts them; `freeze_layer_norm`
with OpenCLIP's meaning); `locked_towers` names the towers none of whose parameters trains, which stay in eval
mode and which the window treats as fixed feature sources. The groups of each tower, what locked means for the
optimizer, the modes and the window: docs/finetuning.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from timm.models import group_parameters
from torch import nn

from naflexclip.settings import REFUSE, setting

TOWERS = ("image", "text")


def tower_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules of each tower of a `NaFlexClip`, by the input it encodes."""
    towers: Any = model
    return {"image": [towers.visual, towers.image_projection], "text": [towers.text]}


def locked_towers(model: nn.Module) -> frozenset[str]:
    """The towers none of whose parameters trains."""
    return frozenset(name for name, modules in tower_modules(model).items()
                     if not any(p.requires_grad for module in modules for p in module.parameters()))


def image_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The image tower's layer groups, input to output."""
    visual: Any = model.visual  # timm's NaFlexVit (nn.Module attributes type as Tensor | Module)
    # timm's matcher puts `norm_pre` (OpenCLIP's ln_pre, `^norm`) with the final norm; it acts on the embeddings,
    # so it belongs to the stem group, as in OpenCLIP's own VisionTransformer.lock
    matcher = {**visual.group_matcher(), "stem": r"^embeds|^norm_pre"}
    matcher["blocks"] = [(r"^blocks\.(\d+)", None), (r"^norm\.|^fc_norm\.", (99999,))]
    names = group_parameters(visual, matcher)
    groups = [[visual.get_parameter(name) for name in group] for _, group in sorted(names.items())]
    projection = list(model.get_submodule("image_projection").parameters())
    return groups + ([projection] if projection else [])


def text_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The text tower's layer groups, input to output."""
    text: Any = model.text  # open_clip's TextTransformer
    blocks = list(text.transformer.resblocks)
    items: list[list[Any]] = [[text.token_embedding, text.positional_embedding, getattr(text, "cls_emb", None)],
                              *([block] for block in blocks[:-1]), [blocks[-1], text.ln_final],
                              [text.text_projection]]
    groups = [list(_parameters(group)) for group in items]
    covered = {id(p) for group in groups for p in group}
    missing = [name for name, p in text.named_parameters() if id(p) not in covered]
    if missing:
        raise RuntimeError(f"text tower parameters outside every lock group: {missing}")
    return [group for group in groups if group]


def _parameters(items: Iterable[Any]) -> Iterable[nn.Parameter]:
    for item in items:
        if isinstance(item, nn.Parameter):
            yield item
        elif isinstance(item, nn.Module):
            yield from item.parameters()


def _lock_groups(groups: list[list[nn.Parameter]], unlocked: int, what: str,
                 keep: frozenset[int] = frozenset()) -> None:
    """Lock every group but the last `unlocked` ones (parameters whose id is in `keep` stay trainable)."""
    if not 0 <= unlocked <= len(groups):
        raise ValueError(f"{what}={unlocked}: the tower has {len(groups)} layer groups")
    for index, group in enumerate(groups):
        locked = index < len(groups) - unlocked
        for param in group:
            trainable = not locked or id(param) in keep
            param.requires_grad_(trainable)
            if not trainable:
                param.grad = None


def lock_image_tower(model: nn.Module, unlocked_groups: int = 0) -> None:
    """Lock the image tower but its last `unlocked_groups` layer groups (`NaFlexClip.lock_image_tower`)."""
    _lock_groups(image_groups(model), unlocked_groups, "unlocked_groups")


def lock_text_tower(model: nn.Module, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
    """Lock the text tower but its last `unlocked_layers` layer groups (`NaFlexClip.lock_text_tower`)."""
    norms = frozenset() if freeze_layer_norm else frozenset(
        id(p) for module in model.get_submodule("text").modules() if isinstance(module, nn.LayerNorm)
        for p in module.parameters())
    _lock_groups(text_groups(model), unlocked_layers, "unlocked_layers", keep=norms)


def lock_summary(model: nn.Module) -> str | None:
    """One line on what is locked (None when nothing is)."""
    parts = []
    for name, modules in tower_modules(model).items():
        params = [p for module in modules for p in module.parameters()]
        trainable = sum(p.requires_grad for p in params)
        if trainable == 0:
            parts.append(f"the {name} tower ({len(params)} tensors; its features are computed once per microbatch, "
                         f"without gradient)")
        elif trainable < len(params):
            norms = {id(p) for module in modules for m in module.modules() if isinstance(m, nn.LayerNorm)
                     for p in m.parameters()}
            only_norms = all(id(p) in norms for p in params if p.requires_grad)
            hint = " (its LayerNorms: --lock-text-freeze-layer-norm locks them too)" if only_norms else ""
            parts.append(f"the {name} tower but {trainable} of its {len(params)} tensors{hint}")
    return "locked: " + "; ".join(parts) if parts else None


_LOCKS = "locked towers (LiT)"
_TRAINABLE = "which parameters train"  # the optimizer state holds the trainable parameters only


@dataclass(frozen=True)
class Locks:
    """OpenCLIP's lock flags (`--lock-image`, ...), as `naflexclip train` and `naflexclip verify` take them; each
    field a setting (`naflexclip.settings`): another value on resume is refused."""

    lock_image: bool = setting(False, rule=REFUSE, why=_TRAINABLE, section=_LOCKS, openclip=False, help=(
        "lock the image tower (no gradient, no optimizer state); fully locked, the window computes its features "
        "once per microbatch"))
    lock_image_unlocked_groups: int = setting(0, rule=REFUSE, why=_TRAINABLE, section=_LOCKS, openclip=0,
                                              help="leave the last N image tower layer groups trainable")
    lock_text: bool = setting(False, rule=REFUSE, why=_TRAINABLE, section=_LOCKS, openclip=False,
                              help="lock the text tower")
    lock_text_unlocked_layers: int = setting(0, rule=REFUSE, why=_TRAINABLE, section=_LOCKS, openclip=0,
                                             help="leave the last N text tower layer groups trainable")
    lock_text_freeze_layer_norm: bool = setting(False, rule=REFUSE, why=_TRAINABLE, section=_LOCKS, openclip=False,
                                                help="lock the LayerNorms of the locked text layers too (without it "
                                                     "they train)")

    def __post_init__(self) -> None:
        for flag, value in (("--lock-image-unlocked-groups", self.lock_image_unlocked_groups),
                            ("--lock-text-unlocked-layers", self.lock_text_unlocked_layers)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        for flag, given, parent, on in (
            ("--lock-image-unlocked-groups", self.lock_image_unlocked_groups, "--lock-image", self.lock_image),
            ("--lock-text-unlocked-layers", self.lock_text_unlocked_layers, "--lock-text", self.lock_text),
            ("--lock-text-freeze-layer-norm", self.lock_text_freeze_layer_norm, "--lock-text", self.lock_text),
        ):
            if given and not on:
                raise ValueError(f"{flag} goes with {parent} (it says what {parent} leaves trainable)")

    @classmethod
    def pick(cls, values: Any) -> Locks:
        """The lock fields of a config or an argparse namespace."""
        return cls(**{f.name: getattr(values, f.name) for f in fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def image_fully_locked(self) -> bool:
        """`--lock-image` without unlocked groups: no image-tower parameter trains."""
        return self.lock_image and self.lock_image_unlocked_groups == 0

    def apply(self, model: nn.Module) -> None:
        """Lock `model`'s towers as the flags say (before DDP/FSDP wrap it and the optimizer is built); a group
        count the tower does not have is a one-line ValueError naming the flag."""
        for flag, on, unlocked, tower, groups in (
            ("--lock-image-unlocked-groups", self.lock_image, self.lock_image_unlocked_groups, "image", image_groups),
            ("--lock-text-unlocked-layers", self.lock_text, self.lock_text_unlocked_layers, "text", text_groups),
        ):
            count = len(groups(model)) if on else 0
            if unlocked > count:
                raise ValueError(f"{flag} {unlocked}: the {tower} tower has {count} layer groups")
        towers: Any = model  # a NaFlexClip (its lock methods)
        if self.lock_image:
            towers.lock_image_tower(unlocked_groups=self.lock_image_unlocked_groups)
        if self.lock_text:
            towers.lock_text_tower(unlocked_layers=self.lock_text_unlocked_layers,
                                  freeze_layer_norm=self.lock_text_freeze_layer_norm)

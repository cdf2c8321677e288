"""Self-distillation (SILC) and masked prediction (TIPS) of SigLIP 2's recipe, with an EMA teacher.

Owns the local crops (patch-grid rectangles re-indexed as shorter NaFlex sequences) and patch masks drawn from each
example's `view_seed`, the mask token, DINO's projection heads, the EMA teacher and `SelfDistillTerm`: per example a
sum over its crops and a mean over its masked patches, which the window normalises by its examples.
The loss, the paper's settings and our simplifications: docs/siglip2_recipe.md#self-distillation-and-masked-prediction.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.batch import EXAMPLE_INPUTS, batch_size
from naflexclip.data.sample_inputs import DecodedSample, SampleInputs
from naflexclip.parallel.wrapping import is_fsdp
from naflexclip.processing.view_seeds import VIEW_SEED, sample_view_seed
from naflexclip.window import Term

SELF_DISTILL = "self_distill"
MASKED_PREDICTION = "masked_prediction"
HEAD_SLOT = "self_distill"  # where the model holds the heads and mask token (`NaFlexClip.attach_head`)

# SILC's local views cover 5–40% of the image area (its global views 40–100%; DINO's multi-crop)
LOCAL_CROP_SCALE = (0.05, 0.4)
LOCAL_CROP_RATIO = (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop aspect range, which DINO's crops use
# DINO's temperatures and centre momentum (SILC follows DINO's loss; SigLIP 2 follows SILC's hyperparameters)
STUDENT_TEMPERATURE = 0.1
TEACHER_TEMPERATURE = 0.04
CENTER_MOMENTUM = 0.9
TEACHER_HEADS = {"global": "global", "patches": "patch"}  # a teacher output's head: its prototypes and centre
MASK_STREAM = 1_000_003  # the mask's generator is seeded with view_seed + this: crops and mask are independent draws


@dataclass(frozen=True)
class SelfDistillConfig:
    """The heads' size and the views: `local_crops` student views per image, `mask_ratio` of its patches masked
    (the recipe's flags: `objectives.siglip2_recipe`)."""

    local_crops: int
    mask_ratio: float
    hidden: int = 2048  # DINO's head: 3-layer MLP of width 2048, bottleneck 256, 65536 prototypes
    bottleneck: int = 256
    prototypes: int = 65536


def head_config(width: int, local_crops: int, mask_ratio: float) -> SelfDistillConfig:
    """DINO's head for towers of width ≥ 512; a proportionally smaller one for the tiny and small presets (ours)."""
    if width >= 512:
        return SelfDistillConfig(local_crops=local_crops, mask_ratio=mask_ratio)
    return SelfDistillConfig(local_crops=local_crops, mask_ratio=mask_ratio, hidden=4 * width,
                             bottleneck=max(8, width // 2), prototypes=16 * width)


class ProjectionHead(nn.Module):
    """DINO's head: MLP → L2-normalised bottleneck → logits against L2-normalised prototypes (DINO's weight-normalised
    last layer with its norm fixed to 1)."""

    def __init__(self, in_dim: int, config: SelfDistillConfig) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, config.hidden), nn.GELU(), nn.Linear(config.hidden, config.hidden),
                                 nn.GELU(), nn.Linear(config.hidden, config.bottleneck))
        self.prototypes = nn.Parameter(torch.randn(config.prototypes, config.bottleneck) * config.bottleneck ** -0.5)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The L2-normalised bottleneck features (what the EMA teacher hands the window)."""
        return F.normalize(self.mlp(x), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cosine_logits(self.features(x), self.prototypes)


def cosine_logits(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Logits of normalised bottleneck features against the L2-normalised prototypes `[P, bottleneck]`."""
    return F.linear(features, F.normalize(prototypes, dim=-1))


def teacher_distribution(targets: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The EMA teacher's centred, sharpened distribution over the prototypes for `targets[key]` (`"global"`:
    `[B, P]`, `"patches"`: `[..., P]` for the rows given), projected from its bottleneck features when the term
    needs it, without grad: the window holds per microbatch the features only, the prototypes and centres once per
    window."""
    head = TEACHER_HEADS[key]
    with torch.no_grad():
        logits = _upcast(cosine_logits(targets[key], targets[f"{head}_prototypes"]))
        return F.softmax((logits - targets[f"{head}_center"]) / TEACHER_TEMPERATURE, dim=-1)


class SelfDistillHeads(nn.Module):
    """What the recipe trains beside the image tower: the mask token, the image-level and the per-patch heads. They
    start fresh (SigLIP 2: "the remaining additional parameters (heads, mask token ...) randomly")."""

    def __init__(self, width: int, config: SelfDistillConfig) -> None:
        super().__init__()
        self.config = config
        self.mask_token = nn.Parameter(torch.randn(width) * 0.02)
        self.global_head = ProjectionHead(width, config)
        self.patch_head = ProjectionHead(width, config)


def _grid_lookup(coord: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[H, W]` sequence index of every patch of one image's grid (its valid patches must fill the rectangle)."""
    index = valid.nonzero().reshape(-1)
    yx = coord[index]
    height, width = int(yx[:, 0].max()) + 1, int(yx[:, 1].max()) + 1
    lookup = torch.full((height, width), -1, dtype=torch.long)
    lookup[yx[:, 0].cpu(), yx[:, 1].cpu()] = index.cpu()
    if bool((lookup < 0).any()):
        raise ValueError(f"an image's valid patches do not fill its {height}x{width} grid; local crops need NaFlex "
                         "images whose patches cover a rectangle")
    return lookup


def crop_boxes(seed: int, height: int, width: int, count: int) -> list[tuple[int, int, int, int]]:
    """`count` crops `(y0, x0, h, w)` of a `height × width` patch grid, each of a random area in `LOCAL_CROP_SCALE`
    and aspect in `LOCAL_CROP_RATIO` (log-uniform), at least one patch, drawn from `seed` alone."""
    gen = torch.Generator().manual_seed(int(seed))
    boxes = []
    for _ in range(count):
        u = torch.rand(4, generator=gen, dtype=torch.float64).tolist()
        area = (LOCAL_CROP_SCALE[0] + u[0] * (LOCAL_CROP_SCALE[1] - LOCAL_CROP_SCALE[0])) * height * width
        ratio = math.exp(math.log(LOCAL_CROP_RATIO[0]) + u[1] * math.log(LOCAL_CROP_RATIO[1] / LOCAL_CROP_RATIO[0]))
        h = min(height, max(1, round(math.sqrt(area / ratio))))
        w = min(width, max(1, round(math.sqrt(area * ratio))))
        y0, x0 = int(u[2] * (height - h + 1)), int(u[3] * (width - w + 1))
        boxes.append((min(y0, height - h), min(x0, width - w), h, w))
    return boxes


def local_crops(image: dict[str, torch.Tensor], view_seed: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
    """The `count` local crops of every image as one NaFlex batch of `B·count` shorter sequences (example-major), each
    crop's patches in row-major order with coordinates relative to the crop."""
    patches, coord, valid = image["patches"], image["patch_coord"], image["patch_valid"]
    rows: list[torch.Tensor] = []
    coords: list[torch.Tensor] = []
    for i in range(patches.shape[0]):
        lookup = _grid_lookup(coord[i], valid[i])
        for y0, x0, h, w in crop_boxes(int(view_seed[i]), *lookup.shape, count):
            rows.append(lookup[y0 : y0 + h, x0 : x0 + w].reshape(-1))
            grid = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            coords.append(torch.stack(grid, -1).reshape(-1, 2))
    length = max(len(r) for r in rows)
    out_patches = patches.new_zeros(len(rows), length, patches.shape[-1])
    out_coord = coord.new_zeros(len(rows), length, 2)
    out_valid = valid.new_zeros(len(rows), length)
    for n, (src, yx) in enumerate(zip(rows, coords, strict=True)):
        out_patches[n, : len(src)] = patches[n // count, src.to(patches.device)]
        out_coord[n, : len(src)] = yx.to(coord.device)
        out_valid[n, : len(src)] = True
    return {"patches": out_patches, "patch_coord": out_coord, "patch_valid": out_valid}


def patch_mask(patch_valid: torch.Tensor, view_seed: torch.Tensor, ratio: float) -> torch.Tensor:
    """`[B, L]`: `round(ratio · n)` (≥ 1) of each image's `n` valid patches, chosen uniformly from its seed alone."""
    mask = torch.zeros(patch_valid.shape, dtype=torch.bool)
    for i in range(patch_valid.shape[0]):
        index = patch_valid[i].nonzero().reshape(-1).cpu()
        if ratio <= 0 or len(index) == 0:
            continue
        gen = torch.Generator().manual_seed(int(view_seed[i]) + MASK_STREAM)
        chosen = torch.randperm(len(index), generator=gen)[: max(1, round(ratio * len(index)))]
        mask[i, index[chosen]] = True
    return mask.to(patch_valid.device)


@contextlib.contextmanager
def masked_embeddings(visual: nn.Module, mask_token: torch.Tensor, mask: torch.Tensor) -> Iterator[None]:
    """Within the block, the tower's patch embeddings at `mask` are the mask token (before the position table)."""
    def replace(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.where(mask[..., None], mask_token.to(output.dtype), output)

    handle = visual.embeds.proj.register_forward_hook(replace)
    try:
        yield
    finally:
        handle.remove()


def _upcast(t: torch.Tensor) -> torch.Tensor:
    # the loss in at least float32 when the towers run in bf16/fp16 (float64 stays float64)
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _tower(visual: nn.Module, image: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's pooled output `[B, width]` and its patch tokens `[B, L, width]` (prefix tokens dropped)."""
    tokens = visual.forward_features(image["patches"], patch_coord=image["patch_coord"],
                                     patch_valid=image["patch_valid"], attn_mask=image.get("attn_mask"))
    pooled = visual.forward_head(tokens["patches"], patch_valid=tokens["patch_valid"])
    prefix = tokens["patches"].shape[1] - image["patch_valid"].shape[1]
    return pooled, tokens["patches"][:, prefix:]


def student_terms(visual: nn.Module, heads: SelfDistillHeads, image: dict[str, torch.Tensor],
                  view_seed: torch.Tensor, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each example's `self_distill` (cross-entropy of the teacher's full-image distribution against the student's on
    each local crop, summed over the crops) and `masked_prediction` (the same per patch, at the masked patches,
    averaged over them) — `[B]` each, for the window to weigh."""
    if image["patches"].dim() != 3:  # timm's patch interpolator bypasses embeds.proj, where the mask token goes in
        raise ValueError(f"self-distillation needs flattened [B, L, P*P*C] patches, got shape "
                         f"{tuple(image['patches'].shape)} (--naflex-patch-sizes)")
    config = heads.config
    count = config.local_crops
    batch = image["patches"].shape[0]
    crops = local_crops(image, view_seed, count)
    pooled, _ = _tower(visual, crops)
    log_p = F.log_softmax(_upcast(heads.global_head(pooled)) / STUDENT_TEMPERATURE, dim=-1)
    owner = torch.arange(batch, device=log_p.device).repeat_interleave(count)
    crop_ce = -(teacher_distribution(targets, "global")[owner].to(log_p.dtype) * log_p).sum(-1)
    mask = patch_mask(image["patch_valid"], view_seed, config.mask_ratio)
    with masked_embeddings(visual, heads.mask_token, mask):
        _, patches = _tower(visual, image)
    if patches.shape[1] != mask.shape[1]:  # the tokens left would not sit at the mask's positions
        raise ValueError(f"masked prediction needs every patch token of the tower, which kept {patches.shape[1]} of "
                         f"{mask.shape[1]}: turn its patch dropout off (--force-patch-dropout 0)")
    # the term is a sum over the masked patches: the student's head and the teacher's targets project those rows
    # only ([M, P] for the M masked patches of the microbatch, not [B, L, P])
    log_q = F.log_softmax(_upcast(heads.patch_head(patches[mask])) / STUDENT_TEMPERATURE, dim=-1)
    patch_targets = teacher_distribution({**targets, "patches": targets["patches"][mask]}, "patches")
    patch_ce = -(patch_targets.to(log_q.dtype) * log_q).sum(-1)
    owner = mask.nonzero()[:, 0]  # each masked row's example, in row-major order as `[mask]` takes them
    per_example = patch_ce.new_zeros(batch).index_add(0, owner, patch_ce)
    return {SELF_DISTILL: crop_ce.reshape(batch, count).sum(1),
            MASKED_PREDICTION: per_example / mask.sum(1).clamp(min=1).to(patch_ce.dtype)}


def attach_heads(model: nn.Module, config: SelfDistillConfig | Mapping[str, Any]) -> SelfDistillHeads:
    """The model's self-distillation heads and mask token, attached as its child `self_distill`
    (`NaFlexClip.attach_head`) with the weights a loaded checkpoint held for them, if any."""
    config = SelfDistillConfig(**config) if isinstance(config, Mapping) else config
    return model.attach_head(HEAD_SLOT, SelfDistillHeads(model.config.image.width, config), config)


class ViewSeeds(SampleInputs):
    """Each sample's `view_seed` (its local crops and mask, `sample_view_seed`) from (seed, epoch, key), in each
    microbatch's `example_inputs`."""

    def check(self, augment: bool, multi_caption: bool) -> None:
        if multi_caption:
            raise ValueError("self-distillation or masked prediction with --multi-positive is not supported yet")

    def of_sample(self, sample: DecodedSample) -> int:
        return sample_view_seed(sample.seed_key[0], sample.seed_key[1], sample.raw.key)

    def of_microbatch(self, values: list[Any], texts: list[str], seq_len: int) -> dict[str, dict[str, Any]]:
        return {EXAMPLE_INPUTS: {VIEW_SEED: torch.tensor(values, dtype=torch.int64)}}


class SelfDistillTerm(Term):
    """Self-distillation and masked prediction, each example's loss (`student_terms`) against the EMA teacher's
    targets of its microbatch (the term's constants: one teacher forward per microbatch, never replayed), each part
    normalised by the window's examples. The heads are the model's child `self_distill` (`attach_heads`); each
    example's crops and mask come from its `view_seed` (`example_inputs`)."""

    def __init__(self, teacher: EmaTeacher, weights: Mapping[str, float]) -> None:
        self.teacher = teacher
        self.weights = {name: float(weight) for name, weight in weights.items() if weight > 0}
        self.parts = tuple(name for name in (SELF_DISTILL, MASKED_PREDICTION) if name in self.weights)

    def count(self, microbatch: dict[str, Any]) -> dict[str, float]:
        return dict.fromkeys(self.parts, batch_size(microbatch))

    def constants(self, microbatch: dict[str, Any], autocast: Callable[[], ContextManager[Any]]) -> dict[str, Any]:
        with autocast():
            targets = self.teacher(image=microbatch["image"])
        return {key: value.detach() for key, value in targets.items()}

    def example_losses(self, model: nn.Module, microbatch: dict[str, Any], out: dict[str, Any],
                       constants: dict[str, Any]) -> dict[str, torch.Tensor]:
        student = getattr(model, "module", model)
        if student.self_distill is None:
            raise ValueError("the self-distillation term needs the model's heads (attach_heads, or Recipe.prepare)")
        view_seed = microbatch[EXAMPLE_INPUTS][VIEW_SEED]
        return student_terms(student.visual, student.self_distill, microbatch["image"], view_seed, constants)

    def random_inputs(self, model: nn.Module, num_examples: int, seed: int) -> dict[str, torch.Tensor]:
        """Each example's seed of its local crops and patch mask."""
        return {VIEW_SEED: torch.randint(0, 2**31 - 1, (num_examples,), generator=torch.Generator().manual_seed(seed))}


class EmaTeacher(nn.Module):
    """The EMA teacher: a frozen copy of the student's image tower and heads, and the centres of its two heads.

    `forward(image=)` (no grad; the window runs it once per microbatch in the cache phase, never replayed) returns the
    teacher's L2-normalised bottleneck features `{"global": [B, D], "patches": [B, L, D]}` with the window's
    prototypes and centres (`window_constants`, one copy per window shared by every microbatch), and records its
    logits' sums for the centre. The student's term projects them (`teacher_distribution`: centred, sharpened) when
    it needs them: what the window holds per microbatch scales with the bottleneck D, not the P prototypes.
    `update(student, sum_over_ranks)` after the optimizer step: every teacher parameter
    `t ← m·t + (1 − m)·s`, each centre `c ← 0.9·c + 0.1·mean(logits)` over the step's teacher forwards of every rank
    (`sum_over_ranks` adds the ranks' sums and counts: the centre is the whole window's, the same on every rank).
    Run state: save and resume it through `state_dict()` / `load_state_dict()` (its parameters and centres; the
    momentum is a flag). Build it at the switch (`--self-distill-start`) from the student: SigLIP 2 initialises the
    teacher with the student's parameters there. Sharded by FSDP2 like the student (`train.self_distill`), the
    update pairs each parameter's local shard with the student's."""

    def __init__(self, student: nn.Module, momentum: float) -> None:
        super().__init__()
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"--ema-momentum must be in [0, 1], got {momentum}")
        model = getattr(student, "module", student)
        if getattr(model, "self_distill", None) is None:
            raise ValueError("the EMA teacher needs the student's self-distillation heads (Recipe.prepare adds them)")
        self.momentum = momentum
        self.visual = copy.deepcopy(model.visual)
        self.heads = copy.deepcopy(model.self_distill)
        for p in self.parameters():
            p.requires_grad_(False)
        prototypes = self.heads.config.prototypes
        reference = model.self_distill.mask_token
        self.register_buffer("global_center", torch.zeros(prototypes, dtype=reference.dtype, device=reference.device))
        self.register_buffer("patch_center", torch.zeros(prototypes, dtype=reference.dtype, device=reference.device))
        self._sums: dict[str, list[torch.Tensor]] = {"global": [], "patches": []}
        self.discard_pending()
        self.eval()

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_state_dict(*args, **kwargs)
        self._window = None  # new parameters and centres: the next forward takes them
        return result

    def _apply(self, *args: Any, **kwargs: Any) -> EmaTeacher:
        self._window = None  # `.to()` and the like replace the tensors the window's constants refer to
        return super()._apply(*args, **kwargs)

    def train(self, mode: bool = True) -> EmaTeacher:
        return super().train(False)  # always eval: no dropout, drop-path or patch dropout

    @torch.no_grad()
    def forward(self, image: dict[str, torch.Tensor], **unused: Any) -> dict[str, torch.Tensor]:
        pooled, patches = _tower(self.visual, image)
        global_features = self.heads.global_head.features(pooled)
        patch_features = self.heads.patch_head.features(patches)
        window = self.window_constants()
        valid = image["patch_valid"][:, : patches.shape[1]]
        # the centre's statistics, once per microbatch: Σ logits = (Σ features)·prototypesᵀ, the logits are linear
        for key, features, count in (("global", global_features, len(global_features)),
                                     ("patches", patch_features[valid], int(valid.sum()))):
            prototypes = window[f"{TEACHER_HEADS[key]}_prototypes"]
            total = cosine_logits(features.double().sum(0), prototypes.double())
            self._sums[key].append(torch.stack([total, torch.full_like(total, count)]))
        return {"global": global_features, "patches": patch_features, **window}

    def window_constants(self) -> dict[str, torch.Tensor]:
        """The heads' prototypes and the centres as this window's forwards see them, held once per window (between
        two updates) and shared by every microbatch's targets: under FSDP2 a copy of the gathered prototypes (the
        shards are all a rank has outside the forward), else the parameters themselves."""
        if self._window is None:
            copy_gathered = is_fsdp(self)  # FSDP2 frees the gathered parameters when it reshards
            self._window = {f"{head}_prototypes": (prototypes.detach().clone() if copy_gathered
                                                   else prototypes.detach())
                            for head, prototypes in (("global", self.heads.global_head.prototypes),
                                                     ("patch", self.heads.patch_head.prototypes))}
            self._window.update(global_center=self.global_center.clone(), patch_center=self.patch_center.clone())
        return self._window

    def student_parameters(self, student: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        model = getattr(student, "module", student)
        pairs = [*zip(self.visual.parameters(), model.visual.parameters(), strict=True),
                 *zip(self.heads.parameters(), model.self_distill.parameters(), strict=True)]
        return [(t, s) for t, s in pairs]

    @torch.no_grad()
    def update(self, student: nn.Module,
               sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """After the optimizer step: the EMA of the student's parameters, and the centres from this step's logits
        (`sum_over_ranks`: the elementwise sum over ranks, e.g. `WindowExchange.sum_over_ranks`; every rank calls
        it once per update, with or without forwards of its own)."""
        for teacher_p, student_p in self.student_parameters(student):
            teacher_p.mul_(self.momentum).add_(student_p.detach().to(teacher_p.dtype), alpha=1.0 - self.momentum)
        for key, center in (("global", self.global_center), ("patches", self.patch_center)):
            total = (torch.stack(self._sums[key]).sum(0) if self._sums[key]
                     else torch.zeros(2, center.numel(), dtype=torch.float64, device=center.device))
            if sum_over_ranks is not None:
                total = sum_over_ranks(total)
            if bool(total[1, 0] > 0):
                mean = total[0] / total[1]
                center.mul_(CENTER_MOMENTUM).add_(mean.to(center.dtype), alpha=1.0 - CENTER_MOMENTUM)
        self.discard_pending()

    def discard_pending(self) -> None:
        """Forget the logits recorded since the last update (a skipped step, or forwards outside training), and the
        window's prototypes and centres."""
        self._sums = {"global": [], "patches": []}
        self._window: dict[str, torch.Tensor] | None = None

"""Built-in synthetic image-caption dataset: coloured shapes on varied backgrounds, drawn from (seed, index).

Each scene holds 1-3 objects (a shape, a colour, a size, a slot), captions that name every object, its regions
(`object_regions`) and per-pixel shape classes (`synthetic_segmentation`); the splits ("train", "val", "zeroshot")
draw from separate seed streams. With `shape_group_size` k > 1 consecutive indices are groups of k scenes that
differ only in their shapes. What the scenes look like and why: docs/data.md#the-built-in-dataset, docs/demo.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "hexagon", "cross", "diamond", "ring")
COLOURS = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink", "brown", "white")
SIZES = ("small", "large")
ATTRIBUTES = {"shape": SHAPES, "colour": COLOURS, "size": SIZES}
SEGMENTATION_CLASSES = ("background", *SHAPES)  # `scene_labels`' classes: 0, then 1 + shape
COLOUR_RGB = {
    "red": (220, 30, 30), "orange": (245, 140, 20), "yellow": (240, 225, 30), "green": (40, 165, 60),
    "cyan": (40, 205, 225), "blue": (40, 70, 220), "purple": (140, 50, 190), "pink": (250, 125, 195),
    "brown": (125, 75, 30), "white": (252, 252, 252),
}
BACKGROUND_STYLES = ("plain", "gradient", "stripes", "noise")
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 48, 512, 4.0
SPLIT_STREAMS = {"train": 0, "val": 1, "zeroshot": 2}

TEMPLATES = (
    "a photo of {objects}.",
    "{objects} on a {background} background.",
    "an image showing {objects}.",
    "{count}: {objects}.",
    "a picture with {objects}",
    "{ordered}, from {direction}.",
)
COUNT_WORDS = ("one shape", "two shapes", "three shapes")


@dataclass(frozen=True)
class SceneObject:
    """One drawn object: indices into SHAPES, COLOURS, SIZES; `box`: where it was drawn, (x0, y0, x1, y1) pixels;
    `disc`: the (cx, cy, r) it was drawn from (what `scene_labels` redraws)."""

    shape: int
    colour: int
    size: int
    box: tuple[float, float, float, float] | None = None
    disc: tuple[float, float, float] | None = None

    def phrase(self) -> str:
        return f"a {SIZES[self.size]} {COLOURS[self.colour]} {SHAPES[self.shape]}"


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    if split not in SPLIT_STREAMS:
        raise ValueError(f"split must be one of {tuple(SPLIT_STREAMS)}, got {split!r}")
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, SPLIT_STREAMS[split], index]))


def _image_size(rng: np.random.Generator, num_objects: int = 1) -> tuple[int, int]:
    """(width, height): about `num_objects`:1 along the long side (within a factor of 2, capped at
    MAX_ASPECT), so each object's slot is roughly square and the objects stay several patches wide
    once NaFlex fits the image into a short sequence; the short side is log-uniform, orientation random."""
    ratio = num_objects * float(np.exp(rng.uniform(-np.log(2.0), np.log(2.0))))
    ratio = min(max(ratio, 1.0 / ratio), MAX_ASPECT)  # long / short, in [1, MAX_ASPECT]
    short = float(np.exp(rng.uniform(np.log(MIN_SIDE), np.log(MAX_SIDE / ratio))))
    long = short * ratio
    width, height = (long, short) if rng.random() < 0.5 else (short, long)
    return int(round(width)), int(round(height))


def _background(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, str]:
    level = int(rng.integers(60, 190))
    tint = rng.integers(-12, 13, size=3)
    base = np.clip(level + tint, 0, 255).astype(np.float32)
    style = BACKGROUND_STYLES[int(rng.integers(len(BACKGROUND_STYLES)))]
    canvas = np.broadcast_to(base, (height, width, 3)).copy()
    if style == "gradient":
        ramp = np.linspace(-35, 35, width if rng.random() < 0.5 else height, dtype=np.float32)
        canvas += ramp[None, :, None] if ramp.shape[0] == width else ramp[:, None, None]
    elif style == "stripes":
        period = int(rng.integers(6, 24))
        stripes = ((np.arange(height) // period) % 2 * 24 - 12).astype(np.float32)
        canvas += stripes[:, None, None]
    elif style == "noise":
        canvas += rng.normal(0, 12, size=(height, width, 1)).astype(np.float32)
    name = "dark" if level < 125 else "light"
    return np.clip(canvas, 0, 255).astype(np.uint8), name


def _draw(draw: ImageDraw.ImageDraw, obj: SceneObject, cx: float, cy: float, r: float,
          fill: int | tuple[int, int, int] | None = None) -> None:
    """Draw `obj` centred at (cx, cy) with radius r, in its colour or `fill` (a label map's class)."""
    fill = COLOUR_RGB[COLOURS[obj.colour]] if fill is None else fill
    shape = SHAPES[obj.shape]
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(r * 0.35)))
    elif shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.regular_polygon((cx, cy + r * 0.15, r), 3, fill=fill)
    elif shape == "hexagon":
        draw.regular_polygon((cx, cy, r), 6, fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r * 0.7, cy), (cx, cy + r), (cx - r * 0.7, cy)], fill=fill)
    elif shape == "cross":
        t = r * 0.33
        draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
        draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)
    elif shape == "star":
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.42)
        points = [(cx + rr * np.cos(a), cy - rr * np.sin(a)) for a, rr in zip(angles, radii, strict=True)]
        draw.polygon(points, fill=fill)


def _join(phrases: list[str]) -> str:
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " and " + phrases[-1]


def render_scene(
    rng: np.random.Generator, num_objects: int, size: tuple[int, int] | None = None,
    shapes: list[int] | None = None,
) -> tuple[Image.Image, list[SceneObject], str, bool]:
    """Draw `num_objects` random objects; returns (image, objects in slot order, background word, wide).

    `shapes`: the shape of each slot instead of the drawn one (the rng stream, and so everything else
    about the scene, is the same either way)."""
    width, height = size or _image_size(rng, num_objects)
    canvas, background = _background(rng, width, height)
    img = Image.fromarray(canvas, "RGB")
    draw = ImageDraw.Draw(img)
    wide = width >= height
    long_side, short_side = (width, height) if wide else (height, width)
    slot = long_side / num_objects
    cell = min(slot, short_side)
    objects = []
    for k in range(num_objects):
        obj = SceneObject(int(rng.integers(len(SHAPES))), int(rng.integers(len(COLOURS))), int(rng.integers(2)))
        if shapes is not None:
            obj = replace(obj, shape=shapes[k])
        frac = rng.uniform(0.45, 0.6) if obj.size == 0 else rng.uniform(0.8, 0.98)
        r = 0.5 * frac * cell
        along = slot * k + slot / 2 + rng.uniform(-1, 1) * max(0.0, slot / 2 - r)
        across = short_side / 2 + rng.uniform(-1, 1) * max(0.0, short_side / 2 - r)
        cx, cy = (along, across) if wide else (across, along)
        _draw(draw, obj, cx, cy, r)
        # the drawing's bounding square, inside the image (every shape spans its square's width or height)
        box = (max(0.0, cx - r), max(0.0, cy - r), min(float(width), cx + r), min(float(height), cy + r))
        objects.append(replace(obj, box=box, disc=(cx, cy, r)))
    return img, objects, background, wide


def scene_labels(objects: list[SceneObject], width: int, height: int) -> np.ndarray:
    """A scene's per-pixel shape classes `[height, width]` uint8: 0 background, `1 + shape` where an object's pixels
    were drawn (the same drawing calls, in the same order, so a later object covers an earlier one as in the image)."""
    labels = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(labels)
    for obj in objects:
        if obj.disc is None:
            raise ValueError("scene_labels needs objects from render_scene (their disc)")
        _draw(draw, obj, *obj.disc, fill=1 + obj.shape)
    return np.array(labels)  # a writable copy (a PIL image's array is read-only)


def caption_for(rng: np.random.Generator, objects: list[SceneObject], background: str, wide: bool) -> str:
    """A caption naming every object's size, colour and shape, from a randomly chosen template."""
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    phrases = [o.phrase() for o in objects]
    ordered = _join(phrases)
    shuffled = _join([phrases[i] for i in rng.permutation(len(phrases))])
    return template.format(
        objects=shuffled, ordered=ordered, background=background, count=COUNT_WORDS[len(objects) - 1],
        direction="left to right" if wide else "top to bottom",
    )


def _scene(seed: int, split: str, index: int, shape_group_size: int) -> tuple[np.random.Generator, Any]:
    """The scene at `index` (image, objects, background, wide) and the generator its caption is drawn from."""
    if not 1 <= shape_group_size <= len(SHAPES):
        raise ValueError(f"shape_group_size must be in [1, {len(SHAPES)}], got {shape_group_size}")
    group, member = divmod(index, shape_group_size)
    rng = _rng(seed, split, group)
    num_objects = int(rng.integers(1, 4))
    shapes = None
    if shape_group_size > 1:
        # one permutation of the shapes per slot, the same for every member of the group: member j takes
        # entry j, so within a group every slot's shape differs
        perms = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, SPLIT_STREAMS[split], group, 1]))
        shapes = [int(perms.permutation(len(SHAPES))[member]) for _ in range(num_objects)]
    return rng, render_scene(rng, num_objects, shapes=shapes)


def synthetic_sample(seed: int, split: str, index: int, shape_group_size: int = 1) -> tuple[Image.Image, str]:
    """The (RGB image, caption) pair at `index` of `split` ("train" or "val"); pure function of its args.

    `shape_group_size` k: indices k·g ... k·g + k - 1 are one scene with k different shapes per slot."""
    rng, (img, objects, background, wide) = _scene(seed, split, index, shape_group_size)
    return img, caption_for(rng, objects, background, wide)


def synthetic_segmentation(seed: int, split: str, index: int, shape_group_size: int = 1
                           ) -> tuple[Image.Image, np.ndarray]:
    """`synthetic_sample`'s image at `index` of `split` and its per-pixel shape classes (`scene_labels`:
    0 background, 1 + index into SHAPES), for the dense-feature probe."""
    _, (img, objects, _, _) = _scene(seed, split, index, shape_group_size)
    return img, scene_labels(objects, *img.size)


def object_regions(objects: list[SceneObject]) -> list[dict[str, Any]]:
    """A scene's regions as a sample's .json holds them: each object's box (pixels) and caption ("a small red
    circle")."""
    return [{"bbox": [round(c, 2) for c in obj.box or ()], "caption": obj.phrase()} for obj in objects]


def synthetic_scene(seed: int, split: str, index: int, shape_group_size: int = 1, multi_caption: bool = False
                    ) -> tuple[Image.Image, str | list[str], list[dict[str, Any]]]:
    """`synthetic_sample`'s (or, `multi_caption`, `synthetic_captions`') image and caption(s), with its regions."""
    rng, (img, objects, background, wide) = _scene(seed, split, index, shape_group_size)
    caption = caption_for(rng, objects, background, wide)
    if multi_caption:
        return img, _more_captions(seed, split, index, caption, objects, background, wide), object_regions(objects)
    return img, caption, object_regions(objects)


def synthetic_captions(seed: int, split: str, index: int, shape_group_size: int = 1) -> tuple[Image.Image, list[str]]:
    """`synthetic_sample`'s image with 2 to 5 captions of it (the multi-caption mode): its own caption first, then
    captions in other templates and object orders, drawn from a stream of their own (image and first caption are
    `synthetic_sample`'s)."""
    rng, (img, objects, background, wide) = _scene(seed, split, index, shape_group_size)
    return img, _more_captions(seed, split, index, caption_for(rng, objects, background, wide), objects, background,
                               wide)


def _more_captions(seed: int, split: str, index: int, first: str, objects: list[SceneObject], background: str,
                   wide: bool) -> list[str]:
    """`first` and 1 to 4 more captions, each a different partial view of the scene, as annotators write them (COCO's
    five captions of an image mention different things): one object, the colours, the shapes, one object and where it
    is. Each alone fits several scenes; together they describe this one, so they are distinct strings and a model
    trained one-hot on one of them per epoch sees a fraction of what the image's captions say."""
    extra = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, SPLIT_STREAMS[split], index, 2]))
    count = COUNT_WORDS[len(objects) - 1]
    places = (("on the left", "in the middle", "on the right") if wide else ("at the top", "in the middle",
                                                                             "at the bottom"))
    one = objects[int(extra.integers(len(objects)))]
    slot = objects.index(one)
    place = "" if len(objects) == 1 else " " + places[0 if slot == 0 else 2 if slot == len(objects) - 1 else 1]
    views = [
        f"there is {one.phrase()} in the picture.",
        f"{count} coloured {_join([COLOURS[o.colour] for o in objects])}.",
        f"{count}: {_join(['a ' + SHAPES[o.shape] for o in objects])}.",
        f"a {background} background with {one.phrase()}{place}.",
    ]
    more = [views[int(k)] for k in extra.permutation(len(views))[: int(extra.integers(1, 5))]]
    return [first, *more]


def zero_shot_sample(seed: int, index: int) -> tuple[Image.Image, str, dict[str, int]]:
    """A single-object validation image, its caption and labels {"shape", "colour", "size"} (class indices)."""
    rng = _rng(seed, "zeroshot", index)
    img, objects, background, wide = render_scene(rng, 1)
    obj = objects[0]
    return img, caption_for(rng, objects, background, wide), {
        "shape": obj.shape, "colour": obj.colour, "size": obj.size,
    }


def zero_shot_prompts(attribute: str) -> list[str]:
    """One prompt per class of `attribute` ("shape", "colour" or "size"), in class order."""
    if attribute == "shape":
        return [f"a photo of a {shape}." for shape in SHAPES]
    if attribute == "colour":
        return [f"a photo of a {colour} shape." for colour in COLOURS]
    if attribute == "size":
        return [f"a photo of a {size} shape." for size in SIZES]
    raise ValueError(f"attribute must be one of {tuple(ATTRIBUTES)}, got {attribute!r}")


def zero_shot_prompt_ensemble(attribute: str) -> list[list[str]]:
    """Per class of `attribute`, captions in the training style that vary the other attributes.

    Average the text embeddings of each inner list to get a class embedding that does not lean
    on one particular shape (for colour) or colour (for shape).
    """
    if attribute not in ATTRIBUTES:
        raise ValueError(f"attribute must be one of {tuple(ATTRIBUTES)}, got {attribute!r}")
    prompts: list[list[str]] = []
    for k in range(len(ATTRIBUTES[attribute])):
        texts = []
        for shape in range(len(SHAPES)):
            for colour in range(len(COLOURS)):
                for size in range(len(SIZES)):
                    obj = SceneObject(shape, colour, size)
                    if getattr(obj, attribute) == k:
                        texts.append(f"a photo of {obj.phrase()}.")
        prompts.append(texts)
    return prompts

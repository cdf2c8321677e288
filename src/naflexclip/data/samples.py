"""Sample decoding: image bytes/PIL and caption bytes to (RGB image, caption), or a named skip reason.

Every way a sample can be unusable maps to one reason in `SKIP_REASONS`; readers and the loader
count them instead of crashing. Palette, CMYK, greyscale, 16-bit and alpha images are converted
to 8-bit RGB (alpha composited over white; 16-bit divided by 257, whatever the content), not skipped.
"""

from __future__ import annotations

import io
import json
import random
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

# a bad region of a sample's .json (`naflexclip.data.regions`): the region is skipped, the sample trains
REGION_REASONS = (
    "region_malformed",  # not {"bbox": [4 numbers], "caption": str}, or a .json that is not a JSON object
    "region_outside_image",  # a coordinate outside [0, width] x [0, height] of the original image
    "region_empty_box",  # x1 <= x0 or y1 <= y0
    "region_no_caption",  # a missing or empty caption
)
SKIP_REASONS = (
    "missing_file",  # CSV row / folder entry whose image file does not exist
    "missing_image",  # WebDataset sample with no image member
    "empty_image",  # zero-byte image data
    "not_an_image",  # bytes PIL cannot identify as an image
    "corrupt_image",  # truncated or corrupt image data
    "degenerate_image",  # zero-size or 1xN / Nx1 image
    "decompression_bomb",  # more pixels than PIL.Image.MAX_IMAGE_PIXELS
    "over_max_image_pixels",  # more pixels than --max-image-pixels (read from the header, before decoding)
    "missing_caption",  # no caption member / cell
    "empty_caption",  # caption is empty or whitespace
    "caption_not_utf8",  # caption bytes are not valid UTF-8
    "malformed_row",  # a CSV/TSV line that does not split into the header's columns
    "truncated_sample",  # a sample whose data a truncated shard cut (the samples before it are kept)
    "truncated_shard",  # a tar shard that ends early or is not a tar (counted once per shard)
    "missing_shard",  # a shard URL that cannot be opened (a shard problem, not a bad sample)
    "epoch_remainder",  # an epoch with fewer samples than ranks: no rank can be given one without the others
    "duplicate_key",  # a key that names several samples of one shard: noted, each of them trains
    # sizes.json's count for a shard is not what it holds: each listed sample it lacks counted; a shard holding more
    # than listed named once per epoch (its samples all train; with --trust-sizes-json each one past the count named)
    "shard_size_mismatch",
    "unreachable_shard",  # a remote shard whose reads kept failing after retries (each of its samples counted)
    "shard_changed",  # a remote shard rewritten since its version was pinned at startup (each sample read counted)
    "read_retry",  # a remote read that failed transiently and was retried: a note, nothing is lost
    "read_throttled",  # a remote read the store throttled (503 SlowDown, 429), retried after a backoff: a note
    *REGION_REASONS,
)
# reasons about whole shards, the plan or the packing, reported apart from bad samples
NOT_SAMPLE_REASONS = ("truncated_shard", "missing_shard", "epoch_remainder", "duplicate_key", "shard_size_mismatch",
                      "shard_holds_more", "read_retry", "read_throttled",
                      *REGION_REASONS)
# notes, not skips: the samples they name all trained
NOTE_REASONS = ("duplicate_key", "shard_holds_more", "read_retry", "read_throttled")
# notes that name no sample: each is an event, counted every time (a read retried, a read throttled)
READ_NOTES = ("read_retry", "read_throttled")


def reasons_line(counts: Mapping[str, int]) -> str:
    """Skip counts as one line: `reason=count, ...` by reason."""
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")


class SkipSample(Exception):
    """A sample that cannot be used; `reason` is one of SKIP_REASONS. `notes`: as `RawSample.notes`."""

    def __init__(self, reason: str, detail: str = "", notes: list[dict[str, Any]] | None = None) -> None:
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail, self.notes = reason, detail, notes or []

    def __reduce__(self) -> tuple[Any, ...]:
        # sent to a loader worker inside a task (a sample of a chunk fetched by the main process that failed):
        # rebuilt from its parts, not from its message
        return type(self), (self.reason, self.detail, self.notes)


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB: alpha over white, 16/32-bit scaled down, palette/CMYK/L expanded."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # scaled by bit depth, never by content: 65535 -> 255 for every image, dark or bright
        # ("I" is how Pillow opens 16-bit greyscale from some formats; its values are read as 16-bit too)
        arr = np.asarray(img).astype(np.float64) / 257.0
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "F":
        return Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


DraftFn = Callable[[tuple[int, int]], tuple[int, int]]


def decode_image(data: bytes | None, draft: DraftFn | None = None, max_pixels: int = 0) -> Image.Image:
    """Decode image bytes to an RGB PIL image, raising SkipSample with the reason when unusable.

    `draft`: maps the stored (height, width) to the smallest (height, width) the transform needs;
    a JPEG is then decoded at a reduced scale still at least that big (libjpeg DCT scaling), which
    makes big JPEGs much cheaper to decode. `max_pixels` > 0 (`--max-image-pixels`): an image with more
    pixels is skipped from its header, before any pixel is decoded.
    """
    if data is None:
        raise SkipSample("missing_image")
    if len(data) == 0:
        raise SkipSample("empty_image")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise SkipSample("decompression_bomb", str(exc)) from None
        except UnidentifiedImageError:
            raise SkipSample("not_an_image", "no image format recognised") from None
        except Exception as exc:  # noqa: BLE001 - any header parse failure is a corrupt image
            raise SkipSample("corrupt_image", f"{type(exc).__name__}: {exc}") from None
        if max_pixels and img.width * img.height > max_pixels:
            raise SkipSample("over_max_image_pixels",
                             f"{img.width}x{img.height} > --max-image-pixels {max_pixels}")
        return _load_checked(img, draft)


def read_image_file(path: str) -> bytes:
    """Read an image file's bytes; a missing file is SkipSample("missing_file")."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise SkipSample("missing_file", path) from None


def _load_checked(img: Image.Image, draft: DraftFn | None) -> Image.Image:
    width, height = img.size
    if min(width, height) < 2:
        raise SkipSample("degenerate_image", f"{width}x{height}")
    if draft is not None and img.format == "JPEG":
        need_h, need_w = draft((height, width))
        img.draft("RGB", (need_w, need_h))
    try:
        img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise SkipSample("decompression_bomb", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - truncated data, bad CRC, broken codec stream
        raise SkipSample("corrupt_image", f"{type(exc).__name__}: {exc}") from None
    try:
        return to_rgb(img)
    except Exception as exc:  # noqa: BLE001
        raise SkipSample("corrupt_image", f"{img.mode}: {exc}") from None


@dataclass(frozen=True)
class JsonCaption:
    """OpenCLIP's `--json-text-key` / `--json-text-key-probs`: a caption read from a field of the sample's JSON.

    Without weights the first field with a non-empty string wins. With weights (missing ones 0), the fields
    with a positive weight are drawn into a priority order without replacement (probability proportional to
    weight), the 0-weight ones follow as fallbacks, and the first non-empty wins; the draw comes from (seed,
    epoch, sample key) alone, so a sample's caption is the same wherever and whenever that epoch reads it.
    """

    keys: tuple[str, ...]
    probs: tuple[float, ...] | None = None

    def order(self, seed: int, epoch: int, sample_key: str) -> list[str]:
        """The fields in the order they are tried for this sample in this epoch."""
        if self.probs is None:
            return list(self.keys)
        weights = [*self.probs, *[0.0] * (len(self.keys) - len(self.probs))]
        rng = random.Random(f"{seed}:{epoch}:{sample_key}")  # str seeds hash with SHA-512: stable across processes
        drawn = [[k, w] for k, w in zip(self.keys, weights, strict=True) if w > 0]
        order = []
        while drawn:
            i = rng.choices(range(len(drawn)), weights=[w for _, w in drawn])[0]
            order.append(drawn.pop(i)[0])
        return order + [k for k, w in zip(self.keys, weights, strict=True) if w <= 0]

    def __call__(self, data: bytes | str | None, seed: int, epoch: int, sample_key: str) -> str | list[str]:
        if data is None:
            raise SkipSample("missing_caption", "no .json member (--json-text-key)")
        try:
            meta = json.loads(data)
        except (ValueError, TypeError):
            raise SkipSample("missing_caption", "the .json member is not JSON (--json-text-key)") from None
        if isinstance(meta, dict):
            for key in self.order(seed, epoch, sample_key):
                value = meta.get(key)
                if isinstance(value, str) and value.strip():
                    return value.strip()
                if isinstance(value, list):  # several captions of the image (the caller takes one, or all)
                    captions = [v.strip() for v in value if isinstance(v, str) and v.strip()]
                    if captions:
                        return captions
        raise SkipSample("missing_caption", f"no non-empty --json-text-key field of {list(self.keys)}")


def one_caption(captions: str | list[str], seed: int, epoch: int, sample_key: str) -> str:
    """One of a sample's captions for this epoch (OpenCLIP's one caption per sample): drawn from (seed, epoch,
    sample key) alone, so every worker, rank and resume reads the same one."""
    if isinstance(captions, str):
        return captions
    return random.Random(f"{seed}:{epoch}:{sample_key}:caption").choice(captions)


def decode_captions(data: bytes | str | list[str] | None, per_line: bool = False) -> str | list[str]:
    """`decode_caption`, or each of several captions (a list; the empty ones left out, SkipSample if none is left).
    `per_line` (--caption-per-line): a caption text's non-empty lines are several captions (one line: one caption)."""
    if not isinstance(data, list):
        text = decode_caption(data)
        lines = [line.strip() for line in text.splitlines() if line.strip()] if per_line else []
        return lines if len(lines) > 1 else text
    captions = [caption.strip() for caption in data if isinstance(caption, str) and caption.strip()]
    if not captions:
        raise SkipSample("empty_caption")
    return captions


def decode_caption(data: bytes | str | None) -> str:
    """Caption bytes/str to stripped text, raising SkipSample for missing, empty or non-UTF-8 captions."""
    if data is None:
        raise SkipSample("missing_caption")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise SkipSample("caption_not_utf8") from None
    else:
        text = data
        try:
            text.encode("utf-8")  # surrogate escapes from a non-UTF-8 CSV fail here
        except UnicodeEncodeError:
            raise SkipSample("caption_not_utf8") from None
    text = text.strip()
    if not text:
        raise SkipSample("empty_caption")
    return text

"""Helpers for the data tests: real PIL-encoded images in several formats/modes, tar shards, bad samples."""

from __future__ import annotations

import io
import struct
import tarfile
import zlib

import numpy as np
from PIL import Image


def image_bytes(width: int, height: int, fmt: str = "PNG", mode: str = "RGB", seed: int = 0) -> bytes:
    """A real encoded image of the given size, format and PIL mode."""
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    elif mode == "P":
        img = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    else:
        img = rgb.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def bomb_png() -> bytes:
    """A tiny PNG whose header claims 20000x20000 pixels (over twice PIL's decompression-bomb limit)."""
    data = bytearray(image_bytes(2, 2, "PNG"))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4: ihdr + 12] = struct.pack(">II", 20000, 20000)
    crc = zlib.crc32(bytes(data[ihdr: ihdr + 17])) & 0xFFFFFFFF
    data[ihdr + 17: ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def write_tar(path: str, members: list[tuple[str, bytes]]) -> None:
    """Write a plain tar of (name, bytes) members in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def truncate_inside_last_member(path: str) -> None:
    """Cut a tar file in the middle of its last member's data (a shard whose download died)."""
    with tarfile.open(path, "r:") as tar:
        last = tar.getmembers()[-1]
    with open(path, "r+b") as f:
        f.truncate(last.offset_data + last.size // 2)


def write_wds_corpus(root) -> tuple[str, list[str], dict[str, int]]:
    """Four shards: bad samples of every kind among good ones, a truncated shard, a clean one, a missing one.

    Returns (shard spec, usable sample keys as the loader names them, skip counts per epoch).
    """
    jpg = image_bytes(40, 30, "JPEG")
    good = [("g_rgb", "jpg", jpg), ("g_palette", "png", image_bytes(30, 50, "PNG", "P")),
            ("g_cmyk", "jpg", image_bytes(33, 21, "JPEG", "CMYK")), ("g_grey", "png", image_bytes(24, 24, "PNG", "L")),
            ("g_16bit", "png", image_bytes(20, 40, "PNG", "I;16")),
            ("g_alpha", "webp", image_bytes(50, 20, "WEBP", "RGBA")), ("img.v2.3", "jpg", jpg)]
    bad = [
        [("b_truncated.jpg", jpg[: len(jpg) // 2]), ("b_truncated.txt", b"cut")],  # corrupt_image (decode)
        [("b_text.jpg", b"this is not an image at all"), ("b_text.txt", b"text file")],  # not_an_image
        [("b_zero.png", b""), ("b_zero.txt", b"zero bytes")],  # empty_image (index)
        [("b_thin.png", image_bytes(1, 40, "PNG")), ("b_thin.txt", b"one pixel wide")],  # degenerate_image
        [("b_bomb.png", bomb_png()), ("b_bomb.txt", b"bomb")],  # decompression_bomb
        [("b_nocap.jpg", jpg)],  # missing_caption (index)
        [("b_emptycap.jpg", jpg), ("b_emptycap.txt", b"  \n")],  # empty_caption (decode)
        [("b_latin1.jpg", jpg), ("b_latin1.txt", "caf\xe9".encode("latin-1"))],  # caption_not_utf8
        [("b_noimage.txt", b"caption without an image")],  # missing_image (index)
    ]
    mixed: list[tuple[str, bytes]] = []
    for i in range(max(len(good), len(bad))):
        if i < len(good):
            key, ext, data = good[i]
            mixed += [(f"{key}.{ext}", data), (f"{key}.txt", f"caption of {key}".encode())]
        mixed += bad[i] if i < len(bad) else []
    write_tar(f"{root}/shard-0.tar", mixed)
    tail = [m for j in range(4) for m in ((f"t{j}.png", image_bytes(16, 24, "PNG", seed=j)), (f"t{j}.txt", b"tail"))]
    write_tar(f"{root}/shard-1.tar", tail)
    truncate_inside_last_member(f"{root}/shard-1.tar")  # t3's caption is cut: t0..t2 survive, t3 is named
    write_tar(f"{root}/shard-2.tar", [m for j in range(6) for m in (
        (f"c{j}.jpg", image_bytes(20 + j, 30, "JPEG", seed=10 + j)), (f"c{j}.txt", f"clean {j}".encode()))])
    usable = ([f"{root}/shard-0.tar:{k}" for k, _, _ in good] + [f"{root}/shard-1.tar:t{j}" for j in range(3)]
              + [f"{root}/shard-2.tar:c{j}" for j in range(6)])
    skips = {"corrupt_image": 1, "not_an_image": 1, "empty_image": 1, "degenerate_image": 1, "decompression_bomb": 1,
             "missing_caption": 1, "empty_caption": 1, "caption_not_utf8": 1, "missing_image": 1,
             "truncated_sample": 1, "truncated_shard": 1, "missing_shard": 1}
    return f"{root}/shard-{{0..3}}.tar", usable, skips


def write_csv_corpus(root) -> tuple[str, list[str], dict[str, int]]:
    """A TSV with a UTF-8 BOM, quoting traps, a malformed row, a missing file and bad images/captions."""
    images = {f"ok{i}.png": image_bytes(20 + 3 * i, 30, "PNG", seed=i) for i in range(9)}
    images["dark16.png"] = image_bytes(20, 20, "PNG", "I;16")
    images["fake.jpg"] = b"<html>not found</html>"
    images["cut.jpg"] = image_bytes(40, 30, "JPEG")[:200]
    for name, data in images.items():
        (root / name).write_bytes(data)
    rows = [
        "\ufefffilepath\ttitle",
        "ok0.png\tplain caption",
        'ok1.png\t"The Best" of summer',  # quotes kept, not eaten
        'ok2.png\t"unbalanced start of a caption',  # must not swallow the rows below
        "ok3.png\ta caption",
        'ok4.png\t"a ""quoted"" word"',  # RFC 4180: a "quoted" word
        "missing.png\tgone",  # missing_file, line 7
        "ok5.png\ttoo\tmany fields",  # malformed_row, line 8
        "fake.jpg\tan html page",  # not_an_image
        "cut.jpg\ta cut jpeg",  # corrupt_image
        "ok6.png\t   ",  # empty_caption
        "dark16.png\ta dark 16-bit image",
        "",
        "ok7.png\tlast row",
    ]
    # caption_not_utf8, on its own image (rows naming one image are one sample with several captions)
    data = "\n".join(rows).encode("utf-8") + b"\n" + b"ok8.png\tcaf\xe9\n"
    (root / "data.tsv").write_bytes(data)
    usable = ["ok0.png", "ok1.png", "ok2.png", "ok3.png", "ok4.png", "dark16.png", "ok7.png"]
    skips = {"missing_file": 1, "malformed_row": 1, "not_an_image": 1, "corrupt_image": 1, "empty_caption": 1,
             "caption_not_utf8": 1}
    return str(root / "data.tsv"), usable, skips


def write_folder_corpus(root, outside) -> tuple[str, list[str], dict[str, int]]:
    """A folder tree: same-stem images, a dotted stem, a symlinked folder, a symlink loop, bad files."""
    import os

    files = {"a.png": image_bytes(20, 30, "PNG"), "a.txt": b"caption a",
             "dup.jpg": image_bytes(30, 20, "JPEG"), "dup.png": image_bytes(20, 20, "PNG", seed=3), "dup.txt": b"dup",
             "img.v2.3.jpg": image_bytes(24, 24, "JPEG", seed=4), "img.v2.3.txt": b"dotted",
             "nocap.png": image_bytes(20, 20, "PNG"), "fake.jpg": b"not an image", "fake.txt": b"fake",
             "sub/b.webp": image_bytes(30, 30, "WEBP", seed=5), "sub/b.txt": b"caption b",
             "sub/empty.png": image_bytes(20, 24, "PNG", seed=6), "sub/empty.txt": b"",
             }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (outside / "linked.png").write_bytes(image_bytes(26, 20, "PNG", seed=7))
    (outside / "linked.txt").write_bytes(b"reached through a symlink")
    os.symlink(outside, root / "link")
    os.symlink(root, root / "sub" / "loop")  # a loop back to the top: followed once, not forever
    usable = [str(root / n) for n in ("a.png", "dup.jpg", "dup.png", "img.v2.3.jpg", "sub/b.webp", "link/linked.png")]
    skips = {"missing_caption": 1, "not_an_image": 1, "empty_caption": 1}
    return str(root), usable, skips

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

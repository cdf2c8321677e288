"""Export slices of the built-in dataset as WebDataset shards, an image folder + CSV, image + .txt pairs, or Parquet
files in the Hub's layout (an `image` struct {bytes, path} and a `caption` column).

So the real readers can be exercised (and benchmarked) on data with known content. WebDataset
export also writes an OpenCLIP-style `sizes.json` (shard name -> sample count) that the reader
uses to size an epoch when `--train-num-samples` is not given.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os

from webdataset.writer import TarWriter

from naflexclip.data.synthetic import synthetic_scene

EXPORT_FORMATS = ("webdataset", "csv", "folder", "parquet")
PARQUET_ROW_GROUP = 100  # rows per Parquet row group (the `datasets` library's for image datasets)
# the `datasets` library's description of the Hub layout's columns (what it reads the image struct as)
HUB_FEATURES = {"info": {"features": {"image": {"_type": "Image"}, "caption": {"dtype": "string", "_type": "Value"}}}}
IMAGE_FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


def _encode(img, image_format: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=IMAGE_FORMATS[image_format], **({"quality": 90} if image_format == "jpg" else {}))
    return buf.getvalue()


def export_synthetic(
    out_dir: str,
    *,
    fmt: str = "webdataset",
    split: str = "train",
    start: int = 0,
    count: int = 1000,
    image_format: str = "jpg",
    shard_size: int = 1000,
    seed: int = 0,
    csv_separator: str = "\t",
) -> list[str]:
    """Write samples [start, start + count) of `split` to `out_dir`; returns the files a reader takes.

    webdataset: `{split}-{00000..}.tar` shards of `shard_size` samples (key.jpg/png + key.txt + key.json);
    csv: `images/{key}.{ext}` (+ `images/{key}.json`) and `{split}.csv` with columns filepath, title (relative paths);
    folder: `{key}.{ext}` + `{key}.txt` + `{key}.json`; parquet: `{split}-{00000..}.parquet` files of `shard_size`
    rows in row groups of `PARQUET_ROW_GROUP`, the Hub's layout (`image`: {bytes, path}, `caption`; no regions).
    Each `.json` holds the scene's regions (`{"regions": [{"bbox": [x0, y0, x1, y1], "caption": ...}]}`, pixels;
    `naflexclip.data.regions`).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"--format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"--image-format must be one of {tuple(IMAGE_FORMATS)}, got {image_format!r}")
    if count < 1 or start < 0 or shard_size < 1:
        raise ValueError(f"need count >= 1, start >= 0, shard_size >= 1; got {count}, {start}, {shard_size}")
    os.makedirs(out_dir, exist_ok=True)
    samples = ((f"{split}{i:08d}", *synthetic_scene(seed, split, i)) for i in range(start, start + count))
    if fmt == "webdataset":
        return _write_shards(out_dir, split, samples, image_format, shard_size, count)
    if fmt == "parquet":
        return _write_parquet(out_dir, split, samples, image_format, shard_size, count)
    if fmt == "csv":
        os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
        table = os.path.join(out_dir, f"{split}.csv")
        with open(table, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter=csv_separator)
            writer.writerow(["filepath", "title"])
            for key, img, caption, regions in samples:
                rel = os.path.join("images", f"{key}.{image_format}")
                with open(os.path.join(out_dir, rel), "wb") as imf:
                    imf.write(_encode(img, image_format))
                _write_regions(os.path.join(out_dir, "images", key), regions)
                writer.writerow([rel, caption])
        return [table]
    for key, img, caption, regions in samples:
        with open(os.path.join(out_dir, f"{key}.{image_format}"), "wb") as f:
            f.write(_encode(img, image_format))
        with open(os.path.join(out_dir, f"{key}.txt"), "w", encoding="utf-8") as f:
            f.write(caption)
        _write_regions(os.path.join(out_dir, key), regions)
    return [out_dir]


def _write_regions(stem: str, regions: list) -> None:
    with open(f"{stem}.json", "w", encoding="utf-8") as f:
        json.dump({"regions": regions}, f)


def _write_shards(out_dir, split, samples, image_format, shard_size, count) -> list[str]:
    paths: list[str] = []
    sizes: dict[str, int] = {}
    num_shards = (count + shard_size - 1) // shard_size
    for shard in range(num_shards):
        name = f"{split}-{shard:05d}.tar"
        path = os.path.join(out_dir, name)
        n = 0
        with TarWriter(path) as writer:
            for key, img, caption, regions in samples:
                writer.write({"__key__": key, image_format: _encode(img, image_format),
                              "txt": caption.encode("utf-8"), "json": json.dumps({"regions": regions}).encode()})
                n += 1
                if n == shard_size:
                    break
        sizes[name] = n
        paths.append(path)
    with open(os.path.join(out_dir, "sizes.json"), "w") as f:
        json.dump(sizes, f, indent=1)
    return paths


def _write_parquet(out_dir, split, samples, image_format, shard_size, count) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                        ("caption", pa.string())], metadata={"huggingface": json.dumps(HUB_FEATURES)})
    paths: list[str] = []
    for shard in range((count + shard_size - 1) // shard_size):
        rows = [{"image": {"bytes": _encode(img, image_format), "path": f"{key}.{image_format}"}, "caption": caption}
                for key, img, caption, _regions in itertools.islice(samples, shard_size)]
        path = os.path.join(out_dir, f"{split}-{shard:05d}.parquet")
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=PARQUET_ROW_GROUP)
        paths.append(path)
    return paths


def shard_spec(paths: list[str]) -> str:
    """A brace pattern naming exported shards or files, e.g. "out/train-{00000..00003}.tar"."""
    if len(paths) == 1:
        return paths[0]
    head, tail = paths[0].rsplit("-", 1)
    last = paths[-1].rsplit("-", 1)[1]
    suffix = tail.split(".", 1)[1]
    return f"{head}-{{{tail.split('.')[0]}..{last.split('.')[0]}}}.{suffix}"

"""Sharded checkpoints (`--fsdp-checkpoint sharded`): every rank writes its own shards of the large named states
(the model, the optimizer) through torch.distributed.checkpoint (DCP); no rank gathers them whole.

This module is DCP's side alone: the folder around the shards (the small states in rank 0's `train_state.pt`,
`checkpoint.json` naming this `FORMAT`, publishing) is `checkpoints.storage`'s, which reads both forms.
`load_into` fills live state dicts (DTensors at any world size, or plain tensors) from the pieces each rank needs;
`read_whole` gathers one state whole in this process. Only DCP's public API is used.
docs/checkpoints.md#sharded-checkpoints---fsdp-checkpoint-sharded.
"""

from __future__ import annotations

import contextlib
import io
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

FORMAT = "sharded"  # `checkpoint.json`'s "format" of a sharded checkpoint
DCP_METADATA = ".metadata"  # DCP's index of the shards


@contextlib.contextmanager
def _one_process_quiet(no_dist: bool) -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group, which is the case: not said."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _no_process_group() -> bool:
    """DCP then works in this process alone (as it decides for itself: `no_dist` is given only to `read_whole`)."""
    return not (dist.is_available() and dist.is_initialized())


# ---------------------------------------------------------------------------------------------- write


class _Writer(FileSystemWriter):
    """DCP's file writer, telling when a save has begun writing (past DCP's one-process warning)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder), sync_files=True)
        self.started = threading.Event()

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        self.started.set()
        super().set_up_storage_writer(*args, **kwargs)


def write_shards(states: dict[str, Any], folder: Path, *, process_group: dist.ProcessGroup | None = None,
                 asynchronous: bool = False) -> Future | None:
    """This rank's pieces of `states` (name -> state dict of tensors, DTensors or not) into `folder`; every rank
    must call it. Synchronous: returns once every rank's pieces and `.metadata` are written (None). Asynchronous:
    returns once this rank's tensors are copied aside (`dcp.async_save`); the future resolves when written."""
    writer = _Writer(folder)
    no_dist = _no_process_group()
    with _one_process_quiet(no_dist):
        if not asynchronous:
            dcp.save(states, storage_writer=writer, process_group=process_group)
            return None
        response = dcp.async_save(states, storage_writer=writer, process_group=process_group)
        # staging is synchronous here (DCP's default): the tensors are copied aside when async_save returns. A
        # newer torch may answer with both futures (`AsyncSaveResponse`): the one of the written files is ours
        future: Future = getattr(response, "upload_completion", response)  # type: ignore[arg-type]
        if no_dist:  # DCP's writer thread warns again as it starts: the filter stays until it has
            while not writer.started.wait(0.01) and not future.done():
                pass
        return future


# ----------------------------------------------------------------------------------------------- read


def _set_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """`value` at `path` (a DCP planner's path of a flattened key: dict keys and list indices) inside `root`,
    creating the dicts and lists on the way."""
    container: Any = root
    for key, following in zip(path[:-1], path[1:], strict=True):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(container, list):
            container.extend([None] * (int(key) + 1 - len(container)))
            if container[int(key)] is None:
                container[int(key)] = empty
            container = container[int(key)]
        else:
            container = container.setdefault(key, empty)
    last = path[-1]
    if isinstance(container, list):
        container.extend([None] * (int(last) + 1 - len(container)))
        container[int(last)] = value
    else:
        container[last] = value


class _WeightsOnlyLoad(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor values back weights-only (DCP's own unpickles anything)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # into the nested state dict the caller handed over
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _metadata(directory: Path) -> Metadata:
    return FileSystemReader(str(directory)).read_metadata()


def metadata_problem(directory: Path, names: tuple[str, ...]) -> str | None:
    """What is wrong with the shards' index: `.metadata` unreadable, without a state of `names`, or pointing to a
    missing file (`file: what`); None when it is whole."""
    try:
        metadata = _metadata(directory)
    except Exception as error:  # a torn or foreign file: unpickling errors of every kind
        return f"{DCP_METADATA}: {type(error).__name__}"
    present = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    absent = sorted(set(names) - present)
    if absent:
        return f"{DCP_METADATA}: holds no state {absent[0]!r}; written by another save?"
    files = sorted({item.relative_path for item in (metadata.storage_data or {}).values()})
    for file in files:
        if not (directory / file).is_file():
            return f"{file}: missing; {DCP_METADATA} points to it"
    return None


def tensor_shapes(directory: Path, name: str) -> dict[str, torch.Tensor]:
    """State `name`'s tensors as empty meta tensors of their saved shapes, keyed as its state dict (reads only
    `.metadata`): what a resume checks a model's shapes against."""
    prefix = f"{name}."
    return {key[len(prefix):]: torch.empty(value.size, dtype=value.properties.dtype, device="meta")
            for key, value in _metadata(directory).state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)}


def saved_keys(directory: Path, name: str) -> set[str]:
    """The flattened keys (`state.<param>.exp_avg`, ...) state `name` holds in the checkpoint."""
    prefix = f"{name}."
    return {key[len(prefix):] for key in _metadata(directory).state_dict_metadata if key.startswith(prefix)}


def load_into(directory: Path, states: dict[str, Any], *, partial: bool = False,
              process_group: dist.ProcessGroup | None = None) -> None:
    """Fill `states` (name -> a live state dict: DTensors at any world size, or plain tensors) in place from the
    checkpoint's shards; every rank must call it. `partial`: entries the checkpoint lacks keep their values
    (an optimizer state for a parameter without one yet)."""
    no_dist = _no_process_group()
    with _one_process_quiet(no_dist):
        dcp.load(states, storage_reader=FileSystemReader(str(directory)), planner=_WeightsOnlyLoad(
            allow_partial_load=partial), process_group=process_group)


def read_whole(directory: Path, name: str) -> dict[str, Any]:
    """State `name` of a sharded checkpoint, whole, in this process alone (no process group needed): every entry
    the index holds under `name`, built empty from it, read flat, then nested as it was saved."""
    reader = FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    paths = metadata.planner_data or {}
    flat: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if paths.get(key, (key,))[0] == name:  # a value DCP reads into in place, or one it replaces (bytes)
            flat[key] = (torch.empty(entry.size, dtype=entry.properties.dtype)
                         if isinstance(entry, TensorStorageMetadata) else None)
    with _one_process_quiet(True):
        dcp.load(flat, storage_reader=reader, planner=_WeightsOnlyLoad(flatten_state_dict=False,
                                                                      flatten_sharded_tensors=False), no_dist=True)
    whole: dict[str, Any] = {}
    for key, value in flat.items():
        _set_path(whole, tuple(paths.get(key, (key,))), value)
    return whole.get(name, {})

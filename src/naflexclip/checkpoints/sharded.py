"""Sharded checkpoints (`--fsdp-checkpoint sharded`): every rank writes its own shards of the large named states
(the model, the optimizer) through torch.distributed.checkpoint (DCP); no rank gathers them whole.

The small states stay in rank 0's `train_state.pt`, and the folder is published as a full one (`storage.publish`).
`load_into` fills live state dicts (DTensors at any world size, or plain tensors) from the pieces each rank needs;
`read_whole` gathers one state whole in this process. docs/checkpoints.md#sharded-checkpoints---fsdp-checkpoint-sharded.
"""

from __future__ import annotations

import io
import os
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from naflexclip.checkpoints import storage

FORMAT = "sharded"


# ---------------------------------------------------------------------------------------------- write


def write_shards(states: dict[str, Any], folder: Path, *, process_group: dist.ProcessGroup | None = None,
                 asynchronous: bool = False) -> Future | None:
    """This rank's pieces of `states` (name -> state dict of tensors, DTensors or not) into `folder`; every rank
    must call it. Synchronous: returns once every rank's pieces and `.metadata` are written (None). Asynchronous:
    returns once this rank's tensors are copied aside (`dcp.async_save`); the future resolves when written."""
    writer = FileSystemWriter(str(folder), sync_files=True)
    no_dist = not (dist.is_available() and dist.is_initialized())
    if no_dist:  # DCP warns (also from its writer's thread) that it assumes one process, which is the case
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    if asynchronous:
        response = dcp.async_save(states, storage_writer=writer, process_group=process_group, no_dist=no_dist)
        # staging is synchronous here (DCP's default): the tensors are copied aside when async_save returns
        return response.upload_completion if isinstance(response, AsyncSaveResponse) else response
    dcp.save(states, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    return None


def finish(checkpoint_dir: Path, name: str, folder: Path, other_states: dict[str, Any], *, step: int, epoch: int,
           sharded: list[str], known: dict[str, str | None] | None = None) -> Path:
    """On rank 0 once every rank's shards are in `folder`: `train_state.pt`, `checkpoint.json`, publish.
    `known`: checksums recorded already (shards linked from a checkpoint of the same step)."""
    try:
        storage.write_state_file(folder, other_states)
        storage.write_meta(folder, step, epoch, known=known, format=FORMAT, sharded=sorted(sharded))
    except BaseException:
        storage.discard(folder)
        raise
    return storage.publish(checkpoint_dir, name, folder)


# ----------------------------------------------------------------------------------------------- read


class _WeightsOnlyLoad(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor values back weights-only (DCP's own unpickles anything)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        storage_key = self.mappings[read_item.dest_index.fqn] if self.flatten_state_dict else None
        loaded = torch.load(value, weights_only=True)
        if storage_key is not None:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, storage_key, loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _WeightsOnlyWhole(_EmptyStateDictLoadPlanner):
    """Rebuilds the named states whole from the metadata (`read_whole`), non-tensor values weights-only."""

    load_bytes = _WeightsOnlyLoad.load_bytes


def _metadata(directory: Path) -> Metadata:
    return FileSystemReader(str(directory)).read_metadata()


def check_metadata(directory: Path, names: tuple[str, ...], damaged: str) -> None:
    """`.metadata` readable, holding the states `checkpoint.json` names, every file it points to present;
    else `storage.CheckpointError` (`damaged`: the message's start) naming the file."""
    try:
        metadata = _metadata(directory)
    except Exception as error:  # a torn or foreign file: unpickling errors of every kind
        raise storage.CheckpointError(f"{damaged} ({storage.DCP_METADATA}: {type(error).__name__})") from None
    present = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    absent = sorted(set(names) - present)
    if absent:
        raise storage.CheckpointError(f"{damaged} ({storage.DCP_METADATA}: holds no state {absent[0]!r}; written "
                                      f"by another save?)")
    files = sorted({item.relative_path for item in (metadata.storage_data or {}).values()})
    for file in files:
        if not (directory / file).is_file():
            raise storage.CheckpointError(f"{damaged} ({file}: missing; {storage.DCP_METADATA} points to it)")


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
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if no_dist:  # DCP warns that it assumes one process, which is the case
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(states, storage_reader=FileSystemReader(str(directory)), planner=_WeightsOnlyLoad(
            allow_partial_load=partial), process_group=process_group, no_dist=no_dist)


def read_whole(directory: Path, name: str) -> dict[str, Any]:
    """State `name` of a sharded checkpoint, whole, in this process alone (no process group needed)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # format_utils' way to read whole

    whole: dict[str, Any] = {}
    _load_state_dict(whole, storage_reader=FileSystemReader(str(directory)), planner=_WeightsOnlyWhole(keys={name}),
                     no_dist=True)
    return whole.get(name, {})


def consolidate(source: Path, out: Path) -> Path:
    """The full form of the sharded checkpoint `source` (`naflexclip checkpoint consolidate`): a checkpoint folder
    `out` (`model.safetensors`, `train_state.pt` holding the other states whole, `checkpoint.json`) that every
    reader of full checkpoints takes; a path ending in `.safetensors` gets the model's weights alone. One process
    holds one state whole at a time."""
    found = storage.load_checkpoint(source)
    if not found.sharded:
        raise ValueError(f"{str(found.path)!r} is a full checkpoint already; nothing to consolidate")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        out.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in found.full_state(storage.MODEL).items()}, str(out))
        return out
    if out.exists():
        raise FileExistsError(f"--out {str(out)!r} exists; name a new folder")
    states = {**found.states, **{name: found.full_state(name) for name in found.sharded}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")  # renamed into place once complete
    try:
        tmp.mkdir()
        storage.write_full(tmp, states, step=found.step, epoch=found.epoch)
    except BaseException:
        storage.discard(tmp)
        raise
    os.replace(tmp, out)
    return out

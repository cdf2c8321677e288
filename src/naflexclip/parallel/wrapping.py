"""Data and model parallelism: DDP or FSDP2 around a model, the window's gradient-sync control, full state dicts.

- `wrap_model` — DDP (default) or FSDP2 `fully_shard` over the units the model names (`sharding_units()`);
  `no_sync_context` — the context the window enters around every backward but the window's last, so
  gradients are synchronised once per window.
- `full_state_dict` / `load_full_state_dict` and the optimizer's: a gathered state on rank 0 for checkpoints.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from naflexclip.parallel.process_group import DistributedEnv, translate_faults


def is_fsdp(model: nn.Module) -> bool:
    """True for a model FSDP2 sharded (`wrap_model(fsdp=True)`): every rank must run its forwards alike."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def wrap_model(model: nn.Module, env: DistributedEnv, fsdp: bool = False) -> nn.Module:
    """DDP (default) or FSDP2 `fully_shard` around a model already on `env.device`; identity in one process.

    Both average gradients over ranks; the window multiplies this rank's row gradients by
    `world_size`, so the average is the single-process gradient of the whole window. FSDP2 makes one unit
    (one all-gather) of each module the model's `sharding_units()` names (NaFlexClip: every transformer
    block of both towers), and one of the rest; a model without that method is one unit.
    """
    if not env.distributed:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        # FSDP2 cannot shard 0-d parameters (logit_scale, logit_bias): keep them whole on every rank
        scalars = {param for param in model.parameters() if param.dim() == 0}
        units = model.sharding_units() if callable(getattr(model, "sharding_units", None)) else []
        for unit in units:
            fully_shard(unit)
        # the root unit holds the rest (embeddings, projections)
        fully_shard(model, ignored_params=scalars or None)
        _REPLICATED[model] = _ReplicatedGrads(model, scalars, env)
        return model
    # the model's buffers are constants (attention masks), identical after DDP's initial broadcast:
    # re-broadcasting them before every forward would add one collective per microbatch
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        buffer_sync = {"forward_sync_buffers": False}  # torch ≥ 2.14's name; still syncs at init
    else:
        buffer_sync = {"broadcast_buffers": False}
    return DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None, **buffer_sync
    )


class _ReplicatedGrads:
    """Averages the gradients of the parameters FSDP2 leaves whole over ranks, on the backwards that sync
    (as DDP would). The window gives `logit_scale`/`logit_bias` the same gradient on every rank, so this only
    keeps ranks bit-identical; `no_sync_context` turns it off with the sharded parameters' sync."""

    def __init__(self, model: nn.Module, params: set[nn.Parameter], env: DistributedEnv) -> None:
        self.env = env
        self.sync = True
        names = {param: name for name, param in model.named_parameters()}
        for param in sorted(params, key=names.__getitem__):  # the same order on every rank
            param.register_post_accumulate_grad_hook(self.average)

    def average(self, param: torch.Tensor) -> None:
        if param.grad is not None and self.sync:
            with translate_faults(self.env, "averaging replicated gradients"):
                # SUM then divide: gloo has no AVG reduction
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(self.env.world_size)


# the FSDP2 models `wrap_model` sharded, and the averaging of the parameters it left whole
_REPLICATED: weakref.WeakKeyDictionary[nn.Module, _ReplicatedGrads] = weakref.WeakKeyDictionary()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (FSDP2 shards in place, so it is its own module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def no_sync_context(model: nn.Module) -> Callable[[], ContextManager[Any]]:
    """The context factory the window enters around every backward but the window's last.

    DDP: `model.no_sync`; FSDP2: `set_requires_gradient_sync(False)`, restored to True on exit;
    anything else: a null context.
    """
    if isinstance(model, DistributedDataParallel):
        return model.no_sync
    if is_fsdp(model):

        replicated = _REPLICATED.get(model)

        @contextlib.contextmanager
        def fsdp_no_sync() -> Iterator[None]:
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            if replicated is not None:  # the parameters left whole follow the sharded ones
                replicated.sync = False
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)  # type: ignore[operator]
                if replicated is not None:
                    replicated.sync = True

        return fsdp_no_sync
    return contextlib.nullcontext


# -------------------------------------------------------------------------------------- checkpoints


def full_state_dict(model: nn.Module, env: DistributedEnv) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, on rank 0 (other ranks get `{}`); every rank must call it.

    DDP: the module's state dict; FSDP2: gathered with `get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`. The tensors are copies: saving them later is safe.
    """
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        with translate_faults(env, "gathering the FSDP state dict"):
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not env.is_main:
            return {}
        # gathered shards are fresh tensors, but the tensors FSDP2 leaves whole (0-d logit_scale/logit_bias)
        # come back as the live CPU parameters themselves: copy those
        unmanaged = {key for key, value in model.state_dict().items() if not isinstance(value, DTensor)}
        return {key: value.detach().to("cpu", copy=True) if key in unmanaged else value for key, value in state.items()}
    if not env.is_main:
        return {}
    return _cpu_copy(dict(unwrap_model(model).state_dict()))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], env: DistributedEnv) -> None:
    """Load a full state dict read on rank 0 (other ranks may pass `{}`) into every rank's model.

    DDP: rank 0 loads it, then broadcasts every parameter and buffer; FSDP2: `set_model_state_dict`
    with `broadcast_from_rank0=True`, each rank keeping its shard. Every rank must call it.
    """
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor

        with translate_faults(env, "loading the FSDP state dict"), torch.no_grad():
            set_model_state_dict(
                model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
            # tensors FSDP2 does not manage (the 0-d logit_scale/logit_bias it cannot shard, buffers)
            # are not reliably loaded by it: copy them on rank 0 and broadcast
            for key, tensor in model.state_dict().items():
                if isinstance(tensor, DTensor):
                    continue
                if env.is_main:
                    tensor.copy_(state[key])
                dist.broadcast(tensor, src=0)
        return
    module = unwrap_model(model)
    if env.is_main or not env.distributed:
        module.load_state_dict(state)
    if env.distributed:
        with translate_faults(env, "broadcasting the loaded state"), torch.no_grad():
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0)


def full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, env: DistributedEnv
) -> dict[str, Any]:
    """The optimizer's whole state on rank 0 (other ranks get `{}`), keyed as `optimizer.state_dict()` is
    for the unwrapped model; every rank must call it. FSDP2: gathered with `get_optimizer_state_dict`."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        with translate_faults(env, "gathering the FSDP optimizer state"):
            state = get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if not env.is_main:
            return {}
        # gathered shards are fresh tensors; CPU tensors that needed no gather (`step`, the states of the
        # 0-d parameters) come back as the live ones, which the next step updates in place: copy those
        live = {
            value.data_ptr()
            for param_state in optimizer.state.values()
            for value in param_state.values()
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        }
        return _copy_if(state, lambda t: t.data_ptr() in live)
    # DDP: every rank holds the same optimizer state (same averaged gradients, same steps); copy it,
    # since optimizer.state_dict() aliases the live tensors that the next step updates in place
    return _cpu_copy(optimizer.state_dict()) if env.is_main else {}


def _cpu_copy(value: Any) -> Any:
    return _copy_if(value, lambda _: True)


def _copy_if(value: Any, should_copy: Callable[[torch.Tensor], bool]) -> Any:
    """`value` (nested dicts/lists of tensors) with the tensors `should_copy` picks copied to CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if should_copy(value) else value
    if isinstance(value, dict):
        return {key: _copy_if(item, should_copy) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_if(item, should_copy) for item in value)
    return value


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], env: DistributedEnv
) -> None:
    """Load a full optimizer state on every rank; all must call it.

    DDP: every rank passes the state it read from the checkpoint itself (the optimizer state is ~2× the
    model: reading the file is cheaper than pickling it through a broadcast). FSDP2: rank 0's state is
    broadcast and sharded (`broadcast_from_rank0`); other ranks may pass `{}`. A trainable parameter the saved
    state has none for (no gradient yet, e.g. the self-distillation heads before `--self-distill-start`) is left
    without state, as `optimizer.load_state_dict` leaves it: its state starts at its first step, as in an
    uninterrupted run (torch's loader gives it a zero state at step 1, which would shift its Adam bias correction).
    """
    names = {id(param): name for name, param in unwrap_model(model).named_parameters()}
    # every rank that holds the state checks it (each raises the same one line); keyed by name, as FSDP2's loader
    # finds a parameter's state: a state keyed by position (one process's, DDP's) would load nothing, silently
    by_name = _optimizer_state_by_name(state, optimizer, names) if state else {}
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        params = [param for group in optimizer.param_groups for param in group["params"]]
        saved = torch.zeros(len(params), dtype=torch.uint8)
        if env.is_main:
            saved = torch.tensor([names[id(p)] in by_name["state"] for p in params], dtype=torch.uint8)
        state = by_name
        with translate_faults(env, "loading the FSDP optimizer state"):
            set_optimizer_state_dict(
                model, optimizer, state,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
            )
            saved = saved.to(env.device)
            dist.broadcast(saved, src=0)
        for param, has_state in zip(params, saved.tolist(), strict=True):
            if not has_state:
                optimizer.state.pop(param, None)
        return
    if not state:
        raise ValueError(f"rank {env.rank}: empty optimizer state; under DDP every rank loads the checkpoint's")
    optimizer.load_state_dict(by_name)


def _optimizer_state_by_name(state: dict[str, Any], optimizer: torch.optim.Optimizer,
                            names: dict[int, str]) -> dict[str, Any]:
    """A full optimizer state (`optimizer.state_dict()`'s form, parameters by position in the param groups, or
    FSDP2's, by name) keyed by parameter name; `names`: each parameter's name by `id`. A state that does not fit
    this optimizer (other param groups, a parameter it does not train, a tensor of another shape) raises
    ValueError in one line: nothing trains on with a state loaded in part."""
    groups = optimizer.param_groups
    saved_sizes = [len(group["params"]) for group in state["param_groups"]]
    sizes = [len(group["params"]) for group in groups]
    if saved_sizes != sizes:
        raise ValueError(f"the checkpoint's optimizer state has parameter groups of {saved_sizes} parameters, this "
                         f"run's optimizer {sizes}; it cannot be loaded")
    by_name = {names[id(param)]: param for group in groups for param in group["params"]}
    param_of: dict[Any, nn.Parameter] = {}
    for index, (saved_group, group) in enumerate(zip(state["param_groups"], groups, strict=True)):
        for key, param in zip(saved_group["params"], group["params"], strict=True):
            if not isinstance(key, int) and key not in by_name:
                raise ValueError(f"the checkpoint's optimizer state holds parameter {key!r}, which this run's "
                                 f"optimizer does not train; it cannot be loaded")
            param_of[key] = param if isinstance(key, int) else by_name[key]
        if {id(param_of[key]) for key in saved_group["params"]} != {id(param) for param in group["params"]}:
            raise ValueError(f"the checkpoint's optimizer state has other parameters in param group {index} than "
                             f"this run's optimizer; it cannot be loaded")
    for key, param_state in state["state"].items():
        if key not in param_of:
            raise ValueError(f"the checkpoint's optimizer state holds a state for parameter {key!r}, which none of "
                             f"its param groups lists; it cannot be loaded")
        param = param_of[key]
        for what, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"the checkpoint's optimizer state of {names[id(param)]} has {what} of shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(param.shape)}; it cannot be loaded")
    # the groups list their names in this optimizer's order: `optimizer.load_state_dict` matches them by position
    return {"state": {names[id(param_of[key])]: value for key, value in state["state"].items()},
            "param_groups": [{**saved_group, "params": [names[id(param)] for param in group["params"]]}
                             for saved_group, group in zip(state["param_groups"], groups, strict=True)]}


# ------------------------------------------------------------------------------ sharded checkpoints


def sharded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as this rank holds it, keyed as the unwrapped model's: FSDP2's DTensor shards (no gather),
    or the whole tensors under DDP or in one process; the live tensors (a sharded checkpoint's writer copies or
    writes them before the next step). Every rank must call it; DCP loads into it in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def load_sharded_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put a `sharded_state_dict`-shaped state (filled from a checkpoint) into the model; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    with torch.no_grad():
        set_model_state_dict(model, state)


def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state as this rank holds it (FSDP2: DTensor shards), keyed by parameter name. An optimizer
    without state yet gets one first (torch's zero-gradient step at lr 0, which leaves the weights as they are),
    so that it can be filled from a checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                                      saved: set[str]) -> None:
    """Put a `sharded_optimizer_state_dict`-shaped state (filled from a checkpoint) into the optimizer; `saved`:
    the parameter names the checkpoint holds a state for. A parameter it has none for (no gradient yet) is left
    without state, as the full form's loader leaves it (its state starts at its first step)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(param): name for name, param in unwrap_model(model).named_parameters()}
    kept = {**state, "state": {name: value for name, value in state["state"].items() if name in saved}}
    set_optimizer_state_dict(model, optimizer, kept, options=StateDictOptions(strict=False))
    for group in optimizer.param_groups:
        for param in group["params"]:
            if names.get(id(param)) not in saved:
                optimizer.state.pop(param, None)

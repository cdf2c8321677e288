"""Parallel plumbing: where a launcher put this process (`launchers`), the process group and rank-0 work
(`process_group`), DDP/FSDP2 wrapping and gradient-sync control (`wrapping`), and the window's view of the other
ranks (`feature_exchange`)."""

from naflexclip.parallel.wrapping import (
    full_optimizer_state_dict,
    full_state_dict,
    is_fsdp,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    no_sync_context,
    unwrap_model,
    wrap_model,
)

__all__ = [
    "full_optimizer_state_dict",
    "full_state_dict",
    "is_fsdp",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "no_sync_context",
    "unwrap_model",
    "wrap_model",
]

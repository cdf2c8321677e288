"""naflexclip: CLIP/SigLIP training with NaFlex ViT image towers and exact gradient accumulation."""

from naflexclip.loss import ClipLoss, SigLipLoss, create_loss
from naflexclip.model import NaFlexClip, create_model, model_config
from naflexclip.siglip2 import export_model
from naflexclip.window import WindowStats, accumulate_gradients, window_loss_scale

__all__ = [
    "ClipLoss",
    "NaFlexClip",
    "SigLipLoss",
    "WindowStats",
    "accumulate_gradients",
    "create_loss",
    "create_model",
    "export_model",
    "model_config",
    "window_loss_scale",
]
__version__ = "0.1.0"

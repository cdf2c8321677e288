"""naflexclip: CLIP/SigLIP training with NaFlex ViT image towers and exact gradient accumulation."""

from naflexclip.families.factory import create_model, export_model
from naflexclip.loss import ClipLoss, DistillLoss, MultiPositiveLoss, SigLipLoss, create_loss
from naflexclip.models.naflex_clip import NaFlexClip, model_config
from naflexclip.window import WindowStats, accumulate_gradients, window_loss_scale

__all__ = [
    "ClipLoss",
    "DistillLoss",
    "MultiPositiveLoss",
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

"""Training: config, model set-up (LoRA, shared base), algorithms and the trainer loop."""

from astrl.training.config import ConfigError, TrainConfig, load_config
from astrl.training.trainer import Trainer, latest_checkpoint, resume

__all__ = ["ConfigError", "TrainConfig", "Trainer", "latest_checkpoint", "load_config", "resume"]

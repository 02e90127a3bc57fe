"""Training: config, model set-up (LoRA, shared base), algorithms and the trainer loop."""

from astrl._lazy import lazy_exports

_EXPORTS = {
    "ConfigError": "astrl.training.config",
    "TrainConfig": "astrl.training.config",
    "Trainer": "astrl.training.trainer",
    "latest_checkpoint": "astrl.training.trainer",
    "load_config": "astrl.training.config",
    "resume": "astrl.training.trainer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

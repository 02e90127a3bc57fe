"""astrl: adaptive stress testing (automated red-teaming) of language models with TorchRL.

The seed "System" API is importable from the top level (loaded on first use, so that
``import astrl`` stays light)::

    from astrl import System, ASTSystem, HFASTSystem, ASTSampler, DPO, IPO, PPO, Trainer, system_train_config

``TrainingConfig`` is ASTRA-RL's name of ``system_train_config``, kept so that ported code runs as is.
"""

from astrl._lazy import lazy_exports

__version__ = "0.1.0"

_SYSTEM_API = {
    "System": "astrl.system",
    "ASTSystem": "astrl.system",
    "HFASTSystem": "astrl.system",
    "ASTSampler": "astrl.system",
    "DPO": "astrl.system",
    "IPO": "astrl.system",
    "PPO": "astrl.system",
    "TrainingConfig": "astrl.system",
    "system_train_config": "astrl.system",
    "SystemValidationError": "astrl.system",
    "Trainer": "astrl.training.trainer",
    "TrainConfig": "astrl.training.config",
}

__all__ = sorted(_SYSTEM_API)
__getattr__, __dir__ = lazy_exports(__name__, _SYSTEM_API)

"""The seed "System" API over astrl's TorchRL components.

Bring a :class:`System` (or use :class:`HFASTSystem`), grow preference trees with
:class:`ASTSampler`, pick a solver (:class:`DPO`, :class:`IPO`, :class:`PPO`) and train with
:class:`astrl.Trainer` on a :func:`system_train_config` (ASTRA-RL's ``TrainingConfig``): the same tree
sampler, losses and trainer as every astrl run.
"""

from astrl.system.adapter import SystemEnv, SystemPolicy
from astrl.system.ast import ASTSystem
from astrl.system.base import System, SystemValidationError
from astrl.system.hf import HFASTSystem
from astrl.system.sampler import ASTSampler
from astrl.system.solvers import DPO, IPO, PPO, SequencePPOLoss, SystemPPO, TrainingConfig, system_train_config

__all__ = [
    "ASTSampler",
    "ASTSystem",
    "DPO",
    "HFASTSystem",
    "IPO",
    "PPO",
    "SequencePPOLoss",
    "System",
    "SystemEnv",
    "SystemPPO",
    "SystemPolicy",
    "SystemValidationError",
    "TrainingConfig",
    "system_train_config",
]

"""Loss modules (TorchRL ``LossModule`` subclasses) for training testers."""

from astrl.losses.ppo import PPOLoss, ValueHead, compute_advantages
from astrl.losses.preference import DPOLoss, IPOLoss, PreferenceLoss

__all__ = ["DPOLoss", "IPOLoss", "PPOLoss", "PreferenceLoss", "ValueHead", "compute_advantages"]

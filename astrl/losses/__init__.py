"""Loss modules (TorchRL ``LossModule`` subclasses) for training testers.

Imported on first use, so that reading :mod:`astrl.losses.settings` (a config's checks) does not pay for torch.
"""

from astrl._lazy import lazy_exports

_EXPORTS = {
    "PPOLoss": "astrl.losses.ppo",
    "ValueHead": "astrl.losses.ppo",
    "compute_advantages": "astrl.losses.ppo",
    "DPOLoss": "astrl.losses.preference",
    "IPOLoss": "astrl.losses.preference",
    "PreferenceLoss": "astrl.losses.preference",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""Loss modules (TorchRL ``LossModule`` subclasses) for training testers."""

"""astrl: adaptive stress testing (automated red-teaming) of language models with TorchRL."""

__version__ = "0.1.0"

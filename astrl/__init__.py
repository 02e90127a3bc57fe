"""astrl: adaptive stress testing (automated red-teaming) of language models with TorchRL."""

from astrl._compat import enable_list_to_stack

enable_list_to_stack()

__version__ = "0.1.0"

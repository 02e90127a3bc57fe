"""Weight sync from the Transformers tester (gradients) to the vLLM engine that generates.

The trainer keeps the tester as a Transformers model (with LoRA adapters by default). After each
update, :func:`push_to_vllm` sends the full weights, with the adapters merged in, through
TorchRL's ``vLLMUpdater(v2=True)`` to the ``AsyncVLLM`` engine of the tester policy. The merge
is computed on the side: the trainer's model keeps its adapters untouched (TorchRL's
``push_weights_from_transformers`` would call ``merge_and_unload`` on it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from astrl.rewards.reference import is_peft_model


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the model as a plain checkpoint: LoRA deltas added, PEFT prefixes dropped.

    The model itself is not modified.
    """
    if not is_peft_model(model):
        yield from ((name, value.detach()) for name, value in model.state_dict().items())
        return
    deltas = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):
                    delta = module.get_delta_weight(adapter).detach()
                    key = f"{name}.base_layer.weight"
                    deltas[key] = deltas.get(key, 0) + delta
    prefix = "base_model.model."
    for name, value in model.state_dict().items():
        if "lora_" in name:
            continue
        value = value.detach() + deltas[name] if name in deltas else value.detach()
        yield name.removeprefix(prefix).replace(".base_layer.", "."), value


def make_vllm_updater(policy, model: torch.nn.Module):
    """TorchRL's vLLM weight updater bound to ``policy.engine``, initialised with ``model``'s layout."""
    from torchrl.collectors.llm import vLLMUpdater

    updater = vLLMUpdater(v2=True, vllm_engine=policy.engine)
    updater.init({name: (value.dtype, value.shape) for name, value in merged_weights(model)})
    return updater


def push_to_vllm(updater, model: torch.nn.Module) -> None:
    """Send ``model``'s current (merged) weights to the engine."""
    with torch.no_grad():
        updater.push_weights(merged_weights(model))

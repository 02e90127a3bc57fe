"""Weight sync from the Transformers tester (gradients) to the vLLM engine that generates.

The trainer keeps the tester as a Transformers model (with LoRA adapters by default). The vLLM
engine runs in the same process on the same GPU (:func:`astrl.policies.make_vllm_engine`), so
after each update :func:`push_to_vllm` hands the full weights, adapters merged in, straight to the
engine's model (``LLM.apply_model`` + the model's own ``load_weights``), then drops the engine's
prefix cache: its KV blocks were computed with the old weights. The merge is computed on the side:
the trainer's model keeps its adapters untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from astrl.rewards.reference import is_peft_model

_VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")


def merged_weights(model: torch.nn.Module, vocab_size: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the model as a plain checkpoint: LoRA deltas added, PEFT prefixes dropped.

    Args:
        model: a Transformers model, with or without PEFT adapters; it is not modified.
        vocab_size: the engine's vocabulary; embedding and output rows past it (a pad token that
            :func:`astrl.models.prepare_tokenizer` added on the trainer side only) are left out.
    """
    for name, value in _merged(model):
        if vocab_size is not None and name.endswith(_VOCAB_ROWS) and value.shape[0] > vocab_size:
            value = value[:vocab_size]
        yield name, value


def _merged(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
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


def engine_vocab_size(engine) -> int:
    """The vocabulary size of the checkpoint a ``vllm.LLM`` engine loaded."""
    return int(engine.llm_engine.model_config.hf_config.vocab_size)


def push_to_vllm(engine, model: torch.nn.Module) -> None:
    """Load ``model``'s current (merged) weights into ``engine`` and clear its prefix cache.

    ``engine`` is a ``vllm.LLM`` running in this process; each tensor is copied by the engine's
    own weight loaders (which fuse q/k/v and gate/up projections and skip a tied ``lm_head``).
    """
    with torch.no_grad():
        weights = list(merged_weights(model, engine_vocab_size(engine)))
        engine.apply_model(lambda engine_model: engine_model.load_weights(iter(weights)))
    engine.reset_prefix_cache()

"""Tester and target policies: TorchRL ``LLMWrapperBase`` modules with explicit generation settings."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from astrl.backends import BACKENDS, check_backend
from astrl.models import LoadedModel, resolve


@dataclass
class GenerationSettings:
    """Sampling settings for one model's turns.

    ``temperature=1`` keeps the log-probs the wrappers return equal to the sampling
    distribution (they are computed from raw logits). ``top_k=0`` and ``top_p=1`` disable
    those filters. Set ``do_sample=False`` for greedy decoding.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def generate_kwargs(self) -> dict:
        kwargs = asdict(self)
        if not self.do_sample:
            kwargs.pop("temperature"), kwargs.pop("top_p"), kwargs.pop("top_k")
            return kwargs
        if self.top_k == 0:  # disabled filters are left out: TorchRL rejects top_k=0
            kwargs.pop("top_k")
        if self.top_p == 1.0:
            kwargs.pop("top_p")
        return kwargs


def input_mode(mode: str) -> str:
    """The wrapper input mode of a conversation mode: ``"chat"`` -> ``"history"``, ``"text"`` -> ``"text"``."""
    if mode not in ("chat", "text"):
        raise ValueError(f"mode must be 'chat' or 'text', got {mode!r}")
    return "history" if mode == "chat" else "text"


def make_policy(
    loaded: LoadedModel,
    generation: GenerationSettings | None = None,
    *,
    input_mode: str = "history",
    backend: str = "transformers",
    return_log_probs: bool = True,
    vllm_memory: float = 0.5,
):
    """Wrap a loaded model as a generating TorchRL LLM policy.

    Args:
        loaded: model, tokenizer and context window from :func:`astrl.models.load_model`.
        generation: sampling settings (default :class:`GenerationSettings`).
        input_mode: ``"history"`` for chat models, ``"text"`` for base models.
        backend: ``"transformers"`` (``TransformersWrapper`` over ``loaded.model``) or ``"vllm"``
            (``vLLMWrapper`` over a vLLM engine that loads the same checkpoint, ``loaded.name``;
            ``loaded.model`` stays the Transformers copy used for scoring and gradients).
        vllm_memory: share of the GPU memory the vLLM engine may take (``backend="vllm"``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if input_mode not in ("history", "text"):
        raise ValueError(f"input_mode must be 'history' or 'text', got {input_mode!r}")
    if input_mode == "history" and not getattr(loaded.tokenizer, "chat_template", None):
        raise ValueError(
            f"model {loaded.name!r} has no chat template, which chat mode needs: use mode 'text' (--mode text) "
            "for base models, or a chat model"
        )
    generation = generation or GenerationSettings()
    wrapper_options = dict(
        tokenizer=loaded.tokenizer,
        input_mode=input_mode,
        generate=True,
        generate_kwargs=generation.generate_kwargs(),
        return_log_probs=return_log_probs,
        pad_output=False,
    )
    if backend == "vllm":
        policy = _vllm_policy(loaded, wrapper_options, vllm_memory)
    else:
        from torchrl.modules.llm import TransformersWrapper

        policy = TransformersWrapper(loaded.model, **wrapper_options)
    policy.context_window = loaded.context_window
    policy.generation = generation
    return policy


def _vllm_policy(loaded: LoadedModel, wrapper_options: dict, memory: float):
    """``vLLMWrapper`` over TorchRL's ``AsyncVLLM`` engine of ``loaded``'s checkpoint.

    Checked first: vllm installed, a CUDA GPU present. ``AsyncVLLM`` runs the engine as a Ray
    actor on its own GPU, which is what TorchRL's vLLM weight updater sends weights to.
    """
    if not 0 < memory <= 1:
        raise ValueError(f"vllm_memory must be in (0, 1], got {memory}")
    check_backend("vllm")
    from astrl.backends import require_ray

    require_ray()
    from torchrl.modules.llm import vLLMWrapper
    from torchrl.modules.llm.backends import AsyncVLLM

    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    engine = AsyncVLLM.from_pretrained(
        resolve(loaded.name),
        num_replicas=1,
        verbose=False,
        dtype=dtype,
        gpu_memory_utilization=memory,
        max_model_len=loaded.context_window,
    )
    policy = vLLMWrapper(engine, **wrapper_options)
    policy.engine = engine
    return policy

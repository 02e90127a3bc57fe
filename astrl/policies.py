"""Tester and target policies: TorchRL ``LLMWrapperBase`` modules with explicit generation settings."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from astrl.argtypes import check_settings, require
from astrl.backends import BACKENDS, check_backend
from astrl.decoding import DecodingSettings
from astrl.models import LoadedModel, resolve
from astrl.names import MODES
from astrl.prefill import TurnCache


@dataclass
class GenerationSettings:
    """Sampling settings for one model's turns.

    ``temperature=1`` keeps the log-probs the wrappers return (``make_policy(..., return_log_probs=True)``)
    equal to the sampling distribution (they are computed from raw logits). ``top_p=1`` disables nucleus
    filtering; ``top_k=0`` leaves top-k to the backend's default (Transformers: the model's generation config,
    else 50; vLLM: off), and a ``top_k`` of at least the vocabulary size disables it. Set ``do_sample=False``
    for greedy decoding.
    """

    max_new_tokens: int = 32
    temperature: float = DecodingSettings.temperature  # the defaults and ranges are DecodingSettings'
    top_p: float = DecodingSettings.top_p
    top_k: int = DecodingSettings.top_k
    do_sample: bool = True

    def __post_init__(self) -> None:
        require("max_new_tokens", self.max_new_tokens, at_least=1)
        check_settings(self, DecodingSettings)

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


def vllm_share(memory: float, *backends: str) -> float:
    """Each vLLM engine's share of the GPU when ``memory`` is the share all of ``backends``' engines take together."""
    return memory / max(1, backends.count("vllm"))


def input_mode(mode: str) -> str:
    """The wrapper input mode of a conversation mode: ``"chat"`` -> ``"history"``, ``"text"`` -> ``"text"``."""
    require("mode", mode, choices=MODES)
    return "history" if mode == "chat" else "text"


def make_policy(
    loaded: LoadedModel,
    generation: GenerationSettings | None = None,
    *,
    input_mode: str = "history",
    backend: str = "transformers",
    return_log_probs: bool = False,
    vllm_memory: float = 0.5,
    vllm_options: dict | None = None,
    turn_cache: bool = True,
    keep_prompt_states: bool = False,
    renders_chats: bool = False,
):
    """Wrap a loaded model as a generating TorchRL LLM policy.

    Args:
        loaded: model, tokenizer and context window from :func:`astrl.models.load_model`.
        generation: sampling settings (default :class:`GenerationSettings`).
        input_mode: ``"history"`` for chat models, ``"text"`` for base models.
        backend: ``"transformers"`` (``TransformersWrapper`` over ``loaded.model``) or ``"vllm"``
            (``vLLMWrapper`` over a vLLM engine that loads the same checkpoint, ``loaded.name``;
            ``loaded.model`` stays the Transformers copy used for scoring and gradients).
        return_log_probs: also write the generated tokens' log-probs (``("log_probs", "response")``, the
            wrapper's, first token 0.0), for which ``generate`` keeps a vocabulary's logits per token and row.
            astrl reads none: behaviour log-probs are recomputed by scoring the tokens, and a reply
            lexicon asks the target's ``generate`` for its logits itself. Sampling is the same either way.
        vllm_memory: share of the GPU memory the vLLM engine may take (``backend="vllm"``).
        vllm_options: more ``vllm.LLM`` keywords for that engine (see :func:`make_vllm_engine`).
        turn_cache: keep the KV cache of the model's last ``generate`` call and prefill only the tokens
            it has not read (a conversation's next turn, a tree node's children); see
            :class:`astrl.prefill.TurnCache`. Transformers backend only (vLLM has its own prefix cache).
        keep_prompt_states: with ``turn_cache``, also keep the last hidden state of every prompt position
            the model reads, so that log-probs of what it has just read (the likelihood term of a target)
            cost one LM-head application instead of a forward (:class:`astrl.lm_scoring.PromptStates`).
        renders_chats: a chat model fed its chats already rendered (``input_mode="text"``, Transformers
            backend): the caller renders each chat as the wrappers would (:func:`astrl._compat.render_chats`)
            and the wrapper tokenizes the text without adding special tokens, so the model reads the same
            tokens as from a ``History``, without the wrapper rendering each row and parsing each reply
            back into messages. The target of a chat conversation, which needs only its replies' tokens.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if input_mode not in ("history", "text"):
        raise ValueError(f"input_mode must be 'history' or 'text', got {input_mode!r}")
    if renders_chats and (input_mode != "text" or backend != "transformers"):
        raise ValueError(
            f"renders_chats needs input_mode 'text' and the transformers backend, got {input_mode!r} and {backend!r}"
        )
    if (input_mode == "history" or renders_chats) and not getattr(loaded.tokenizer, "chat_template", None):
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
    if renders_chats:  # the rendered template holds its own special tokens, as History's tokenization reads it
        wrapper_options["tokenizer_kwargs"] = {"add_special_tokens": False}
    if backend == "vllm":
        policy = _vllm_policy(loaded, wrapper_options, vllm_memory, vllm_options)
    else:
        from torchrl.modules.llm import TransformersWrapper

        if turn_cache and not isinstance(loaded.model.generate, TurnCache):
            TurnCache(loaded.model, keep_states=keep_prompt_states)
        elif turn_cache and keep_prompt_states:
            loaded.model.generate.keep_states = True
        device = next(loaded.model.parameters()).device  # the wrapper moves the prompt's tokens there
        policy = TransformersWrapper(loaded.model, **wrapper_options, device=None if device.type == "cpu" else device)
    policy.context_window = loaded.context_window
    policy.generation = generation
    policy.renders_chats = renders_chats
    return policy


def _vllm_policy(loaded: LoadedModel, wrapper_options: dict, memory: float, engine_options: dict | None = None):
    """``vLLMWrapper`` over an in-process vLLM engine that loads ``loaded``'s checkpoint."""
    engine = make_vllm_engine(loaded, memory, **(engine_options or {}))
    from torchrl.modules.llm import vLLMWrapper

    policy = vLLMWrapper(engine, **wrapper_options)
    policy.engine = engine
    return policy


def make_vllm_engine(loaded: LoadedModel, memory: float = 0.5, **options):
    """A ``vllm.LLM`` engine for ``loaded``'s checkpoint, in this process, on the first visible GPU.

    The engine runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set
    otherwise), beside the Transformers model: weight pushes are plain GPU copies
    (:func:`astrl.training.vllm_sync.push_to_vllm`), with no Ray actor or NCCL group, which two
    processes on one GPU cannot form. vLLM places its engine on ``cuda:0``; to use another GPU, make
    it the only visible one (``CUDA_VISIBLE_DEVICES``).

    Args:
        loaded: the model whose checkpoint (``loaded.name``) and dtype the engine uses.
        memory: share of the GPU's memory the engine may take (weights + KV cache).
        options: more ``vllm.LLM`` keywords (e.g. ``enforce_eager=True``, ``seed=0``).
    """
    require("vllm_memory", memory, above=0, at_most=1)
    device = next(loaded.model.parameters()).device
    check_backend("vllm", str(device))
    if device.index not in (None, 0):
        raise ValueError(
            f"backend 'vllm' runs its engine on cuda:0 beside the trainer, but the model is on {device}: "
            f"set CUDA_VISIBLE_DEVICES={device.index} and device=cuda"
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    settings = dict(
        model=str(resolve(loaded.name)),
        dtype=dtype,
        gpu_memory_utilization=memory,
        max_model_len=loaded.context_window,
        enable_prefix_caching=True,
    )
    return vllm.LLM(**{**settings, **options})

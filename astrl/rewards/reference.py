"""The frozen reference model the tester is kept close to (KL penalty)."""

from __future__ import annotations

import copy

import torch


class _ModelView(torch.nn.Module):
    """A module that stands for another model (:attr:`viewed`): its config, generation config and parameters."""

    @property
    def viewed(self) -> torch.nn.Module:
        raise NotImplementedError

    @property
    def config(self):
        return self.viewed.config

    @property
    def generation_config(self):
        return getattr(self.viewed, "generation_config", None)

    def parameters(self, recurse: bool = True):
        return self.viewed.parameters(recurse)


class AdaptersDisabled(_ModelView):
    """A PEFT model seen with its adapters switched off: the frozen base, without a second copy.

    Each call switches the model's adapter layers off (their ``enable_adapters(False)``, what
    ``model.disable_adapter()`` does) and back to what they were, so the reference shares every
    weight with the tester and cannot drift while the adapters train. The layers are found once per
    set of adapters: ``disable_adapter()`` itself walks the whole model and reads its status, about
    40 ms a call on the embedded 135M model with LoRA on seven projections, which a search that reads
    the target a token at a time pays dozens of times an opener.
    """

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        if not hasattr(peft_model, "disable_adapter"):
            raise TypeError(f"{type(peft_model).__name__} has no disable_adapter(): not a PEFT model")
        # kept out of the module tree so that .parameters() / state_dict() do not list the tester's weights
        object.__setattr__(self, "peft_model", peft_model)
        object.__setattr__(self, "_layers", (None, []))

    @property
    def viewed(self) -> torch.nn.Module:
        return self.peft_model

    def get_output_embeddings(self) -> torch.nn.Module | None:
        """The LM head, called with the adapters off when it holds one (a LoRA on the head), so that
        log-prob code can apply it to the positions it needs instead of building every position's logits."""
        head = self.peft_model.get_output_embeddings() if hasattr(self.peft_model, "get_output_embeddings") else None
        if head is None or not any(_is_adapter_layer(m) for m in head.modules()):
            return head
        return _DisabledHead(self, head)

    def adapter_layers(self) -> list[torch.nn.Module]:
        """The model's adapter layers (PEFT tuner layers), found again when its adapters change."""
        names = tuple(getattr(self.peft_model, "peft_config", {}))
        if self._layers[0] != names:
            object.__setattr__(self, "_layers", (names, [m for m in self.peft_model.modules() if _is_adapter_layer(m)]))
        return self._layers[1]

    def _call(self, fn, *args, **kwargs):
        was_training = self.peft_model.training
        if was_training:
            self.peft_model.eval()  # no dropout in the reference, even while the tester trains
        try:
            return self._without_adapters(fn, *args, **kwargs)
        finally:
            if was_training:
                self.peft_model.train(True)

    def _without_adapters(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` with every adapter layer off, each restored to its own state after."""
        layers = self.adapter_layers()
        if not layers:  # adapters that are no layers (prompt tuning, say): peft's own switch
            with self.peft_model.disable_adapter():
                return fn(*args, **kwargs)
        were_on = [not layer.disable_adapters for layer in layers]
        try:
            for layer in layers:
                layer.enable_adapters(False)
            return fn(*args, **kwargs)
        finally:
            for layer, on in zip(layers, were_on, strict=True):
                if on:
                    layer.enable_adapters(True)

    def forward(self, *args, **kwargs):
        return self._call(self.peft_model, *args, **kwargs)

    def generate(self, *args, **kwargs):
        """Generate with the base weights (e.g. a target that shares its base with a LoRA tester).

        Calls the PEFT model's class method, not a ``generate`` hook set on the tester's instance
        (:class:`astrl.prefill.TurnCache` keeps KV caches computed with the adapters on); hooks for the
        base go on this object instead."""
        return self._call(type(self.peft_model).generate, self.peft_model, *args, **kwargs)


def _is_adapter_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


class _DisabledHead(torch.nn.Module):
    """An output head that holds an adapter, run with its :class:`AdaptersDisabled` model's adapters off."""

    def __init__(self, owner: AdaptersDisabled, head: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "head", head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.owner._call(self.head, hidden)


def is_peft_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` as it is now, in eval mode and without gradients. A ``generate`` hook set on
    the instance (:class:`astrl.prefill.SharedPrefill`, :class:`astrl.prefill.TurnCache`, with its
    caches) stays with the original and is not copied."""
    hook = vars(model).pop("generate", None)
    try:
        clone = copy.deepcopy(model)
    finally:
        if hook is not None:
            model.generate = hook
    clone.eval()
    clone.requires_grad_(False)
    return clone


def make_reference(tester: torch.nn.Module) -> torch.nn.Module:
    """The reference for ``tester``: its base with adapters disabled if it is a PEFT (LoRA) model,
    otherwise a frozen copy taken now (before training changes the tester).

    The result is in eval mode and never receives gradients; score with it under
    ``torch.inference_mode()`` (:class:`astrl.rewards.TokenLogProbs` does).
    """
    if is_peft_model(tester):
        return AdaptersDisabled(tester)
    return frozen_copy(tester)


class PinnedReference(_ModelView):
    """A reference that is ``base`` until :meth:`pin` and then a frozen copy of the tester as it stood
    at that call (e.g. the tester its warm start left, as the SFT policy is the reference in RLHF).

    Losses and scorers keep this one object, so pinning reaches every holder of the reference. The copy
    costs one more model in memory; a checkpoint keeps its trainable state
    (:meth:`astrl.training.algorithm.TrainingSource.reference_state`).
    """

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "base", base)  # not a submodule: it may be the tester's own weights
        self.pinned: torch.nn.Module | None = None

    @property
    def viewed(self) -> torch.nn.Module:
        """The model the reference scores with now."""
        return self.base if self.pinned is None else self.pinned

    def pin(self, tester: torch.nn.Module) -> torch.nn.Module:
        """Become a frozen copy of ``tester`` as it is now; returns the copy."""
        self.pinned = frozen_copy(tester)
        return self.pinned

    def get_output_embeddings(self) -> torch.nn.Module | None:
        model = self.viewed
        return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def forward(self, *args, **kwargs):
        return self.viewed(*args, **kwargs)

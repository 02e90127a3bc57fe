"""Shared prefill for ``model.generate``: identical rows of a batch read their prompt once.

Tree siblings (``tree_width`` probes from one state) and the conversations of a GRPO group at
their first turn send the same prompt several times in one ``generate`` call, and raw ``generate``
prefills every copy. :class:`SharedPrefill` wraps a model's ``generate``: it finds the distinct
rows (ids and attention mask), runs the model once over each distinct prompt but its last token
with ``use_cache=True``, gathers that KV cache back to the full batch and hands it to the original
``generate``, which then processes only each row's last prompt token before sampling. The logits
are those of a full prefill up to float rounding, so sampling draws from the same distribution with
the same random numbers.
"""

from __future__ import annotations

import torch

from astrl.lm_scoring import accepts


class SharedPrefill:
    """Replaces ``model.generate`` by a version that prefills each distinct prompt row once.

    Calls that pass positional arguments, no ``input_ids``, a ``past_key_values``, prompts of one
    token, or a batch without repeated rows go to the original ``generate`` unchanged, as do all
    calls while ``enabled`` is False. ``remove()`` puts the original back. ``calls_shared`` /
    ``rows_saved`` count what it did.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.original = model.generate
        self.calls_shared = 0
        self.rows_saved = 0
        self.enabled = True
        model.generate = self

    def remove(self) -> None:
        """Restore the model's original ``generate``."""
        if self.model.generate is self:
            self.model.generate = self.original

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if (
            not self.enabled
            or args
            or ids is None
            or kwargs.get("past_key_values") is not None
            or ids.dim() != 2
            or ids.shape[1] < 2
        ):
            return self.original(*args, **kwargs)
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        width = ids.shape[1]
        distinct, inverse = torch.unique(torch.cat([ids, mask.to(ids.dtype)], dim=1), dim=0, return_inverse=True)
        if len(distinct) == len(ids):
            return self.original(*args, **kwargs)
        u_ids, u_mask = distinct[:, :width], distinct[:, width:].to(mask.dtype)
        positions = (u_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens
        extra = {"logits_to_keep": 1} if accepts(self.model, "logits_to_keep") else {}
        with torch.no_grad():
            out = self.model(
                input_ids=u_ids[:, :-1],
                attention_mask=u_mask[:, :-1],
                position_ids=positions[:, :-1],
                use_cache=True,
                **extra,
            )
        cache = out.past_key_values
        cache.batch_select_indices(inverse.to(ids.device))  # row i gets the cache of its distinct prompt
        self.calls_shared += 1
        self.rows_saved += len(ids) - len(distinct)
        return self.original(**{**kwargs, "attention_mask": mask, "past_key_values": cache})

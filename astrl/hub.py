"""Whether the Hugging Face hub can be reached, asked once and quickly (no torch import)."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached right now, or None when a connection opens.

    ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` say so directly; otherwise one TCP connection to
    the hub (``HF_ENDPOINT``), or to the HTTPS proxy when one is set, is tried with ``timeout``,
    instead of the libraries' minute of retries.
    """
    from urllib.parse import urlsplit

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"{name} is set"
    proxy = next((os.environ[k] for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy") if os.environ.get(k)), None)
    if proxy:
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    else:
        url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname
    if not host:
        return None  # nothing to check against: let the library try
    port = url.port or (443 if url.scheme == "https" else 80)
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port} is unreachable ({err.strerror or type(err).__name__})"
    return None

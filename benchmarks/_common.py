"""Helpers shared by the benchmark scripts: arguments, timers, memory probes, JSON output."""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # after PYTHONPATH: a checkout put there first is the one measured
    sys.path.append(str(ROOT))


def base_parser(description: str) -> argparse.ArgumentParser:
    """Arguments every benchmark takes: ``--quick``, ``--device``, ``--backend``, ``--model``, ``--threads``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes: under 2 minutes on 2 CPU cores")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--backend", default="transformers", choices=["transformers", "vllm"], help="generation backend of the policies"
    )
    parser.add_argument("--model", default="smollm2-135m", help="embedded model name or a local model folder")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm-eager", action="store_true", help="vLLM without CUDA graphs or compilation (faster start, slower steps)"
    )
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    """``vllm.LLM`` keywords from the arguments (the backend's defaults unless ``--vllm-eager``)."""
    return {"enforce_eager": True} if args.vllm_eager else {}


def gpu_memory(device: str) -> dict:
    """Peak memory of this process's PyTorch allocator, in GiB (vLLM's in-process engine included); {} on CPU."""
    if not str(device).startswith("cuda"):
        return {}
    return {"gpu_peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def setup(args: argparse.Namespace) -> dict:
    """Apply threads/seed, resolve the dtype; return the fields every JSON result carries."""
    from astrl.backends import check_backend

    check_backend(args.backend, args.device)  # vllm: fails here, with the fix, without vllm or a GPU
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    torch.manual_seed(args.seed)
    info = {
        "device": str(args.device),
        "device_name": torch.cuda.get_device_name() if str(args.device).startswith("cuda") else "cpu",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "quick": bool(args.quick),
        "model": args.model,
        "dtype": args.dtype,
        "backend": args.backend,
        "torch": torch.__version__,
    }
    return info


def sync(device: str) -> None:
    """Wait for queued CUDA work so that wall-clock timers are honest."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class Timer:
    """Accumulates wall-clock seconds and call counts of wrapped callables; with ``memory=True`` also
    each section's peak memory in MiB (``peaks``: resident memory on CPU, the PyTorch allocator's on
    CUDA), nested sections included. The peak counter is reset at every section boundary
    (:func:`reset_peak_memory`), so a reading covers only the interval since the previous boundary, and
    it counts for every section open through that interval."""

    def __init__(self, device: str = "cpu", memory: bool = False) -> None:
        self.device = device
        self.memory = memory
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.peaks: dict[str, float] = {}
        self.peak_mb = 0.0  # over every interval read so far, inside sections or not
        self._open: list[str] = []

    def overall_peak_mb(self) -> float:
        """The peak over the whole run so far (the resets make ``ru_maxrss`` and ``VmHWM`` useless for it)."""
        return max(self.peak_mb, peak_memory_mb(self.device))

    def _read_peak(self, names: list[str]) -> None:
        """Fold the peak since the last boundary into ``names``' peaks, then start a new interval."""
        peak = peak_memory_mb(self.device)
        self.peak_mb = max(self.peak_mb, peak)
        for name in names:
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        reset_peak_memory(self.device)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        sync(self.device)
        if self.memory:
            self._read_peak(self._open)  # the interval before this section belongs to the enclosing ones
            self._open.append(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.memory:
                self._read_peak(self._open)
                self._open.pop()

    def wrap(self, name: str | Callable[[], str], fn: Callable) -> Callable:
        """``fn`` timed in section ``name`` (a callable ``name`` is asked at each call)."""

        def timed(*args, **kwargs):
            with self.section(name() if callable(name) else name):
                return fn(*args, **kwargs)

        return timed


def rss_mb() -> float:
    """Current resident set size in MiB (Linux ``/proc``)."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def hwm_rss_mb() -> float:
    """Peak resident set size of this process image (``VmHWM``; unlike ``ru_maxrss`` it is not
    inherited from the parent across fork/exec), in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return max_rss_mb()


def peak_memory_mb(device: str) -> float:
    """Peak memory since the last :func:`reset_peak_memory`, in MiB: the PyTorch allocator's on CUDA,
    the process's resident set (``VmHWM``) on CPU."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return hwm_rss_mb()


def reset_peak_memory(device: str) -> None:
    """Start a new peak interval: ``torch.cuda.reset_peak_memory_stats`` on CUDA; on Linux CPU, glibc's
    ``malloc_trim(0)`` first returns the freed heap it keeps (else every later interval would start
    from the largest heap so far), then writing 5 to ``/proc/self/clear_refs`` sets ``VmHWM`` back to
    the resident set, which is then what is live."""
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError as error:
        raise RuntimeError(f"cannot reset the peak resident set through /proc/self/clear_refs: {error}") from None


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def max_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakMemory:
    """Peak memory of a block above its start: RSS polled every 5 ms on CPU, max allocated on CUDA."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = str(device)
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def _poll(self, start: float) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, rss_mb() - start)
            time.sleep(0.005)

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated() / 2**20
            return self
        self._start = rss_mb()
        self._thread = threading.Thread(target=self._poll, args=(self._start,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20 - self._start
            return
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, rss_mb() - self._start)


def emit(result: dict) -> None:
    """Print the result as one JSON object on the last stdout line."""
    print(json.dumps(result, sort_keys=False), flush=True)


def r(x: float, digits: int = 4) -> float:
    """Round for the JSON output."""
    return round(float(x), digits)

"""Out-of-memory (GPU, and the host's for CPU engines) as a ConfigError that names the setting to change.

Start-up allocates in four places that a configuration can overrun: the weights (the model and
its dtype), the profiling forward (max_num_batched_tokens), the KV pool (its budget's setting)
and the CUDA graphs (max_num_seqs, enforce_eager). `OutOfMemoryGuard` wraps each: torch's
OutOfMemoryError inside becomes a ConfigError that says what was being allocated, how much the
device has, and the fix. The failed step's tensors are released before it is raised (the
finished frames of the error's traceback are cleared and the allocator's cache emptied), so a
process that catches it can go on, or retry with other settings, without a restart.

`check_weights_fit` refuses weights that cannot fit before a byte is allocated, `check_host_fits`
a CPU engine's buffers larger than the machine's memory (which Linux would grant, then kill the
process for touching); on a CPU the guard takes the host allocator's error too. A step that runs
out of memory later, while serving, is the engine's StepError (tandem/engine/engine.py), whose
message names the same settings; `release_failed_step` frees what it held.
"""
from __future__ import annotations

import gc
import os
import traceback

import torch

from tandem.errors import ConfigError

GiB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def device_memory(device: torch.device) -> str:
    """'X GiB free of Y GiB' (and what other processes hold, when they hold more than 1 GiB)."""
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    held = f" (other processes hold {_gib(others)})" if others > GiB else ""
    return f"{_gib(free)} free of {_gib(total)}{held}"


def check_weights_fit(num_bytes: int, device: torch.device, what: str, fix: str) -> None:
    """Raise ConfigError when num_bytes of weights exceed the device's free memory (CUDA only)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if num_bytes > free:
        raise ConfigError(f"{what}: the weights need {_gib(num_bytes)}, the GPU has {device_memory(device)}; {fix}")


def host_memory_bytes() -> int | None:
    """The machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_available_bytes() -> int | None:
    """The memory the OS can still give without swapping (Linux's MemAvailable: free memory and the
    caches it can drop), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_fits(num_bytes: int, what: str, fix: str) -> None:
    """Raise ConfigError when num_bytes exceed the machine's physical memory, or what it has
    available now (the weights already loaded count): Linux grants an allocation it cannot back and
    kills the process once its pages are touched, which for a KV pool is when requests fill it."""
    total = host_memory_bytes()
    if total is not None and num_bytes > total:
        raise ConfigError(f"{what} needs {_gib(num_bytes)}, more than this machine's {_gib(total)} of memory; {fix}")
    available = host_available_bytes()
    if available is not None and num_bytes > available:
        of = f" of {_gib(total)}" if total is not None else ""
        raise ConfigError(f"{what} needs {_gib(num_bytes)}, more than the {_gib(available)}{of} this machine has "
                          f"available now; {fix}")


def _host_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


class OutOfMemoryGuard:
    """`with OutOfMemoryGuard(device, doing, fix):` turns a CUDA out-of-memory error in the body into
    ConfigError(f"{doing} ran out of GPU memory (...); {fix}"), after releasing what the body held."""

    def __init__(self, device: torch.device, doing: str, fix: str):
        self.device, self.doing, self.fix = device, doing, fix

    def __enter__(self) -> OutOfMemoryGuard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            return
        if issubclass(exc_type, torch.OutOfMemoryError):
            where = "GPU memory"
        elif _host_out_of_memory(exc):
            where = "host memory"
        else:
            return
        memory = release_failed_step(exc, self.device)
        del exc, tb
        raise ConfigError(f"{self.doing} ran out of {where}{memory}; {self.fix}") from None


def release_failed_step(exc: BaseException, device: torch.device) -> str:
    """Free what a step that raised exc held: the finished frames of its traceback (their
    tensors; running frames stay) and then the allocator's cache. -> ': X GiB free of Y GiB' on
    CUDA, '' elsewhere, for the error message."""
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    if device.type != "cuda":
        return ""
    torch.cuda.empty_cache()
    return f": {device_memory(device)}"

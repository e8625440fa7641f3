"""What the Triton wrappers ask of the device they launch on, in one place: its SM count (grids
are sized to fill the chip) and whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1,
the CPU test path, which lacks libdevice, PDL and bf16 dots)."""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on device (8 off a GPU: the interpreter's grids stay small)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreting() -> bool:
    """Whether Triton interprets the kernels on the CPU instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET") == "1"

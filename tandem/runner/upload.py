"""Host lists -> device int64 tensors in one copy (each small H2D copy costs ~10-20 us)."""
from __future__ import annotations

import torch
from torch import Tensor


def upload(device: torch.device, *lists: list[int]) -> list[Tensor]:
    """One int64 tensor per list, all views of a single transfer."""
    sizes = [len(x) for x in lists]
    flat = [v for x in lists for v in x]
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return list(dev.split(sizes))

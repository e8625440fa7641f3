"""Host lists -> device int64 tensors in one copy (each small H2D copy costs ~10-20 us)."""
from __future__ import annotations

import torch
from torch import Tensor


class Uploader:
    """Uploads host lists as views of one H2D transfer, staged through a pinned buffer that is
    reused every step (pinning fresh host memory per call costs more than the copy itself).

    Regions of the staging buffer are handed out in order and recycled by new_step(), which
    the runner calls at the start of a step: the previous step ended with a device->host sync,
    so every copy out of the buffer has finished by then.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
        self.offset = 0

    def new_step(self) -> None:
        self.offset = 0

    def __call__(self, *lists: list[int]) -> list[Tensor]:
        """One int64 tensor per list, all views of a single transfer."""
        sizes = [len(x) for x in lists]
        host = torch.tensor([v for x in lists for v in x], dtype=torch.int64)
        if self.pinned is None:
            return list(host.to(self.device).split(sizes))
        n = host.shape[0]
        if self.offset + n <= self.pinned.shape[0]:
            staged = self.pinned[self.offset : self.offset + n]
            staged.copy_(host)
            self.offset += n
        else:  # larger than what is left this step: a one-off pinned copy
            staged = host.pin_memory()
        return list(staged.to(self.device, non_blocking=True).split(sizes))

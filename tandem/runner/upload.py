"""Host lists -> device int64 tensors in one copy (each small H2D copy costs ~10-20 us)."""
from __future__ import annotations

import torch
from torch import Tensor


class Uploader:
    """Uploads host lists as views of one H2D transfer, staged through a pinned buffer that is
    reused every step (pinning fresh host memory per call costs more than the copy itself).

    The buffer has two halves, used by alternate steps; new_step(), which the runner calls at
    the start of a step, switches halves and hands out the new one in order. A half is reused
    two steps later: the engine collects step n (waits for a copy queued after every upload of
    step n but the draft's, and the draft's precede step n + 1's copy) before it launches step
    n + 2, so every copy out of the half has finished by then.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
        self.half_size = capacity // 2
        self.half = 0
        self.offset, self.end = 0, self.half_size  # before the first step: half 0

    def new_step(self) -> None:
        self.half ^= 1
        self.offset = self.half * self.half_size
        self.end = self.offset + self.half_size

    def __call__(self, *lists: list[int]) -> list[Tensor]:
        """One int64 tensor per list, all views of a single transfer."""
        sizes = [len(x) for x in lists]
        host = torch.tensor([v for x in lists for v in x], dtype=torch.int64)
        if self.pinned is None:
            return list(host.to(self.device).split(sizes))
        n = host.shape[0]
        if self.offset + n <= self.end:
            staged = self.pinned[self.offset : self.offset + n]
            staged.copy_(host)
            self.offset += n
        else:  # larger than what is left this step: a one-off pinned copy
            staged = host.pin_memory()
        return list(staged.to(self.device, non_blocking=True).split(sizes))

"""Host lists -> device int64 tensors in one copy (each small H2D copy costs ~10-20 us), and
device tensors back to the host behind an event (to_host)."""
from __future__ import annotations

from array import array

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
        """One int64 tensor per list, all views of a single transfer, each starting on a 16-byte
        boundary: Triton specialises a kernel on whether each pointer argument is 16-byte aligned,
        so a view at an odd offset would compile another variant of the kernels it feeds (the
        attention's seq_lens and cu_q_lens, the rotary kernel's positions) in the middle of serving."""
        sizes = [len(x) for x in lists]
        padded = [n + (n & 1) for n in sizes]  # even: 2 x 8 bytes
        flat = array("q")  # filled in C: half the time of a flattened list through torch.tensor
        for x in lists:
            flat.extend(x)
            if len(x) & 1:
                flat.append(0)
        host = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
        return [t[:n] for t, n in zip(self._send(host).split(padded), sizes)]

    def words(self, host: Tensor) -> Tensor:
        """A host int32 tensor (a grammar bitmask [m, w]) -> the same on the device, through the
        same staging as the lists."""
        flat = host.contiguous().view(-1)
        n = flat.numel()
        if n % 4:  # whole 16-byte units
            flat = torch.cat([flat, flat.new_zeros(4 - n % 4)])
        return self._send(flat.view(torch.int64)).view(torch.int32)[:n].view(host.shape)

    def _send(self, host: Tensor) -> Tensor:
        """host [n] int64 -> on the device (pinned staging on CUDA; no wait)."""
        if self.pinned is None:
            return host.to(self.device)
        n = host.shape[0]
        if self.offset + n <= self.end:
            staged = self.pinned[self.offset : self.offset + n]
            staged.copy_(host)
            self.offset += n
        else:  # larger than what is left this step: a one-off pinned copy
            staged = host.pin_memory()
        return staged.to(self.device, non_blocking=True)


def to_host(t: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """Start the copy of t to (pinned) host memory -> (the host tensor, an event recorded after the
    copy, for the caller to wait on; None on a CPU, where t is already there). Never waits."""
    if not t.is_cuda:
        return t, None
    host = t.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready

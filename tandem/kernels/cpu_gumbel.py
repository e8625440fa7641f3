"""Seeded Gumbel-max sampling's uniforms on a CPU (cpu_gumbel.c through ctypes), bit-identical to
the reference tandem.sampling.gumbel.uniform over a whole vocabulary; tested in
tests/sampling/test_cpu_gumbel.py."""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels import cpu_build


def uniform_rows(keys: Tensor, vocab_size: int, isa: str) -> Tensor:
    """keys [n] int64 (noise_key's, on the CPU) -> u [n, vocab_size] fp32 =
    uniform(keys[:, None], arange(vocab_size))."""
    keys = keys.to(torch.int64).contiguous()
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32)
    cpu_build.library(isa).tandem_uniform_rows(keys.data_ptr(), keys.shape[0], vocab_size, out.data_ptr(),
                                                torch.get_num_threads())
    return out

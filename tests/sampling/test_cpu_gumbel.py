"""tandem/kernels/cpu_gumbel.c (the Gumbel sampler's uniforms for whole vocabulary rows) against the
int64 reference of tandem/sampling/gumbel.py: the same bits, in every build."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_build, cpu_gumbel
from tandem.sampling import gumbel
from tandem.sampling.gumbel import DRAFT_SALT, RECOVER_SALT, TARGET_SALT, noise_key, uniform

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(cpu_build.load_error(isa) is not None,
                                                   reason=f"CPU kernels: {cpu_build.load_error(isa)}"))
        for isa in cpu_build.ISAS]


def _keys(n: int, salt: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    positions = torch.randint(0, 2**31, (n,), generator=g)
    keys = noise_key(seeds, positions, salt)
    keys[:1] = 0  # the ends of the key range
    if n > 1:
        keys[-1] = 2**32 - 1
    return keys


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (4, 151936), (3, 16384), (2, 16385), (5, 1000), (1, 7), (0, 50)])
def test_uniform_rows_are_the_references_bits(isa, rows, vocab):
    keys = _keys(rows, RECOVER_SALT, rows * 31 + vocab)
    out = cpu_gumbel.uniform_rows(keys, vocab, isa)
    ref = uniform(keys[:, None], torch.arange(vocab)[None, :])
    assert out.dtype == torch.float32 and out.shape == (rows, vocab)
    assert torch.equal(out, ref)
    if rows:
        assert 0.0 < out.min().item() and out.max().item() < 1.0


@pytest.mark.skipif(cpu_build.best_isa() is None, reason="no CPU kernels build here")
@pytest.mark.parametrize("salt", [TARGET_SALT, DRAFT_SALT, RECOVER_SALT])
def test_gumbel_draws_unchanged_by_the_c_uniforms(salt, monkeypatch):
    """gumbel_from_keys and gumbel_argmax on a CPU (through the C uniforms) give the noise and the
    draws of the int64 reference, bit for bit, including rows of masked tokens."""
    n, vocab = 6, 151936
    g = torch.Generator().manual_seed(salt)
    logits = 3 * torch.randn(n, vocab, generator=g)
    logits[1, 100:] = float("-inf")
    seeds, positions = torch.randint(0, 2**40, (n,), generator=g), torch.arange(n) + 17
    keys = noise_key(seeds, positions, salt)
    fast_noise, fast_draw = gumbel.gumbel_from_keys(keys, vocab), gumbel.gumbel_argmax(logits, seeds, positions, salt)
    monkeypatch.setattr(cpu_build, "best_isa", lambda: None)  # the reference's path
    assert torch.equal(fast_noise, gumbel.gumbel_from_keys(keys, vocab))
    assert torch.equal(fast_draw, gumbel.gumbel_argmax(logits, seeds, positions, salt))
    assert fast_draw[1] < 100

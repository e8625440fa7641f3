"""The n-gram lookup kernel (tandem/kernels/ngram.py) against its torch reference,
tandem.spec.ngram.ngram_drafts, on fresh random contexts (the drafts buffer poisoned first). On
CUDA (marked gpu), and on small cases in Triton's interpreter (TANDEM_TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TANDEM_TRITON_INTERPRET") == "1":  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tandem.kernels.ngram import _ngram_kernel, ngram_lookup  # noqa: E402
from tandem.spec.ngram import ngram_drafts  # noqa: E402
from tests.helpers import assert_lookup_output  # noqa: E402
from tests.kernels.interp import interpret_mark  # noqa: E402

POISON = -7


def _check(device: str, seed: int, slots: int, width: int, vocab: int, min_n: int, max_n: int, k: int,
           max_model_len: int) -> None:
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (slots, width), generator=g, dtype=torch.int32)
    num_tokens = torch.randint(0, width + 1, (slots,), generator=g)
    num_tokens[0] = width  # one full row (the longest walk)
    n = max(1, slots // 2)
    chosen = torch.randperm(slots, generator=g)[:n]
    want = torch.randint(0, k + 1, (n,), generator=g)
    want[0] = k
    ref_drafts, ref_counts = ngram_drafts(context[chosen], num_tokens[chosen], min_n, max_n, k, max_model_len)
    ref_counts = torch.minimum(ref_counts, want)
    drafts = torch.full((slots + 1, k), POISON, dtype=torch.int64)
    counts = ngram_lookup(context.to(device), num_tokens.to(device), chosen.to(device), want.to(device),
                          drafts_dev := drafts.to(device), min_n, max_n, max_model_len).cpu()
    drafts = drafts_dev.cpu()
    assert_lookup_output(counts, ref_counts, drafts, ref_drafts, chosen, POISON)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [2, 5, 32000])
@pytest.mark.parametrize("lookup", [(1, 1), (2, 5), (1, 8), (3, 40)])
def test_ngram_lookup_gpu(vocab, lookup):
    for seed, (slots, width, k) in enumerate([(1, 7, 4), (8, 300, 4), (33, 2500, 7), (64, 5000, 1)]):
        _check("cuda", seed, slots, width, vocab, *lookup, k, max_model_len=width + 3)
        _check("cuda", seed + 100, slots, width, vocab, *lookup, k, max_model_len=width)  # at the limit: no drafts


@pytest.mark.gpu
def test_ngram_lookup_no_requests_gpu():
    drafts = torch.zeros(3, 2, dtype=torch.int64, device="cuda")
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    counts = ngram_lookup(torch.zeros(2, 4, dtype=torch.int32, device="cuda"), torch.zeros(2, dtype=torch.int64,
                          device="cuda"), empty, empty, drafts, 1, 2, 8)
    assert counts.shape == (0,)


@interpret_mark(_ngram_kernel)
@pytest.mark.parametrize("vocab", [2, 40])
def test_ngram_lookup_interpreted(vocab):
    for seed, (slots, width, k) in enumerate([(1, 5, 3), (6, 40, 4), (4, 1100, 2)]):
        _check("cpu", seed, slots, width, vocab, 1, 3, k, max_model_len=width + 2)

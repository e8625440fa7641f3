"""The suffix lookup kernel (tandem/kernels/suffix.py) against its torch reference,
tandem.spec.suffix.suffix_drafts, on fresh random contexts and corpora (the drafts buffer poisoned
first). On CUDA (marked gpu), and on small cases in Triton's interpreter (TANDEM_TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TANDEM_TRITON_INTERPRET") == "1":  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tandem.kernels.suffix import _suffix_kernel, suffix_lookup, walk_tables  # noqa: E402
from tandem.spec.suffix import SEPARATOR, suffix_drafts  # noqa: E402
from tests.helpers import assert_lookup_output  # noqa: E402
from tests.kernels.interp import interpret_mark  # noqa: E402

POISON = -7


def _check(device: str, seed: int, slots: int, width: int, corpus_len: int, vocab: int, k: int, depth: int = 24,
           factor: float = 1.0, min_prob: float = 0.1, occurrences: int = 1024, candidates: int = 64,
           headroom: int = 3) -> int:
    """One random case; -> the drafts proposed (so a test can see that it proposed some)."""
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (slots, width), generator=g, dtype=torch.int32)
    num_tokens = torch.randint(0, width + 1, (slots,), generator=g)
    num_tokens[0] = width  # one full row (the longest scan)
    corpus = None
    if corpus_len:
        corpus = torch.randint(0, vocab, (corpus_len,), generator=g, dtype=torch.int32)
        corpus[torch.randint(0, corpus_len, (max(1, corpus_len // 50),), generator=g)] = SEPARATOR
        corpus[-1] = SEPARATOR
    n = max(1, slots // 2)
    chosen = torch.randperm(slots, generator=g)[:n]
    want = torch.randint(0, k + 1, (n,), generator=g)
    want[0] = k
    max_model_len = width + headroom
    ref_drafts, ref_counts = suffix_drafts(context[chosen], num_tokens[chosen], corpus, depth, k, factor, min_prob,
                                           max_model_len, occurrences, candidates)
    ref_counts = torch.minimum(ref_counts, want)
    drafts = torch.full((slots + 1, k), POISON, dtype=torch.int64, device=device)
    tables = walk_tables(depth, k, factor, min_prob, candidates, torch.device(device))
    counts = suffix_lookup(context.to(device), num_tokens.to(device), None if corpus is None else corpus.to(device),
                           chosen.to(device), want.to(device), drafts, tables, depth, max_model_len, occurrences,
                           candidates).cpu()
    drafts = drafts.cpu()
    assert_lookup_output(counts, ref_counts, drafts, ref_drafts, chosen, POISON)
    return int(counts.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [2, 6, 50, 32000])
@pytest.mark.parametrize("corpus_len", [0, 4096, 65536])
def test_suffix_lookup_gpu(vocab, corpus_len):
    for seed, (slots, width, k) in enumerate([(1, 7, 4), (8, 300, 4), (33, 2500, 7), (64, 5000, 1), (4, 2049, 16)]):
        _check("cuda", seed, slots, width, corpus_len, vocab, k)
        _check("cuda", seed + 100, slots, width, corpus_len, vocab, k, headroom=0)  # at the limit: no drafts


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_suffix_lookup_settings_gpu(seed):
    """Short depths, small windows (the occurrence and candidate caps bind), other thresholds."""
    for vocab in (2, 4, 9):
        _check("cuda", seed, 16, 700, 3000, vocab, 6, depth=3, occurrences=16, candidates=4)
        _check("cuda", seed, 16, 700, 3000, vocab, 5, depth=8, factor=0.5, min_prob=0.3, occurrences=64)
        _check("cuda", seed, 16, 700, 0, vocab, 8, depth=40, factor=2.0, min_prob=0.0, candidates=8)


@pytest.mark.gpu
def test_suffix_lookup_no_requests_gpu():
    drafts = torch.zeros(3, 2, dtype=torch.int64, device="cuda")
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    counts = suffix_lookup(torch.zeros(2, 4, dtype=torch.int32, device="cuda"),
                           torch.zeros(2, dtype=torch.int64, device="cuda"), None, empty, empty, drafts,
                           walk_tables(24, 2, 1.0, 0.1, 64, torch.device("cuda")), 24, 8, 1024, 64)
    assert counts.shape == (0,)


@interpret_mark(_suffix_kernel)
@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_suffix_lookup_interpreted(vocab):
    proposed = 0
    for seed, (slots, width, corpus_len, k) in enumerate([(1, 5, 0, 3), (6, 40, 100, 4), (4, 300, 1500, 2)]):
        proposed += _check("cpu", seed, slots, width, corpus_len, vocab, k)
        proposed += _check("cpu", seed, slots, width, corpus_len, vocab, k, depth=3, occurrences=8, candidates=4,
                           min_prob=0.3)
    assert proposed > 0

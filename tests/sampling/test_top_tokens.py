"""top_tokens: the k likeliest tokens of each row, equal values in token-id order, so a row's first j are its
top j whatever k (a request's logprobs entries do not hang on the widest request of its step)."""
import pytest
import torch

import tandem.sampling.sampler as sampler
from tandem.sampling.sampler import compute_logprobs, top_tokens


def test_top_tokens_orders_ties_by_id_and_keeps_its_prefix():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        values = -torch.randint(0, 12, (3, 400), generator=g).float() / 7  # many equal values
        lp = values.log_softmax(-1)
        lp[0, 5] = float("-inf")
        full = top_tokens(lp, 60)
        want = torch.stack([torch.tensor(sorted(range(400), key=lambda i: (-lp[r, i].item(), i))[:60]) for r in range(3)])
        assert torch.equal(full, want)
        for k in (1, 2, 7, 33):
            assert torch.equal(top_tokens(lp, k), full[:, :k])


def test_compute_logprobs_entries_do_not_depend_on_the_width():
    """logprobs=1 alone and as the first of logprobs=5 (the step's widest): the same token and value."""
    lp = torch.tensor([[0.0, 1.0, 3.0, 3.0, 3.0, -2.0]])
    _, rank, ids1, vals1 = compute_logprobs(lp, torch.tensor([3]), 1)
    _, _, ids5, vals5 = compute_logprobs(lp, torch.tensor([3]), 5)
    assert ids1.tolist() == [[2]] and ids5[:, :1].tolist() == [[2]] and ids5[0, :3].tolist() == [2, 3, 4]
    assert torch.equal(vals5[:, :1], vals1) and rank.tolist() == [3]


def test_top_tokens_candidates_and_whole_rows_agree():
    """The CPU's candidate path (ties within TIE_MARGIN of the k-th value), its fallback (more ties there) and
    keying every token give the same ids; no rows, no ids."""
    g = torch.Generator().manual_seed(1)
    for spread in (3, 400):  # 3 values: ties spill past the margin; 400: rarely
        lp = (-torch.randint(0, spread, (40, 1000), generator=g).float() / 7).log_softmax(-1)
        for k in (1, 5, 30, 990, 1000):
            assert torch.equal(top_tokens(lp, k), sampler._keyed_top(lp, k, torch.arange(1000)))
    assert top_tokens(torch.zeros(0, 50), 3).shape == (0, 3)


@pytest.mark.gpu
def test_top_tokens_on_gpu_match_the_cpu():
    """The GPU keys every token of every row (TOP_ROWS a pass): the CPU's ids, ties in token-id order, on a
    vocabulary-wide bf16-valued batch (many exact ties) and past one pass of rows."""
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(70, 128256, generator=g).bfloat16().float().log_softmax(-1)
    lp[3, :100] = float("-inf")
    for k in (1, 5, 20):
        assert torch.equal(top_tokens(lp.cuda(), k).cpu(), top_tokens(lp, k))

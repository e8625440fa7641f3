"""The watermark's context-hash kernel against the torch reference (tandem.sampling.watermark)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels.watermark import context_hashes  # noqa: E402
from tandem.sampling.watermark import context_hash, last_window  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("width", [1, 4, 7])
@pytest.mark.parametrize("with_drafts", [False, True])
def test_context_hashes_equal_the_reference(width, with_drafts):
    g = torch.Generator().manual_seed(width)
    slots, k, n = 40, 5, 300
    windows = torch.randint(-1, 160_000, (slots, width), generator=g)  # -1: before a sequence's start
    drafts = torch.randint(0, 160_000, (slots + 1, k), generator=g)
    slot_ids = torch.randint(0, slots, (n,), generator=g)
    num_drafts = torch.randint(0, k + 1, (n,), generator=g)
    if with_drafts:
        want = context_hash(last_window(windows[slot_ids], drafts[slot_ids], num_drafts, width))
        got = context_hashes(windows.cuda(), slot_ids.cuda(), drafts.cuda(), slot_ids.cuda(), num_drafts.cuda())
    else:
        want = context_hash(windows[slot_ids])
        got = context_hashes(windows.cuda(), slot_ids.cuda(), None, None, None)
    assert torch.equal(got.cpu(), want)
    assert context_hashes(windows.cuda(), slot_ids[:0].cuda(), None, None, None).shape == (0,)


def test_context_hashes_of_per_row_tails():
    """A tail indexed by its own rows (a step's emitted tokens), not by slot."""
    g = torch.Generator().manual_seed(9)
    windows = torch.randint(-1, 1000, (8, 4), generator=g)
    tokens = torch.randint(0, 1000, (6, 5), generator=g)  # 6 requests x 5 emitted tokens
    slot_ids = torch.randint(0, 8, (6,), generator=g)
    req = torch.arange(6).repeat_interleave(5)
    j = torch.arange(5).repeat(6)
    want = context_hash(last_window(windows[slot_ids[req]], tokens[req], j, 4))
    got = context_hashes(windows.cuda(), slot_ids[req].cuda(), tokens.cuda(), req.cuda(), j.cuda())
    assert torch.equal(got.cpu(), want)

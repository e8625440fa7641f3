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


@pytest.mark.parametrize("history_len,count_scale", [(64, 1), (64, 3), (4096, 1), (100, 2)])
def test_context_hashes_seen_equal_the_reference(history_len, count_scale):
    """The fused hash + history search against WatermarkState.keys' torch path, on histories that
    are empty, partly filled and wrapped, rows with 0..k drafts before them, and contexts planted
    in the history (within reach and pushed out of it) and among the earlier rows."""
    from tandem.upload import Uploader
    from tandem.sampling.watermark import WatermarkConfig, WatermarkState

    g = torch.Generator().manual_seed(history_len + count_scale)
    slots, k, width, n = 16, 4, 3, 200
    cfg = WatermarkConfig(key=5, context_width=width, deduplicate_contexts_max_history=max(history_len, 64))
    ref = WatermarkState(cfg, slots, history_len, torch.device("cpu"), Uploader(torch.device("cpu")))
    ref.windows = torch.randint(0, 6, (slots, width), generator=g)  # few tokens: contexts repeat
    drafts = torch.randint(0, 6, (slots + 1, k), generator=g)
    ref.count = torch.randint(0, count_scale * history_len + 1, (slots,), generator=g)
    ref.history = torch.full((slots, history_len + 1), -1, dtype=torch.int64)
    for s in range(slots):  # the written columns hold hashes of random small contexts
        written = min(int(ref.count[s]), history_len)
        ref.history[s, :written] = context_hash(torch.randint(0, 6, (written, width), generator=g))
    ref.history[:, -1] = torch.randint(0, 2**32, (slots,), generator=g)  # scratch: never searched
    slot_ids = torch.randint(0, slots, (n,), generator=g)
    num_drafts = torch.randint(0, k + 1, (n,), generator=g)
    want_h, want_seen = ref.keys(slot_ids, drafts, slot_ids, num_drafts)
    assert 0 < int(want_seen.sum()) < n  # both outcomes occur
    gpu = WatermarkState(cfg, slots, history_len, torch.device("cuda"), Uploader(torch.device("cuda")), use_triton=True)
    gpu.windows, gpu.history, gpu.count = ref.windows.cuda(), ref.history.cuda(), ref.count.cuda()
    got_h, got_seen = gpu.keys(slot_ids.cuda(), drafts.cuda(), slot_ids.cuda(), num_drafts.cuda())
    assert torch.equal(got_h.cpu(), want_h) and torch.equal(got_seen.cpu(), want_seen)
    plain_h, plain_seen = gpu.keys(slot_ids.cuda())
    want_h, want_seen = ref.keys(slot_ids)
    assert torch.equal(plain_h.cpu(), want_h) and torch.equal(plain_seen.cpu(), want_seen)

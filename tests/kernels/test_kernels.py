"""Each Triton kernel in tandem/kernels/ against its pure-torch reference (tests/kernels/refs.py).

Every check draws fresh random inputs and poisons the output first (NaN / -1), so unwritten
elements fail. Tolerances (relative Frobenius error): bf16 1e-2, fp32 1e-5 (IEEE dots, no tf32).
Samplers must match token for token, except where the reference's own top scores (or the
accept test's two sides) are within 1e-5 relative: fp32 rounding of a log or a sum decides those.

GPU tests are marked `gpu` (skipped without CUDA). The same checks run on tiny shapes in
Triton's interpreter on the CPU with:

    TANDEM_TRITON_INTERPRET=1 pytest tests/kernels

NOTE: Triton 3.6's interpreter fails on runtime loop bounds with numpy >= 2.4 (triton#9171);
use numpy < 2.4 there (e.g. a venv with --system-site-packages and numpy==2.3.5).
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TANDEM_TRITON_INTERPRET") == "1"
if INTERPRET:  # must precede the first `import triton`: @triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from tandem.kernels.attention import paged_attention  # noqa: E402
from tandem.kernels.decode_inputs import decode_inputs, decode_inputs_ref  # noqa: E402
from tandem.kernels.gumbel import argmax_rows, gumbel_sample, gumbel_uniform  # noqa: E402
from tandem.kernels.kv_store import _kv_store_kernel, kv_store  # noqa: E402
from tandem.kernels.rejection import rejection_sample  # noqa: E402
from tandem.layers.backend import AttnBackend  # noqa: E402
from tandem.sampling.gumbel import (ACCEPT_SALT, DRAFT_SALT, RECOVER_SALT, TARGET_SALT, draft_salt,  # noqa: E402
                                   gumbel_argmax)
from tests.kernels.interp import interpret_mark  # noqa: E402
from tests.kernels.refs import (  # noqa: E402
    gumbel_sample_ref,
    gumbel_scores_ref,
    gumbel_uniform_ref,
    kv_store_ref,
    paged_attention_ref,
    rejection_sample_ref,
)

NEG_INF = float("-inf")
TIE_RTOL = 1e-5


interpret = interpret_mark(_kv_store_kernel)
GPU = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ----------------------------------------------------------------------------- kv_store
def check_kv_store(device, num_tokens, num_kv_heads, head_dim, dtype, num_blocks=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # k and v as strided views of a fused [num_tokens, (2 + x) * Hkv * D] projection output
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    k, v = fused[:, 0], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding rows
    slot_mapping = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store(k, v, k_cache, v_cache, slot_mapping)
    kv_store_ref(k, v, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    for idx in (slot_mapping.int(),):  # int32 slots are accepted too
        kv_store(k * 2, v * 2, k_cache, v_cache, idx)
        kv_store_ref(k * 2, v * 2, k_ref, v_ref, idx)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (3, 64)])
def test_kv_store_gpu(dtype, num_kv_heads, head_dim):
    check_kv_store(GPU, 300, num_kv_heads, head_dim, dtype, num_blocks=40, seed=head_dim)


@interpret
def test_kv_store_interpret():
    check_kv_store("cpu", 13, 2, 16, torch.float32, num_blocks=4, block_size=4)


# ----------------------------------------------------------------------------- attention
def make_attention_batch(device, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size, seed):
    """Random paged batch: scattered block tables, random cache contents (stale values past
    each request's keys too), q with poisoned padding rows at the end."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    num_blocks_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(num_blocks_req) + 5
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(num_blocks_req) + 2
    block_tables = torch.randint(0, num_blocks, (len(q_lens), max_blocks), generator=g, dtype=torch.int32)
    offset = 0
    for r, n in enumerate(num_blocks_req):
        block_tables[r, :n] = perm[offset : offset + n]
        offset += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens + 3, num_heads, head_dim, generator=g).to(dtype)
    cu_q_lens = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    to = dict(device=device)
    return (q.to(**to), k_cache.to(**to), v_cache.to(**to), block_tables.to(**to),
            torch.tensor(seq_lens, dtype=torch.int64, device=device), cu_q_lens.to(**to))


def check_attention(device, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16,
                    num_splits=None, seed=0, padding_reqs=(), min_split_keys=None):
    q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens = make_attention_batch(
        device, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size, seed)
    seq_lens[list(padding_reqs)] = 0  # graph padding rows: q_len 1, no keys
    num_tokens = sum(q_lens)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, max(q_lens), scale, out,
                    num_splits=num_splits, min_split_keys=min_split_keys)
    ref = torch.full(q.shape, float("nan"), dtype=torch.float64, device=device)
    paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, cu_q_lens,
                        max(q_lens), scale, ref)
    assert not out[:num_tokens].isnan().any(), "unwritten or NaN output rows"
    assert out[num_tokens:].isnan().all(), "rows past cu_q_lens[-1] were written"
    err = rel_err(out[:num_tokens], ref[:num_tokens])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert err < tol, (err, q_lens, ctx_lens)
    # Per request as well: a wrong short request would hide inside a long one's norm.
    cu = cu_q_lens.tolist()
    for r in range(len(q_lens)):
        e = rel_err(out[cu[r] : cu[r + 1]], ref[cu[r] : cu[r + 1]])
        assert e < 2 * tol, (r, e, q_lens[r], ctx_lens[r])


GQA_CASES = [  # (H, Hkv, D, dtype): GQA ratios 1, 4, 7; head dims 64, 128
    (8, 8, 128, torch.bfloat16),
    (32, 8, 128, torch.bfloat16),
    (28, 4, 128, torch.bfloat16),
    (8, 8, 64, torch.bfloat16),
    (16, 4, 64, torch.bfloat16),
    (14, 2, 64, torch.bfloat16),
    (32, 8, 128, torch.float32),
    (14, 2, 64, torch.float32),
]


def _gqa_id(case):
    h, hkv, d, dtype = case
    return f"H{h}-Hkv{hkv}-D{d}-{str(dtype).split('.')[-1]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GQA_CASES, ids=_gqa_id)
def test_attention_mixed_gpu(case):
    """Decode, verification and prefill-chunk requests in one launch, prefixes 0..2000."""
    h, hkv, d, dtype = case
    q_lens = [1, 5, 300, 1, 5, 300, 1, 5]
    ctx_lens = [0, 2000, 1234, 2000, 7, 0, 517, 0]
    check_attention(GPU, q_lens, ctx_lens, h, hkv, d, dtype, seed=d + h)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GQA_CASES, ids=_gqa_id)
def test_attention_decode_verify_gpu(case):
    """One-tile batches: decode (split-K by default, and unsplit) and verification (q_len 5)."""
    h, hkv, d, dtype = case
    g = torch.Generator().manual_seed(h * d)
    ctx = torch.randint(0, 2001, (6,), generator=g).tolist() + [0, 2000]
    check_attention(GPU, [1] * 8, ctx, h, hkv, d, dtype, seed=1)
    check_attention(GPU, [1] * 8, ctx, h, hkv, d, dtype, num_splits=1, seed=2)
    check_attention(GPU, [1] * 8, ctx, h, hkv, d, dtype, num_splits=8, min_split_keys=1, seed=4)
    check_attention(GPU, [5] * 8, ctx, h, hkv, d, dtype, seed=3)
    check_attention(GPU, [1], [300], h, hkv, d, dtype, seed=5)  # batch 1: 32 splits, 3 with keys


@pytest.mark.gpu
def test_attention_single_long_prefill_gpu():
    check_attention(GPU, [2048], [0], 32, 8, 128, torch.bfloat16, seed=5)
    check_attention(GPU, [1000, 1], [1500, 4000], 32, 8, 128, torch.bfloat16, seed=6)


@pytest.mark.gpu
def test_attention_zero_length_request_gpu():
    """A padded request (q_len 0) is skipped; its neighbours are unaffected."""
    check_attention(GPU, [1, 0, 5], [100, 50, 30], 32, 8, 128, torch.bfloat16, num_splits=4, seed=7)
    check_attention(GPU, [1, 0, 5], [700, 50, 300], 32, 8, 128, torch.bfloat16, num_splits=4, seed=7,
                    min_split_keys=1)


@pytest.mark.gpu
def test_attention_active_splits_follow_context_gpu():
    """One captured launch, contexts from 1 key to many splits: each request runs only the
    splits its keys need (the rest exit) and the merge combines exactly those."""
    ctx = [0, 1, 127, 128, 129, 255, 256, 257, 511, 1024, 3000, 4095]
    check_attention(GPU, [1] * len(ctx), ctx, 32, 8, 128, torch.bfloat16, num_splits=16, seed=11)
    check_attention(GPU, [1] * len(ctx), ctx, 32, 8, 128, torch.bfloat16, num_splits=16, min_split_keys=1,
                    seed=12)
    check_attention(GPU, [4] * len(ctx), ctx, 32, 8, 128, torch.bfloat16, num_splits=16, seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_padding_rows_gpu(num_splits):
    """Captured-graph padding (seq_len 0, q_len 1) writes zeros, never NaN."""
    check_attention(GPU, [1] * 6, [40, 0, 300, 0, 0, 9], 32, 8, 128, torch.bfloat16, num_splits=num_splits,
                    seed=8, padding_reqs=(1, 4))


@interpret
def test_attention_padding_rows_interpret():
    check_attention("cpu", [1] * 4, [5, 0, 30, 0], 4, 2, 16, torch.float32, block_size=4, num_splits=2,
                    seed=9, padding_reqs=(1, 3))
    check_attention("cpu", [1] * 4, [5, 0, 30, 0], 4, 2, 16, torch.float32, block_size=4, num_splits=2,
                    seed=9, padding_reqs=(1, 3), min_split_keys=1)
    check_attention("cpu", [1] * 4, [5, 0, 30, 0], 4, 2, 16, torch.float32, block_size=4, num_splits=1,
                    seed=9, padding_reqs=(1, 3))


@interpret
@pytest.mark.parametrize("h,hkv,d,dtype", [(4, 1, 16, torch.float32), (6, 2, 32, torch.bfloat16),
                                            (7, 1, 16, torch.float32)])
def test_attention_interpret(h, hkv, d, dtype):
    check_attention("cpu", [1, 5, 40, 0], [0, 70, 20, 3], h, hkv, d, dtype, block_size=4, seed=h)
    check_attention("cpu", [1, 1, 1], [0, 37, 100], h, hkv, d, dtype, block_size=4, num_splits=4, seed=h + 1)
    check_attention("cpu", [1, 1, 1], [0, 37, 100], h, hkv, d, dtype, block_size=4, num_splits=4, seed=h + 1,
                    min_split_keys=1)
    check_attention("cpu", [3, 5], [33, 0], h, hkv, d, dtype, block_size=16, seed=h + 2)


# ----------------------------------------------------------------------------- gumbel
def random_sampling_batch(device, n, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[1, 10:] = NEG_INF  # masked tails and sparse rows
    logits[2, :-1] = NEG_INF
    logits[3, torch.rand(vocab, generator=g) < 0.9] = NEG_INF
    temperature = torch.rand(n, generator=g) * 1.5 + 0.1
    temperature[torch.rand(n, generator=g) < 0.25] = 0.0
    temperature[0] = 0.0
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    positions = torch.randint(0, 2**40, (n,), generator=g)
    to = dict(device=device)
    return logits.to(dtype).to(**to), temperature.to(**to), seeds.to(**to), positions.to(**to)


def check_gumbel(device, n, vocab, dtype, salt, seed):
    logits, temperature, seeds, positions = random_sampling_batch(device, n, vocab, dtype, seed)
    u = gumbel_uniform(seeds, positions, salt, vocab)
    assert torch.equal(u, gumbel_uniform_ref(seeds, positions, salt, vocab)), "uniforms differ"
    out = torch.full((n,), -1, dtype=torch.int64, device=device)
    gumbel_sample(logits, temperature, seeds, positions, salt, out)
    ref = gumbel_sample_ref(logits, temperature, seeds, positions, salt, torch.empty_like(out))
    assert ((out >= 0) & (out < vocab)).all()
    bad = (out != ref).nonzero().flatten().tolist()
    scores = gumbel_scores_ref(logits, temperature, seeds, positions, salt)
    for i in bad:  # only near-ties of the reference's own scores may differ
        a, b = float(scores[i, out[i]]), float(scores[i, ref[i]])
        assert abs(a - b) <= TIE_RTOL * max(1.0, abs(b)), (i, a, b)
    assert len(bad) <= max(1, n // 100), bad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,vocab", [(1, 128256), (64, 32000), (257, 50257)])
def test_gumbel_sample_gpu(dtype, n, vocab):
    check_gumbel(GPU, max(n, 4), vocab, dtype, TARGET_SALT, seed=n)
    check_gumbel(GPU, max(n, 4), vocab, dtype, DRAFT_SALT, seed=n + 1)
    check_gumbel(GPU, max(n, 4), vocab, dtype, draft_salt(3), seed=n + 2)  # a round's fourth draft


@interpret
def test_gumbel_sample_interpret():
    check_gumbel("cpu", 6, 3001, torch.float32, TARGET_SALT, seed=0)
    check_gumbel("cpu", 5, 700, torch.float32, RECOVER_SALT, seed=1)
    check_gumbel("cpu", 5, 700, torch.float32, draft_salt(2), seed=2)


def check_argmax(device, n, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab + 7, generator=g) * 3).to(dtype)
    logits[0, :] = 1.0  # all tied: the lowest token wins
    logits[1, vocab // 2 :] = logits[1].max() + 1  # ties across chunks
    logits[2, :-1] = NEG_INF
    view = logits.to(device)[:, :vocab]  # a row-strided slice, as the padded LM head gives
    out = torch.full((n,), -1, dtype=torch.int64, device=device)
    argmax_rows(view, out)
    assert torch.equal(out.cpu(), view.cpu().float().argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,vocab", [(3, 128256), (8, 151936), (300, 32000)])
def test_argmax_rows_gpu(dtype, n, vocab):
    check_argmax(GPU, n, vocab, dtype, seed=n)


@interpret
def test_argmax_rows_interpret():
    check_argmax("cpu", 4, 5000, torch.float32, seed=0)


# ----------------------------------------------------------------------------- rejection
def random_verify_batch(device, num_reqs, vocab, k_max, seed, greedy_frac=0.3, with_q=True, synthetic=False,
                        pad=0, drop_sampled=False, forced=False):
    """Requests with 0..k_max drafts laid out as the speculator does; drafts drawn from q with
    the DRAFT salt (greedy requests mostly draft the target argmax). pad: p and q are views of
    rows pad wider (a padded vocabulary); drop_sampled: every other non-greedy row is left out of
    sampled_idx (it then stops at its argmax); forced: a third of the draft rows allow one token
    in p and q alike (a grammar's forced text) while their draft is another one, which q could not
    have drawn: a residual with no mass, where the samplers emit p's argmax."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, k_max + 1, (num_reqs,), generator=g).tolist()
    num_rows = sum(k + 1 for k in ks)
    p = torch.randn(num_rows, vocab, generator=g) * 2
    q = p + torch.randn(num_rows, vocab, generator=g) * 0.7
    p[:, 0] = NEG_INF  # a token the target masks and one the draft masks
    q[:, 1] = NEG_INF
    greedy_req = torch.rand(num_reqs, generator=g) < greedy_frac
    row_req = torch.cat([torch.full((k + 1,), r) for r, k in enumerate(ks)])
    row_index = torch.cat([torch.arange(k + 1) for k in ks])
    bonus = torch.cat([torch.arange(k + 1) == k for k in ks])
    seeds = torch.randint(0, 2**62, (num_reqs,), generator=g)[row_req]
    positions = torch.randint(0, 5000, (num_reqs,), generator=g)[row_req] + row_index
    drafts = gumbel_argmax(q, seeds, positions, DRAFT_SALT)
    greedy = greedy_req[row_req]
    drafts = torch.where(greedy & (torch.rand(num_rows, generator=g) < 0.7), p.argmax(-1), drafts)
    if forced:
        rows = (~bonus & (torch.rand(num_rows, generator=g) < 0.33)).nonzero().flatten()
        only = torch.randint(2, vocab, (rows.numel(),), generator=g)
        for t in (p, q):
            t[rows] = NEG_INF
            t[rows, only] = 0.0
        drafts[rows] = torch.where(only == 2, 3, 2)
    drafts = torch.where(bonus, -1, drafts)
    sampled = (~greedy).nonzero().flatten()
    if drop_sampled:
        sampled = sampled[::2]
    rates = torch.tensor([0.9, 0.6, 0.3]) if synthetic else None
    to = dict(device=device)
    if pad:  # widen on the device (a copy there would make the views contiguous again)
        p, q = (torch.cat([t, torch.randn(num_rows, pad, generator=g)], 1).to(**to)[:, :vocab] for t in (p, q))
    return (p.to(**to), drafts.to(**to), bonus.to(**to), greedy.to(**to),
            sampled.to(**to) if sampled.numel() else None, q.to(**to) if with_q else None,
            seeds.to(**to), positions.to(**to), row_req.to(**to), row_index.to(**to), num_reqs,
            rates.to(**to) if synthetic else None)


def near_tie(args, row, token_a, token_b) -> bool:
    """Whether the reference's decision at `row` is within rounding: the accept test's two sides,
    or the two tokens' scores in the stop draw."""
    from tandem.sampling.gumbel import gumbel_from_keys, noise_key, uniform

    p_logits, drafts, bonus, greedy, _, q_logits, seeds, positions = args[:8]
    coupled = q_logits is None and args[11] is None  # greedy drafts: each row's draw is the target's own
    pl = p_logits[row : row + 1]
    p = pl.softmax(-1)[0]
    q = q_logits[row : row + 1].softmax(-1)[0] if q_logits is not None else None
    x = int(drafts[row].clamp(min=0))
    s, pos = seeds[row : row + 1], positions[row : row + 1]
    u = float(uniform(noise_key(s, pos, ACCEPT_SALT), torch.zeros_like(s))[0])
    q_x = float(q[x]) if q is not None else 1.0
    lhs, rhs = u * q_x, float(p[x])
    if not (bool(bonus[row]) or bool(greedy[row]) or coupled) and abs(lhs - rhs) <= TIE_RTOL * max(lhs, rhs):
        return True
    if bool(bonus[row]) or coupled:
        scores = pl[0] + gumbel_from_keys(noise_key(s, pos, TARGET_SALT), pl.shape[1])[0]
    else:
        resid = (p - q).clamp(min=0) if q is not None else p.scatter(0, torch.tensor([x], device=p.device), 0.0)
        scores = resid.log() + gumbel_from_keys(noise_key(s, pos, RECOVER_SALT), pl.shape[1])[0]
    a, b = float(scores[token_a]), float(scores[token_b])
    return abs(a - b) <= TIE_RTOL * max(1.0, abs(b))


def check_rejection(device, num_reqs, vocab, k_max, seed, **kw):
    args = random_verify_batch(device, num_reqs, vocab, k_max, seed, **kw)
    tokens, emitted = rejection_sample(*args)
    ref_tokens, ref_emitted = rejection_sample_ref(*args)
    row_req, row_index = args[8], args[9]
    assert ((emitted >= 1) & (emitted <= k_max + 1)).all()
    reached = row_index < emitted[row_req]
    assert (tokens[~reached] == -1).all()
    assert ((tokens[reached] >= 0) & (tokens[reached] < vocab)).all()
    assert (args[0][reached].gather(1, tokens[reached][:, None]) > NEG_INF).all()  # every token one p allows
    reached_ref = row_index < ref_emitted[row_req]
    same_row = (tokens == ref_tokens) & (reached == reached_ref)
    bad_reqs = torch.unique(row_req[reached & ~same_row | reached_ref & ~same_row]).tolist()
    starts = torch.full((num_reqs,), row_req.shape[0], device=device).scatter_reduce(
        0, row_req, torch.arange(row_req.shape[0], device=device), "amin").tolist()
    for r in bad_reqs:  # explain each mismatch by a near-tie at its first divergent row
        n_common = int(min(emitted[r], ref_emitted[r]))
        j = next(j for j in range(n_common) if not bool(same_row[starts[r] + j]) or j == n_common - 1)
        row = starts[r] + j
        assert near_tie(args, row, int(tokens[row]), int(ref_tokens[row])), (r, j)
    assert len(bad_reqs) <= max(1, num_reqs // 50), bad_reqs
    return emitted


REJECTION_EDGES = {  # (num_reqs, vocab, k_max, keywords)
    "one-row": (1, 100, 0, {}),
    "one-block": (8, 4096, 4, {}),
    "padded-vocab": (8, 5000, 4, dict(pad=24)),
    "sampled-subset": (16, 3000, 4, dict(greedy_frac=0.0, drop_sampled=True)),
    "sampled-subset-greedy-drafts": (16, 3000, 4, dict(greedy_frac=0.0, drop_sampled=True, with_q=False)),
    "forced-rows": (16, 5000, 4, dict(greedy_frac=0.0, forced=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["probabilistic", "one_hot_q", "synthetic", "all_greedy", "all_sampled"])
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_rejection_sample_gpu(mode, vocab):
    kw = dict(probabilistic={}, one_hot_q=dict(with_q=False), synthetic=dict(synthetic=True),
              all_greedy=dict(greedy_frac=1.0), all_sampled=dict(greedy_frac=0.0))[mode]
    emitted = check_rejection(GPU, 64, vocab, 5, seed=vocab % 97, **kw)
    assert 1.0 < emitted.float().mean() < 6.0  # both accept and reject paths ran


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(REJECTION_EDGES))
def test_rejection_sample_edges_gpu(case):
    """One row; a vocabulary of one block; logits rows wider than the vocabulary; sampled_idx a
    strict subset of the non-greedy rows (with sampled drafts, and greedy ones: the coupled test)."""
    num_reqs, vocab, k_max, kw = REJECTION_EDGES[case]
    check_rejection(GPU, num_reqs, vocab, k_max, seed=5, **kw)


@interpret
@pytest.mark.parametrize("kw", [{}, dict(with_q=False), dict(synthetic=True), dict(greedy_frac=1.0),
                                dict(greedy_frac=0.0)])
def test_rejection_sample_interpret(kw):
    check_rejection("cpu", 12, 1000, 4, seed=3, **kw)
    check_rejection("cpu", 6, 9000, 4, seed=4, **kw)  # three vocabulary blocks, the last ragged


@interpret
@pytest.mark.parametrize("case", list(REJECTION_EDGES))
def test_rejection_sample_edges_interpret(case):
    num_reqs, vocab, k_max, kw = REJECTION_EDGES[case]
    check_rejection("cpu", num_reqs, vocab, k_max, seed=5, **kw)


def check_block(device, num_reqs, vocab, k_max, seed, **kw):
    """The fused block verification against tandem.spec.rejection.block_rejection_sample (float64
    ratios and masses there, fp32 here: a decision within rounding of its threshold may differ,
    in at most 1 request in 25)."""
    from tandem.kernels.rejection import block_rejection_sample as fused_block
    from tandem.spec.rejection import block_rejection_sample as block_ref

    args = random_verify_batch(device, num_reqs, vocab, k_max, seed, **kw)
    tokens, emitted = fused_block(*args)
    ref_tokens, ref_emitted = block_ref(*args)
    row_req, row_index = args[8], args[9]
    assert ((emitted >= 1) & (emitted <= k_max + 1)).all()
    reached = row_index < emitted[row_req]
    assert (tokens[~reached] == -1).all() and ((tokens[reached] >= 0) & (tokens[reached] < vocab)).all()
    assert (args[0][reached].gather(1, tokens[reached][:, None]) > NEG_INF).all()  # every token one p allows
    row_same = (~reached | (tokens == ref_tokens)).long()
    same = (emitted == ref_emitted) & torch.ones(num_reqs, dtype=torch.int64, device=device).scatter_reduce(
        0, row_req, row_same, "amin").bool()
    assert (~same).sum() <= max(1, num_reqs // 25), (~same).nonzero().flatten().tolist()
    return emitted


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["probabilistic", "one_hot_q", "all_greedy", "all_sampled"])
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_block_rejection_sample_gpu(mode, vocab):
    kw = dict(probabilistic={}, one_hot_q=dict(with_q=False), all_greedy=dict(greedy_frac=1.0),
              all_sampled=dict(greedy_frac=0.0))[mode]
    emitted = check_block(GPU, 64, vocab, 5, seed=vocab % 89, **kw)
    assert 1.0 < emitted.float().mean() < 6.0


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in REJECTION_EDGES if c != "one-row"] + ["one-row"])
def test_block_rejection_sample_edges_gpu(case):
    num_reqs, vocab, k_max, kw = REJECTION_EDGES[case]
    check_block(GPU, num_reqs, vocab, k_max, seed=6, **kw)


@interpret
@pytest.mark.parametrize("kw", [{}, dict(with_q=False), dict(greedy_frac=1.0), dict(greedy_frac=0.0)])
def test_block_rejection_sample_interpret(kw):
    check_block("cpu", 12, 1000, 4, seed=3, **kw)
    check_block("cpu", 6, 9000, 4, seed=4, **kw)  # three vocabulary blocks, the last ragged


@interpret
@pytest.mark.parametrize("case", list(REJECTION_EDGES))
def test_block_rejection_sample_edges_interpret(case):
    num_reqs, vocab, k_max, kw = REJECTION_EDGES[case]
    check_block("cpu", num_reqs, vocab, k_max, seed=5, **kw)


# ----------------------------------------------------------------------------- decode inputs
def check_decode_inputs(device, n, seed, block_size=16, max_model_len=300):
    g = torch.Generator().manual_seed(seed)
    k, max_blocks = 4, -(-max_model_len // block_size)
    pos = torch.randint(0, max_model_len + 3, (n,), generator=g)  # some past the end: clamped
    pos[0] = max_model_len - 2
    slots = torch.randperm(2 * n + 1, generator=g)[:n]
    drafts = torch.randint(0, 128256, (2 * n + 1, k), generator=g)
    table = torch.randint(0, 5000, (n, max_blocks), generator=g)
    valid = torch.rand(n, generator=g) < 0.8
    for col in (0, k - 2):
        args = [t.to(device) for t in (pos, slots, drafts)] + [col] + [t.to(device) for t in (table, valid)]
        args += [max_model_len, block_size]
        got = decode_inputs(*args)
        want = decode_inputs_ref(*args)
        for name, a, b in zip(("pos", "safe", "ids", "slot_mapping", "seq_lens", "cu_q_lens"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, col)
        # AttnBackend.draft_step (the draft loop's caller): the kernel path against the torch path
        steps = [AttnBackend(block_size, torch.device(device), use_table=True, use_triton=t).draft_step(
            *args[:6], max_blocks * block_size, max_model_len) for t in (True, False)]
        for a, b in zip(steps[0][:3], steps[1][:3]):
            assert torch.equal(a, b)
        for field in ("slot_mapping", "block_tables", "seq_lens"):
            assert torch.equal(getattr(steps[0][3], field), getattr(steps[1][3], field)), field
        assert torch.equal(steps[0][3].cu_q_lens.long(), steps[1][3].cu_q_lens.long())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 130])
def test_decode_inputs_gpu(n):
    check_decode_inputs(GPU, n, seed=n)


@interpret
def test_decode_inputs_interpret():
    check_decode_inputs("cpu", 5, seed=1)
    check_decode_inputs("cpu", 130, seed=2)


# ----------------------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu
def test_kernels_capture_in_cuda_graph_gpu():
    """No host sync anywhere: each wrapper captures, and a replay on new device values (shorter
    contexts, new logits) matches the reference."""
    g = torch.Generator().manual_seed(11)
    ctx = torch.randint(100, 2000, (8,), generator=g).tolist()
    q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens = make_attention_batch(
        GPU, [1] * 8, ctx, 32, 8, 128, torch.bfloat16, 16, seed=11)
    out = torch.full_like(q, float("nan"))
    logits, temperature, seeds, positions = random_sampling_batch(GPU, 16, 32000, torch.float32, seed=12)
    tokens = torch.full((16,), -1, dtype=torch.int64, device=GPU)
    verify = random_verify_batch(GPU, 16, 32000, 4, seed=13)
    verify_out = []

    def step():
        paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, 1, 128**-0.5, out)
        gumbel_sample(logits, temperature, seeds, positions, TARGET_SALT, tokens)
        verify_out[:] = rejection_sample(*verify)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seq_lens.copy_(seq_lens // 2 + 1)
    q.copy_(torch.randn_like(q))
    logits.copy_(torch.randn_like(logits) * 3)
    verify[0].copy_(torch.randn_like(verify[0]) * 2)
    graph.replay()
    torch.cuda.synchronize()
    num_tokens = 8
    ref = torch.zeros(q.shape, dtype=torch.float64, device=GPU)
    paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, cu_q_lens, 1,
                        128**-0.5, ref)
    assert rel_err(out[:num_tokens], ref[:num_tokens]) < 1e-2
    ref_tokens = gumbel_sample_ref(logits, temperature, seeds, positions, TARGET_SALT, torch.empty_like(tokens))
    assert int((tokens == ref_tokens).sum()) >= 15  # a near-tie at most
    ref_rows, ref_emitted = rejection_sample_ref(*verify)
    assert (verify_out[1] == ref_emitted).float().mean() > 0.9

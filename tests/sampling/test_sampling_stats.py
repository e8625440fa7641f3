"""Statistical and exactness tests of the sampler: seeded Gumbel-max, noise keys, truncation
masks, penalties, and the first sampled token end to end through LLM.generate.

Every test uses fixed seeds, so it is deterministic. Goodness-of-fit thresholds are honest
(p > 1e-3); each statistical test has a negative control showing it has power at the same
sample size.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tandem import LLM, SamplingParams
from tandem.plan import NewReq
from tandem.sampling.gumbel import (
    ACCEPT_SALT,
    BLOCK_SALT,
    DRAFT_SALT,
    RECOVER_SALT,
    TARGET_SALT,
    WATERMARK_SALT,
    _fmix32,
    _mul32,
    draft_salt,
    gumbel_argmax,
    gumbel_noise,
    noise_key,
    uniform,
)
from tandem.sampling.processors import SampleRows, apply_logits_processors, apply_min_p, apply_top_k_top_p
from tandem.sampling.state import SamplingState
from tests.stats import ALPHA, chisq_counts_pvalue, chisq_pvalue
from tests.helpers import hf_model, make_hf_model

# Every stream: a draft's salt per column (draft_salt) never meets another one's.
SALTS = (TARGET_SALT, DRAFT_SALT, RECOVER_SALT, ACCEPT_SALT, BLOCK_SALT, WATERMARK_SALT,
         *(draft_salt(c) for c in range(1, 16)))


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------- statistics
# ----------------------------------------------------------------------------- Gumbel-max
def _keys(n: int, mode: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if mode == "seeds":  # one position, many seeds (large, spread-out values)
        seeds = torch.randint(0, 2**62, (n,), generator=g)
        positions = torch.full((n,), 17, dtype=torch.int64)
    else:  # one seed, many consecutive positions
        seeds = torch.full((n,), 123456789, dtype=torch.int64)
        positions = torch.arange(n, dtype=torch.int64)
    return seeds, positions


@pytest.mark.parametrize("mode", ["seeds", "positions"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("vocab", [8, 13])
def test_gumbel_argmax_matches_softmax(temperature, vocab, mode):
    n = 40_000
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=g) * 1.5
    logits[3] = float("-inf")  # a masked token is never drawn
    scaled = (logits / temperature)[None].expand(n, vocab)
    seeds, positions = _keys(n, mode, seed=int(temperature * 10) + vocab)
    tokens = gumbel_argmax(scaled.contiguous(), seeds, positions, TARGET_SALT).numpy()
    probs = torch.softmax(logits.double() / temperature, -1).numpy()
    assert chisq_pvalue(tokens, probs) > ALPHA
    # Negative control: the same samples against a slightly wrong distribution.
    wrong = torch.softmax(logits.double() / (temperature * 1.15), -1).numpy()
    assert chisq_pvalue(tokens, wrong) < 1e-6


def test_gumbel_salts_and_positions_are_independent():
    """Draws of one key under two salts, or at adjacent positions, are independent."""
    n, vocab = 30_000, 6
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.3, -1.0, 0.2]]).expand(n, vocab).contiguous()
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(5))
    pos = torch.full((n,), 40, dtype=torch.int64)
    a = gumbel_argmax(logits, seeds, pos, TARGET_SALT).numpy()
    for b_tokens in (
        gumbel_argmax(logits, seeds, pos, DRAFT_SALT),
        gumbel_argmax(logits, seeds, pos, RECOVER_SALT),
        gumbel_argmax(logits, seeds, pos + 1, TARGET_SALT),
        gumbel_argmax(logits, seeds + 1, pos, TARGET_SALT),
    ):
        table = np.zeros((vocab, vocab))
        np.add.at(table, (a, b_tokens.numpy()), 1)
        assert stats.chi2_contingency(table).pvalue > ALPHA
    # Negative control: the same salt and key is perfectly dependent.
    same = gumbel_argmax(logits, seeds, pos, TARGET_SALT).numpy()
    table = np.zeros((vocab, vocab))
    np.add.at(table, (a, same), 1)
    assert stats.chi2_contingency(table).pvalue < 1e-12


def test_accept_uniform_is_uniform():
    """The accept test's uniforms (token 0 of the ACCEPT key) are U(0, 1): KS test."""
    seeds = torch.randint(0, 2**62, (20_000,), generator=torch.Generator().manual_seed(9))
    u = uniform(noise_key(seeds, torch.arange(20_000), ACCEPT_SALT), torch.zeros(20_000, dtype=torch.int64))
    assert stats.kstest(u.double().numpy(), "uniform").pvalue > ALPHA
    assert stats.kstest(u.double().numpy() ** 1.1, "uniform").pvalue < 1e-6  # control


# ----------------------------------------------------------------------------- noise keys
def test_noise_is_a_pure_function_of_the_key():
    g = torch.Generator().manual_seed(0)
    n, vocab = 64, 50
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=g)
    seeds[:4] = torch.tensor([0, 1, 2**32, 2**63 - 1])
    positions = torch.randint(0, 100_000, (n,), generator=g)
    for salt in SALTS:
        full = gumbel_noise(seeds, positions, salt, vocab)
        # Alone, in reverse order, and inside a bigger batch with other keys interleaved.
        for i in range(0, n, 7):
            alone = gumbel_noise(seeds[i : i + 1], positions[i : i + 1], salt, vocab)
            assert torch.equal(alone[0], full[i])
        perm = torch.randperm(n, generator=g)
        assert torch.equal(gumbel_noise(seeds[perm], positions[perm], salt, vocab), full[perm])
        others = torch.randint(0, 2**40, (n,), generator=g)
        mixed_s = torch.stack([seeds, others], 1).flatten()
        mixed_p = torch.stack([positions, positions + 3], 1).flatten()
        assert torch.equal(gumbel_noise(mixed_s, mixed_p, salt, vocab)[0::2], full)
        # Vocab size only appends columns: a token's noise does not depend on the vocab.
        assert torch.equal(gumbel_noise(seeds, positions, salt, vocab + 30)[:, :vocab], full)
        # The argmax follows the noise: one request alone vs the batch.
        logits = torch.randn(n, vocab, generator=g)
        tok = gumbel_argmax(logits, seeds, positions, salt)
        assert torch.equal(gumbel_argmax(logits[5:6], seeds[5:6], positions[5:6], salt), tok[5:6])


def test_noise_differs_across_salts_positions_seeds():
    seeds = torch.tensor([0, 1, 7, 2**32, 2**32 + 1, 2**62, 12345678901])
    vocab = 64
    for pos in (0, 1, 511, 2**20):
        positions = torch.full_like(seeds, pos)
        per_salt = [gumbel_noise(seeds, positions, s, vocab) for s in SALTS]
        for a in range(len(SALTS)):
            for b in range(a + 1, len(SALTS)):
                assert (per_salt[a] != per_salt[b]).float().mean() > 0.95
        # Different seeds (incl. ones differing only in the high 32 bits) differ.
        noise = per_salt[0]
        for i in range(len(seeds)):
            for j in range(i + 1, len(seeds)):
                assert (noise[i] != noise[j]).float().mean() > 0.95, (seeds[i], seeds[j])
    # Different positions for the same seed differ; keys over 10k positions are all distinct.
    s = torch.full((10_000,), 42, dtype=torch.int64)
    keys = noise_key(s, torch.arange(10_000), TARGET_SALT)
    assert keys.unique().numel() == 10_000
    assert ((keys >= 0) & (keys < 2**32)).all()


def test_uniforms_in_open_interval_and_distinct_small_vocab():
    keys = noise_key(torch.arange(256), torch.arange(256) * 3, TARGET_SALT)
    tokens = torch.arange(320)[None, :]
    u = uniform(keys[:, None], tokens)
    assert u.dtype == torch.float32
    assert ((u > 0) & (u < 1)).all()
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()
    # The 32-bit hash is a bijection in the token for a fixed key.
    for key in keys[:16]:
        h = _fmix32(key ^ _mul32(torch.arange(1 << 16), 0x27D4EB2D))
        assert h.unique().numel() == 1 << 16


def _key_for_uniform_one(token: int) -> int:
    """A key whose uniform for `token` has all 24 kept bits set (h >> 8 == 2**24 - 1)."""
    inv = lambda c: pow(c, -1, 1 << 32)  # noqa: E731

    def unfmix(h: int) -> int:
        def unshift(x: int, s: int) -> int:
            y = x
            for _ in range(32 // s + 1):
                y = x ^ (y >> s)
            return y & 0xFFFFFFFF

        h = unshift(h, 16)
        h = (h * inv(0xC2B2AE35)) & 0xFFFFFFFF
        h = unshift(h, 13)
        h = (h * inv(0x85EBCA6B)) & 0xFFFFFFFF
        return unshift(h, 16)

    return unfmix(0xFFFFFFFF) ^ ((token * 0x27D4EB2D) & 0xFFFFFFFF)


def test_uniform_never_reaches_one():
    token = 5
    key = _key_for_uniform_one(token)
    # Sanity check of the inverse hash: the key indeed maps token 5 to the top 24-bit value.
    h = _fmix32(torch.tensor([key]) ^ _mul32(torch.tensor([token]), 0x27D4EB2D))
    assert int(h) >> 8 == (1 << 24) - 1
    u = uniform(torch.tensor([key]), torch.tensor([token]))
    assert float(u) < 1.0


def test_masked_token_never_sampled_realistic_vocab():
    vocab, seed, pos, bad = 32_000, 308, 10, 16_804
    logits = torch.zeros(1, vocab)
    logits[0, bad] = float("-inf")
    tok = gumbel_argmax(logits, torch.tensor([seed]), torch.tensor([pos]), TARGET_SALT)
    assert int(tok) != bad


# ----------------------------------------------------------------------------- truncation masks
def _ref_top_k_top_p(row: np.ndarray, k: int, p: float) -> np.ndarray:
    """Reference on one float64 row: -> keep mask. Ties at the top-k cut are kept; top-p keeps
    the smallest sorted prefix whose (top-k renormalised) mass reaches p, plus ties of its last."""
    keep = np.isfinite(row)
    if 0 < k < row.size:
        kth = np.sort(row)[::-1][k - 1]
        keep &= row >= kth
    if p < 1:
        vals = np.sort(row[keep])[::-1]
        probs = np.exp(vals - vals.max())
        probs /= probs.sum()
        cum = np.cumsum(probs)
        n = int(np.searchsorted(cum, p, side="left")) + 1  # first prefix with mass >= p
        n = min(n, vals.size)
        keep &= row >= vals[n - 1]
    return keep


def _ref_top_p_ambiguous(row: np.ndarray, k: int, p: float) -> bool:
    """True when a prefix mass lies within float32 noise of p (either answer is defensible)."""
    if p >= 1:
        return False
    keep = _ref_top_k_top_p(row, k, 1.0)
    vals = np.sort(row[keep])[::-1]
    probs = np.exp(vals - vals.max())
    probs /= probs.sum()
    return bool(np.any(np.abs(np.cumsum(probs) - p) < 1e-5))


def _random_rows(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(n, vocab, generator=g) * 2
    # Quantised rows have ties (at the top-k cut and inside the top-p prefix).
    q = torch.rand(n, generator=g) < 0.4
    logits[q] = torch.round(logits[q] * 2) / 2
    # Some rows arrive partly masked already (as after min-p).
    masked = (torch.rand(n, vocab, generator=g) < 0.2) & (torch.rand(n, 1, generator=g) < 0.3)
    masked[:, 0] = False
    return logits.masked_fill(masked, float("-inf"))


@pytest.mark.parametrize("vocab", [5, 17, 64])
def test_top_k_top_p_mask_exact(vocab):
    g = torch.Generator().manual_seed(vocab)
    n = 400
    logits = _random_rows(n, vocab, g)
    top_k = torch.randint(0, vocab + 3, (n,), generator=g)  # includes 0 (off) and k > vocab
    top_k[torch.rand(n, generator=g) < 0.25] = 0
    top_p = torch.rand(n, generator=g).clamp(min=0.02)
    top_p[torch.rand(n, generator=g) < 0.25] = 1.0
    top_p[:3] = torch.tensor([1e-6, 0.999999, 1.0])
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    checked = 0
    for i in range(n):
        row = logits[i].double().numpy()
        k, p = int(top_k[i]), float(top_p[i])
        if _ref_top_p_ambiguous(row, k, p):
            continue
        keep = _ref_top_k_top_p(row, k, p)
        got = torch.isfinite(out[i]).numpy()
        assert (got == keep).all(), (i, k, p, row, got, keep)
        # Survivors keep their logits unchanged.
        assert torch.equal(out[i][torch.from_numpy(keep)], logits[i][torch.from_numpy(keep)])
        checked += 1
    assert checked >= n * 0.95
    # Both off: identity.
    same = apply_top_k_top_p(logits.clone(), torch.zeros(n, dtype=torch.int64), torch.ones(n))
    assert torch.equal(same, logits)


def test_top_p_one_keeps_every_token_in_a_mixed_batch():
    # A row without top-k / top-p, batched with one that uses them, runs through the same masks:
    # at a real vocabulary a fp32 running sum reaches 1 before the tail, which must not drop it.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 151_936, generator=g) * 3
    out = apply_top_k_top_p(logits.clone(), torch.tensor([0, 50]), torch.tensor([1.0, 0.9]))
    assert torch.equal(out[0], logits[0])
    assert int(torch.isfinite(out[1]).sum()) <= 50


def test_top_k_keeps_ties_at_the_cut():
    row = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(row.clone(), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, False, True, True, True, False]
    # With k=1 the single survivor has all the mass: any p keeps just it.
    out = apply_top_k_top_p(row.clone(), torch.tensor([1]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False, False, False]


def test_top_p_drops_the_tail_whose_mass_is_exactly_one_minus_p():
    """vLLM's rule: sorted ascending, a token goes when the mass at or below it is <= 1 - p, so with
    probabilities [0.25, 0.25, 0.5] (exact in binary) and p = 0.5 the 0.5 token alone is kept."""
    out = apply_top_k_top_p(torch.tensor([[0.25, 0.25, 0.5]]).log(), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [False, False, True]


def test_top_p_uses_top_k_renormalised_mass():
    # Probabilities ~ [0.4, 0.3, 0.2, 0.1]: without top-k, p=0.6 keeps 2 tokens; with k=2 the
    # renormalised mass is [0.571, 0.429], and p=0.6 still needs both; p=0.55 needs only one.
    row = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    keep = lambda k, p: torch.isfinite(apply_top_k_top_p(row.clone(), torch.tensor([k]), torch.tensor([p]))[0]).tolist()  # noqa: E731
    assert keep(0, 0.6) == [True, True, False, False]
    assert keep(2, 0.6) == [True, True, False, False]
    assert keep(2, 0.55) == [True, False, False, False]
    assert keep(0, 0.75) == [True, True, True, False]
    assert keep(3, 0.95) == [True, True, True, False]


@pytest.mark.parametrize("vocab", [7, 40])
def test_min_p_mask_exact(vocab):
    g = torch.Generator().manual_seed(100 + vocab)
    n = 300
    logits = _random_rows(n, vocab, g)
    min_p = torch.rand(n, generator=g)
    min_p[torch.rand(n, generator=g) < 0.25] = 0.0
    min_p[:2] = torch.tensor([1.0, 0.0])
    out = apply_min_p(logits.clone(), min_p)
    checked = 0
    for i in range(n):
        row = logits[i].double().numpy()
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        thresh = float(min_p[i]) * probs.max()
        if np.any(np.abs(probs - thresh) < 1e-6 * max(thresh, 1e-30)) and min_p[i] not in (0.0, 1.0):
            continue
        keep = (probs >= thresh) & np.isfinite(row)
        got = torch.isfinite(out[i]).numpy()
        assert (got == keep).all(), (i, float(min_p[i]), row)
        checked += 1
    assert checked >= n * 0.95
    # min_p = 1 keeps exactly the tied maxima; min_p = 0 keeps all finite tokens.
    assert torch.equal(torch.isfinite(out[0]), logits[0] == logits[0].max())
    assert torch.equal(torch.isfinite(out[1]), torch.isfinite(logits[1]))


# ----------------------------------------------------------------------------- penalties and bias
def _state_with(reqs: list[tuple[int, list[int], int, SamplingParams]], vocab: int) -> SamplingState:
    state = SamplingState(8, vocab, (1,), torch.device("cpu"))
    for slot, token_ids, num_prompt, params in reqs:
        state.add(NewReq(req_id=slot, slot=slot, token_ids=token_ids, num_prompt_tokens=num_prompt,
                         params=params, seed=slot))
    return state


def _ref_processors(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                    num_outputs: int, eos=(1,)) -> torch.Tensor:
    x = logits.double().clone()
    vocab = x.numel()
    for t, b in (params.logit_bias or {}).items():
        if 0 <= t < vocab:
            x[t] += b
    if num_outputs < params.min_tokens:
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        for t in stop:
            if t < vocab:
                x[t] = float("-inf")
    if params.has_penalties:
        counts = np.bincount(output, minlength=vocab)
        for t in range(vocab):
            if t in prompt or counts[t] > 0:
                x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
            x[t] -= params.frequency_penalty * counts[t]
            x[t] -= params.presence_penalty * (counts[t] > 0)
    return x


def test_penalties_and_logit_bias_against_reference():
    vocab = 24
    g = torch.Generator().manual_seed(3)
    cases = [
        # slot, prompt, output so far, params
        (0, [2, 3, 3, 5], [7, 7, 7, 3, 9], SamplingParams(repetition_penalty=1.7, max_tokens=50)),
        (1, [4, 11], [11, 12, 12, 0], SamplingParams(frequency_penalty=0.8, max_tokens=50)),
        (2, [6], [6, 6, 8], SamplingParams(presence_penalty=-1.3, max_tokens=50)),
        (3, [2, 9, 9], [9, 10, 10, 10, 20], SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.5,
                                                           presence_penalty=1.1, max_tokens=50)),
        (4, [1, 2, 3], [4], SamplingParams(logit_bias={0: 5.0, 3: -7.5, 23: 2.0, 99: 1.0}, max_tokens=50)),
        (5, [5, 5], [2, 1, 2], SamplingParams(logit_bias={2: -3.0}, repetition_penalty=1.3,
                                              frequency_penalty=0.4, min_tokens=6, max_tokens=50)),
        (6, [7], [], SamplingParams(max_tokens=50)),  # nothing to do
    ]
    state = _state_with([(s, pr + out, len(pr), p) for s, pr, out, p in cases], vocab)
    n = len(cases)
    logits = torch.randn(n, vocab, generator=g) * 3
    rows = SampleRows(slots=[c[0] for c in cases], slot_ids=torch.arange(n), positions=torch.zeros(n, dtype=torch.int64),
                      num_outputs=[len(c[2]) for c in cases])
    got = logits.clone()
    apply_logits_processors(got, state, rows)
    for i, (slot, prompt, output, params) in enumerate(cases):
        ref = _ref_processors(logits[i], params, prompt, output, len(output))
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-5, msg=f"slot {slot}")

    # After more outputs are recorded (-1 = no token), counts follow.
    more = {0: [7, 3], 1: [11], 3: [20, 20]}
    emitted = torch.full((n, 2), -1, dtype=torch.int64)
    for slot, toks in more.items():
        emitted[slot, : len(toks)] = torch.tensor(toks)
    state.record_outputs(rows.slots, emitted)
    got = logits.clone()
    apply_logits_processors(got, state, rows)
    for i, (slot, prompt, output, params) in enumerate(cases):
        ref = _ref_processors(logits[i], params, prompt, output + more.get(slot, []), len(output))
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-5, msg=f"slot {slot}")

    # Earlier drafts of the same request count as outputs (rows verifying later drafts).
    prior = torch.full((n, 3), -1, dtype=torch.int64)
    prior[0, :2] = torch.tensor([7, 15])
    prior[3, :3] = torch.tensor([9, 9, 2])
    rows.prior_drafts = prior
    got = logits.clone()
    apply_logits_processors(got, state, rows)
    for i, (slot, prompt, output, params) in enumerate(cases):
        extra = [t for t in prior[i].tolist() if t >= 0] if params.has_penalties else []
        ref = _ref_processors(logits[i], params, prompt, output + more.get(slot, []) + extra, len(output))
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-5, msg=f"slot {slot}")


def test_min_tokens_masks_stop_tokens_until_reached():
    vocab = 10
    p = SamplingParams(min_tokens=3, stop_token_ids=[4, 7], max_tokens=10)
    state = _state_with([(0, [2, 3], 2, p)], vocab)
    logits = torch.zeros(2, vocab)
    rows = SampleRows(slots=[0, 0], slot_ids=torch.zeros(2, dtype=torch.int64),
                      positions=torch.zeros(2, dtype=torch.int64), num_outputs=[2, 3])
    apply_logits_processors(logits, state, rows)
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [1, 4, 7]
    assert torch.isfinite(logits[1]).all()


# ----------------------------------------------------------------------------- end to end
def _ref_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    row = (logits.double() / temperature).numpy()
    keep = np.isfinite(row)
    if min_p > 0:
        pr = np.exp(row - row.max())
        keep &= pr >= min_p * pr.max()
    row = np.where(keep, row, -np.inf)
    keep = _ref_top_k_top_p(row, top_k, top_p)
    probs = np.where(keep, np.exp(row - row[keep].max()), 0.0)
    return probs / probs.sum()


E2E_CONFIGS = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=1.5),
    dict(temperature=1.0, top_k=6),
    dict(temperature=1.2, top_p=0.7),
    dict(temperature=0.8, top_k=10, top_p=0.9),
    dict(temperature=1.0, min_p=0.1),
]


def test_first_token_matches_transformers_softmax(tmp_path):
    vocab = 40
    path = make_hf_model(tmp_path / "m", "qwen2", vocab_size=vocab, tokenizer=False, init_std=0.5, seed=4)
    prompts = [[5, 9, 3], [2, 30, 31, 17, 8, 8, 20, 11, 6]]
    with torch.no_grad():
        hf = hf_model(path)
        ref_logits = [hf(torch.tensor([p])).logits[0, -1] for p in prompts]
    n = 2000
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=8, max_num_seqs=512)
    reqs, params = [], []
    for c, cfg in enumerate(E2E_CONFIGS):  # prompts alternate between configs
        for s in range(n):
            reqs.append({"prompt_token_ids": prompts[c % 2]})
            params.append(SamplingParams(seed=c * 100_003 + s, max_tokens=1, ignore_eos=True, **cfg))
    outs = llm.generate(reqs, params, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids[0] for o in outs]).reshape(len(E2E_CONFIGS), n)
    for c, cfg in enumerate(E2E_CONFIGS):
        logits = ref_logits[c % 2]
        probs = _ref_probs(logits, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
        assert 0.05 < probs.max() < 0.95, "logits should be neither flat nor one-hot"
        assert (probs > 0).sum() >= 3
        pv = chisq_pvalue(tokens[c], probs)
        assert pv > ALPHA, (cfg, pv)
        # Negative control: the untruncated, differently tempered distribution is rejected.
        wrong = _ref_probs(logits, cfg["temperature"] * 1.3, 0, 1.0)
        assert chisq_counts_pvalue(np.bincount(tokens[c], minlength=vocab), wrong) < 1e-4, cfg


@pytest.mark.parametrize("num_top", [0, 3])
def test_logprobs_in_row_chunks_equal_the_whole_batch(num_top):
    """compute_logprobs goes CHUNK_ROWS rows at a time (bounding its [rows, V] temporaries): the
    same values as one pass over all rows, -1 tokens (past a rejection) included."""
    from tandem.sampling.processors import CHUNK_ROWS
    from tandem.sampling.sampler import _logprobs, compute_logprobs

    g = torch.Generator().manual_seed(3)
    n = 2 * CHUNK_ROWS + 17
    processed = torch.randn(n, 50, generator=g)
    processed[::7, :10] = float("-inf")
    tokens = torch.randint(0, 50, (n,), generator=g)
    tokens[::5] = -1
    for got, want in zip(compute_logprobs(processed, tokens, num_top), _logprobs(processed, tokens, num_top)):
        assert got.shape == want.shape and torch.equal(got, want)


def test_logprob_rank_counts_ties_before_the_token():
    """The sampled token's rank is the number of tokens at least as likely (vLLM's rule): tied
    tokens, frequent in bf16 logits, all rank as the last of their tie."""
    from tandem.sampling.sampler import compute_logprobs

    processed = torch.tensor([[4.0, 2.0, 2.0, 2.0, 1.0], [4.0, 2.0, 2.0, 2.0, 1.0]])
    _, rank, _, _ = compute_logprobs(processed, torch.tensor([2, 0]), 0)
    assert rank.tolist() == [4, 1]


def test_bad_word_windows_slide_over_emitted_tokens_only():
    """A verification's rows past its first rejection hold -1 (nothing emitted): the bad-word window
    keeps the tokens emitted before them, so a word whose first token ended the round still bites."""
    state = SamplingState(2, 20, (1,), torch.device("cpu"))
    params = SamplingParams(max_tokens=50, bad_words_token_ids=[[4, 7, 9]])
    state.add(NewReq(req_id=0, slot=1, token_ids=[1, 2], num_prompt_tokens=2, params=params, seed=0))
    state.record_outputs([1], torch.tensor([[3, 4, 7, -1, -1]]))
    assert state.recent[1].tolist() == [4, 7]
    state.record_outputs([1], torch.tensor([[5, -1]]))
    assert state.recent[1].tolist() == [7, 5]


def test_penalties_over_more_rows_than_a_chunk():
    """Penalties go CHUNK_ROWS rows at a time: a batch of 2.5 chunks (rows of 60 requests with
    different penalties, several rows per request as in a verification, some without
    penalties) matches the reference row by row."""
    from tandem.sampling.processors import CHUNK_ROWS

    vocab, num_slots = 30, 60
    g = torch.Generator().manual_seed(5)
    state = SamplingState(num_slots, vocab, (1,), torch.device("cpu"))
    cases = {}
    for slot in range(num_slots):
        prompt = torch.randint(0, vocab, (3,), generator=g).tolist()
        output = torch.randint(0, vocab, (slot % 5,), generator=g).tolist()
        params = SamplingParams(max_tokens=50) if slot % 4 == 0 else SamplingParams(
            repetition_penalty=1.0 + slot / 50, frequency_penalty=slot / 100, presence_penalty=-slot / 80, max_tokens=50)
        state.add(NewReq(req_id=slot, slot=slot, token_ids=prompt + output, num_prompt_tokens=3, params=params, seed=slot))
        cases[slot] = (prompt, output, params)
    slots = [i % num_slots for i in range(5 * CHUNK_ROWS // 2)]
    n = len(slots)
    logits = torch.randn(n, vocab, generator=g) * 3
    rows = SampleRows(slots=slots, slot_ids=torch.tensor(slots), positions=torch.zeros(n, dtype=torch.int64),
                      num_outputs=[len(cases[s][1]) for s in slots])
    got = logits.clone()
    apply_logits_processors(got, state, rows)
    for i, slot in enumerate(slots):
        prompt, output, params = cases[slot]
        ref = _ref_processors(logits[i], params, prompt, output, len(output))
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-5, msg=f"row {i}")

"""The rejection sampler alone: exactness against p, the plain reference, greedy rows, bonus
rows sharing the plain sampler's noise, and synthetic acceptance rates.

Convention: p is the TARGET distribution, q the DRAFT distribution. Every test is seeded and
deterministic; goodness-of-fit thresholds are p > 1e-3 with negative controls for power.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.plan import NewReq
from tandem.sampling.gumbel import (
    ACCEPT_SALT,
    DRAFT_SALT,
    RECOVER_SALT,
    TARGET_SALT,
    gumbel_argmax,
    gumbel_from_keys,
    noise_key,
    uniform,
)
from tandem.sampling.processors import SampleRows
from tandem.sampling.sampler import sample
from tandem.sampling.state import SamplingState
from tandem.sampling_params import SamplingParams
from tandem.spec.rejection import rejection_sample, rejection_sample_ref
from tests.stats import ALPHA, chisq_pvalue

NEG_INF = float("-inf")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------- batch builder
class Group:
    """N requests sharing target rows p [k+1, V] and draft rows q [k, V] (logits, temperature
    already applied), each with its own seed and start position. Drafts are drawn from q with
    the DRAFT salt, as the speculator does, unless given."""

    def __init__(self, p, q, n, seed, *, greedy=False, drafts=None, one_hot_q=False):
        self.p, self.q, self.n = p, q, n
        self.k = p.shape[0] - 1
        g = torch.Generator().manual_seed(seed)
        self.seeds = torch.randint(0, 2**62, (n,), generator=g)
        self.pos0 = torch.randint(1, 4000, (n,), generator=g)
        self.greedy = greedy
        self.one_hot_q = one_hot_q
        if drafts is None:
            drafts = torch.stack(
                [gumbel_argmax(q[j].expand(n, -1).contiguous(), self.seeds, self.pos0 + j, DRAFT_SALT)
                 for j in range(self.k)], 1) if self.k else torch.zeros(n, 0, dtype=torch.int64)
        self.drafts = drafts  # [n, k]


def run(groups, synthetic_rates=None, q_none=False, sampler=rejection_sample):
    """Call sampler (rejection_sample's arguments) over every group in one batch; -> per group
    (tokens [n, k+1], num_emitted [n])."""
    p_l, q_l, draft, bonus, greedy, seeds, pos, req, idx = ([] for _ in range(9))
    base = 0
    for gr in groups:
        k1, n, vocab = gr.k + 1, gr.n, gr.p.shape[1]
        j = torch.arange(k1).repeat(n)
        p_l.append(gr.p.repeat(n, 1))
        qb = torch.cat([gr.q, torch.randn(1, vocab)]) if gr.q is not None else torch.zeros(k1, vocab)
        q_l.append(qb.repeat(n, 1))
        draft.append(torch.cat([gr.drafts, torch.full((n, 1), -1)], 1).flatten())
        bonus.append(j == gr.k)
        greedy.append(torch.full((n * k1,), gr.greedy))
        seeds.append(gr.seeds.repeat_interleave(k1))
        pos.append(gr.pos0.repeat_interleave(k1) + j)
        req.append(torch.arange(n).repeat_interleave(k1) + base)
        idx.append(j)
        base += n
    greedy_t = torch.cat(greedy)
    sampled = (~greedy_t).nonzero().flatten()
    row_tokens, num_emitted = sampler(
        torch.cat(p_l), torch.cat(draft), torch.cat(bonus), greedy_t,
        sampled if sampled.numel() else None,
        None if q_none else torch.cat(q_l),
        torch.cat(seeds), torch.cat(pos), torch.cat(req), torch.cat(idx), base, synthetic_rates,
    )
    out, r0, q0 = [], 0, 0
    for gr in groups:
        k1 = gr.k + 1
        out.append((row_tokens[r0 : r0 + gr.n * k1].view(gr.n, k1), num_emitted[q0 : q0 + gr.n]))
        r0 += gr.n * k1
        q0 += gr.n
    return out


def random_pq(k, vocab, seed, p_scale=1.5, q_noise=1.0, mask=True):
    """Target rows p [k+1, V] and correlated draft rows q [k, V] (partial acceptance)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(k + 1, vocab, generator=g) * p_scale
    q = p[:k] + torch.randn(k, vocab, generator=g) * q_noise
    if mask:  # a token the target masks but the draft proposes, and one the draft masks
        p[:, 0] = NEG_INF
        q[:, 1] = NEG_INF
    return p, q


def check_against_ref(gr, tokens, emitted, limit=300, one_hot=False):
    """Each request against rejection_sample_ref with the same uniforms and Gumbel noise; with
    one_hot (greedy drafts, q_logits None), against the coupled test: every row emits the target's
    own draw (TARGET salt at its position), and a draft stands iff it equals that draw."""
    p = gr.p.softmax(-1)
    if one_hot:
        for i in range(min(gr.n, limit)):
            pos = gr.pos0[i] + torch.arange(gr.k + 1)
            draws = gumbel_argmax(gr.p, gr.seeds[i].expand(gr.k + 1), pos, TARGET_SALT)
            num_acc = next((j for j in range(gr.k) if int(gr.drafts[i, j]) != int(draws[j])), gr.k)
            assert int(emitted[i]) == num_acc + 1, i
            assert tokens[i, : num_acc + 1].tolist() == draws[: num_acc + 1].tolist(), i
        return
    for i in range(min(gr.n, limit)):
        drafts = gr.drafts[i]
        q = torch.nn.functional.one_hot(drafts, p.shape[1]).float() if one_hot else gr.q.softmax(-1)
        pos = gr.pos0[i] + torch.arange(gr.k + 1)
        s = gr.seeds[i].expand(gr.k + 1)
        u = uniform(noise_key(s, pos, ACCEPT_SALT), torch.zeros_like(s))[: gr.k]
        keys = noise_key(s, pos, RECOVER_SALT)
        keys[gr.k] = noise_key(s[-1:], pos[-1:], TARGET_SALT)[0]
        gumbel = gumbel_from_keys(keys, p.shape[1])
        num_acc, final = rejection_sample_ref(p, q, drafts, u, gumbel)
        assert int(emitted[i]) == num_acc + 1, i
        assert tokens[i, :num_acc].tolist() == drafts[:num_acc].tolist(), i
        assert int(tokens[i, num_acc]) == final, i


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", [1, 2, 3])
def test_emitted_tokens_distributed_as_p(k):
    vocab, n = 10, 6000
    p, q = random_pq(k, vocab, seed=k)
    gr = Group(p, q, n, seed=100 + k)
    (tokens, emitted), = run([gr])
    assert ((emitted >= 1) & (emitted <= k + 1)).all()
    probs = p.double().softmax(-1).numpy()
    # The first emitted token ~ p[0]; the token at row j, when the run reaches it, ~ p[j]
    # (rows here do not depend on the prefix, so reaching row j says nothing about it).
    for j in range(k + 1):
        reached = emitted > j
        assert reached.sum() > 300, (j, int(reached.sum()))
        pv = chisq_pvalue(tokens[reached, j].numpy(), probs[j])
        assert pv > ALPHA, (j, pv)
    # Both paths are exercised.
    assert 0.2 < (emitted > 1).float().mean() < 0.9
    # Negative controls at the same sample size: the drafts are q-distributed, not p.
    assert chisq_pvalue_nozero(gr.drafts[:, 0].numpy(), probs[0]) < 1e-6
    # ... and a verifier that gets q's temperature wrong (q_logits * 2) is caught.
    wrong = Group(p, q, n, seed=100 + k, drafts=gr.drafts)
    wrong.q = q * 2
    (wtok, _), = run([wrong])
    assert chisq_pvalue(wtok[:, 0].numpy(), probs[0]) < 1e-4
    check_against_ref(gr, tokens, emitted)


def chisq_pvalue_nozero(samples, probs) -> float:
    """chisq_pvalue, but samples in zero-probability bins just count against the fit."""
    probs = np.asarray(probs, dtype=np.float64) + 1e-9
    return chisq_pvalue(samples, probs)


@pytest.mark.parametrize("k", [1, 3])
def test_one_hot_q_greedy_drafts(k):
    """q_logits=None: drafts verified as one-hot q by the coupled test, accepted with probability
    p(x), every emitted token the target's own seeded draw."""
    vocab, n = 9, 6000
    p, q = random_pq(k, vocab, seed=20 + k, mask=False)
    p[:, 2] = NEG_INF
    fixed = q.argmax(-1)
    fixed[0] = 2  # a draft the target forbids: always rejected
    groups = [
        Group(p, None, n, seed=30 + k, drafts=q.argmax(-1).expand(n, -1).clone()),  # deterministic drafts
        Group(p, None, n, seed=31 + k, drafts=fixed.expand(n, -1).clone()),
        # One-hot verification is valid for any draft independent of the accept noise, e.g.
        # drafts drawn from a q it never sees.
        Group(p, None, n, seed=32 + k, drafts=Group(p, q, n, seed=32 + k).drafts),
    ]
    results = run(groups, q_none=True)
    probs = p.double().softmax(-1).numpy()
    for gi, (gr, (tokens, emitted)) in enumerate(zip(groups, results)):
        assert ((emitted >= 1) & (emitted <= k + 1)).all()
        for j in range(k + 1):
            reached = emitted > j
            if reached.sum() < 300:
                continue
            pv = chisq_pvalue(tokens[reached, j].numpy(), probs[j])
            assert pv > ALPHA, (gi, j, pv)
        check_against_ref(gr, tokens, emitted, limit=200, one_hot=True)
    # Forbidden draft: never accepted, and the recovered token is never the draft.
    tokens, emitted = results[1]
    assert (emitted == 1).all() and (tokens[:, 0] != 2).all()
    # Acceptance of the first deterministic draft x is Bernoulli(p(x)).
    tokens, emitted = results[0]
    x = int(q[0].argmax())
    acc = (emitted > 1).double().mean().item()
    px = probs[0, x]
    assert abs(acc - px) < 4 * np.sqrt(px * (1 - px) / n) + 1e-9


def test_greedy_rows_accept_iff_argmax():
    vocab, k, n = 12, 3, 2000
    g = torch.Generator().manual_seed(7)
    p = torch.randn(k + 1, vocab, generator=g)
    q = torch.randn(k, vocab, generator=g)
    amax = p.argmax(-1)
    # Each draft equals the target argmax with probability 0.6, else another token.
    hit = torch.rand(n, k, generator=g) < 0.6
    other = (amax[:k] + torch.randint(1, vocab, (n, k), generator=g)) % vocab
    drafts = torch.where(hit, amax[:k].expand(n, -1), other)
    greedy = Group(p, q, n, seed=8, greedy=True, drafts=drafts)
    sampled = Group(*random_pq(k, vocab, seed=9), 500, seed=10)  # mixed batch
    for q_none in (False, True):
        (tokens, emitted), (stok, semit) = run([greedy, sampled], q_none=q_none)
        num_acc = torch.where(hit.all(1), k, (~hit).int().argmax(1))
        assert torch.equal(emitted, num_acc + 1)
        for i in range(n):
            a = int(num_acc[i])
            assert tokens[i, :a].tolist() == drafts[i, :a].tolist()
            assert int(tokens[i, a]) == int(amax[a])  # argmax at the mismatch, or the bonus argmax
        if not q_none:
            check_against_ref(sampled, stok, semit, limit=100)
    # All-greedy batch (sampled_idx None).
    (tokens, emitted), = run([greedy])
    assert torch.equal(emitted, num_acc + 1)


def test_bonus_row_uses_plain_sample_noise():
    """When every draft is accepted (q == p), the bonus token is exactly what the plain sampler
    draws at that position; with no drafts the result is the plain sampler's token."""
    vocab, n = 16, 64
    g = torch.Generator().manual_seed(11)
    for k in (0, 1, 3):
        p = torch.randn(k + 1, vocab, generator=g) * 2
        p[:, 5] = NEG_INF
        gr = Group(p, p[:k].clone(), n, seed=12 + k)
        (tokens, emitted), = run([gr])
        assert (emitted == k + 1).all()
        assert torch.equal(tokens[:, :k], gr.drafts)
        last = p[k].expand(n, -1).contiguous()
        pos = gr.pos0 + k
        expect = gumbel_argmax(last, gr.seeds, pos, TARGET_SALT)
        assert torch.equal(tokens[:, k], expect)
        # The same through the engine's sampler with a SamplingState (seeds live per slot).
        state = SamplingState(n, vocab, (1,), torch.device("cpu"))
        for i in range(n):
            state.add(NewReq(req_id=i, slot=i, token_ids=[0], num_prompt_tokens=1,
                             params=SamplingParams(temperature=1.0), seed=int(gr.seeds[i])))
        rows = SampleRows(slots=list(range(n)), slot_ids=torch.arange(n), positions=pos, num_outputs=[k] * n)
        assert torch.equal(sample(last, state, rows), tokens[:, k])


def test_masked_draft_never_accepted_probabilistic():
    """A draft the target masks (p(x) = 0) is always rejected; a token the draft masks can still
    be emitted via the residual."""
    vocab, k, n = 8, 1, 4000
    p = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(1))
    p[:, 3] = NEG_INF
    q = torch.full((k, vocab), NEG_INF)
    q[0, 3] = 0.0  # draft always proposes 3
    q[0, 4] = 0.0
    gr = Group(p, q, n, seed=5)
    (tokens, emitted), = run([gr])
    is3 = gr.drafts[:, 0] == 3
    assert is3.any() and (~is3).any()
    assert (emitted[is3] == 1).all()
    assert (tokens[:, 0] != 3).all()
    pv = chisq_pvalue(tokens[:, 0].numpy(), p[0].double().softmax(-1).numpy())
    assert pv > ALPHA


def test_a_residual_without_mass_emits_the_targets_token():
    """Where the residual has no mass (p allows only the token a rejection rules out, as top_k = 1 or a
    grammar's forced token makes it), the row emits p's one token, never a token p forbids: in
    synthetic mode (the draft rejected by its rate) and with a probabilistic draft that q gave no mass."""
    vocab = 8
    p = torch.full((2, vocab), NEG_INF)
    p[:, 5] = 0.0  # the target allows token 5 alone
    args = dict(row_is_bonus=torch.tensor([False, True]), row_greedy=torch.tensor([False, False]),
                sampled_idx=torch.tensor([0, 1]), seeds=torch.tensor([7, 7]), positions=torch.tensor([10, 11]),
                row_req=torch.tensor([0, 0]), row_index=torch.tensor([0, 1]), num_reqs=1)
    tokens, emitted = rejection_sample(p, row_draft=torch.tensor([5, -1]), q_logits=None,
                                       synthetic_rates=torch.tensor([0.0]), **args)
    assert tokens[: int(emitted[0])].tolist() == [5]
    tokens, emitted = rejection_sample(p, row_draft=torch.tensor([3, -1]), q_logits=p.clone(), **args)
    assert tokens[: int(emitted[0])].tolist() == [5]


# ----------------------------------------------------------------------------- synthetic mode
def test_synthetic_conditional_rates():
    vocab, k, n = 10, 3, 20_000
    rates = torch.tensor([0.8, 0.5, 0.25])
    p, q = random_pq(k, vocab, seed=40)
    sampled = Group(p, q, n, seed=41)
    greedy = Group(p, q, 4000, seed=42, greedy=True)
    results = run([sampled, greedy], synthetic_rates=rates)
    for gr, (tokens, emitted) in zip((sampled, greedy), results):
        assert ((emitted >= 1) & (emitted <= k + 1)).all()
        for j in range(k):
            reached = int((emitted > j).sum())
            accepted = int((emitted > j + 1).sum())
            c = float(rates[j])
            assert reached > 100
            rate = accepted / reached
            assert abs(rate - c) <= 4 * np.sqrt(c * (1 - c) / reached), (j, rate, c, reached)
        # Accepted drafts are emitted as is; the stop token is the residual / bonus draw.
        psm = gr.p.softmax(-1)
        for i in range(300):
            a = int(emitted[i]) - 1
            assert tokens[i, :a].tolist() == gr.drafts[i, :a].tolist()
            if gr.greedy:
                assert int(tokens[i, a]) == int(gr.p[a].argmax())
                continue
            pos = gr.pos0[i : i + 1] + a
            if a == k:
                expect = gumbel_argmax(gr.p[a][None], gr.seeds[i : i + 1], pos, TARGET_SALT)
            else:
                residual = (psm[a] - gr.q[a].softmax(-1)).clamp(min=0)
                keys = noise_key(gr.seeds[i : i + 1], pos, RECOVER_SALT)
                expect = (residual.log()[None] + gumbel_from_keys(keys, vocab)).argmax(-1)
            assert int(tokens[i, a]) == int(expect), i
    # Rates of 1 and 0 are exact.
    (tokens, emitted), = run([Group(p, q, 500, seed=43)], synthetic_rates=torch.tensor([1.0, 1.0, 0.0]))
    assert (emitted == 3).all()

"""Block verification (rejection_sample_method="block"): the vectorised sampler against the paper's
algorithm written out, its output distribution, and that it accepts at least as many drafts as the
one-at-a-time test on the same drafts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.sampling.gumbel import BLOCK_SALT, RECOVER_SALT, TARGET_SALT, gumbel_argmax, gumbel_from_keys, noise_key, \
    uniform
from tandem.spec.rejection import block_rejection_sample, block_verify_ref, rejection_sample
from tests.spec.test_rejection import Group, random_pq, run
from tests.stats import ALPHA, chisq_counts_pvalue, chisq_pvalue

@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def _run(sampler, groups, q_none=False):
    """test_rejection.run with another sampler."""
    return run(groups, q_none=q_none, sampler=sampler)


@pytest.mark.parametrize("one_hot", [False, True])
def test_block_matches_the_papers_algorithm(one_hot):
    """Every request of a batch (three groups, k = 1, 3, 5: requests of different lengths side by
    side) against block_verify_ref with the same uniforms and Gumbel noise."""
    groups = []
    for k, seed in ((1, 1), (3, 2), (5, 3)):
        p, q = random_pq(k, 12, seed=seed, q_noise=0.7, mask=not one_hot)
        gr = Group(p, q, 300, seed=40 + seed)
        if one_hot:
            gr.q = None
        groups.append(gr)
    for gr, (tokens, emitted) in zip(groups, _run(block_rejection_sample, groups, q_none=one_hot)):
        p = gr.p.softmax(-1)
        accepted = []
        for i in range(gr.n):
            drafts = gr.drafts[i]
            q = torch.nn.functional.one_hot(drafts, p.shape[1]).float() if one_hot else gr.q.softmax(-1)
            s = gr.seeds[i].expand(gr.k + 1)
            pos = gr.pos0[i] + torch.arange(gr.k + 1)
            eta = uniform(noise_key(s[:1], gr.pos0[i : i + 1], BLOCK_SALT), torch.arange(1, gr.k + 1))
            keys = noise_key(s, pos, RECOVER_SALT)
            keys[gr.k] = noise_key(s[-1:], pos[-1:], TARGET_SALT)[0]
            tau, final = block_verify_ref(p, q, drafts, eta, gumbel_from_keys(keys, p.shape[1]))
            assert int(emitted[i]) == tau + 1, i
            assert tokens[i, :tau].tolist() == drafts[:tau].tolist() and int(tokens[i, tau]) == final, i
            accepted.append(tau)
        assert 0 < np.mean(accepted) < gr.k  # both kinds of outcome


@pytest.mark.parametrize("one_hot", [False, True])
def test_block_output_is_distributed_as_p(one_hot):
    """Rows that do not depend on the prefix (position j's target distribution is p[j] whatever
    came before): a verified block, continued by fresh draws from p past it (what later rounds
    would do), is distributed as the product of p[j], jointly over the first two positions and
    position by position. Negative control: the same test catches a residual that leaves out the
    running ratio P_tau."""
    k, vocab, n = 3, 8, 8000
    p, q = random_pq(k, vocab, seed=11, q_noise=0.8)
    gr = Group(p, q, n, seed=12)
    if one_hot:
        gr.q = None
    probs = p.double().softmax(-1).numpy()

    def full_sequences(sampler):
        (tokens, emitted), = _run(sampler, [gr], q_none=one_hot)
        g = torch.Generator().manual_seed(99)
        fresh = torch.stack([torch.multinomial(p[j].softmax(-1), n, replacement=True, generator=g)
                             for j in range(k + 1)], 1)  # [n, k + 1]
        reached = torch.arange(k + 1)[None, :] < emitted[:, None]
        return torch.where(reached, tokens, fresh).numpy()

    seq = full_sequences(block_rejection_sample)
    for j in range(k + 1):
        assert chisq_pvalue(seq[:, j], probs[j]) > ALPHA, j
    pair = np.bincount(seq[:, 0] * vocab + seq[:, 1], minlength=vocab * vocab)
    assert chisq_counts_pvalue(pair, np.outer(probs[0], probs[1]).ravel()) > ALPHA

    import tandem.spec.rejection as rej

    real = rej.uniform

    def broken(*args, **kwargs):  # every block accepted: the drafts' own (q) distribution
        u = real(*args, **kwargs)
        return torch.zeros_like(u) if args and args[0].shape == gr.seeds.repeat_interleave(k + 1).shape else u

    rej.uniform = broken
    try:
        bad = full_sequences(block_rejection_sample)
    finally:
        rej.uniform = real
    assert min(chisq_pvalue(bad[:, j], probs[j] + 1e-9) for j in range(k)) < 1e-4


def test_drafts_the_target_forbids_end_the_block():
    """Drafts p forbids (p(x) = 0), where q gives them nothing either (a grammar's forced token, the
    draft another): none is accepted, and the block emits p's only token after them."""
    vocab = 8
    p = torch.full((3, vocab), float("-inf"))
    p[:, 5] = 0.0
    tokens, emitted = block_rejection_sample(
        p, torch.tensor([3, 3, -1]), torch.tensor([False, False, True]), torch.tensor([False] * 3),
        torch.tensor([0, 1, 2]), p.clone(), torch.tensor([7] * 3), torch.tensor([10, 11, 12]),
        torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), 1)
    assert tokens[: int(emitted[0])].tolist() == [5]


def test_block_accepts_at_least_as_many_drafts():
    """The same drafts, verified one at a time and as a block: with sampled drafts the block keeps
    more of them on average (Sun et al.: it is the optimal verifier among those that keep the
    target's distribution); with one-hot drafts (greedy drafting) both keep a draft prefix with
    probability the product of its p(x), which no valid verifier can beat: no gain, no loss."""
    for one_hot in (False, True):
        k, n = 4, 20000
        p, q = random_pq(k, 16, seed=5, q_noise=0.9, mask=False)
        gr = Group(p, q, n, seed=6)
        if one_hot:
            gr.q = None
        (_, standard), = _run(rejection_sample, [gr], q_none=one_hot)
        (_, block), = _run(block_rejection_sample, [gr], q_none=one_hot)
        gain = (block.double().mean() - standard.double().mean()).item()
        spread = (standard.double().std() / n ** 0.5).item()
        if one_hot:
            assert abs(gain) < 4 * spread, (gain, spread)
        else:
            assert gain > 0.1 and gain > 5 * spread, (gain, spread)


def test_greedy_requests_keep_the_exact_match_rule():
    k, n = 3, 500
    p, q = random_pq(k, 10, seed=8, mask=False)
    amax = p.argmax(-1)
    drafts = amax[:k].expand(n, -1).clone()
    drafts[n // 2 :, 1] = (amax[1] + 1) % 10  # half of them miss at the second draft
    gr = Group(p, q, n, seed=9, greedy=True, drafts=drafts)
    (tokens, emitted), = _run(block_rejection_sample, [gr])
    assert (emitted[: n // 2] == k + 1).all() and (emitted[n // 2 :] == 2).all()
    assert (tokens[: n // 2] == amax).all() and (tokens[n // 2 :, 1] == amax[1]).all()


def test_the_uniforms_are_fresh_every_round():
    """A row's uniform is keyed by (seed, the round's first position, the row): the same position
    verified in two rounds that start at different places reads two independent uniforms."""
    seeds = torch.tensor([7, 7])
    a = uniform(noise_key(seeds, torch.tensor([100, 101]), BLOCK_SALT), torch.tensor([2, 1]))  # position 102 twice
    assert a[0] != a[1]
    tokens = gumbel_argmax(torch.zeros(2, 50), seeds, torch.tensor([3, 3]), TARGET_SALT)
    assert tokens[0] == tokens[1]  # (the token draws stay keyed by position, as in the standard test)

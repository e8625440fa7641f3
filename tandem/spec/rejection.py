"""RejectionSampler: verify k drafts per request against the target distribution p.

Convention: p is the TARGET's processed distribution, q the DRAFT's.

Draft x_i (verified at row i-1 of its request) is accepted with probability min(1, p(x)/q(x)):
accept iff u_i * q(x) < p(x), with u_i a uniform keyed by (seed, position, ACCEPT salt). At the
first rejection a "recovered" token is drawn from norm(max(0, p - q)) (RECOVER salt); if all
drafts survive, a "bonus" token is drawn from p at the last row (TARGET salt, the same key a
non-speculative step would use). Requests at temperature 0 accept exactly when x equals the
target argmax and emit the argmax at the first mismatch. Output per request: accepted drafts +
1 token; the emitted sequence is distributed exactly as p.

Greedy drafts (one-hot q) are verified by coupling instead: every row draws the target's token
as a non-speculative step would (Gumbel-max over p, TARGET salt, keyed by the row's position),
x is accepted iff it equals that draw, and the first mismatch emits the draw. That accepts x
with probability p(x) and draws the rest from p without x, as the test above would, but the
tokens are exactly the ones the target alone emits with the request's seed: speculation (and a
preemption, which drops the pending drafts) leaves a seeded request's output unchanged.

Synthetic mode (benchmarks only, not lossless): accept draft i iff u_i < c_i, the configured
conditional rate; the token emitted after the run is drawn as above.

Block verification (`block_rejection_sample`, rejection_sample_method="block"; Sun et al. 2024,
arXiv 2403.10444) judges the drafts as a block instead of one at a time: with the running
ratio P_0 = 1, P_i = min(1, P_(i-1) p(x_i) / q(x_i)) and the residual mass one row on,
rho_i = sum_x max(P_i p_i(x) - q_i(x), 0), draft block i is kept at threshold h_i = rho_i /
(rho_i + 1 - P_i) (h = P at the bonus row) and tau = the last i whose uniform eta_i <= h_i
(0 if none) drafts are accepted; the token after them is drawn from max(P_tau p_tau - q_tau, 0)
(RECOVER salt), or from p at the bonus row (TARGET salt). It emits the target's distribution too
and accepts at least as many drafts in expectation. Unlike the one-at-a-time test, its outcome
reads the uniforms of rows past tau, which the next round verifies again: keyed by (seed,
position) as vLLM keys them, those rows' uniforms would be conditioned on this round's outcome
(eta > h), so here each is keyed by (seed, the round's first position, the row): a fresh
uniform every round, and the output stays exactly the target's across rounds.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.sampling.gumbel import (ACCEPT_SALT, BLOCK_SALT, RECOVER_SALT, TARGET_SALT, gumbel_from_keys, noise_key,
                                   uniform)


def rejection_sample(
    p_logits: Tensor,
    row_draft: Tensor,
    row_is_bonus: Tensor,
    row_greedy: Tensor,
    sampled_idx: Tensor | None,
    q_logits: Tensor | None,
    seeds: Tensor,
    positions: Tensor,
    row_req: Tensor,
    row_index: Tensor,
    num_reqs: int,
    synthetic_rates: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Vectorised over the rows of every request in the step.

    p_logits [num_rows, V] fp32: target processed logits (temperature applied; -inf masked).
    row_draft [num_rows] int64: the draft this row verifies (ignored on bonus rows).
    row_is_bonus [num_rows] bool: the request's last row (no draft to verify).
    row_greedy [num_rows] bool: the request runs at temperature 0.
    sampled_idx [m] int64 or None: the rows with temperature > 0 (known on the host).
    q_logits [num_rows, V] fp32 or None: draft logits after temperature (None: greedy drafts, q one-hot).
    seeds, positions [num_rows] int64: noise keys (position of the token the row generates).
    row_req [num_rows] int64: request index in [0, num_reqs); row_index [num_rows]: j within it.
    synthetic_rates [k] fp32 or None: conditional acceptance rates (synthetic mode).
    Returns row_tokens [num_rows] int64 (the token emitted at each row, if the run reaches it)
    and num_emitted [num_reqs] int64 (accepted + 1).
    """
    vocab = p_logits.shape[-1]
    p = p_logits.softmax(dim=-1)  # [num_rows, V]
    draft = row_draft.clamp(min=0, max=vocab - 1)
    p_x = p.gather(1, draft[:, None])[:, 0]
    if q_logits is None:
        q = None
        q_x = torch.ones_like(p_x)
    else:
        q = q_logits.softmax(dim=-1)
        q_x = q.gather(1, draft[:, None])[:, 0]
    u = uniform(noise_key(seeds, positions, ACCEPT_SALT), torch.zeros_like(seeds))
    target_argmax = p_logits.argmax(dim=-1)
    coupled = q is None and synthetic_rates is None  # greedy drafts: the draw decides (module docstring)

    # Token to emit if the run stops at this row.
    stop_token = target_argmax.clone()
    if sampled_idx is not None:
        idx = sampled_idx
        bonus = row_is_bonus[idx]
        if coupled:
            scores, keys = p_logits[idx], noise_key(seeds[idx], positions[idx], TARGET_SALT)
        else:
            if q is None:
                residual = p[idx].scatter(1, draft[idx][:, None], 0.0)
            else:
                residual = (p[idx] - q[idx]).clamp(min=0)
            # Bonus rows draw from p exactly as a non-speculative step would (same logits, same
            # key); rejection rows draw from the residual with their own salt.
            scores = torch.where(bonus[:, None], p_logits[idx], residual.log())
            keys = torch.where(
                bonus,
                noise_key(seeds[idx], positions[idx], TARGET_SALT),
                noise_key(seeds[idx], positions[idx], RECOVER_SALT),
            )
        drawn = (scores + gumbel_from_keys(keys, vocab)).argmax(dim=-1)
        if not coupled:  # an all-zero residual (p == q) follows no rejection that p and q drew: p's argmax
            drawn = torch.where(~bonus & (residual.sum(-1) <= 0), target_argmax[idx], drawn)
        stop_token[idx] = drawn

    if synthetic_rates is not None:
        accept = u < synthetic_rates[row_index.clamp(max=synthetic_rates.shape[0] - 1)]
    elif coupled:  # a sampled row's stop token is the target's draw; a greedy row's, its argmax
        accept = draft == stop_token
    else:
        accept = torch.where(row_greedy, draft == target_argmax, u * q_x < p_x)
    accept = accept & ~row_is_bonus & (row_draft >= 0)

    # num_accepted per request = leading accepted rows.
    first_reject = torch.full((num_reqs,), 1 << 30, dtype=torch.int64, device=p.device)
    first_reject.scatter_reduce_(0, row_req, torch.where(accept, 1 << 30, row_index), "amin")
    num_accepted = first_reject  # every request has a bonus row, which is never "accepted"
    row_tokens = torch.where(row_index < num_accepted[row_req], row_draft, stop_token)
    return row_tokens, num_accepted + 1


def block_rejection_sample(
    p_logits: Tensor,
    row_draft: Tensor,
    row_is_bonus: Tensor,
    row_greedy: Tensor,
    sampled_idx: Tensor | None,
    q_logits: Tensor | None,
    seeds: Tensor,
    positions: Tensor,
    row_req: Tensor,
    row_index: Tensor,
    num_reqs: int,
    synthetic_rates: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Block verification (module docstring): rejection_sample's arguments and results. A request's
    rows are contiguous and in order (row_index 0, 1, ...), as every step lays them out. Requests
    at temperature 0 keep the exact-match rule."""
    if synthetic_rates is not None:
        raise ValueError("block verification does not take synthetic acceptance rates")
    vocab = p_logits.shape[-1]
    p = p_logits.softmax(dim=-1)  # [num_rows, V]
    draft = row_draft.clamp(min=0, max=vocab - 1)
    is_draft = ~row_is_bonus & (row_draft >= 0)
    p_x = p.gather(1, draft[:, None])[:, 0]
    q = q_logits.softmax(dim=-1) if q_logits is not None else None
    q_x = q.gather(1, draft[:, None])[:, 0] if q is not None else torch.ones_like(p_x)
    # log P_i, the running ratio over the drafts before row i (P_0 = 1): the walk S_i of log ratios
    # clipped at 0 from above is S_i - max_(m <= i) S_m. Float64; a log ratio kept within +-200
    # (P = e^-200 is 0 to every later test) keeps the sums finite; each request's walk is lifted by
    # 1e6 per request so one cumulative max over all rows never crosses a request.
    ratio = (p_x.double().clamp(min=1e-300).log() - q_x.double().clamp(min=1e-300).log()).clamp(-200.0, 200.0)
    ratio = torch.where(p_x > 0, ratio, -200.0)  # a draft p forbids ends every block, whatever q says of it
    ratio = torch.where(is_draft, ratio, 0.0)  # [num_rows]: row i's draft's log ratio
    walk = ratio.cumsum(0) - ratio  # sum over the rows before, across requests
    first = torch.zeros(num_reqs, dtype=walk.dtype, device=walk.device).scatter_reduce(
        0, row_req, torch.where(row_index == 0, walk, 0.0), "sum")  # [num_reqs]: the walk at each first row
    walk = walk - first[row_req]  # S_i within the request (S_0 = 0)
    lift = row_req.double() * 1e6
    log_ratio = walk - ((walk + lift).cummax(0).values - lift)  # log P_i <= 0
    ratio_p = log_ratio.exp()  # [num_rows] P_i (float64)
    if q is None:  # one-hot q at the row's draft: rho = P (1 - p(x))
        rho = ratio_p * (1 - p_x.double())
    else:
        rho = (ratio_p[:, None].float() * p - q).clamp(min=0).sum(-1).double()
    denom = rho + 1 - ratio_p
    h = torch.where(row_is_bonus, ratio_p, torch.where(denom > 0, rho / denom.clamp(min=1e-300), 1.0))
    eta = block_uniforms(seeds, positions, row_index).double()
    kept = (row_index >= 1) & (eta <= h)  # eta_i <= h_i: the first i drafts may stand
    tau = torch.zeros(num_reqs, dtype=torch.int64, device=p.device).scatter_reduce(
        0, row_req, torch.where(kept, row_index, 0), "amax")  # [num_reqs]
    # Requests at temperature 0: the drafts that equal the target's argmax, up to the first that does not.
    target_argmax = p_logits.argmax(dim=-1)
    miss = torch.where(is_draft & (draft == target_argmax), 1 << 30, row_index)
    leading = torch.full((num_reqs,), 1 << 30, dtype=torch.int64, device=p.device).scatter_reduce(
        0, row_req, miss, "amin")
    req_greedy = torch.zeros(num_reqs, dtype=torch.int64, device=p.device).scatter_reduce(
        0, row_req, row_greedy.long(), "amax").bool()
    num_accepted = torch.where(req_greedy, leading, tau)

    stop_token = target_argmax.clone()  # the token a row emits if the block stops there
    if sampled_idx is not None:
        idx = sampled_idx
        bonus = row_is_bonus[idx]
        scaled = ratio_p[idx].float()[:, None] * p[idx]
        if q is None:
            residual = scaled.scatter(1, draft[idx][:, None], 0.0)
        else:
            residual = (scaled - q[idx]).clamp(min=0)
        scores = torch.where(bonus[:, None], p_logits[idx], residual.log())
        keys = torch.where(bonus, noise_key(seeds[idx], positions[idx], TARGET_SALT),
                           noise_key(seeds[idx], positions[idx], RECOVER_SALT))
        drawn = (scores + gumbel_from_keys(keys, vocab)).argmax(dim=-1)
        empty = ~bonus & (residual.sum(-1) <= 0)  # (only where the block cannot stop): p's argmax, as rejection_sample
        stop_token[idx] = torch.where(empty, target_argmax[idx], drawn)
    row_tokens = torch.where(row_index < num_accepted[row_req], row_draft, stop_token)
    return row_tokens, num_accepted + 1


def block_uniforms(seeds: Tensor, positions: Tensor, row_index: Tensor) -> Tensor:
    """Block verification's uniform of each row [num_rows] fp32, keyed by (seed, the position of
    its round's first row, the row): fresh every round (module docstring)."""
    return uniform(noise_key(seeds, positions - row_index, BLOCK_SALT), row_index)


def block_verify_ref(p: Tensor, q: Tensor, draft: Tensor, eta: Tensor, gumbel: Tensor) -> tuple[int, int]:
    """Block verification as the paper writes it, one request, for tests. p [k+1, V] target probs,
    q [k, V] draft probs, draft [k], eta [k] (eta[i - 1] is eta_i), gumbel [k+1, V].
    -> (num_accepted, the token after them)."""
    k = draft.shape[0]
    ratios, tau = [1.0], 0
    for i in range(1, k + 1):
        x = int(draft[i - 1])
        ratios.append(min(1.0, ratios[-1] * float(p[i - 1, x]) / float(q[i - 1, x])))
        if i < k:
            rho = float((ratios[i] * p[i] - q[i]).clamp(min=0).sum())
            h = rho / (rho + 1 - ratios[i]) if rho + 1 - ratios[i] > 0 else 1.0
        else:
            h = ratios[k]
        if float(eta[i - 1]) <= h:
            tau = i
    if tau == k:
        return k, int((p[k].log() + gumbel[k]).argmax())
    residual = (ratios[tau] * p[tau] - q[tau]).clamp(min=0)
    return tau, int((residual.log() + gumbel[tau]).argmax())


def force_target_tokens(
    row_tokens: Tensor,
    num_emitted: Tensor,
    forced: Tensor,
    row_draft: Tensor,
    row_req: Tensor,
    row_index: Tensor,
    num_reqs: int,
) -> tuple[Tensor, Tensor]:
    """Verify by exact match the requests whose target draw is a function of the prefix (the
    watermark's keyed draw): a draft is accepted iff it equals the target's draw at its row,
    and the first mismatch (at the latest the bonus row) emits the target's draw, so the output
    is exactly what the target alone would emit.

    forced [num_rows] int64: the target's draw at each row of such a request, -1 elsewhere (a
    request's rows are all forced or none). row_tokens / num_emitted are rejection_sample's
    results, returned with the forced requests' entries replaced.
    """
    is_forced = forced >= 0
    mismatch = is_forced & (row_draft != forced)  # a bonus row's draft is -1: always a mismatch
    big = torch.full((num_reqs,), 1 << 30, dtype=torch.int64, device=forced.device)
    first = big.scatter_reduce(0, row_req, torch.where(mismatch, row_index, 1 << 30), "amin")  # [num_reqs]
    req_forced = torch.zeros(num_reqs, dtype=torch.int64, device=forced.device).scatter_reduce(
        0, row_req, is_forced.long(), "amax").bool()  # (no boolean indexing: it would wait for the device)
    row_tokens = torch.where(is_forced, torch.where(row_index < first[row_req], row_draft, forced), row_tokens)
    return row_tokens, torch.where(req_forced, first + 1, num_emitted)


def rejection_sample_ref(p: Tensor, q: Tensor, draft: Tensor, u: Tensor, gumbel: Tensor) -> tuple[int, int]:
    """Plain single-request reference for tests. p [k+1, V] target probs, q [k, V] draft probs,
    draft [k] tokens, u [k] uniforms, gumbel [k+1, V] noise. -> (num_accepted, final token)."""
    k = draft.shape[0]
    for i in range(k):
        x = int(draft[i])
        if float(u[i]) * float(q[i, x]) < float(p[i, x]):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        return i, int((residual.log() + gumbel[i]).argmax())
    return k, int((p[k].log() + gumbel[k]).argmax())

"""RejectionSampler: verify k drafts per request against the target distribution p.

Convention: p is the TARGET's processed distribution, q the DRAFT's.

Draft x_i (verified at row i-1 of its request) is accepted with probability min(1, p(x)/q(x)):
accept iff u_i * q(x) < p(x), with u_i a uniform keyed by (seed, position, ACCEPT salt). At the
first rejection a "recovered" token is drawn from norm(max(0, p - q)) (RECOVER salt); if all
drafts survive, a "bonus" token is drawn from p at the last row (TARGET salt, the same key a
non-speculative step would use). Greedy drafts have one-hot q, so x is accepted with
probability p(x) and the residual is p with x removed. Requests at temperature 0 accept
exactly when x equals the target argmax and emit the argmax at the first mismatch. Output per
request: accepted drafts + 1 token; the emitted sequence is distributed exactly as p.

Synthetic mode (benchmarks only, not lossless): accept draft i iff u_i < c_i, the configured
conditional rate; the token emitted after the run is drawn as above.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.sampling.gumbel import ACCEPT_SALT, RECOVER_SALT, TARGET_SALT, gumbel_from_keys, noise_key, uniform


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
    if synthetic_rates is not None:
        accept = u < synthetic_rates[row_index.clamp(max=synthetic_rates.shape[0] - 1)]
    else:
        accept = torch.where(row_greedy, draft == target_argmax, u * q_x < p_x)
    accept = accept & ~row_is_bonus & (row_draft >= 0)

    # Token to emit if the run stops at this row.
    stop_token = target_argmax.clone()
    if sampled_idx is not None:
        idx = sampled_idx
        bonus = row_is_bonus[idx]
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
        salt_noise = gumbel_from_keys(keys, vocab)
        # An all-zero residual (p == q exactly) can only follow an acceptance; any token will do.
        stop_token[idx] = (scores + salt_noise).argmax(dim=-1)

    # num_accepted per request = leading accepted rows.
    first_reject = torch.full((num_reqs,), 1 << 30, dtype=torch.int64, device=p.device)
    first_reject.scatter_reduce_(0, row_req, torch.where(accept, 1 << 30, row_index), "amin")
    num_accepted = first_reject  # every request has a bonus row, which is never "accepted"
    row_tokens = torch.where(row_index < num_accepted[row_req], row_draft, stop_token)
    return row_tokens, num_accepted + 1


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

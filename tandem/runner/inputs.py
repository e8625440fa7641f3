"""Build one step's model inputs from a StepPlan: ids, positions, attention metadata, logits rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.layers.backend import AttnBackend
from tandem.plan import PENDING_TOKEN, StepPlan
from tandem.sampling.processors import SampleRows


@dataclass(slots=True)
class Batch:
    """A flat batch of mixed prefill chunks, decode tokens and verification runs."""

    input_ids: Tensor  # [num_tokens] int64 (draft positions filled on device)
    positions: Tensor  # [num_tokens] int64
    attn: object  # AttnMetadata (CPU reference) or TableAttnMetadata (CUDA)
    logits_indices: Tensor  # [num_rows] int64, token rows whose logits are needed
    rows: SampleRows  # who each logits row belongs to
    sampling: list[int]  # indices into plan.reqs of requests that sample this step
    cu_num_rows: list[int]  # [len(sampling) + 1] prefix sums of rows per sampling request (1 + drafts)
    row_draft_index: Tensor  # [num_rows] int64, j for the row after the request's j-th draft
    draft_dst: Tensor | None  # [num_draft_tokens] int64 token rows that take a pending draft
    draft_src: Tensor | None  # [num_draft_tokens, 2] int64 (slot, draft index) of each
    pending_dst: Tensor | None  # [num_pending] int64 token rows fed the slot's last sampled token
    pending_slots: Tensor | None  # [num_pending] int64 the slot of each
    # prompt_logprobs: token rows whose logits give a prompt token's logprobs, and those tokens
    prompt_rows: Tensor | None = None  # [num_prompt_rows] int64
    prompt_targets: Tensor | None = None  # [num_prompt_rows] int64
    prompt_reqs: list[int] | None = None  # indices into plan.reqs of the requests they belong to, in order


def build_batch(plan: StepPlan, backend: AttnBackend) -> Batch:
    ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    row_slots: list[int] = []
    row_positions: list[int] = []
    row_num_outputs: list[int] = []
    row_draft_index: list[int] = []
    draft_dst: list[int] = []
    draft_src: list[tuple[int, int]] = []
    pending_dst: list[int] = []
    pending_slots: list[int] = []
    sampling: list[int] = []
    cu_num_rows = [0]
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_reqs: list[int] = []
    for i, r in enumerate(plan.reqs):
        base = len(ids)
        if r.prompt_logprob_targets:
            prompt_rows.extend(range(base, base + len(r.prompt_logprob_targets)))
            prompt_targets.extend(r.prompt_logprob_targets)
            prompt_reqs.append(i)
        if r.input_token_ids[0] == PENDING_TOKEN:  # planned ahead: the token is on the device
            pending_dst.append(base)
            pending_slots.append(r.slot)
        num_in, num_drafts, slot, start = len(r.input_token_ids), r.num_drafts, r.slot, r.start_pos
        ids.extend(r.input_token_ids)
        positions.extend(range(start, start + num_in + num_drafts))
        if num_drafts:
            ids.extend([0] * num_drafts)
            draft_dst.extend(range(base + num_in, base + num_in + num_drafts))
            draft_src.extend((slot, j) for j in range(num_drafts))
        if not r.sample:
            continue
        last = base + num_in - 1
        if not num_drafts:  # (a decode: one row)
            logits_indices.append(last)
            row_slots.append(slot)
            row_positions.append(start + num_in)  # position generated
            row_num_outputs.append(r.num_output_tokens)
            row_draft_index.append(0)
        else:
            for j in range(num_drafts + 1):
                logits_indices.append(last + j)
                row_slots.append(slot)
                row_positions.append(start + num_in + j)
                row_num_outputs.append(r.num_output_tokens + j)
                row_draft_index.append(j)
        sampling.append(i)
        cu_num_rows.append(len(logits_indices))

    attn = backend.prefill(
        [r.start_pos for r in plan.reqs],
        [r.num_new_tokens for r in plan.reqs],
        [r.block_ids for r in plan.reqs],
        slots=[r.slot for r in plan.reqs],
    )
    flat_src = [v for pair in draft_src for v in pair]
    (ids_t, pos_t, logits_t, slots_t, row_pos_t, draft_idx_t, dst_t, src_t, pend_dst_t, pend_slots_t, prompt_rows_t,
     prompt_targets_t) = backend.upload(
        ids, positions, logits_indices, row_slots, row_positions, row_draft_index, draft_dst, flat_src, pending_dst,
        pending_slots, prompt_rows, prompt_targets,
    )
    rows = SampleRows(slots=row_slots, slot_ids=slots_t, positions=row_pos_t, num_outputs=row_num_outputs)
    return Batch(
        input_ids=ids_t,
        positions=pos_t,
        attn=attn,
        logits_indices=logits_t,
        rows=rows,
        sampling=sampling,
        cu_num_rows=cu_num_rows,
        row_draft_index=draft_idx_t,
        draft_dst=dst_t if draft_dst else None,
        draft_src=src_t.view(-1, 2) if draft_src else None,
        pending_dst=pend_dst_t if pending_dst else None,
        pending_slots=pend_slots_t if pending_dst else None,
        prompt_rows=prompt_rows_t if prompt_rows else None,
        prompt_targets=prompt_targets_t if prompt_rows else None,
        prompt_reqs=prompt_reqs or None,
    )


def row_prior_drafts(batch: Batch, drafts: Tensor) -> Tensor:
    """[num_rows, k] the drafts preceding each logits row within its request (-1 padded).

    drafts [max_num_seqs, k] int64 is the speculator's per-slot draft buffer.
    """
    k = drafts.shape[1]
    cols = torch.arange(k, device=drafts.device)[None, :]
    prior = drafts[batch.rows.slot_ids]  # [num_rows, k]
    return torch.where(cols < batch.row_draft_index[:, None], prior, -1)

"""Watermark detection: does a token sequence carry the keyed draws of tandem.sampling.watermark?

Each scored token x_t, after its context c_t (the context_width tokens before it), contributes
-log(1 - u(key, c_t, x_t)). For text the key did not draw, u is uniform, so each term is
Exp(1) and their sum over n tokens is Gamma(n, 1); the p-value is that sum's upper tail. A
watermarked token was the argmax of l_v / T + g_v, which favours large u, so the sum grows with
every token the model had a real choice about (low-entropy, near-forced tokens add little).
A context the generation had drawn after before (deduplicate_contexts "single_turn" or "all",
within its last deduplicate_contexts_max_history contexts) was drawn without the key, so it is
not scored, exactly as the generation decided; under "none" a repeated (context, token) pair,
whose u repeats, is scored once. The scored terms stay independent and the p-value exact. Needs
only the token ids and the key (and the generating engine's other watermark settings).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.engine import as_token_ids
from tandem.errors import RequestError
from tandem.sampling.watermark import WatermarkConfig, keyed_uniform, parse_watermark_config, sequence_contexts

DEFAULT_P_VALUE_THRESHOLD = 0.01  # vLLM's detector default


@dataclass(frozen=True)
class WatermarkDetection:
    num_tokens: int  # tokens scored (those drawn with the key, as far as their contexts are known)
    score: float  # sum of -log(1 - u) over them
    p_value: float  # P(score >= this | the text was not drawn with the key); 1.0 when nothing was scored
    watermarked: bool  # p_value < the threshold


def detect_watermark(
    token_ids: list[int],
    watermark_config: WatermarkConfig | dict,
    prompt_token_ids: list[int] | None = None,
    p_value_threshold: float = DEFAULT_P_VALUE_THRESHOLD,
) -> WatermarkDetection:
    """Score generated token_ids against the key of watermark_config (as given to LLM(...)).

    prompt_token_ids: the tokens before the output, when known; they give the first
    context_width tokens their contexts. Without them those tokens are not scored.
    """
    cfg = parse_watermark_config(watermark_config)
    if cfg is None:
        raise RequestError("watermark_config is required: the key the text would have been drawn with")
    token_ids = as_token_ids(token_ids, "token_ids")  # (numpy's arrays and integers too, as generate takes them)
    prompt_token_ids = None if prompt_token_ids is None else as_token_ids(prompt_token_ids)
    for name, ids in (("token_ids", token_ids), ("prompt_token_ids", prompt_token_ids or [])):
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise RequestError(f"{name} must be a list of token ids (integers >= 0)")
    if not 0 < p_value_threshold < 1:
        raise RequestError(f"p_value_threshold={p_value_threshold!r} must be in (0, 1)")
    w = cfg.context_width
    contexts = [tuple(c) for c in sequence_contexts(list(prompt_token_ids or []) + list(token_ids), w).tolist()]
    num_prompt = len(prompt_token_ids or [])
    drawn_after: dict[tuple, int] = {}  # context -> its latest entry in the generation's history
    entries = 0
    if cfg.deduplicate_contexts == "all":
        for c in contexts[:num_prompt]:
            drawn_after[c] = entries
            entries += 1
    history = cfg.deduplicate_contexts_max_history
    scored_pairs: set[tuple] = set()
    keep_ctx, keep_tok = [], []
    for i, token in enumerate(token_ids):
        c = contexts[num_prompt + i]
        known = prompt_token_ids is not None or i >= w  # else the context reaches into an unknown prompt
        if cfg.deduplicate_contexts == "none":
            fresh = (c, token) not in scored_pairs
            scored_pairs.add((c, token))
        else:
            last = drawn_after.get(c)
            fresh = last is None or (history is not None and last < entries - history)
            drawn_after[c] = entries
            entries += 1
        if known and fresh:
            keep_ctx.append(c)
            keep_tok.append(token)
    n = len(keep_tok)
    if n == 0:
        return WatermarkDetection(0, 0.0, 1.0, False)
    u = keyed_uniform(cfg.key, torch.tensor(keep_ctx, dtype=torch.int64), torch.tensor(keep_tok)).double()
    score = float(-torch.log1p(-u).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(float(n), dtype=torch.float64),
                                            torch.tensor(score, dtype=torch.float64)))
    return WatermarkDetection(num_tokens=n, score=score, p_value=p_value, watermarked=p_value < p_value_threshold)

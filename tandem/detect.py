"""Watermark detection: does a token sequence carry the keyed draws of tandem.sampling.watermark?

Each scored token x_t, after its context c_t (the context_width tokens before it), contributes
-log(1 - u(key, c_t, x_t)). For text the key did not draw, u is uniform, so each term is
Exp(1) and their sum over n tokens is Gamma(n, 1); the p-value is that sum's upper tail. A
watermarked token was the argmax of l_v / T + g_v, which favours large u, so the sum grows with
every token the model had a real choice about (low-entropy, near-forced tokens add little).
A repeated (context, token) pair repeats its u, so only its first occurrence is scored: the
terms stay independent and the p-value exact. Needs only the token ids and the key.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import RequestError
from tandem.sampling.watermark import WatermarkConfig, keyed_uniform, parse_watermark_config

DEFAULT_P_VALUE_THRESHOLD = 0.01  # vLLM's detector default


@dataclass(frozen=True)
class WatermarkDetection:
    num_tokens: int  # tokens scored (first occurrences of a (context, token) pair with a known context)
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
    for name, ids in (("token_ids", token_ids), ("prompt_token_ids", prompt_token_ids or [])):
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise RequestError(f"{name} must be a list of token ids (integers >= 0)")
    if not 0 < p_value_threshold < 1:
        raise RequestError(f"p_value_threshold={p_value_threshold!r} must be in (0, 1)")
    w = cfg.context_width
    if prompt_token_ids is None:
        seq = list(token_ids)  # the first w tokens' contexts reach into an unknown prompt: not scored
    else:
        seq = ([-1] * w + list(prompt_token_ids))[-w:] + list(token_ids)  # -1: before the start, as generated
    if len(seq) <= w:
        return WatermarkDetection(0, 0.0, 1.0, False)
    t = torch.tensor(seq, dtype=torch.int64)
    contexts = t.unfold(0, w, 1)[: len(seq) - w]  # [m, w]: contexts[i] precedes seq[i + w]
    targets = t[w:]
    pairs = torch.cat([contexts, targets[:, None]], dim=1)  # [m, w + 1]
    _, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    first_seen = torch.full((int(inverse.max()) + 1,), len(pairs), dtype=torch.int64)
    first_seen.scatter_reduce_(0, inverse, torch.arange(len(pairs)), "amin")
    keep = first_seen[inverse] == torch.arange(len(pairs))  # [m] the pair's first occurrence
    u = keyed_uniform(cfg.key, contexts[keep], targets[keep]).double()
    score = float(-torch.log1p(-u).sum())
    n = int(keep.sum())
    p_value = float(torch.special.gammaincc(torch.tensor(float(n), dtype=torch.float64),
                                            torch.tensor(score, dtype=torch.float64)))
    return WatermarkDetection(num_tokens=n, score=score, p_value=p_value, watermarked=p_value < p_value_threshold)

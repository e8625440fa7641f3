"""The keyed (watermark) draw and its detector, without a model."""
import numpy as np
import pytest
import torch
from scipy import stats as sps

from tandem.detect import detect_watermark
from tandem.errors import ConfigError, RequestError
from tandem.sampling.gumbel import gumbel_argmax
from tandem.sampling.watermark import (
    WATERMARK_SALT, WatermarkConfig, context_hash, keyed_uniform, last_window, parse_watermark_config,
)
from tandem.sampling_params import SamplingParams
from tests.stats import ALPHA, chisq_pvalue


def row_keys(key, contexts):
    """The (seeds, positions) pair a keyed draw passes to gumbel_argmax with WATERMARK_SALT."""
    hashes = context_hash(contexts)
    return torch.full_like(hashes, key), hashes


def test_config_parsing_and_errors():
    assert parse_watermark_config(None) is None
    cfg = parse_watermark_config({"key": 42})
    assert cfg == WatermarkConfig(key=42, context_width=4, algorithm="gumbel", deduplicate_contexts="single_turn",
                                  deduplicate_contexts_max_history=8192)  # vLLM's defaults
    assert parse_watermark_config(cfg) == cfg
    assert "42" not in repr(cfg)  # the secret stays out of logs
    for bad, field in [({}, "key is required"), ({"key": -1}, "key"), ({"key": 2**63}, "key"), ({"key": True}, "key"),
                       ({"key": 1, "context_width": 0}, "context_width"), ({"key": 1, "context_width": 65}, "context_width"),
                       ({"key": 1, "algorithm": "kgw"}, "algorithm"), ({"key": 1, "prf": "hmac"}, "prf"), ("42", "dict"),
                       ({"key": 1, "deduplicate_contexts": "yes"}, "deduplicate_contexts"),
                       ({"key": 1, "deduplicate_contexts_max_history": 8}, "max_history")]:
        with pytest.raises(ConfigError, match=field):
            parse_watermark_config(bad)
    with pytest.raises(RequestError, match="watermarking"):
        SamplingParams(watermarking=1)


def test_context_hash_depends_on_every_token_and_its_order():
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 150_000, (2000, 4), generator=g)
    h = context_hash(ctx)
    assert h.dtype == torch.int64 and int(h.min()) >= 0 and int(h.max()) < 2**32
    assert torch.equal(h, context_hash(ctx.clone()))
    for j in range(4):  # changing any one token changes the hash
        changed = ctx.clone()
        changed[:, j] += 1
        assert (context_hash(changed) != h).all()
    swapped = ctx[:, [1, 0, 2, 3]]
    differ = ctx[:, 0] != ctx[:, 1]
    assert (context_hash(swapped)[differ] != h[differ]).all()
    # -1 (before the sequence's start) is a token like any other
    assert context_hash(torch.tensor([[-1, -1, 5, 6]])) != context_hash(torch.tensor([[0, 0, 5, 6]]))


def test_last_window_matches_a_list_reference():
    g = torch.Generator().manual_seed(1)
    n, w, m = 50, 4, 6
    head = torch.randint(-1, 100, (n, w), generator=g)
    tail = torch.randint(0, 100, (n, m), generator=g)
    num = torch.randint(0, m + 1, (n,), generator=g)
    out = last_window(head, tail, num, w)
    for i in range(n):
        want = (head[i].tolist() + tail[i, : num[i]].tolist())[-w:]
        assert out[i].tolist() == want


def test_keyed_draw_is_distributed_as_softmax_over_keys():
    """For a fixed context the keyed draw is deterministic; over keys it is softmax(l / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    n = 20_000
    contexts = torch.tensor([[3, 1, 4, 1]]).expand(n, 4)
    draws = []
    for key in range(4):  # keys x contexts: independent noise vectors
        seeds, hashes = row_keys(key, contexts + torch.arange(n)[:, None] * (key + 1))
        draws.append(gumbel_argmax(logits.expand(n, -1).clone(), seeds, hashes, WATERMARK_SALT))
    draws = torch.cat(draws)
    assert chisq_pvalue(draws.numpy(), logits.softmax(-1).numpy()) > ALPHA
    seeds, hashes = row_keys(7, contexts[:5])
    again = gumbel_argmax(logits.expand(5, -1).clone(), seeds, hashes, WATERMARK_SALT)
    assert torch.unique(again).numel() == 1  # one context, one key: one token


def _random_walk_draws(key, n, vocab, w, seed, watermark=True):
    """A toy 'model' whose next-token logits are random: tokens drawn with the key (or not)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (w,), generator=g).tolist()
    prompt = list(seq)
    for _ in range(n):
        logits = torch.randn(vocab, generator=g) * 2
        if watermark:
            seeds, hashes = row_keys(key, torch.tensor([seq[-w:]]))
            tok = int(gumbel_argmax(logits[None], seeds, hashes, WATERMARK_SALT)[0])
        else:
            tok = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        seq.append(tok)
    return prompt, seq[w:]


def test_detector_finds_the_key_and_only_the_key():
    prompt, out = _random_walk_draws(key=1234, n=200, vocab=500, w=4, seed=0)
    found = detect_watermark(out, {"key": 1234}, prompt_token_ids=prompt)
    assert found.watermarked and found.p_value < 1e-12 and found.num_tokens == 200
    assert found.score > 2 * found.num_tokens
    without_prompt = detect_watermark(out, {"key": 1234})
    assert without_prompt.num_tokens == 196 and without_prompt.watermarked
    other = detect_watermark(out, {"key": 1235}, prompt_token_ids=prompt)
    assert not other.watermarked
    wider = detect_watermark(out, {"key": 1234, "context_width": 5}, prompt_token_ids=prompt)
    assert not wider.watermarked
    assert detect_watermark(out[:3], {"key": 1234}) == detect_watermark([], {"key": 1234})  # nothing to score
    with pytest.raises(RequestError, match="token_ids"):
        detect_watermark([1, -2], {"key": 1})
    import numpy as np  # numpy's arrays, as generate takes them (a prompt's was numpy's bare ValueError)

    assert detect_watermark(np.array(out), {"key": 1234}, prompt_token_ids=np.array(prompt)) == found
    with pytest.raises(ConfigError, match="key"):
        detect_watermark([1, 2], {"key": "x"})


def test_detector_p_values_are_uniform_without_the_watermark():
    """Under the null (text not drawn with the key) the p-value is uniform, even for repetitive
    text: repeated (context, token) pairs are scored once. Each text has its own key: texts of
    three tokens share their pairs, so under one key their p-values would move together."""
    g = torch.Generator().manual_seed(5)
    p_values = []
    for i in range(400):
        if i % 2:  # low-entropy, repetitive text: few distinct pairs
            out = torch.randint(0, 3, (60,), generator=g).tolist()
        else:
            out = torch.randint(0, 1000, (60,), generator=g).tolist()
        p_values.append(detect_watermark(out, {"key": 99 + i}).p_value)
    assert sps.kstest(np.array(p_values), "uniform").pvalue > ALPHA
    _, out = _random_walk_draws(key=1, n=40, vocab=50, w=4, seed=3, watermark=False)
    assert detect_watermark(out + out, {"key": 1}).num_tokens <= len(out) + 4  # the repeat adds no pairs


def test_keyed_uniform_is_what_the_draw_maximises():
    """The detector's u is the draw's: with flat logits the drawn token has the largest u."""
    contexts = torch.randint(0, 1000, (64, 4), generator=torch.Generator().manual_seed(2))
    vocab = 300
    seeds, hashes = row_keys(77, contexts)
    tokens = gumbel_argmax(torch.zeros(64, vocab), seeds, hashes, WATERMARK_SALT)
    every = torch.stack([keyed_uniform(77, contexts, torch.full((64,), v)) for v in range(vocab)], dim=1)
    assert torch.equal(every.argmax(dim=1), tokens)


def test_detector_replays_each_deduplication_scope():
    """"none" scores a repeated (context, token) pair once; "single_turn" a repeated context
    once; "all" also skips contexts that occur in the prompt."""
    prompt = [7, 8, 9, 1]
    out = [2, 3, 4, 2, 3, 5, 7, 8, 9, 6]  # (2, 3) repeats with 4 then 5; (7, 8) occurs in the prompt
    base = {"key": 3, "context_width": 2}
    scored = {scope: detect_watermark(out, dict(base, deduplicate_contexts=scope), prompt_token_ids=prompt).num_tokens
              for scope in ("none", "single_turn", "all")}
    assert scored == {"none": 10, "single_turn": 9, "all": 7}  # "all": (7, 8) and (8, 9) are the prompt's
    again = out + out
    assert detect_watermark(again, dict(base, deduplicate_contexts="none"), prompt_token_ids=prompt).num_tokens == 12  # (9, 6), (6, 2) are new

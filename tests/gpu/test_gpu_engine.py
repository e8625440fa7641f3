"""GPU: speculative greedy output equals target-only output; graphs equal eager; fp32 and bf16;
async scheduling equals synchronous; a steady step waits for the device once; dependent launches
equal plain ones; running out of memory at start-up or in a step names the setting and releases
the memory."""
import collections
import gc
import json

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError, StepError
from tandem.spec import step_costs
from tandem.spec.adaptive import StepCosts
from tests.helpers import make_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    target = make_hf_model(root / "t", "qwen2", num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                           init_std=0.3, max_position_embeddings=1024)
    draft = make_hf_model(root / "d", "qwen2", num_layers=1, hidden_size=64, seed=3, max_position_embeddings=1024)
    return target, draft


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(2, 300, (n,), generator=g).tolist()} for n in (3, 17, 64, 200, 9, 33)]


def _run(target, dtype, spec=None, enforce_eager=False, device="cuda", params=None, async_scheduling=None,
         watermark_config=None, kv_cache_dtype="auto"):
    llm = LLM(str(target), dtype=dtype, device=device, max_model_len=512, block_size=16, max_num_seqs=8,
              speculative_config=spec, enforce_eager=enforce_eager, kv_cache_memory_bytes=64 << 20,
              async_scheduling=async_scheduling, watermark_config=watermark_config, kv_cache_dtype=kv_cache_dtype)
    params = params or SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)], llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_equals_target_on_gpu(models, dtype):
    target, draft = models
    base, _ = _run(target, dtype)
    for spec_model, k in ((draft, 3), (target, 4)):
        spec = dict(model=str(spec_model), num_speculative_tokens=k)
        out, llm = _run(target, dtype, spec)
        assert out == base
        if spec_model == target:
            assert llm.engine.spec_metrics.acceptance_rate > 0.9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafts_follow_the_requests_processors_on_gpu(models, dtype):
    """A request with a +100 logit bias and one with allowed ids and a penalty, beside plain ones:
    the draft proposes under their steering processors (the bias, the allowed ids; the penalty stays
    the target's), so every draft of the biased request is accepted, and every output is
    target-only's."""
    target, draft = models
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [greedy.clone(logit_bias={50: 100.0}), greedy.clone(allowed_token_ids=list(range(2, 250)),
                                                                 repetition_penalty=1.2)] + [greedy] * 4
    base, _ = _run(target, dtype, params=params)
    out, llm = _run(target, dtype, dict(model=str(draft), num_speculative_tokens=4), params=params)
    assert out == base and set(out[0]) == {50}
    biased = llm.generate(_prompts()[:1], params[:1], use_tqdm=False)[0].metrics
    assert biased.num_accepted_tokens == biased.num_draft_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kv_cache_on_gpu(models, dtype):
    """kv_cache_dtype='fp8': float8 caches for target and draft, 2x (bf16) / 4x (fp32) the blocks
    in the same memory; speculative greedy output equals target-only's with them, CUDA graphs equal
    eager (fp32). How near the full-precision cache's output it stays: tests/engine/test_kv_cache_dtype.py."""
    target, draft = models
    base, llm = _run(target, dtype, kv_cache_dtype="fp8")
    _, plain = _run(target, dtype)
    assert llm.engine.runner.kv.k[0].dtype == torch.float8_e4m3fn and llm.engine.runner.graphs
    widen = 4 if dtype == "float32" else 2
    assert llm.config.cache.num_blocks >= 0.95 * widen * plain.config.cache.num_blocks
    for spec_model, k in ((draft, 3), (target, 4)):
        out, spec = _run(target, dtype, dict(model=str(spec_model), num_speculative_tokens=k), kv_cache_dtype="fp8")
        assert spec.engine.runner.speculator.kv.k[0].dtype == torch.float8_e4m3fn
        assert out == base
    eager, _ = _run(target, dtype, kv_cache_dtype="fp8", enforce_eager=True)
    if dtype == "float32":  # (bf16: the eager path's kernels may round differently, as without fp8)
        assert eager == base


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_round_graph_drafts_as_the_eager_path(models, dtype, monkeypatch):
    """A greedy drafting round after a uniform verification step is one graph replay (catch-up,
    argmax, the k - 1 loop steps): its drafts are those of the eager catch-up and loop, so the
    acceptance is the same (and near 1 with the target as its own draft)."""
    from tandem.spec.draft_graphs import DraftGraphs

    target, _ = models
    spec = dict(model=str(target), num_speculative_tokens=4)
    rounds = []
    run_round = DraftGraphs.run_round
    monkeypatch.setattr(DraftGraphs, "run_round", lambda self, *a: rounds.append(1) or run_round(self, *a))
    base, _ = _run(target, dtype)
    graphed, llm = _run(target, dtype, spec)
    eager, llm_eager = _run(target, dtype, spec, enforce_eager=True)
    assert graphed == eager == base and len(rounds) > 0
    a, b = llm.engine.spec_metrics, llm_eager.engine.spec_metrics
    assert a.acceptance_rate > 0.9
    assert abs(a.num_accepted_tokens - b.num_accepted_tokens) <= 0.02 * b.num_draft_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dynamic_speculation_on_gpu(models, dtype, monkeypatch):
    """Drafts by batch size (4 / 1 / none / 2 as the batch shrinks from 6 to 1): the graphs of
    each number of drafts replay, the steps without drafts are planned ahead (async scheduling),
    the output is the target's, graphs equal eager, and the draft (the target itself) accepts
    nearly everything after the steps it skipped."""
    from tandem.scheduler.scheduler import Scheduler
    from tandem.spec.draft_graphs import DraftGraphs

    target, _ = models
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 24, 36, 48, 60, 72)]
    spec = dict(model=str(target), num_speculative_tokens=4,
                num_speculative_tokens_per_batch_size=[[1, 1, 4], [2, 2, 1], [3, 4, 0], [5, 8, 2]])
    rounds = collections.Counter()
    run_round = DraftGraphs.run_round
    monkeypatch.setattr(DraftGraphs, "run_round", lambda self, *a: rounds.update([self.k]) or run_round(self, *a))
    ahead = []
    schedule_ahead = Scheduler.schedule_ahead
    monkeypatch.setattr(Scheduler, "schedule_ahead", lambda self, prev: ahead.append(schedule_ahead(self, prev)) or ahead[-1])
    base, _ = _run(target, dtype, params=params)
    ahead.clear()
    graphed, llm = _run(target, dtype, spec, params=params)
    assert llm.engine.async_scheduling and sum(p is not None for p in ahead) >= 10
    eager, _ = _run(target, dtype, spec, enforce_eager=True, params=params)
    assert graphed == eager == base
    assert set(rounds) == {1, 2, 4}
    assert sorted(llm.engine.runner.graphs) == [1, 2, 3, 5]
    assert llm.engine.spec_metrics.acceptance_rate > 0.9


# Step costs in an 8B target's proportions on the H200 (ms; sizes 1, 2, 4, 8; K = 0..4).
EIGHT_B_LIKE = StepCosts((1, 2, 4, 8), tuple(tuple(c * (1 + 0.02 * i) for c in (4.0, 4.6, 5.0, 5.4, 5.8))
                                             for i in range(4)))


@pytest.mark.parametrize("own_draft", [True, False])
def test_adaptive_speculation_on_gpu(models, own_draft, monkeypatch):
    """num_speculative_tokens_per_batch_size="auto" on the graphs: the start-up profile times every
    graph size and number of drafts, the output is the target's, and the choice follows the
    draft: the target as its own draft keeps drafting, an unrelated one is mostly switched off
    (those steps planned ahead: async scheduling is on). The choice runs on a fixed table: a tiny
    model's graph replays cost about the same with drafts or without, which leaves the measured
    choice to the timer's noise."""
    measured, profile = [], step_costs.profile_step_costs
    monkeypatch.setattr(step_costs, "profile_step_costs",
                        lambda runner, cfg: measured.append(profile(runner, cfg)) or EIGHT_B_LIKE)
    target, draft = models
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 24, 36, 48, 60, 72)]
    spec = dict(model=str(target if own_draft else draft), num_speculative_tokens=4,
                num_speculative_tokens_per_batch_size="auto")
    base, _ = _run(target, "bfloat16", params=params)
    out, llm = _run(target, "bfloat16", spec, params=params)
    assert out == base and llm.engine.async_scheduling
    [costs], by_k = measured, llm.engine.adaptive.num_steps_by_k
    assert costs.sizes == (1, 2, 4, 8) and all(0 < t < float("inf") for row in costs.ms for t in row)
    assert llm.engine.adaptive.costs is EIGHT_B_LIKE
    assert sorted(llm.engine.runner.graphs) == [1, 2, 3, 4, 5]
    seen = f"steps by K {by_k}, {llm.engine.adaptive.log_line()}, costs:\n{costs.table()}"
    if own_draft:
        assert llm.engine.spec_metrics.acceptance_rate > 0.9 and by_k[0] < sum(by_k) / 2, seen
    else:
        assert by_k[0] > sum(by_k) / 2, seen


@pytest.mark.parametrize("spec_on", [False, True])
def test_graph_path_equals_eager_path(models, spec_on):
    target, draft = models
    spec = dict(model=str(target), num_speculative_tokens=3) if spec_on else None
    eager, _ = _run(target, "float32", spec, enforce_eager=True)
    graphed, llm = _run(target, "float32", spec)
    assert llm.engine.runner.graphs, "graphs were not captured"
    assert graphed == eager


def test_draft_enforce_eager_keeps_the_targets_graphs(models):
    """speculative_config enforce_eager=True (vLLM's per-draft override): the draft runs without
    CUDA graphs, the target keeps its own, and greedy drafts and output are the graphed engine's."""
    target, draft = models
    spec = dict(model=str(draft), num_speculative_tokens=3)
    graphed, llm = _run(target, "float32", spec)
    eager_draft, llm_eager = _run(target, "float32", {**spec, "enforce_eager": True})
    assert llm_eager.engine.runner.graphs and not llm_eager.engine.runner.speculator.graphs
    assert llm_eager.engine.runner.speculator.step_graph is None and llm.engine.runner.speculator.graphs
    assert eager_draft == graphed
    assert llm_eager.engine.spec_metrics.num_accepted_tokens == llm.engine.spec_metrics.num_accepted_tokens


def test_confidence_stop_is_refused_on_gpu(models):
    """draft_confidence_threshold reads each draft step's confidence on the host: on a GPU that wait
    would stall the draft graphs, so LLM refuses it there (vLLM allows it on SM121 alone)."""
    target, draft = models
    with pytest.raises(ConfigError, match="^speculative_config.draft_confidence_threshold is supported on the CPU only"):
        LLM(str(target), device="cuda", speculative_config=dict(model=str(draft), num_speculative_tokens=3,
                                                                draft_confidence_threshold=0.5))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_watermarked_speculation_on_gpu(models, dtype):
    """The keyed draws (the Triton sampler with the watermark's keys) survive speculation on the
    GPU: speculative output equals target-only output, graphs or not; the target as its own draft
    agrees with itself (fp32: every draft)."""
    from tandem.detect import detect_watermark

    target, draft = models
    key = {"key": 4242}
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=48, ignore_eos=True, seed=1)
    base, _ = _run(target, dtype, params=params, watermark_config=key)
    eager, _ = _run(target, dtype, params=params, watermark_config=key, enforce_eager=True)
    assert eager == base
    for spec_model, k in ((draft, 3), (target, 4)):
        spec = dict(model=str(spec_model), num_speculative_tokens=k)
        out, llm = _run(target, dtype, spec, params=params, watermark_config=key)
        assert out == base
        if spec_model == target:
            assert llm.engine.spec_metrics.acceptance_rate > (0.999 if dtype == "float32" else 0.9)
    prompts = _prompts()
    found = [detect_watermark(o, key, prompt_token_ids=p["prompt_token_ids"]) for o, p in zip(base, prompts)]
    assert all(f.p_value < 1e-4 for f in found), found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_structured_outputs_on_gpu(models, dtype):
    """Constrained requests on the GPU: graphs equal eager, speculative output (greedy and
    probabilistic drafts, the drafts brought to the host for the masks, those that leave the
    grammar drawn again; or every draft masked in the round) equals target-only output, and every
    output keeps to its constraint."""
    import re

    from tandem import StructuredOutputsParams

    regex = r"[0-9]{2,4}-(yes|no)"
    constraints = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(choice=["apple pie", "fox"]),
                   StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 99}},
                                                 "required": ["n"], "additionalProperties": False},
                                           disable_any_whitespace=True)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraints[i % 3]) for i in range(6)]
    base, llm = _run(models[0], dtype, params=params)
    texts = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in base]
    for i, text in enumerate(texts):
        ok = [re.fullmatch(regex, text), text in ("apple pie", "fox"), text.startswith('{"n":')][i % 3]
        assert ok, (i, text)
    eager, _ = _run(models[0], dtype, params=params, enforce_eager=True)
    assert eager == base
    for spec_model, k, method in ((models[1], 3, "greedy"), (models[0], 4, "greedy"), (models[0], 3, "probabilistic")):
        spec = dict(model=str(spec_model), num_speculative_tokens=k, draft_sample_method=method)
        out, llm = _run(models[0], dtype, spec, params=params)  # drafts that leave the grammar drawn again
        assert out == base, (k, method)
        assert llm.engine.spec_metrics.num_draft_tokens > 0
    llm.engine.grammar_drafting = "round"  # every draft masked in the round, step by step
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)] == base


def test_keyed_draw_kernel_equals_the_reference():
    """sampler.draw on CUDA (Triton) and the torch reference draw the same tokens for watermark keys."""
    from tandem.sampling.gumbel import gumbel_argmax
    from tandem.sampling.sampler import draw
    from tandem.sampling.watermark import WATERMARK_SALT, context_hash

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151_936, device="cuda", generator=g) * 3
    logits[:, 1000:2000] = float("-inf")
    contexts = torch.randint(0, 151_936, (64, 4), device="cuda", generator=g)
    hashes = context_hash(contexts)
    seeds = torch.full_like(hashes, 123456789)
    fast = draw(logits, seeds, hashes, WATERMARK_SALT, use_triton=True)
    ref = gumbel_argmax(logits, seeds, hashes, WATERMARK_SALT)
    assert torch.equal(fast, ref)


def test_gpu_matches_cpu_fp32(models):
    target, _ = models
    gpu, _ = _run(target, "float32")
    cpu, _ = _run(target, "float32", device="cpu")
    assert gpu == cpu


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_on_gpu_match_cpu(models, mode):
    """fp32, a sampled request with top-k (and prompt logprobs), a greedy one, and one with allowed ids and bad words,
    speculation on (the verification graph's logits buffer, which the processors overwrite in
    place; bad words read the earlier drafts): the GPU's tokens and logprobs in either mode are the
    CPU's."""
    target, draft = models
    spec = dict(model=str(draft), num_speculative_tokens=3)
    params = [SamplingParams(temperature=0.9, top_k=40, max_tokens=24, seed=7, logprobs=3, ignore_eos=True,
                             prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, max_tokens=24, seed=3, logprobs=3, ignore_eos=True,
                             allowed_token_ids=list(range(2, 250)),
                             bad_words_token_ids=[[5], [7, 8], [9, 10, 11]] + [[a, a + 1] for a in range(2, 250, 2)])]
    outs = {}
    for device in ("cuda", "cpu"):
        llm = LLM(str(target), dtype="float32", device=device, max_model_len=512, block_size=16, max_num_seqs=8,
                  speculative_config=spec, kv_cache_memory_bytes=64 << 20, logprobs_mode=mode)
        got = llm.generate(_prompts()[:3], params, use_tqdm=False)
        outs[device] = [(o.outputs[0].token_ids, o.outputs[0].logprobs + (o.prompt_logprobs or [None])[1:])
                        for o in got]
        del llm
    for (toks_g, lps_g), (toks_c, lps_c) in zip(outs["cuda"], outs["cpu"]):
        assert toks_g == toks_c and len(lps_g) == len(lps_c)
        for a, b in zip(lps_g, lps_c):
            assert a.keys() == b.keys()
            # fp32 on both, but the GPU's matmuls reduce in another order: 1.8e-4 seen at a logprob of -3.6
            assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=5e-4)


def test_head_dim_80_on_gpu_matches_cpu(tmp_path):
    """A head_dim that is not a power of two (80, as Phi-2 / StableLM have) runs the masked Triton
    tiles: fp32 greedy output on the GPU (graphs and speculation on) equals the CPU reference's; a
    head_dim the kernels do not take is refused before loading."""
    target = make_hf_model(tmp_path / "t", "llama", hidden_size=320, num_heads=4, num_kv_heads=2, init_std=0.3,
                           max_position_embeddings=1024)
    draft = make_hf_model(tmp_path / "d", "llama", hidden_size=160, num_heads=2, num_kv_heads=1, num_layers=1,
                          seed=4, max_position_embeddings=1024)
    spec = dict(model=str(draft), num_speculative_tokens=3)
    gpu, _ = _run(target, "float32", spec)
    cpu, _ = _run(target, "float32", spec, device="cpu")
    assert gpu == cpu
    odd = make_hf_model(tmp_path / "o", "llama", hidden_size=96, num_heads=8, num_kv_heads=2, seed=5,
                        max_position_embeddings=1024)
    with pytest.raises(ConfigError, match=r"^model: head_dim=12 is not supported on CUDA"):
        LLM(str(odd), dtype="float32", device="cuda", max_model_len=512)


def test_o_proj_bias_on_gpu_matches_cpu(tmp_path):
    """attention_bias (Llama's q/k/v and o biases): the GPU's one-row GEMV that adds o_proj into the
    residual, its few-row verification GEMM and the prefill's matmul each add the bias; fp32 greedy
    tokens and logprobs (graphs and speculation on) are the CPU's."""
    target = make_hf_model(tmp_path / "t", "llama", hidden_size=128, init_std=0.3, max_position_embeddings=1024,
                           extra={"attention_bias": True})
    draft = make_hf_model(tmp_path / "d", "llama", num_layers=1, seed=4, max_position_embeddings=1024,
                          extra={"attention_bias": True})
    spec = dict(model=str(draft), num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    gpu, llm = _run(target, "float32", spec, params=params)
    gpu_lps = [o.outputs[0].logprobs for o in llm.generate(_prompts(), params, use_tqdm=False)]
    del llm
    cpu, llm = _run(target, "float32", spec, device="cpu", params=params)
    cpu_lps = [o.outputs[0].logprobs for o in llm.generate(_prompts(), params, use_tqdm=False)]
    assert gpu == cpu
    for a, b in zip(sum(gpu_lps, []), sum(cpu_lps, [])):
        assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=5e-4)


def test_generate_compare_on_gpu(models, capsys):
    """`tandem generate --compare` on CUDA (the README's main job on a GPU machine): the speculative
    engine gives its memory back before the target-only engine sizes its KV pool from
    gpu_memory_utilization, which used to find no room left."""
    from tandem.cli import main

    gc.collect()
    torch.cuda.empty_cache()
    target, draft = models
    rc = main(["generate", "--model", str(target), "--draft", str(draft), "--device", "cuda", "--dtype", "float32",
               "--max-tokens", "16", "--ignore-eos", "--compare", "The quick brown fox"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "identical output: yes" in err and "speedup" in err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_sampling_with_greedy_drafts_equals_target_on_gpu(models, dtype):
    """The fused sampler's coupled test: with greedy drafts a seeded sampled request emits the
    tokens target-only decoding emits with that seed (graphs or not, through rejections)."""
    target, draft = models
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=48, ignore_eos=True, seed=7)
    base, _ = _run(target, dtype, params=params)
    eager, _ = _run(target, dtype, params=params, enforce_eager=True)
    assert eager == base
    for spec_model, k in ((draft, 3), (target, 4)):
        spec = dict(model=str(spec_model), num_speculative_tokens=k)
        out, llm = _run(target, dtype, spec, params=params)
        assert out == base
        m = llm.engine.spec_metrics  # a greedy draft stands with probability p(x): some do, some do not
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens, (k, m.num_accepted_tokens, m.num_draft_tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_lookup_on_gpu(models, dtype, tmp_path):
    """method="ngram": greedy and seeded-sampled output equal target-only's on the GPU (prompts
    that repeat themselves, so the lookup drafts; steps planned ahead while it finds nothing,
    as async scheduling is on by default), every verification (1..k drafts) is captured,
    graphs equal eager (fp32), and on a target that repeats one token (its LM head zeroed) every
    draft is accepted."""
    import shutil

    from safetensors.torch import load_file, save_file

    target, _ = models
    spec = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    repeated = [{"prompt_token_ids": p["prompt_token_ids"] * 2} for p in _prompts()]

    def run(model, params, spec=None, enforce_eager=False):
        llm = LLM(str(model), dtype=dtype, max_model_len=512, block_size=16, max_num_seqs=8, speculative_config=spec,
                  enforce_eager=enforce_eager, kv_cache_memory_bytes=64 << 20)
        return [o.outputs[0].token_ids for o in llm.generate(repeated, params, use_tqdm=False)], llm

    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_tokens=48, ignore_eos=True, seed=7)
    for params in (greedy, sampled):
        base, _ = run(target, params)
        out, llm = run(target, params, spec)
        assert sorted(llm.engine.runner.graphs) == [1, 2, 3, 4, 5]
        assert llm.engine.async_scheduling  # steps planned ahead while the lookup finds nothing
        assert out == base
        assert llm.engine.spec_metrics.num_draft_tokens > 0
        if dtype == "float32":
            assert run(target, params, spec, enforce_eager=True)[0] == base
    constant = tmp_path / "constant"
    shutil.copytree(target, constant)
    weights = load_file(str(constant / "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(constant / "model.safetensors"), metadata={"format": "pt"})
    base, _ = run(constant, greedy)
    out, llm = run(constant, greedy, spec)
    assert out == base
    m = llm.engine.spec_metrics
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens


def test_sampled_speculation_runs_on_gpu(models):
    target, draft = models
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True, seed=5)
    spec = dict(model=str(draft), num_speculative_tokens=3, draft_sample_method="probabilistic")
    a, llm = _run(target, "bfloat16", spec, params=params)
    assert llm.engine.runner.speculator.step_graph is not None  # the loop steps replay the one-step graph
    b, _ = _run(target, "bfloat16", spec, params=params)
    assert a == b and all(len(t) == 32 for t in a)
    eager, _ = _run(target, "bfloat16", spec, params=params, enforce_eager=True)
    assert eager == a


def test_draft_with_fewer_vocabulary_rows_on_gpu(models, tmp_path):
    """A draft table of 310 rows under a 320-row target (the tokenizer has 301): greedy output
    equals target-only through the draft's graphs (prompt ids up to 319 reach its embedding), and
    probabilistic drafts run with the rows it lacks at probability zero."""
    target, _ = models
    small = make_hf_model(tmp_path / "d", "qwen2", num_layers=1, hidden_size=64, seed=3, vocab_size=310,
                          max_position_embeddings=1024)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in (5, 40, 120)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3)
    outs = {}
    for spec in (None, dict(model=str(small), num_speculative_tokens=3),
                 dict(model=str(small), num_speculative_tokens=3, draft_sample_method="probabilistic")):
        llm = LLM(str(target), dtype="bfloat16", max_model_len=512, block_size=16, max_num_seqs=8,
                  speculative_config=spec, kv_cache_memory_bytes=64 << 20)
        assert llm.engine.vocab_size == 320
        method = spec and spec.get("draft_sample_method", "greedy")
        outs[method] = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
                        for p in (greedy, sampled)]
        del llm
    assert outs["greedy"][0] == outs[None][0] == outs["probabilistic"][0]
    assert all(len(t) == 40 for t in outs["probabilistic"][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pruned_draft_head_on_gpu(models, dtype, monkeypatch):
    """A draft head pruned to 150 of 320 ids (draft_vocab_size), the target as its own draft: the
    greedy round graphs map each argmax to its id (every draft a hot id, the same acceptance as the
    eager path) and the output is the target's; sampled drafts run on the one-step graph."""
    from tandem.spec.draft_graphs import DraftGraphs

    target, _ = models
    spec = dict(model=str(target), num_speculative_tokens=4, draft_vocab_size=150)
    seen = []
    run_round = DraftGraphs.run_round

    def watch(self, *a):
        run_round(self, *a)
        seen.append(self.drafts.unique().tolist())

    monkeypatch.setattr(DraftGraphs, "run_round", watch)
    base, _ = _run(target, dtype)
    graphed, llm = _run(target, dtype, spec)
    eager, llm_eager = _run(target, dtype, spec, enforce_eager=True)
    assert graphed == eager == base and seen
    hot = set(llm.engine.runner.speculator.hot_ids.tolist())
    assert len(hot) < 160 and all(set(ids) <= hot for ids in seen)
    a, b = llm.engine.spec_metrics, llm_eager.engine.spec_metrics
    assert 0.2 < a.acceptance_rate < 0.9  # the target's tokens outside the hot set are never drafted
    assert abs(a.num_accepted_tokens - b.num_accepted_tokens) <= 0.02 * b.num_draft_tokens
    params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=5)
    sampled = dict(spec, draft_sample_method="probabilistic")
    x, _ = _run(target, dtype, sampled, params=params)
    y, _ = _run(target, dtype, sampled, params=params, enforce_eager=True)
    assert all(len(t) == 32 for t in x)
    if dtype == "float32":  # (bf16: a draft that is the target makes p / q ~ 1, so rounding moves acceptances)
        assert x == y


def test_block_verification_on_gpu(models):
    """rejection_sample_method="block" (torch ops on the device): greedy requests give the
    target's tokens, sampled ones the same tokens on the graphs as eagerly (fp32), and the target
    as its own probabilistic draft (p == q) keeps nearly every block."""
    target, _ = models
    spec = dict(model=str(target), num_speculative_tokens=4, draft_sample_method="probabilistic",
                rejection_sample_method="block")
    base, _ = _run(target, "float32")
    greedy, _ = _run(target, "float32", spec)
    assert greedy == base
    params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=5)
    x, llm = _run(target, "float32", spec, params=params)
    y, _ = _run(target, "float32", spec, params=params, enforce_eager=True)
    assert x == y and all(len(t) == 32 for t in x)
    assert llm.engine.spec_metrics.acceptance_rate > 0.9


def test_kv_pool_sized_from_memory_fraction(models):
    """No explicit byte budget: the pool comes from gpu_memory_utilization after profiling."""
    target, draft = models
    llm = LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=8,
              gpu_memory_utilization=0.3, speculative_config=dict(model=str(draft), num_speculative_tokens=3))
    free, total = torch.cuda.mem_get_info()
    assert llm.engine.cfg.cache.num_blocks > 0
    assert torch.cuda.memory_reserved() <= 0.3 * total + (256 << 20)
    base, _ = _run(target, "bfloat16")
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_the_process_stays_within_the_memory_fraction(tmp_path, method):
    """gpu_memory_utilization bounds everything the process holds on the device: weights,
    activations, the KV pool, and what is allocated after it (the runner's and speculator's
    buffers, the CUDA graphs' static logits, their memory pool and the driver's memory for them,
    the sampler's temporaries; measured by a rehearsal over a scratch KV pool before the pool is
    sized). With a 128k vocabulary and 256 sequences the graphs take ~1 GiB (their logits alone
    0.74 GiB; probabilistic drafts keep 0.5 GiB of draft logits more); read as the device's used
    memory after a run of max_num_seqs requests with every sampling feature."""
    shape = dict(num_key_value_heads=2, vocab_size=128256, max_position_embeddings=1024, num_hidden_layers=2,
                 num_attention_heads=8)
    target = _config_dir(tmp_path / "t", hidden_size=512, intermediate_size=1024, **shape)
    draft = _config_dir(tmp_path / "d", hidden_size=256, intermediate_size=512, **shape)
    _allocated()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(target, dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=1024, max_num_seqs=256,
              gpu_memory_utilization=0.3,
              speculative_config=dict(model=draft, num_speculative_tokens=4, draft_load_format="dummy",
                                      draft_sample_method=method))
    assert llm.engine.graph_memory_bytes > 700 << 20  # the three static logits buffers: 0.74 GiB
    # The worst case the rehearsal measures, for real: max_num_seqs requests of 8 tokens (the first
    # step prefills max_num_batched_tokens = 2048), then all of them verifying drafts at once with
    # every sampling feature and 20 logprobs.
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10, 11, 12]} for i in range(256)]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 0.5}, min_tokens=2,
                            logprobs=20, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    torch.cuda.synchronize()
    used = total - torch.cuda.mem_get_info()[0]  # by every process: the CUDA context counts as the engine's
    over = used - 0.3 * total
    print(f"used {used / 2**30:.2f} GiB, {over / 2**20:.0f} MiB above gpu_memory_utilization")
    assert over <= 64 << 20, f"{over / 2**20:.0f} MiB above gpu_memory_utilization"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_equals_synchronous(models, dtype):
    target, _ = models
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_k=40, max_tokens=40, seed=7, logprobs=2)
    for params in (greedy, sampled):
        sync, _ = _run(target, dtype, params=params, async_scheduling=False)
        overlapped, llm = _run(target, dtype, params=params)
        assert llm.engine.async_scheduling  # the default on a GPU without a draft
        assert overlapped == sync


@pytest.mark.parametrize("spec_on", [False, True, "ngram", "suffix"])
def test_steady_step_waits_for_the_device_once(models, spec_on):
    """In steady decoding nothing but the step's own result copy waits for the device: any
    hidden synchronisation (.item(), a pageable copy, torch.tensor(list, device=cuda)) raises.
    One request is watermarked (its keyed draws and context windows stay on the device). Suffix
    lookup: with a response in its corpus."""
    target, draft = models
    spec = dict(model=str(draft), num_speculative_tokens=3) if spec_on else None
    if spec_on == "ngram":
        spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    if spec_on == "suffix":
        spec = dict(method="suffix", num_speculative_tokens=4)
    llm = LLM(str(target), dtype="bfloat16", max_model_len=512, block_size=16, max_num_seqs=8,
              speculative_config=spec, kv_cache_memory_bytes=64 << 20, watermark_config={"key": 1})
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    if spec_on == "suffix":  # a response for the corpus (it enters with the next plan)
        llm.generate(_prompts()[:1], greedy.clone(max_tokens=20), use_tqdm=False)
    limited = greedy.clone(allowed_token_ids=list(range(2, 250)), bad_words_token_ids=[[5], [7, 8], [9, 10, 11]],
                           repetition_penalty=1.2)
    keyed = greedy.clone(temperature=0.8, top_p=0.95)
    for i, p in enumerate(_prompts()[:4]):
        engine.add_request(str(i), p["prompt_token_ids"], limited if i == 3 else keyed if i == 2 else greedy)
    _steady_steps(engine)
    assert engine.has_unfinished_requests()


def _steady_steps(engine, before=None) -> None:
    """Four steps (prefills, first decodes), then before() and eight steps in which any hidden
    synchronisation raises."""
    for _ in range(4):
        engine.step()
    if before is not None:
        before()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("way", [None, "auto", "repair", "round"])
def test_constrained_steps_wait_only_for_their_results(models, way, monkeypatch):
    """A structured-output request beside a free one: its masks reach the logits without a hidden
    synchronisation, and a step waits once for its result (None: target-only). With a draft
    (k = 3) the engine waits once more for the request's drafts; a free round whose drafts leave
    the grammar ("repair", and "auto", the GPU's default, until the request's misfits are
    frequent) adds a wait a redrawn column and one for the new drafts; a round masked step by
    step ("round", and "auto" once misfits are frequent) waits for the request's emitted tokens and
    then for each of its drafts but the last."""
    from tandem import StructuredOutputsParams
    from tandem.engine.grammar import Grammars
    from tandem.spec.speculator import DraftSpeculator

    target, draft = models
    spec = dict(model=str(draft), num_speculative_tokens=3) if way else None
    llm = LLM(str(target), dtype="bfloat16", max_model_len=512, block_size=16, max_num_seqs=8,
              speculative_config=spec, kv_cache_memory_bytes=64 << 20)
    engine = llm.engine
    assert engine.grammar_drafting == "auto"
    engine.grammar_drafting = way
    free = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    digits = free.clone(structured_outputs=StructuredOutputsParams(regex="[0-9]{80}"))
    for i, p in enumerate(_prompts()[:2]):
        engine.add_request(str(i), p["prompt_token_ids"], digits if i == 0 else free)
    waits, repairs, masked = [], [], []
    real_sync, real_repair, real_masks = torch.cuda.Event.synchronize, DraftSpeculator.repair, Grammars.draft_masks

    def repair(self, items, masks):  # a wait a redrawn column, and one for the drafts read after
        cols = range(min(it.first for it in items), max(it.num_drafts for it in items))
        repairs.append(1 + sum(any(it.first <= c < it.num_drafts for it in items) for c in cols))
        return real_repair(self, items, masks)

    def draft_masks(self, plan):
        out = real_masks(self, plan)
        masked.append(out is not None)
        return out

    def watch():
        monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (waits.append(1), real_sync(self))[1])
        monkeypatch.setattr(DraftSpeculator, "repair", repair)
        monkeypatch.setattr(Grammars, "draft_masks", draft_masks)

    _steady_steps(engine, watch)
    assert engine.has_unfinished_requests()
    k = 3
    expected = 8 if way is None else 8 * 2 + sum(repairs) + k * sum(masked)
    assert len(waits) == expected, (len(waits), repairs, masked)
    if way == "repair":
        assert repairs  # a random draft's free drafts leave [0-9]: some are drawn again
    if way == "auto":  # its free rounds miss so often that most rounds are masked
        assert sum(masked) >= 4, masked


@pytest.mark.parametrize("spec_on", [False, True])
def test_dependent_launches_equal_plain_launches(models, spec_on, monkeypatch):
    """Kernels launched with programmatic dependent launch (each may start before the one before
    it has finished, tandem/kernels/pdl.py) give what plain launches give, in graphs and eagerly:
    the same tokens and the same logprobs, greedy and sampled."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    target, draft = models
    spec = dict(model=str(draft), num_speculative_tokens=3) if spec_on else None
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.9, top_k=40, max_tokens=40, seed=7, logprobs=2)

    def run(enforce_eager):
        llm = LLM(str(target), dtype="bfloat16", max_model_len=512, block_size=16, max_num_seqs=8,
                  speculative_config=spec, enforce_eager=enforce_eager, kv_cache_memory_bytes=64 << 20)
        outs = [o.outputs[0] for params in (greedy, sampled) for o in llm.generate(_prompts(), params, use_tqdm=False)]
        return [(o.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs]) for o in outs]

    for enforce_eager in (False, True):
        monkeypatch.setenv("TANDEM_PDL", "0")
        plain = run(enforce_eager)
        monkeypatch.delenv("TANDEM_PDL")
        assert run(enforce_eager) == plain


def test_few_row_gemm_in_the_engine(models, monkeypatch):
    """Verification and catch-up rows through the few-row tensor-core GEMM with the rotary inside
    (tandem/kernels/gemm_rows.py; its width threshold lowered so this small model's layers take
    it): speculative greedy output == target-only output in bf16, graphs == eager."""
    monkeypatch.setattr("tandem.layers.gpu_linear.FEW_ROWS_MIN_OUT", 1)
    target, draft = models
    base, _ = _run(target, "bfloat16")
    spec = dict(model=str(draft), num_speculative_tokens=3)
    graphed, _ = _run(target, "bfloat16", spec)
    eager, _ = _run(target, "bfloat16", spec, enforce_eager=True)
    assert graphed == base
    assert eager == base


def test_fp8_draft_on_gpu(models, monkeypatch):
    """A draft in weight-only fp8 (speculative_config quantization="fp8": the GEMVs and, with the
    width threshold lowered, the few-row GEMMs stream e4m3 weights): output == target-only in bf16,
    graphs == eager (acceptance within 2%, as the graph and eager catch-ups differ in row layout)."""
    monkeypatch.setattr("tandem.layers.gpu_linear.FEW_ROWS_MIN_OUT", 1)
    target, draft = models
    base, _ = _run(target, "bfloat16")
    for spec_model, k in ((draft, 3), (target, 4)):
        spec = dict(model=str(spec_model), num_speculative_tokens=k, quantization="fp8")
        graphed, llm = _run(target, "bfloat16", spec)
        eager, llm_eager = _run(target, "bfloat16", spec, enforce_eager=True)
        assert graphed == base and eager == base
        assert abs(llm.engine.spec_metrics.acceptance_rate - llm_eager.engine.spec_metrics.acceptance_rate) <= 0.02
        lin = llm.engine.runner.speculator.model.model.layers[0].mlp.down_proj
        assert lin.w8.dtype == torch.float8_e4m3fn and lin.kernel_weight is lin.w8


def _config_dir(path, **shape):
    """A config.json-only Llama (load_format="dummy")."""
    path.mkdir(parents=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0,
                  torch_dtype="bfloat16", tie_word_embeddings=False) | shape
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_out_of_memory_names_the_setting(models, tmp_path, monkeypatch):
    """Weights that cannot fit are refused before loading (target and draft); a real out-of-memory
    while loading (that check bypassed) or while profiling the largest step is a ConfigError naming
    the setting; what the failed step allocated is released, and the next engine runs."""
    target, _ = models
    before = _allocated()
    giant = _config_dir(tmp_path / "giant", hidden_size=16384, intermediate_size=53248, num_hidden_layers=64,
                        num_attention_heads=128, num_key_value_heads=8, vocab_size=320, max_position_embeddings=1024)
    dummy = dict(dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=512)
    with pytest.raises(ConfigError, match=r"^model='.*giant' in bfloat16: the weights need 3\d\d\.\d GiB, the GPU "
                                          r"has .* free of .*; use a smaller model, or a smaller dtype$"):
        LLM(giant, **dummy)
    with pytest.raises(ConfigError, match=r"^speculative_config.model='.*giant' in bfloat16: the weights need .*; use "
                                          r"a smaller speculative_config.model, or a smaller speculative_config.dtype$"):
        LLM(str(target), dtype="bfloat16", device="cuda", max_model_len=512, kv_cache_memory_bytes=64 << 20,
            speculative_config=dict(model=giant, num_speculative_tokens=2, draft_load_format="dummy"))
    assert _allocated() - before < 64 << 20
    with monkeypatch.context() as m:
        m.setattr("tandem.models.loader.check_weights_fit", lambda *args: None)
        with pytest.raises(ConfigError, match=r"^loading the weights of model='.*giant' in bfloat16 ran out of GPU "
                                              r"memory: .* free of .*; use a smaller model, or a smaller dtype$"):
            LLM(giant, **dummy)
    assert _allocated() - before < 64 << 20
    n = 1 << 23  # one 8M-token prefill: its activations (> 200 GiB) cannot fit, the 1.4 GiB of weights can
    long = _config_dir(tmp_path / "long", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=n)
    with pytest.raises(ConfigError, match=rf"^profiling the largest step \(max_num_batched_tokens={n}\) ran out of "
                                          r"GPU memory: .*; lower max_num_batched_tokens$"):
        LLM(long, **(dummy | dict(max_model_len=n, max_num_batched_tokens=n, max_num_seqs=1)))
    assert _allocated() - before < 64 << 20
    outs, _ = _run(target, "bfloat16")
    assert all(len(t) == 48 for t in outs)


def _fill_allocator() -> list:
    """Cap the allocator at the memory it holds now and fill the free space inside it, so that
    the next allocation of more than about 1 MiB fails whatever earlier tests left cached. ->
    the filler tensors (free them, then lift the cap with set_per_process_memory_fraction(1.0))."""
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / torch.cuda.mem_get_info()[1])
    filler, size = [], 1 << 32
    while size >= 1 << 20:
        try:
            filler.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return filler


@pytest.mark.parametrize("spec_on", [False, True])
def test_out_of_memory_in_a_step_ends_its_requests(tmp_path, spec_on):
    """A real CUDA out-of-memory error in a serving step (the allocator capped and filled) is
    a StepError naming the settings; it ends the requests of that step, releases what
    the step held, and once memory is back the engine gives a fresh engine's output."""
    n = 4000
    shape = dict(num_key_value_heads=2, vocab_size=320, max_position_embeddings=n + 64)
    target = _config_dir(tmp_path / "t", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=8, **shape)
    draft = _config_dir(tmp_path / "d", hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                        num_attention_heads=4, **shape)
    spec = dict(model=draft, num_speculative_tokens=3, draft_load_format="dummy") if spec_on else None
    kwargs = dict(dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=n + 64, max_num_seqs=4,
                  max_num_batched_tokens=n, kv_cache_memory_bytes=256 << 20, speculative_config=spec)
    llm = LLM(target, **kwargs)
    prompts = [{"prompt_token_ids": torch.randint(2, 300, (m,), generator=torch.Generator().manual_seed(m)).tolist()}
               for m in (n - 8, 20)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = _allocated()
    filler = _fill_allocator()
    try:
        with pytest.raises(StepError, match=r"^an engine step \(\d requests, \d+ tokens\) ran out of GPU memory: .* "
                                            r"free of .*; leave more memory outside the KV cache \(lower "
                                            r"kv_cache_memory_bytes\) or make steps smaller \(lower "
                                            rf"max_num_batched_tokens={n} or max_num_seqs=4\)$"):
            llm.generate(prompts, params, use_tqdm=False)
        held = sum(t.numel() for t in filler)
        assert _allocated() - held - before < 1 << 20  # the failed step's activations are gone
    finally:
        del filler
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.scheduler.blocks.num_blocks
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    fresh = LLM(target, **kwargs)  # the same seeded dummy weights
    assert outs == [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]


def test_kv_pool_leaves_room_for_the_drafts_step(tmp_path):
    """Both models' largest step is profiled before the pool takes what gpu_memory_utilization leaves:
    a draft far wider than its target (its 32k-token prefill needs ~3 GiB the target's does not)
    keeps the process's peak within the fraction."""
    n = 1 << 15
    shape = dict(num_key_value_heads=2, vocab_size=32000, max_position_embeddings=n)
    target = _config_dir(tmp_path / "t", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, **shape)
    draft = _config_dir(tmp_path / "d", hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                        num_attention_heads=32, **shape)
    _allocated()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(target, dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=n, max_num_seqs=4,
              max_num_batched_tokens=n, gpu_memory_utilization=0.3,
              speculative_config=dict(model=draft, num_speculative_tokens=3, draft_load_format="dummy",
                                      draft_sample_method="probabilistic"))
    prompt = {"prompt_token_ids": torch.randint(10, 30000, (n - 8,), generator=torch.Generator().manual_seed(0)).tolist()}
    out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert torch.cuda.max_memory_allocated() <= 0.3 * total + (256 << 20)

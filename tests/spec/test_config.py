"""SpeculativeConfig validation, draft/target compatibility checks, and metrics arithmetic."""
import logging

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.plan import ScheduledReq, StepPlan, StepResult
from tandem.spec.config import SpeculativeConfig, length_to_rates
from tandem.spec.metrics import SpecMetrics
from tests.helpers import make_hf_model


def cfg(**kw):
    base = dict(model="draft", num_speculative_tokens=3)
    base.update(kw)
    return SpeculativeConfig.from_user(base, target_max_model_len=128)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2.5), "num_speculative_tokens"),
        (dict(num_speculative_tokens=True), "num_speculative_tokens"),
        (dict(num_speculative_tokens=128), "num_speculative_tokens=128 must be below max_model_len=128"),
        (dict(method="eagle"), "method"),
        (dict(draft_sample_method="nucleus"), "draft_sample_method"),
        (dict(rejection_sample_method="typical"), "rejection_sample_method"),
        (dict(rejection_sample_method="block", synthetic_acceptance_rates=[0.9, 0.5, 0.1]),
         "need rejection_sample_method='synthetic'"),
        (dict(synthetic_acceptance_rates=[0.5, 0.4, 0.3]), "synthetic_method"),
        (dict(synthetic_acceptance_length=2.0), "synthetic_method"),
        (dict(rejection_sample_method="synthetic"), "exactly one"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.5]), "k=3"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.9, 0.5, 1.2]), "[0, 1]"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5, 0.6, 0.1]), "non-increasing"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_length=4.5), "synthetic_acceptance_length"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_length=0.5), "synthetic_acceptance_length"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_length=True), "synthetic_acceptance_length"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[True] * 3), "[0, 1]"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_length=2.0,
              synthetic_acceptance_rates=[1, 1, 0]), "exactly one"),
        (dict(max_model_len=256), "max_model_len"),
        (dict(draft_load_format="gguf"), "draft_load_format"),
        (dict(seed=-1), "speculative_config.seed"),
        (dict(seed="x"), "speculative_config.seed"),
        (dict(seed=2**64), "speculative_config.seed"),
        (dict(dtype="fp8"), "speculative_config.dtype"),
        (dict(model=123), "speculative_config.model"),
        (dict(quantization="int4"), "quantization"),
        (dict(bogus=1), "unknown keys"),
        (dict(draft_tensor_parallel_size=0), "draft_tensor_parallel_size"),
        (dict(num_speculative_tokens_per_batch_size=[[1, 8, 4]]), "num_speculative_tokens=3"),
        (dict(num_speculative_tokens_per_batch_size=[[1, 8, -1]]), "num_speculative_tokens=3"),
        (dict(num_speculative_tokens_per_batch_size=[[0, 8, 1]]), "1 <= start <= end"),
        (dict(num_speculative_tokens_per_batch_size=[[9, 8, 1]]), "1 <= start <= end"),
        (dict(num_speculative_tokens_per_batch_size=[[1, 8, 2], [8, 16, 0]]), "overlap"),
        (dict(num_speculative_tokens_per_batch_size=[[1, 8]]), "triple of integers"),
        (dict(num_speculative_tokens_per_batch_size=[[1, 8, 1.5]]), "triple of integers"),
        (dict(num_speculative_tokens_per_batch_size="1-8:2"), "or \"auto\""),
        (dict(num_speculative_tokens_per_batch_size="Auto"), "or \"auto\""),
        (dict(tensor_parallel_size=2), "pass draft_tensor_parallel_size instead"),  # vLLM's trap
        (dict(use_local_argmax_reduction=True, draft_sample_method="probabilistic"),
         "use_local_argmax_reduction=True needs draft_sample_method='greedy'"),
        (dict(use_local_argmax_reduction="yes"), "use_local_argmax_reduction='yes' must be"),
        (dict(enforce_eager=1), "enforce_eager=1 must be"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates={0.9: "a", 0.2: "b"}), "list of floats"),
        (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates={0.9, 0.2, 0.1}), "list of floats"),
    ],
)
def test_bad_config(kw, field):
    with pytest.raises(ConfigError) as e:
        cfg(**kw)
    assert field.replace("synthetic_method", "rejection_sample_method='synthetic'") in str(e.value)


def test_missing_required_keys():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig.from_user({"model": "x"}, 128)
    with pytest.raises(ConfigError, match="model"):
        SpeculativeConfig.from_user({"num_speculative_tokens": 2}, 128)
    with pytest.raises(ConfigError, match="dict or SpeculativeConfig"):
        SpeculativeConfig.from_user("draft", 128)
    with pytest.raises(ConfigError, match=r"unknown keys \['modle'\]"):  # a misspelt key named, not "model is required"
        SpeculativeConfig.from_user({"modle": "x", "num_speculative_tokens": 2}, 128)


def test_vllm_keys_that_ask_for_nothing_more():
    """vLLM's method=None ("detect") is this draft model, and draft_tensor_parallel_size=1 a whole
    draft (LLM checks it against tensor_parallel_size); a method tandem lacks is refused by name
    before the draft model it does not need."""
    assert cfg(method=None).method == "draft_model"
    assert cfg(method="draft_model", draft_tensor_parallel_size=1).k == 3
    with pytest.raises(ConfigError, match="method='eagle'"):
        SpeculativeConfig.from_user({"method": "eagle", "num_speculative_tokens": 3}, 128)
    assert SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3}, 128).ngram  # test_ngram.py


def test_vllm_only_keys():
    """vLLM's speculative_config keys tandem does not take: left at a value that asks for nothing
    (a config written out for vLLM with every field) they pass; set, each is refused saying why and
    what to do instead; the methods of trained heads, by name."""
    quiet = dict(parallel_drafting=False, use_heterogeneous_vocab=False, enable_adaptive_verification=False,
                 kv_cache_dtype="auto", moe_backend=None, code_revision=None,
                 draft_load_config=None, disable_padded_drafter_batch=False, dspark_block_size=None,
                 revision="main", attention_backend="auto")
    assert cfg(**quiet) == cfg()
    assert SpeculativeConfig.from_user(dict(method="ngram", num_speculative_tokens=3, **quiet), 128).ngram
    for kw, fix in [
        (dict(parallel_drafting=True), "one token a step"),
        (dict(use_heterogeneous_vocab=True), "the target's vocabulary"),
        (dict(enable_adaptive_verification=True), "num_speculative_tokens_per_batch_size='auto'"),
        (dict(kv_cache_dtype="fp8"), "LLM's kv_cache_dtype"),
        (dict(attention_backend="FLASH_ATTN"), "attention kernels itself"),
        (dict(revision="v1.0"), "never a hub revision"),
        (dict(revision="auto"), "never a hub revision"),  # ("auto" passes only where vLLM has it)
        (dict(draft_load_config={"x": 1}), "pass draft_load_format"),
        (dict(disable_eagle_block_drop=True), "EAGLE / MTP / DSpark"),
        (dict(dspark_block_size=4), "EAGLE / MTP / DSpark"),
    ]:
        key, value = next(iter(kw.items()))
        with pytest.raises(ConfigError, match=rf"speculative_config\.{key}={value!r} is not supported: .*{fix}"):
            cfg(**kw)
    for method in ("eagle3", "mtp", "medusa", "mlp_speculator", "deepseek_mtp", "ernie_mtp"):
        with pytest.raises(ConfigError, match=rf"method='{method}' drafts with heads trained on the target's hidden"):
            cfg(method=method)


def test_drafts_per_batch_size():
    c = cfg(num_speculative_tokens_per_batch_size=[(9, 64, 0), [2, 8, 1]])
    assert c.num_speculative_tokens_per_batch_size == ((9, 64, 0), (2, 8, 1))
    assert [c.k_for_batch(n) for n in (1, 2, 8, 9, 64, 65)] == [3, 1, 1, 0, 0, 3]
    assert c.draft_counts == (0, 1, 3)
    assert cfg().draft_counts == (3,) and cfg().k_for_batch(100) == 3
    auto = cfg(num_speculative_tokens_per_batch_size="auto")
    assert auto.adaptive and not c.adaptive and auto.draft_counts == (0, 1, 2, 3) and auto.k_for_batch(9) == 3
    assert SpeculativeConfig.from_user(c, 128) == c


def test_numpy_values_are_read_as_the_values_they_hold():
    """An array of ranges, an np.int64 k (they raised numpy's "truth value of an array is
    ambiguous", naming no field)."""
    np = pytest.importorskip("numpy")
    c = cfg(num_speculative_tokens_per_batch_size=np.array([[1, 2, 0], [3, 64, 1]]), num_speculative_tokens=np.int64(3))
    assert c.num_speculative_tokens_per_batch_size == ((1, 2, 0), (3, 64, 1)) and c.num_speculative_tokens == 3
    assert type(c.num_speculative_tokens) is int
    with pytest.raises(ConfigError, match="method"):
        cfg(method=np.array(["ngram", "suffix"]))


def test_a_range_past_max_num_seqs_turns_nothing_off(pair, caplog):
    """A [start, end, 0] range that starts past max_num_seqs is one no batch reaches: it no longer lets
    async_scheduling=True through with a draft model that always drafts, and the log says it never applies."""
    target, draft, _ = pair
    spec = dict(model=str(draft), num_speculative_tokens=2, num_speculative_tokens_per_batch_size=[[8, 64, 0]])
    with pytest.raises(ConfigError, match="async_scheduling=True is not supported"):
        LLM(str(target), max_model_len=64, max_num_seqs=2, async_scheduling=True, speculative_config=spec)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        llm = LLM(str(target), max_model_len=64, max_num_seqs=2, speculative_config=spec)
    assert "[(8, 64, 0)] start past max_num_seqs=2" in caplog.text and not llm.engine.async_scheduling
    reachable = dict(spec, num_speculative_tokens_per_batch_size=[[2, 64, 0]])
    assert LLM(str(target), max_model_len=64, max_num_seqs=2, async_scheduling=True,
               speculative_config=reachable).engine.async_scheduling


def test_synthetic_length_becomes_rates():
    c = cfg(rejection_sample_method="synthetic", synthetic_acceptance_length=2.5)
    assert c.synthetic_acceptance_rates == (1.0, 0.5, 0.0) and c.synthetic_acceptance_length is None
    assert length_to_rates(3.4, 5) == pytest.approx((1, 1, 0.4, 0, 0))
    assert length_to_rates(4, 3) == (1.0, 1.0, 1.0)
    c = cfg(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.8, 0.4, 0.0])
    assert c.conditional_rates() == pytest.approx([0.8, 0.5, 0.0])


def test_accepts_config_object():
    obj = SpeculativeConfig(model="d", num_speculative_tokens=2, draft_sample_method="probabilistic")
    assert SpeculativeConfig.from_user(obj, 64).draft_sample_method == "probabilistic"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return make_hf_model(root / "t", "llama"), make_hf_model(root / "d", "llama", num_layers=1, seed=3), root


def test_draft_graphs_need_the_targets(pair):
    """vLLM's per-draft enforce_eager: True runs the draft eagerly (on the CPU there are no graphs
    anyway); False under a target with enforce_eager=True is refused, before any model loads."""
    target, draft, _ = pair
    spec = dict(model=str(draft), num_speculative_tokens=2)
    llm = LLM(str(target), dtype="float32", max_model_len=128, speculative_config={**spec, "enforce_eager": True})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [3, 4]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    with pytest.raises(ConfigError, match=r"^speculative_config.enforce_eager=False with enforce_eager=True is not "
                                          r"supported: .* leave speculative_config.enforce_eager out"):
        LLM(str(target), dtype="float32", max_model_len=128, enforce_eager=True,
            speculative_config={**spec, "enforce_eager": False})


def test_draft_path_missing(pair):
    target, _, root = pair
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(target), speculative_config={"model": str(root / "nope"), "num_speculative_tokens": 2})


def test_vocabulary_mismatch_is_refused(pair, tmp_path):
    target, _, _ = pair
    other = make_hf_model(tmp_path / "o", "llama", vocab_size=200, tokenizer=False)
    with pytest.raises(ConfigError, match="tokenizer has .* tokens but the smaller embedding table"):
        LLM(str(target), speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_tokenizer_mismatch_is_refused(pair, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, _, _ = pair
    other = make_hf_model(tmp_path / "o", "llama", tokenizer=False)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(other))
    with pytest.raises(ConfigError, match="tokenizers of target .* and draft .* differ"):
        LLM(str(target), speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_a_gguf_vocabulary_padded_with_placeholders_pairs_with_the_unpadded_one(tmp_path, monkeypatch):
    """llama.cpp's converter pads a GGUF's vocabulary with "[PAD<id>]" tokens up to the embedding
    rows; the same family's Hugging Face tokenizer stops at its last real token (its table keeps
    the rows, as Qwen2.5's 151665 tokens in 151936). The two pair, either way round: every id both
    define names the same token. Greedy output is the target's alone."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tandem.models.hub import resolve_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "plain.gguf", arch="qwen2", seed=1)
    write_tiny_gguf(tmp_path / "padded.gguf", arch="qwen2", seed=2, n_layers=1, num_pad_tokens=13)
    hf = tmp_path / "hf"  # the Hugging Face form: the plain tokenizer, the padded table's 282 rows
    shutil.copytree(resolve_model(tmp_path / "plain.gguf", torch.float32, progress=False), hf)
    weights = load_file(hf / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = torch.cat([weights[name], 0.5 * torch.randn(13, weights[name].shape[1])])
    save_file(weights, hf / "model.safetensors")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 13}))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, block_size=8, seed=0)
    for target, draft in ((str(hf), str(tmp_path / "padded.gguf")), (str(tmp_path / "padded.gguf"), str(hf))):
        alone = LLM(target, **kw).generate(["the then"], params, use_tqdm=False)[0].outputs[0].token_ids
        spec = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 2}, **kw)
        assert spec.generate(["the then"], params, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_draft_shorter_than_target_context(pair, tmp_path):
    target, _, _ = pair
    short = make_hf_model(tmp_path / "s", "llama", max_position_embeddings=64)
    with pytest.raises(ConfigError, match="lower max_model_len to 64"):
        LLM(str(target), max_model_len=128, speculative_config={"model": str(short), "num_speculative_tokens": 2})


def test_synthetic_mode_warns(pair, caplog):
    target, draft, _ = pair
    spec = dict(model=str(draft), num_speculative_tokens=2, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[0.5, 0.2])
    with caplog.at_level(logging.WARNING, logger="tandem"):
        LLM(str(target), max_model_len=64, speculative_config=spec)
    assert any("NOT distributed as the target" in r.message for r in caplog.records)


def test_synthetic_acceptance_matches_configured_rates(pair):
    target, draft, _ = pair
    rates = [0.8, 0.5, 0.2]
    spec = dict(model=str(draft), num_speculative_tokens=3, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=rates)
    llm = LLM(str(target), dtype="float32", max_model_len=128, speculative_config=spec)
    prompts = [{"prompt_token_ids": [5 + i, 9, 14]} for i in range(16)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    m = llm.engine.spec_metrics
    for measured, drafted, expect in zip(m.accepted_per_position, m.drafted_per_position, rates):
        # Rounds that verified fewer than 3 drafts (near max_tokens) still follow the same chain.
        p = measured / drafted
        sigma = (expect * (1 - expect) / drafted) ** 0.5
        assert abs(p - expect) < 4 * sigma + 0.02, (p, expect, drafted)
    assert m.mean_acceptance_length == pytest.approx(1 + sum(rates), abs=0.15)


def _item(req_id, num_drafts):
    return ScheduledReq(req_id, 0, 10, [1], num_drafts, [0], True, 3)


def test_metrics_arithmetic():
    m = SpecMetrics(k=3)
    plan = StepPlan([], [_item(0, 3), _item(1, 3), _item(2, 2), _item(3, 0)])
    result = StepResult([[5, 6, 7, 8], [5], [5, 6], [9]], [None] * 4, [3, 3, 3, 3])
    m.observe(plan, result)
    assert (m.num_draft_rounds, m.num_draft_tokens, m.num_accepted_tokens) == (3, 8, 4)
    assert m.acceptance_rate == pytest.approx(4 / 8)
    assert m.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert m.accepted_per_position == [2, 1, 1] and m.drafted_per_position == [3, 3, 2]
    assert m.length_histogram == [0, 1, 1, 0, 1]
    assert "acceptance rate 0.500" in m.log_line()
    # Per-position rates over every round, as vLLM's (not over the rounds that drafted the position).
    assert m.per_position_rates() == pytest.approx([a / m.num_draft_rounds for a in (2, 1, 1)])
    assert sum(m.per_position_rates()) == pytest.approx(m.mean_acceptance_length - 1)


def test_the_periodic_log_line_covers_its_interval():
    """As vLLM's periodic line: the rounds since the last line (rates, tokens a second), the totals
    after them; an interval without a round logs nothing."""
    m = SpecMetrics(k=3)
    m.observe(StepPlan([], [_item(0, 3), _item(1, 3)]), StepResult([[5, 6, 7, 8], [5, 6, 7, 8]], [None] * 2, [3, 3]))
    line = m.interval_line(10.0)
    assert "last 10.0 s: mean acceptance length 4.00, acceptance rate 1.000, accepted 0.6 tokens/s" in line
    assert "drafted 0.6 tokens/s (6 of 6 drafts, 2 rounds), per-position [1.00, 1.00, 1.00]" in line
    assert m.interval_line(10.0) is None
    m.observe(StepPlan([], [_item(0, 3), _item(1, 3)]), StepResult([[5], [5, 6]], [None] * 2, [3, 3]))
    line = m.interval_line(5.0)
    assert "last 5.0 s: mean acceptance length 1.50, acceptance rate 0.167, accepted 0.2 tokens/s" in line
    assert "(1 of 6 drafts, 2 rounds), per-position [0.50, 0.00, 0.00]" in line
    assert line.endswith("since the start: acceptance rate 0.583, mean acceptance length 2.75")


def test_the_engine_logs_its_acceptance_every_interval(pair, caplog):
    target, draft, _ = pair
    quiet = LLM(str(target), speculative_config={"model": str(draft), "num_speculative_tokens": 2}, dtype="float32",
                max_model_len=64)
    assert quiet.engine.log_interval_s == float("inf")  # vLLM's LLM: disable_log_stats=True unless asked
    llm = LLM(str(target), speculative_config={"model": str(draft), "num_speculative_tokens": 2}, dtype="float32",
              max_model_len=64, disable_log_stats=False)
    assert llm.engine.log_interval_s == 10.0
    llm.engine.log_interval_s = 0.0
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "speculative decoding, last" in r.getMessage()]
    assert lines and all("since the start" in line for line in lines)


def test_metrics_leave_out_drafts_past_max_tokens():
    """A request with room for 1 more draft verifies 3: one round of 1 draft, accepted or not."""
    m = SpecMetrics(k=3)
    items = [ScheduledReq(0, 0, 10, [1], 3, [0], True, 3, num_useful_drafts=1),
             ScheduledReq(1, 1, 10, [1], 3, [0], True, 3, num_useful_drafts=0),
             ScheduledReq(2, 2, 10, [1], 3, [0], True, 3, num_useful_drafts=2)]
    m.observe(StepPlan([], items), StepResult([[5, 6, 7, 8], [5, 6], [5]], [None] * 3, [3, 3, 3]))
    assert (m.num_draft_rounds, m.num_draft_tokens, m.num_accepted_tokens) == (2, 3, 1)
    assert m.accepted_per_position == [1, 0, 0] and m.drafted_per_position == [2, 1, 0]
    assert m.length_histogram == [0, 1, 1, 0, 0]


def test_per_request_metrics(pair):
    target, _, _ = pair
    spec = dict(model=str(target), num_speculative_tokens=3)
    llm = LLM(str(target), dtype="float32", max_model_len=128, speculative_config=spec)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    # Target as draft: every round accepts all its drafts; 13 tokens = 1 (prefill) + 3 rounds of 4.
    assert (m.num_draft_rounds, m.num_draft_tokens, m.num_accepted_tokens) == (3, 9, 9)
    assert m.acceptance_rate == 1.0 and m.mean_acceptance_length == 4.0
    assert m.accepted_per_position == [3, 3, 3]
    assert m.acceptance_histogram == [0, 0, 0, 3] and m.acceptance_by_num_drafts == {3: [0, 0, 0, 3]}
    assert m.per_step_accepted is None  # kept with per_request_spec_decode_metrics="detailed" only
    # 11 tokens: the third round verifies 3 drafts but only 1 can become output, and only it counts.
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    assert len(out.outputs[0].token_ids) == 11
    assert (m.num_draft_rounds, m.num_draft_tokens, m.num_accepted_tokens) == (3, 7, 7)
    assert m.mean_acceptance_length == pytest.approx(1 + 7 / 3) and m.accepted_per_position == [3, 2, 2]
    assert m.acceptance_histogram == [0, 1, 0, 2] and m.acceptance_by_num_drafts == {1: [0, 1], 3: [0, 0, 0, 2]}

"""Tensor parallelism on the CPU: two ranks (processes over gloo) give the one-rank engine's tokens."""
from __future__ import annotations

import time

import pytest
import torch

from tests.helpers import assert_greedy_equal_up_to_near_tie, make_hf_model, make_spec_models
from tandem import LLM, SamplingParams
from tandem.config import read_arch_config
from tandem.errors import ConfigError, RequestError, StepError
from tandem.models.loader import load_model
from tandem.parallel.shard import shard_arch, shard_param, vocab_rows
from tandem.sampling_params import StructuredOutputsParams

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 33, 7]}, {"prompt_token_ids": [4, 4, 100, 2, 17, 8, 8, 3]},
           {"prompt_token_ids": [250]}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = make_spec_models(root)
    # tied embeddings and a vocabulary that two ranks split unevenly (161 + 160 rows), q/k norms
    out["tied"] = make_hf_model(root / "tied", "qwen3", vocab_size=321, tie=True, num_heads=4, num_kv_heads=2,
                                head_dim=16, seed=3)
    return out


def _run(model, tp, prompts=PROMPTS, params=None, setup=None, **kw):
    llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=tp, **kw)
    try:
        if setup is not None:
            setup(llm)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        if tp > 1:
            llm.engine.close()


def _tokens(outs):
    return [o.token_ids for o in outs]


def test_shards_reassemble_the_checkpoint(models):
    """Each rank's slice of every weight, put back together, is the whole weight: q, k and v heads
    and gate / up rows by output, o / down by input, the head by vocabulary rows (zero-padded)."""
    arch = read_arch_config(models["tied"])
    from tandem.config import ModelConfig

    whole = load_model(ModelConfig(str(models["tied"]), arch, torch.float32, 128), torch.device("cpu"))
    params = dict(whole.named_parameters())
    params["lm_head.weight"] = whole.lm_head.weight
    local = shard_arch(arch, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, arch.intermediate_size // 2)
    d = arch.head_dim
    for name, full in params.items():
        parts = [shard_param(name, full, arch, r, 2) for r in range(2)]
        if name.endswith("qkv_proj.weight"):
            q, k, v = zip(*(p.split([2 * d, d, d]) for p in parts))
            assert torch.equal(torch.cat(q + k + v), full)
        elif name.endswith("gate_up_proj.weight"):
            half = arch.intermediate_size // 2
            gate, up = zip(*(p.split(half) for p in parts))
            assert torch.equal(torch.cat(gate + up), full)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), full)
        elif name == "lm_head.weight":
            assert [p.shape[0] for p in parts] == [vocab_rows(321, 2)] * 2 == [161, 161]
            assert torch.equal(torch.cat(parts)[:321], full) and not parts[1][160:].any()
        else:
            assert all(torch.equal(p, full) for p in parts), name


@pytest.mark.parametrize("name", ["target", "tied"])
def test_checkpoint_read_in_rank_parts(models, name):
    """Each rank reads from the safetensors files only its part of each tensor (q/k/v biases
    included; a tied head from the embedding table): the weights the whole model cut by shard_param
    gives."""
    from types import SimpleNamespace

    from tandem.config import ModelConfig

    arch = read_arch_config(models[name])
    cfg = ModelConfig(str(models[name]), arch, torch.float32, 128, tp_size=2)
    whole = load_model(cfg, torch.device("cpu"))
    full = dict(whole.named_parameters())
    full["lm_head.weight"] = whole.lm_head.weight
    for rank in range(2):
        ranked = load_model(cfg, torch.device("cpu"), tp=SimpleNamespace(rank=rank, size=2))
        got = dict(ranked.named_parameters())
        assert got.keys() == full.keys()
        for key, t in got.items():
            assert torch.equal(t, shard_param(key, full[key], arch, rank, 2)), (rank, key)


def test_greedy_two_ranks_match_one(models):
    """Greedy decoding on two ranks gives the one-rank tokens, alone and with a draft sharded over
    the same ranks (its greedy drafts from each rank's best token) or whole on every rank (with a
    pruned head: draft_vocab_size); the structured-output request's grammar advances in lockstep on
    both ranks."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    choice = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
        choice=["alpha beta", "gamma"]))
    prompts = PROMPTS + ["Pick one:"]
    params = [greedy] * len(PROMPTS) + [choice]
    ref = _run(models["target"], 1, prompts, params)
    assert ref[-1].text in ("alpha beta", "gamma")
    for kw in (dict(), dict(speculative_config={"model": str(models["near"]), "num_speculative_tokens": 3}),
               # vLLM's use_local_argmax_reduction=False: the sharded draft's logits gathered instead
               dict(speculative_config={"model": str(models["near"]), "num_speculative_tokens": 3,
                                        "use_local_argmax_reduction": False}),
               # the confidence stop: every rank ends the same chains (the logits gathered whole)
               dict(speculative_config={"model": str(models["near"]), "num_speculative_tokens": 3,
                                        "draft_confidence_threshold": 0.3}),
               dict(speculative_config={"model": str(models["other"]), "num_speculative_tokens": 2,
                                        "draft_tensor_parallel_size": 1, "draft_vocab_size": 200})):
        spec = kw.get("speculative_config", {})

        def setup(llm):  # rank 0's draft reduces its argmax across ranks unless told not to
            if spec.get("draft_tensor_parallel_size") is None and spec:
                assert llm.engine.runner.speculator.local_argmax is spec.get("use_local_argmax_reduction", True)

        outs = _run(models["target"], 2, prompts, params, setup, **kw)
        for out, r in zip(outs[:-1], ref[:-1]):
            assert_greedy_equal_up_to_near_tie(out, r, gap=1e-4)
        assert outs[-1].text == ref[-1].text, kw


def test_every_rank_takes_the_same_settings_and_refusals(models):
    """Setting an engine attribute reaches every rank (free drafts for a constrained request change
    the drafts, hence the steps: one rank alone would fall out of step), and a request the engine
    refuses is refused on every rank, the others going on."""
    spec = {"model": str(models["near"]), "num_speculative_tokens": 3}
    choice = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex="[a-z ]{3,12}"))
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(PROMPTS) + [choice]
    prompts = PROMPTS + ["Write:"]

    def setup(llm):
        llm.engine.grammar_drafting = None
        with pytest.raises(RequestError, match="max_model_len"):
            llm.engine.add_request("too-long", [1] * 200, SamplingParams())

    assert _tokens(_run(models["target"], 2, prompts, params, setup, speculative_config=spec)) == \
        _tokens(_run(models["target"], 1, prompts, params, setup, speculative_config=spec))


def test_a_rank_that_exits_stops_the_engine(models):
    """A rank whose process has exited: the next step or request gets a fatal StepError naming it
    (not a collective waiting for it), and aborts still end requests on rank 0."""
    threads = torch.get_num_threads()
    llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    try:
        p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].token_ids) == 4
        worker = llm.engine._workers.procs[0]
        worker.terminate()
        worker.join(timeout=30)
        with pytest.raises(StepError, match="rank 1 has exited") as info:
            llm.generate(PROMPTS[:1], p, use_tqdm=False)
        assert info.value.fatal
        assert llm.engine.abort_request("no-such-request") is False
    finally:
        llm.engine.close()
    assert torch.get_num_threads() == threads  # the CPU's share rank 0 gave up comes back


def test_ctrl_c_reaches_rank_0_alone(models):
    """Ctrl-C in a terminal signals every process of its group: the other ranks ignore it, so rank 0
    decides (a server finishes its requests first) and the engine goes on (rank 1 ended with a
    KeyboardInterrupt and the engine stopped)."""
    import os
    import signal

    llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    try:
        p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        before = llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].token_ids
        worker = llm.engine._workers.procs[0]
        os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert worker.is_alive()
        assert llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].token_ids == before
    finally:
        llm.engine.close()


def test_dropping_the_llm_stops_its_ranks_and_gives_the_threads_back(models):
    """An LLM dropped without engine.close() (a script that just ends its use): its ranks stop and the
    caller's torch threads come back; they stayed cut to rank 0's share for good."""
    import gc

    threads = torch.get_num_threads()
    llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    procs = list(llm.engine._workers.procs)
    assert torch.get_num_threads() < threads or threads == 1
    del llm
    gc.collect()
    assert torch.get_num_threads() == threads
    for proc in procs:
        proc.join(timeout=30)
        assert not proc.is_alive()


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_engines_give_the_caller_its_threads_back(models, first):
    """Two tensor-parallel engines in one process, closed in either order: the caller ends with the
    torch threads it had (closed first, the first engine gave them back and the second then put back
    the count it had found, rank 0's share, for good)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kw = dict(dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
        engines = {"a": LLM(str(models["target"]), **kw), "b": LLM(str(models["target"]), **kw)}
        for name in (first, "b" if first == "a" else "a"):
            engines[name].engine.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_rank_that_fails_to_load_names_its_error(models, tmp_path, monkeypatch):
    """Rank 1 fails while loading, after joining the group (here: its copy of the checkpoint is
    corrupt; in life, its own out-of-memory): rank 0's next collective breaks at once, and rank 0
    raises rank 1's error, not the transport's."""
    import shutil
    import time

    import tandem.engine.llm as llm_mod

    broken = tmp_path / "broken"
    shutil.copytree(models["target"], broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    real = llm_mod.Workers

    def workers(size, port, launch):  # only the other rank reads the broken copy
        return real(size, port, dict(launch, model=str(broken)))

    monkeypatch.setattr(llm_mod, "Workers", workers)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"tensor-parallel rank 1: model: .*broken.* is not a valid safetensors") \
            as info:
        LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 120  # not the group's 600 s timeout
    assert info.value.__cause__ is not None  # rank 0's own failure, chained


def test_a_rank_that_fails_before_joining_is_not_waited_for(models, monkeypatch):
    """Rank 1 fails before it joins the group (here: a setting only it gets, refused; in life, its
    GPU busy): rank 0 does not wait for it to join (the group's 600 s timeout) but raises its error,
    and gets its torch threads back."""
    import time

    import tandem.engine.llm as llm_mod

    real = llm_mod.Workers
    monkeypatch.setattr(llm_mod, "Workers", lambda size, port, launch: real(size, port, dict(launch, dtype="float7")))
    threads, t0 = torch.get_num_threads(), time.monotonic()
    with pytest.raises(ConfigError, match=r"tensor-parallel rank 1: .*float7"):
        LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    assert time.monotonic() - t0 < 60 and torch.get_num_threads() == threads


def test_a_rank_whose_own_call_fails_stops_the_engine_at_once(models):
    """A call that fails on rank 1 alone (in life, its own out-of-memory; here a step it alone is
    sent, wrongly): rank 1 reports its error and leaves, so rank 0's next step does not wait in a
    collective for it but raises rank 1's error, fatal; the engine then takes no more work, and
    once closed says so."""
    import time

    llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        llm.engine._workers.send("step", ("not a step's argument",), {})
        t0 = time.monotonic()
        with pytest.raises(StepError, match=r"tensor-parallel rank 1 failed.*step: TypeError") as info:
            llm.generate(PROMPTS, p, use_tqdm=False)
        assert info.value.fatal and time.monotonic() - t0 < 60
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(StepError, match="rank 1 failed"):
            llm.generate(PROMPTS[:1], p, use_tqdm=False)
    finally:
        llm.engine.close()
    with pytest.raises(StepError, match=r"the engine was closed \(engine.close\(\)\)"):
        llm.generate(PROMPTS[:1], p, use_tqdm=False)


def test_an_interrupted_step_stops_the_engine(models, monkeypatch):
    """Ctrl-C on rank 0 in a step: the other rank may wait in that step's collectives, so the ranks
    no longer agree; the interrupt reaches the caller, and the engine takes no more work (a fatal
    StepError saying why) rather than hang or mismatch collectives."""
    llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        runner = llm.engine._engine.runner
        real, calls = runner.launch_sampling, []

        def interrupted(*args, **kwargs):  # after the step's forward: rank 1 waits in the sampling's gather
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(runner, "launch_sampling", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, p, use_tqdm=False)
        with pytest.raises(StepError, match="interrupted under tensor parallelism") as info:
            llm.generate(PROMPTS, p, use_tqdm=False)
        assert info.value.fatal
    finally:
        llm.engine.close()


def test_a_request_that_cannot_reach_the_other_ranks_is_refused(models):
    """Every rank gets each request: extra_args that do not pickle are refused by name (a
    RequestError, not pickle's TypeError), and the call's earlier requests end with it."""
    import threading

    llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    try:
        ok = SamplingParams(temperature=0, max_tokens=4)
        bad = SamplingParams(temperature=0, max_tokens=4, extra_args={"lock": threading.Lock()})
        with pytest.raises(RequestError, match="must be picklable"):
            llm.generate(PROMPTS[:2], [ok, bad], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert len(llm.generate(PROMPTS[:1], ok, use_tqdm=False)[0].outputs[0].token_ids) == 4
        # a call that cannot bind (a keyword add_request lacks) fails on rank 0 alone: the ranks live on
        with pytest.raises(TypeError, match="prompt"):
            llm.engine.add_request("x", [5, 6, 7], ok, prompt="the text")
        assert len(llm.generate(PROMPTS[:1], ok, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.close()


def test_an_unguarded_script_gets_told_not_stuck(models, tmp_path):
    """A script that makes a tensor-parallel LLM at its top level: each spawned rank imports it
    first, which fails there; rank 0 says why and what to do instead of waiting for that rank."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from tandem import LLM\n"
                      f"LLM({str(models['target'])!r}, dtype='float32', device='cpu', tensor_parallel_size=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'create the LLM under `if __name__ == "__main__":`' in done.stderr, done.stderr[-2000:]


def test_tied_uneven_vocabulary_two_ranks(models):
    """A tied head split 161 / 160 over the ranks (padding rows never win) with q / k norms."""
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert _tokens(_run(models["tied"], 2, params=p)) == _tokens(_run(models["tied"], 1, params=p))


def test_o_proj_bias_is_added_once_over_two_ranks(models, tmp_path):
    """attention_bias gives Llama an o_proj bias, a row-parallel one: rank 0 adds it, the sum once."""
    biased = make_hf_model(tmp_path / "biased", "llama", extra={"attention_bias": True}, seed=5)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    one, two = _run(biased, 1, params=p), _run(biased, 2, params=p)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_seeded_sampling_two_ranks_match_one(models):
    """Seeded sampling with probabilistic drafts: both ranks draw the same keyed tokens from the
    gathered logits (no token is exchanged), and those are the one-rank engine's."""
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=11)
    spec = {"model": str(models["near"]), "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    assert _tokens(_run(models["target"], 2, params=p, speculative_config=spec)) == \
        _tokens(_run(models["target"], 1, params=p, speculative_config=spec))


def test_every_sampling_feature_two_ranks_match_one(models):
    """Penalties, bias, truncation, n > 1, stop strings, min_tokens, logprobs and prompt logprobs,
    watermarked draws and sampled drafts: the same tokens and (to rounding) logprobs on two ranks."""
    spec = {"model": str(models["near"]), "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"}
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                             presence_penalty=0.3, frequency_penalty=0.2, logit_bias={7: 3.0}, n=2, seed=5,
                             max_tokens=12, min_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop=["e"], bad_words_token_ids=[[9]], logprobs=1),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]
    runs = []
    for tp in (1, 2):
        llm = LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=tp,
                  speculative_config=spec, watermark_config={"key": 11})
        try:
            runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        finally:
            if tp > 1:
                llm.engine.close()
    for one, two in zip(*runs):
        assert [o.token_ids for o in two.outputs] == [o.token_ids for o in one.outputs]
        for a, b in zip(two.outputs, one.outputs):
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        for x, y in zip(two.prompt_logprobs or [], one.prompt_logprobs or []):
            assert (x is None) == (y is None) and (x is None or all(abs(x[t].logprob - y[t].logprob) < 1e-4
                                                                    for t in x))


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's num_attention_heads"),
    (dict(tensor_parallel_size=2, speculative_config={"model": "other", "num_speculative_tokens": 2}),
     "tensor_parallel_size=2 does not divide the draft model.*; or set speculative_config.draft_tensor_parallel_size=1"),
    (dict(tensor_parallel_size=2, speculative_config={"model": "near", "num_speculative_tokens": 2,
                                                      "draft_tensor_parallel_size": 4}),
     "draft_tensor_parallel_size=4 must be 1"),
    (dict(speculative_config={"model": "near", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}),
     "draft_tensor_parallel_size=2 must be 1"),
    (dict(tensor_parallel_size=2, speculative_config={"model": "near", "num_speculative_tokens": 2,
                                                      "num_speculative_tokens_per_batch_size": "auto"}),
     "not supported with tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=2, speculative_config={"model": "near", "num_speculative_tokens": 2,
                                                      "draft_vocab_size": 100}),
     "prune the draft's LM head, which is not sharded: set speculative_config.draft_tensor_parallel_size=1"),
])
def test_configurations_that_cannot_shard(models, kw, match):
    spec = kw.get("speculative_config")
    if spec is not None:
        kw = dict(kw, speculative_config=dict(spec, model=str(models[spec["model"]])))
    with pytest.raises(ConfigError, match=match):
        LLM(str(models["target"]), dtype="float32", device="cpu", max_model_len=128, **kw)

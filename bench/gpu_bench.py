"""GPU benchmark (issue 5): target-only decode vs the roofline, speculative decoding with
synthetic acceptance and on the eps pair, and transformers as the peer, in one run.

    python3 bench/gpu_bench.py --out $OUT/gpu_bench.json           # on the H200
    python3 bench/gpu_bench.py --quick                              # small shapes, minutes
    python3 bench/gpu_bench.py --sections synthetic --ks 4 --batches 1 --env-ab TANDEM_PDL=0  # an A/B
    python3 bench/gpu_bench.py --sections target,synthetic --ks 4 --target-quantizations none,fp8  # the fp8 target

Models use load_format="dummy" (seeded random weights, real shapes). Step times are medians
over timed engine steps after warm-up (each step includes its one device->host sync); graph
replay times (target verify vs decode, the draft's catch-up and whole round) come from CUDA events.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, print_table, write_json  # noqa: E402

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192),
                bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
LLAMA_1B = dict(LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
QWEN_15B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
QWEN_05B = dict(QWEN_15B, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, tie_word_embeddings=True)
# Target / draft shapes of the synthetic section (--pairs) and of gpu_profile.py --pair.
PAIRS = {"llama": (("llama-8b", LLAMA_8B), ("llama-1b", LLAMA_1B)),
         "qwen": (("qwen-1.5b", QWEN_15B), ("qwen-0.5b", QWEN_05B))}
TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=32000)
TINY_DRAFT = dict(TINY, num_hidden_layers=1)

# Per-position unconditional acceptance measured on the real Qwen2.5-Coder pair on CPU at k = 8, code prompts
# (docs/benchmarks.md, 2026-12-04: `python bench/real_pair.py --ks 8 --default-k 8 --classes code --skip-hf`);
# the "real-cpu" profile's default, overridable with --real-rates.
REAL_RATES = "0.924,0.859,0.783,0.739,0.707,0.663,0.630,0.598"


def write_config(root: Path, name: str, shape: dict) -> str:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(shape))
    return str(d)


def weight_bytes(shape: dict, quantization: str | None = None) -> int:
    """Bytes of every weight a decode step reads (all but the input embedding; a tied table
    is read once, as the LM head). bf16; quantization="fp8": the layers' linears a byte a weight
    (their per-row scales counted), the norms and the LM head bf16."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim", h // heads)
    linears = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i
    rows = heads * d + 2 * kv * d + h + 2 * i + h  # output rows of qkv, o, gate_up, down: an fp32 scale each
    per_linear_weight = 1 if quantization == "fp8" else 2
    layer = per_linear_weight * linears + (4 * rows if quantization == "fp8" else 0) + 2 * 2 * h
    return n * layer + 2 * (h + shape["vocab_size"] * h)


def kv_bytes_per_token(shape: dict, kv_cache_dtype: str) -> int:
    """Bytes of K and V one token keeps in the cache (bf16, or 1 a value in fp8)."""
    d = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    elem = 1 if kv_cache_dtype.startswith("fp8") else 2
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * d * elem


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    return 2 * (2 << 30) / statistics.median(times)


def make_llm(target: str, spec: dict | None, max_num_seqs: int, max_model_len: int, watermark_config=None,
             kv_cache_dtype: str = "auto", quantization: str | None = None, batch_invariant: bool = False):
    from tandem import LLM

    return LLM(target, dtype="bfloat16", load_format="dummy", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               kv_cache_memory_bytes=12 << 30, speculative_config=spec, enable_prefix_caching=False,
               watermark_config=watermark_config, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
               batch_invariant=batch_invariant)


def target_quantizations(args) -> list[tuple[str | None, str]]:
    """--target-quantizations as (LLM's quantization, the suffix of the target's name)."""
    return [(None, "") if q == "none" else (q, f" {q}") for q in args.target_quantizations.split(",")]


def free() -> None:
    """Return what the engines the caller dropped (`del llm` first: a name still bound keeps one) held."""
    gc.collect()
    torch.cuda.empty_cache()


def measure_steps(llm, batch: int, prompt_len: int, steps: int, warmup: int = 8, temperature: float = 0.0) -> dict:
    """Decode-phase step time: add `batch` requests, prefill them, then time `steps` steps; with a
    speculator, the draft rounds, accepted and drafted tokens of those steps alone (`rounds`,
    `accepted`, `drafted`: not the prefill's or the warm-up's)."""
    from tandem import SamplingParams

    engine = llm.engine
    # Seeds 0, 1, ...: reproducible, and each request its own draws (one seed for all had every request of a
    # batch accept and reject at the same rounds under synthetic acceptance: a batch of 8 was one sample).
    params = [SamplingParams(temperature=temperature, max_tokens=warmup + steps * 10 + 64, ignore_eos=True, seed=i)
              for i in range(batch)]
    g = torch.Generator().manual_seed(batch)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(batch)]
    for rid, p in zip(ids, params):
        engine.add_request(rid, torch.randint(10, 30000, (prompt_len,), generator=g).tolist(), p)
    produced = {rid: 0 for rid in ids}

    def step() -> int:
        n = 0
        for out in engine.step():
            new = len(out.outputs[0].token_ids) - produced.get(out.request_id, 0)
            produced[out.request_id] = len(out.outputs[0].token_ids)
            n += new
        return n

    while any(v == 0 for v in produced.values()):
        step()
    for _ in range(warmup):
        step()
    metrics = engine.spec_metrics
    before = (metrics.num_draft_rounds, metrics.num_accepted_tokens, metrics.num_draft_tokens) \
        if metrics is not None else None
    times, tokens = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens += step()
        times.append(time.perf_counter() - t0)
    counts = {} if before is None else dict(rounds=metrics.num_draft_rounds - before[0],
                                            accepted=metrics.num_accepted_tokens - before[1],
                                            drafted=metrics.num_draft_tokens - before[2])
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    med = statistics.median(times)
    return {"ms_per_step": med * 1e3, "tokens_per_step": tokens / steps, "tok_s": tokens / sum(times),
            "steps": steps, **counts}


def recapture(llm) -> None:
    llm.engine.runner.graphs.clear()
    gc.collect()
    llm.engine.capture_graphs()


def use_gemv(llm, on: bool) -> None:
    """One-row linears through the Triton GEMV (on) or cuBLAS (off), graphs recaptured: the A/B
    of tandem/layers/gpu_linear.py on the same engine."""
    from tandem.layers.gpu_linear import GemvLinear

    runner = llm.engine.runner
    models = [runner.model] + ([runner.speculator.model] if runner.speculator is not None else [])
    for model in models:
        for m in model.modules():
            if isinstance(m, GemvLinear):
                m.use_gemv = on
    recapture(llm)


class env_variant:
    """Environment assignments ("A=1,B=2") in force inside the block, graphs recaptured on entry
    and exit: an A/B of a launch-time switch (e.g. TANDEM_PDL) on one engine."""

    def __init__(self, llm, assignments: str):
        self.llm = llm
        self.env = dict(kv.split("=", 1) for kv in assignments.split(","))

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        recapture(self.llm)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        recapture(self.llm)


def graph_time(graph) -> float:
    """Median replay time. The replays read the attention metadata the graph's buffers hold, so
    time a graph after real steps have run through it: a freshly captured one holds the capture's
    (empty) contexts and replays faster than a real step."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    ts = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return statistics.median(ts)


def draft_graph_times(sp, b: int) -> tuple[float, float]:
    """-> (the draft's catch-up graph, its whole greedy round graph: catch-up + k - 1 loop steps)
    in ms, replayed on the buffers the last real round left (the graphs of k drafts)."""
    g = sp.graphs[sp.k]
    return graph_time(g.catchup.graphs[g.catchup.bucket(b)]), graph_time(g.rounds[g.bucket(b)])


def target_only(root, shapes, batches, args, bw, results) -> dict:
    base = {}
    kv_dtypes = args.kv_cache_dtypes.split(",")
    for (name, shape), kv_dtype, (quant, suffix) in [(s, kv, q) for s in shapes for kv in kv_dtypes
                                                     for q in target_quantizations(args)]:
        llm = make_llm(write_config(root, name, shape), None, max(batches), args.max_model_len, kv_cache_dtype=kv_dtype,
                       batch_invariant=args.batch_invariant,
                       quantization=quant)
        wb = weight_bytes(shape, quant)
        name = name + suffix
        engine = llm.engine
        for b in batches:
            r = measure_steps(llm, b, args.prompt_len, args.steps)
            if engine.async_scheduling:  # the same engine, each step planned after the last one's result
                engine.async_scheduling = False
                r["sync_ms_per_step"] = measure_steps(llm, b, args.prompt_len, args.steps)["ms_per_step"]
                engine.async_scheduling = True
            g = llm.engine.runner.graphs[1]
            r["graph_ms"] = graph_time(g.graphs[g.bucket(b)])
            if b == 1 and args.ab_gemv:
                use_gemv(llm, False)
                r["cublas_ms_per_step"] = measure_steps(llm, b, args.prompt_len, args.steps)["ms_per_step"]
                g = llm.engine.runner.graphs[1]
                r["cublas_graph_ms"] = graph_time(g.graphs[g.bucket(b)])
                use_gemv(llm, True)
                print(f"[target-only] {name} b=1 with cuBLAS for one-row linears: {r['cublas_ms_per_step']:.2f} "
                      f"ms/step ({r['cublas_graph_ms']:.2f} graph)", flush=True)
            for variant in args.env_ab:
                with env_variant(llm, variant):
                    v = dict(ms_per_step=measure_steps(llm, b, args.prompt_len, args.steps)["ms_per_step"])
                    g = llm.engine.runner.graphs[1]
                    v["graph_ms"] = graph_time(g.graphs[g.bucket(b)])
                r.setdefault("variants", {})[variant] = v
                print(f"[target-only] {name} b={b} with {variant}: {v['ms_per_step']:.2f} ms/step "
                      f"({v['graph_ms']:.2f} graph)", flush=True)
            r["roofline_frac"] = wb / (r["ms_per_step"] / 1e3) / bw
            r["roofline_frac_graph"] = wb / (r["graph_ms"] / 1e3) / bw
            # the cache a step reads, at least (every request's prompt; the steps add to it)
            kv = b * args.prompt_len * kv_bytes_per_token(shape, kv_dtype)
            r.update(model=name, batch=b, weight_gb=wb / 1e9, kv_cache_dtype=kv_dtype, kv_read_gb=kv / 1e9,
                     roofline_frac_with_kv=(wb + kv) / (r["ms_per_step"] / 1e3) / bw)
            results["target_only"].append(r)
            if kv_dtype == kv_dtypes[0]:
                base[(name, b)] = r
            print(f"[target-only] {name} (kv {kv_dtype}) b={b}: {r['ms_per_step']:.2f} ms/step ({r['graph_ms']:.2f} graph, "
                  f"{r.get('sync_ms_per_step', float('nan')):.2f} without async scheduling), "
                  f"{r['tok_s']:.1f} tok/s, roofline {r['roofline_frac']:.2f} ({r['roofline_frac_graph']:.2f})",
                  flush=True)
        del llm, engine, g  # every name bound to the engine (else it stays on the GPU beside the next)
        free()
    return base


def synthetic(root, target, draft, base, ks, profiles, batches, args, results) -> None:
    tname, tshape = target
    dname, dshape = draft
    tdir, ddir = write_config(root, tname, tshape), write_config(root, dname, dshape)
    variants = [(t, q, v, k) for t in target_quantizations(args) for q in args.draft_quantization.split(",")
                for v in args.draft_vocab_sizes.split(",") for k in ks]
    for (target_quant, suffix), quant, vocab, k in variants:
        tname = target[0] + suffix
        quant = None if quant == "none" else quant
        vocab = None if vocab == "none" else int(vocab)
        tag = (f" {quant} draft" if quant else "") + (f" head {vocab}" if vocab else "")
        spec = dict(model=ddir, num_speculative_tokens=k, rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[1.0] * k, draft_load_format="dummy", quantization=quant,
                    draft_vocab_size=vocab)
        llm = make_llm(tdir, spec, max(batches), args.max_model_len, quantization=target_quant,
                       batch_invariant=args.batch_invariant)
        sp = llm.engine.runner.speculator
        for b in batches:
            graphs_ms = None
            for pname, rates in profiles(k):
                uncond = torch.tensor(rates, dtype=torch.float32)
                cond = uncond / torch.cat([torch.ones(1), uncond[:-1]]).clamp(min=1e-9)
                sp.synthetic_rates.copy_(cond.clamp(max=1.0).cuda())
                r = measure_steps(llm, b, args.prompt_len, args.synthetic_steps or args.steps)
                rounds, acc = r["rounds"], r["accepted"]
                ref = base[(tname, b)]
                if graphs_ms is None:  # after real rounds, so the graphs hold real contexts (graph_time)
                    n = llm.engine.runner.graphs[1 + k].bucket(b)
                    graphs_ms = (graph_time(llm.engine.runner.graphs[1 + k].graphs[n]), *draft_graph_times(sp, b))
                verify_ms, catchup_ms, round_ms = graphs_ms
                decode_ms = ref["graph_ms"]  # the target-only engine's decode graph (this engine never decodes)
                expected = 1 + sum(rates)  # E[tokens per round] = 1 + sum of unconditional rates
                r.update(target=tname, draft=dname, k=k, batch=b, profile=pname, draft_quantization=quant,
                         draft_vocab_size=vocab,
                         speedup=r["tok_s"] / ref["tok_s"],
                         # the same round time at the expected tokens per round (no sampling luck)
                         speedup_at_expected=expected * ref["ms_per_step"] / r["ms_per_step"],
                         mean_acceptance_length=1 + acc / max(rounds, 1), expected_acceptance_length=expected,
                         # vLLM's draft acceptance rate: accepted / drafted tokens
                         acceptance_rate=acc / max(rounds * k, 1), expected_acceptance_rate=sum(rates) / k,
                         verify_over_decode=verify_ms / decode_ms, draft_catchup_ms=catchup_ms,
                         draft_step_ms=round_ms / k, decode_ms=decode_ms, verify_ms=verify_ms)
                results["synthetic"].append(r)
                print(f"[synthetic{tag}] {tname} / {dname} k={k} b={b} {pname}: {r['tok_s']:.1f} tok/s, x{r['speedup']:.2f} "
                      f"(x{r['speedup_at_expected']:.2f} at the expected acceptance), acceptance rate "
                      f"{r['acceptance_rate']:.2f} (expected {r['expected_acceptance_rate']:.2f}), round {r['ms_per_step']:.2f} ms, "
                      f"v={r['verify_over_decode']:.2f}, draft step {r['draft_step_ms']:.2f} ms", flush=True)
                for variant in args.env_ab if pname == "uniform-0.8" else []:
                    with env_variant(llm, variant):
                        c = measure_steps(llm, b, args.prompt_len, args.synthetic_steps or args.steps)
                        v_round = draft_graph_times(sp, b)[1]
                    v_base = ref.get("variants", {}).get(variant, ref)["ms_per_step"]
                    v = dict(round_ms=c["ms_per_step"], draft_step_ms=v_round / k,
                             speedup_at_expected=expected * v_base / c["ms_per_step"])
                    r.setdefault("variants", {})[variant] = v
                    print(f"[synthetic] k={k} b={b} uniform-0.8 with {variant}: round {v['round_ms']:.2f} ms, draft "
                          f"step {v['draft_step_ms']:.2f} ms, x{v['speedup_at_expected']:.2f} at the expected "
                          f"acceptance (of its own target-only)", flush=True)
                if args.ab_gemv and b == 1 and pname == "uniform-0.8" and "cublas_ms_per_step" in ref:
                    use_gemv(llm, False)
                    c = measure_steps(llm, b, args.prompt_len, args.synthetic_steps or args.steps)
                    sp = llm.engine.runner.speculator
                    c_round = draft_graph_times(sp, b)[1]
                    use_gemv(llm, True)
                    cublas_target_tok_s = 1e3 / ref["cublas_ms_per_step"]
                    r.update(cublas_tok_s=c["tok_s"], cublas_speedup=c["tok_s"] / cublas_target_tok_s,
                             cublas_ms_per_step=c["ms_per_step"], cublas_draft_step_ms=c_round / k,
                             cublas_speedup_at_expected=expected * ref["cublas_ms_per_step"] / c["ms_per_step"])
                    print(f"[synthetic] k={k} b=1 uniform-0.8 with cuBLAS for one-row linears: {c['tok_s']:.1f} "
                          f"tok/s, x{r['cublas_speedup']:.2f} (of cuBLAS target-only; x"
                          f"{r['cublas_speedup_at_expected']:.2f} at the expected acceptance), round "
                          f"{c['ms_per_step']:.2f} ms, draft step {r['cublas_draft_step_ms']:.2f} ms", flush=True)
        write_json(args.out, results)  # after every k: a sweep cut short by a time limit keeps what it measured
        del llm, sp
        free()


def eps_engine(root, shape, base_name, args, max_num_seqs=1, **llm_kw):
    """The eps pair's engine: draft = the target's first 4 layers (+ its embeddings, norm,
    head), copied in; returns it with the o_proj / down_proj weights of the target's layers of
    index >= 4 (0-based: the issue's "layers 5 and up", which the draft lacks), which set_eps scales."""
    tdir = write_config(root, base_name, shape)
    ddir = write_config(root, base_name + "-first4", dict(shape, num_hidden_layers=4))
    spec = dict(model=ddir, num_speculative_tokens=4, draft_load_format="dummy", **llm_kw.pop("spec_extra", {}))
    llm = make_llm(tdir, spec, max_num_seqs, args.max_model_len, **llm_kw)
    target = llm.engine.runner.model
    draft = llm.engine.runner.speculator.model
    with torch.no_grad():
        for (name, p) in draft.named_parameters():
            p.copy_(target.get_parameter(name))
        originals = {i: (layer.self_attn.o_proj.weight.clone(), layer.mlp.down_proj.weight.clone())
                     for i, layer in enumerate(target.model.layers) if i >= 4}
    return llm, originals


def set_eps(llm, originals, eps: float) -> None:
    """In the target, layers of index >= 4 (0-based) have o_proj and down_proj scaled by eps (0: the draft
    exactly)."""
    target = llm.engine.runner.model
    with torch.no_grad():
        for i, (o, d) in originals.items():
            layer = target.model.layers[i]
            layer.self_attn.o_proj.weight.copy_(o * eps)
            layer.mlp.down_proj.weight.copy_(d * eps)


def eps_pair(root, shape, base_name, base, epss, args, results) -> None:
    """Greedy k = 4 on the eps pair at batch 1, for each eps."""
    llm, originals = eps_engine(root, shape, base_name, args)
    for eps in epss:
        set_eps(llm, originals, eps)
        r = measure_steps(llm, 1, args.prompt_len, args.steps)
        rounds, acc = r["rounds"], r["accepted"]
        r.update(eps=eps, k=4, batch=1, mean_acceptance_length=1 + acc / max(rounds, 1),
                 speedup=r["tok_s"] / base[(base_name, 1)]["tok_s"])
        results["eps_pair"].append(r)
        print(f"[eps] eps={eps}: {r['tok_s']:.1f} tok/s, AL {r['mean_acceptance_length']:.2f}, x{r['speedup']:.2f}",
              flush=True)
    del llm, originals
    free()


def watermark(root, shape, base_name, batches, args, results) -> None:
    """What the watermark costs: sampling at temperature 1, target-only and k = 4 on the eps pair
    (probabilistic drafts without the watermark; with it, the keyed draws and exact-match
    verification), each with and without watermark_config, side by side. Speedups are over
    target-only without the watermark at the same batch."""
    key = json.loads(args.watermark_config)
    configs = [("target-only", None, None, {}), ("target-only + watermark", None, key, {})]
    configs += [(f"k=4 eps={eps}" + (" + watermark" if wm else ""), eps, wm, {})
                for eps in args.watermark_eps for wm in (None, key)]
    sampled_runs(root, shape, base_name, batches, args, configs, results["watermark"], "watermark")


def verification(root, shape, base_name, batches, args, results) -> None:
    """Block verification against the one-at-a-time test: sampling at temperature 1, target-only
    and k = 4 on the eps pair with probabilistic drafts, rejection_sample_method "standard" and
    "block" side by side. Speedups are over target-only at the same batch."""
    configs = [("target-only", None, None, {})]
    configs += [(f"k=4 eps={eps} {method}", eps, None, {"rejection_sample_method": method})
                for eps in args.watermark_eps for method in ("standard", "block")]
    sampled_runs(root, shape, base_name, batches, args, configs, results["verification"], "verification")


def sampled_runs(root, shape, base_name, batches, args, configs, out: list, tag: str) -> None:
    """configs: (name, eps or None for target-only, watermark_config, speculative_config extras);
    each engine at temperature 1 at every batch, rows appended to out."""
    tdir = write_config(root, base_name, shape)
    base = {}
    for name, eps, wm, extra in configs:
        if eps is None:
            llm, originals = make_llm(tdir, None, max(batches), args.max_model_len, watermark_config=wm), None
        else:
            llm, originals = eps_engine(root, shape, base_name, args, max(batches), watermark_config=wm,
                                        spec_extra=dict(draft_sample_method="probabilistic", **extra))
            set_eps(llm, originals, eps)
        for b in batches:
            measure_steps(llm, b, args.prompt_len, args.steps, temperature=1.0)  # warm-up: first-use compiles
            r = measure_steps(llm, b, args.prompt_len, args.steps, temperature=1.0)
            if "rounds" in r:
                r["mean_acceptance_length"] = 1 + r["accepted"] / max(r["rounds"], 1)
            if name == "target-only":
                base[b] = r["tok_s"]
            r.update(config=name, batch=b, speedup=r["tok_s"] / base[b])
            out.append(r)
            print(f"[{tag}] {name} b={b}: {r['tok_s']:.1f} tok/s, {r['ms_per_step']:.2f} ms/step, "
                  f"AL {r.get('mean_acceptance_length', 1):.2f}, x{r['speedup']:.2f}", flush=True)
        del llm, originals
        free()


def triton_variants() -> dict[str, int]:
    """Compiled Triton kernel variants in this process, per kernel of tandem's."""
    import importlib
    import pkgutil

    import tandem.kernels
    from triton.runtime.jit import JITFunction

    out = {}
    for info in pkgutil.iter_modules(tandem.kernels.__path__):
        try:
            mod = importlib.import_module(f"tandem.kernels.{info.name}")
        except Exception:  # the CPU extension's module
            continue
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction):
                out[name] = sum(len(cache[0]) for cache in obj.device_caches.values())
    return out


class StepLog:
    """Every step the runner launches: its kind, device time (CUDA events around the launch,
    so the time from the previous step's end to this one's, idle included), host launch time,
    and the Triton variants its launch compiled. Kinds: graph (a captured decode / verification
    replay), ragged (eager decodes / verifications), mixed (prefill chunks beside decodes),
    prefill (prefill chunks only)."""

    def __init__(self, runner):
        self.runner, self.launch, self.rows = runner, runner.launch, []
        self.profile: tuple[set[str], cProfile.Profile] | None = None  # (kinds, profiler): host time of those
        runner.launch = self._launch

    def _launch(self, plan):
        prefill = sum(len(r.input_token_ids) for r in plan.reqs if len(r.input_token_ids) > 1)
        graph = self.runner._graph_for(plan) is not None
        kind = "graph" if graph else "prefill" if prefill == plan.num_tokens else "mixed" if prefill else "ragged"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        variants, t0 = triton_variants(), time.perf_counter()
        start.record()
        profiled = self.profile is not None and kind in self.profile[0]
        if profiled:
            self.profile[1].enable()
        launched = self.launch(plan)
        if profiled:
            self.profile[1].disable()
        end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        new = {k: v - variants.get(k, 0) for k, v in triton_variants().items() if v > variants.get(k, 0)}
        self.rows.append(dict(kind=kind, reqs=len(plan.reqs), tokens=plan.num_tokens, prefill_tokens=prefill,
                              host_ms=host_ms, compiled=sum(new.values()), compiled_kernels=new, events=(start, end)))
        return launched

    def clear(self) -> None:
        self.rows = []

    def summary(self) -> dict:
        torch.cuda.synchronize()
        out = {}
        for r in self.rows:
            start, end = r.pop("events")
            r["device_ms"] = start.elapsed_time(end)
        for kind in ("graph", "ragged", "mixed", "prefill"):
            rows = [r for r in self.rows if r["kind"] == kind]
            if not rows:
                continue
            clean = [r for r in rows if not r["compiled"]]
            out[kind] = dict(steps=len(rows), seconds=sum(r["device_ms"] for r in rows) / 1e3,
                             median_ms=statistics.median(r["device_ms"] for r in clean) if clean else None,
                             median_host_ms=statistics.median(r["host_ms"] for r in clean) if clean else None,
                             median_tokens=statistics.median(r["tokens"] for r in rows),
                             compiles=sum(r["compiled"] for r in rows),
                             compile_steps=len(rows) - len(clean),
                             compile_step_seconds=sum(r["device_ms"] for r in rows if r["compiled"]) / 1e3,
                             compiled_kernels=sorted({k for r in rows for k in r["compiled_kernels"]}))
        return out


def serving(root, target, draft, batches, args, results) -> None:
    """Continuous batching as a server meets it: 4 x max_num_seqs requests of args.prompt_len
    tokens, output lengths drawn from 64..256 (seeded), all submitted at once; requests finish
    at different steps and waiting ones are prefilled into their slots. Target-only against
    k = 4 at synthetic uniform acceptance --serving-rate (0.8) on the same requests, and with
    each --serving-k-schedule also k = 4 with drafts by batch size (or "auto"). Reports output tokens/s over
    the whole run (warm: the median of --serving-repeats later runs of the same requests; cold: the first, whose eager
    steps compile kernels for the shapes they meet), and where the steps' time went by kind
    (StepLog): CUDA graph replays, eager ragged verifications, eager steps with prefill chunks,
    and the Triton variants compiled during serving."""
    from tandem import SamplingParams

    tname, tshape = target
    dname, dshape = draft
    tdir, ddir = write_config(root, tname, tshape), write_config(root, dname, dshape)
    k, rate = 4, args.serving_rate
    rates = [rate ** (i + 1) for i in range(k)]  # unconditional, as speculative_config takes them
    synthetic = dict(model=ddir, num_speculative_tokens=k, draft_load_format="dummy",
                     rejection_sample_method="synthetic", synthetic_acceptance_rates=rates)
    engines = [("target-only", None), (f"k={k} uniform-{rate}", synthetic)]
    for schedule in args.serving_k_schedule:
        ranges = "auto" if schedule == "auto" else \
            [[int(v) for v in r.replace(":", "-").split("-")] for r in schedule.split(",")]
        engines.append((f"k={k} uniform-{rate} by batch size {schedule}",
                        dict(synthetic, num_speculative_tokens_per_batch_size=ranges)))
    for b in batches:
        g = torch.Generator().manual_seed(b)
        n = 4 * b
        prompts = [{"prompt_token_ids": torch.randint(10, 30000, (args.prompt_len,), generator=g).tolist()}
                   for _ in range(n)]
        lengths = torch.randint(64, 257, (n,), generator=g).tolist()
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
        first = len(results["serving"])
        for name, spec in engines:
            t0 = time.perf_counter()
            llm = make_llm(tdir, spec, b, args.max_model_len)
            start_s, start_variants = time.perf_counter() - t0, sum(triton_variants().values())
            log = StepLog(llm.engine.runner)
            llm.generate(prompts[:b], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * b,
                         use_tqdm=False)  # warm-up: compiles the eager paths' kernels
            walls, kinds = [], []
            for _ in range(1 + args.serving_repeats):  # cold (the eager steps' new shapes compile kernels), then warm
                log.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - t0)
                kinds.append(log.summary())
            if args.serving_profile:  # a third run: the host time of those steps' launches, by function
                log.profile = (set(args.serving_profile.split(",")), cProfile.Profile())
                llm.generate(prompts, params, use_tqdm=False)
                text = io.StringIO()
                pstats.Stats(log.profile[1], stream=text).sort_stats("tottime").print_stats(30)
                print(f"[serving] {name} max_num_seqs={b}: host time of {args.serving_profile} launches", flush=True)
                print(text.getvalue()[:8000], flush=True)
                log.profile = None
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == sum(lengths)
            wall = statistics.median(walls[1:])  # the step kinds below are the first warm run's
            r = dict(engine=name, max_num_seqs=b, requests=n, output_tokens=tokens, seconds=wall, cold_seconds=walls[0],
                     warm_seconds=walls[1:],
                     tok_s=tokens / wall, cold_tok_s=tokens / walls[0], start_s=start_s,
                     variants_at_start=start_variants, variants_after=sum(triton_variants().values()),
                     steps=sum(v["steps"] for v in kinds[1].values()),
                     graph_steps=kinds[1].get("graph", {}).get("steps", 0), cold_kinds=kinds[0], warm_kinds=kinds[1])
            if llm.engine.adaptive is not None:  # "auto": what it measured and chose (over every run)
                r.update(llm.engine.adaptive.summary())
            results["serving"].append(r)
            print(f"[serving] {name} max_num_seqs={b}: {r['tok_s']:.0f} tok/s warm ({tokens} tokens in {wall:.2f} s), "
                  f"{r['cold_tok_s']:.0f} cold; {r['graph_steps']} of {r['steps']} steps on graphs; Triton variants "
                  f"{start_variants} at start, {r['variants_after']} after", flush=True)
            log.runner.launch = log.launch  # (the wrapper binds the log to the runner and back: a cycle)
            del llm, log
            free()
        base = results["serving"][first]
        for spec_r in results["serving"][first + 1 :]:
            spec_r["speedup"] = spec_r["tok_s"] / base["tok_s"]


def invariance(root, target, draft, args, results) -> None:
    """LLM(batch_invariant=True) against the default engine, side by side (8B / 1B shapes, dummy weights, bf16):
    greedy output of one prompt alone, among 7 others, and under speculation (k = 4, the 1B draft, real
    verification) over --invariance-tokens tokens: where each first parts from the prompt alone, if it does
    (random weights put many logits near each other: near ties a sum in another order turns); and the prompt's
    prefill (median of 3 after a warm-up, prefix caching off). With --batch-invariant: the invariant engine alone."""
    from tandem import SamplingParams

    tdir, ddir = write_config(root, *target), write_config(root, *draft)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 30000, (n,), generator=g).tolist() for n in (args.prompt_len * 12, 40, 300, 7,
                                                                                  900, 64, 5, 128)]
    params = SamplingParams(temperature=0, max_tokens=args.invariance_tokens, ignore_eos=True)

    def first_difference(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

    for inv in (True,) if args.batch_invariant else (False, True):
        llm = make_llm(tdir, None, 8, args.max_model_len, batch_invariant=inv)
        one = {"prompt_token_ids": prompts[0]}
        times = []
        for i in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([one], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        alone = llm.generate([one], params, use_tqdm=False)[0].outputs[0].token_ids
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)[0].outputs[0].token_ids
        del llm
        free()
        spec = dict(model=ddir, num_speculative_tokens=4, draft_load_format="dummy")
        llm = make_llm(tdir, spec, 1, args.max_model_len, batch_invariant=inv)
        speculative = llm.generate([one], params, use_tqdm=False)[0].outputs[0].token_ids
        del llm
        free()
        row = dict(batch_invariant=inv, prompt_tokens=len(prompts[0]), tokens=args.invariance_tokens,
                   prefill_ms=statistics.median(times[1:]) * 1e3,
                   batched_first_difference=first_difference(batched, alone),
                   speculative_first_difference=first_difference(speculative, alone))
        results["invariance"].append(row)
        print(f"[invariance] {row}", flush=True)


def hf_peer(target_shape, draft_shape, args, results) -> None:
    import transformers

    def build(shape):
        cfg = dict(shape)
        arch = cfg.pop("architectures")[0]
        cfg.pop("torch_dtype", None)
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        return model.eval()

    target = build(target_shape)
    draft = build(draft_shape)
    ids = torch.randint(10, 30000, (1, args.prompt_len), device="cuda")
    n = args.hf_tokens
    for name, kw in (("hf_generate", {}), ("hf_assisted", {"assistant_model": draft})):
        target.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, **kw)
        # The first full-length run is the cold one: every new sequence length pays first-call costs
        # (H200, 8B: 16.6-18.1 tok/s cold, 31-47 warm). The peer is the median of the warm runs after it.
        samples = []
        for _ in range(1 + args.hf_repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
            torch.cuda.synchronize()
            samples.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
        r = {"engine": name, "batch": 1, "tok_s": statistics.median(samples[1:]), "cold_tok_s": samples[0],
             "warm_tok_s_runs": samples[1:]}
        results["hf"].append(r)
        print(f"[hf] {name}: {r['tok_s']:.1f} tok/s warm (median of {' / '.join(f'{s:.1f}' for s in samples[1:])}), "
              f"{samples[0]:.1f} cold", flush=True)
    del target, draft
    free()


def peer_ratios(results: dict, target_name: str) -> list[dict]:
    """Every batch-1 run of the target (target-only, each synthetic profile, each eps) against
    transformers' target-only `generate`, warm and cold; [] without that peer."""
    peer = next((r for r in results["hf"] if r["engine"] == "hf_generate"), None)
    if peer is None:
        return []
    runs = [("target-only" + (f", {r['kv_cache_dtype']} kv cache" if r.get("kv_cache_dtype", "auto") != "auto" else ""),
             r["tok_s"]) for r in results["target_only"] if r["model"] == target_name and r["batch"] == 1]
    runs += [(f"k={r['k']} {r['profile']}" + (f" {r['draft_quantization']} draft" if r["draft_quantization"] else "")
              + (f" head {r['draft_vocab_size']}" if r.get("draft_vocab_size") else ""), r["tok_s"])
             for r in results["synthetic"] if r["target"] == target_name and r["batch"] == 1]
    runs += [(f"eps pair {r['eps']} (k=4, greedy)", r["tok_s"]) for r in results["eps_pair"]]
    return [dict(run=name, tok_s=t, over_warm=t / peer["tok_s"], over_cold=t / peer["cold_tok_s"]) for name, t in runs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/gpu_bench.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--invariance-tokens", type=int, default=256,
                   help="the invariance section's greedy tokens a run (its prompt: 12 x --prompt-len tokens)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every engine with LLM(batch_invariant=True) (the target and synthetic sections)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--synthetic-steps", type=int, default=None,
                   help="timed steps per synthetic configuration (default --steps); more steps, less "
                        "sampling noise in the realised acceptance")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="the target section's KV cache dtypes, comma-separated (auto,fp8: both, side by side)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--hf-tokens", type=int, default=64)
    p.add_argument("--hf-repeats", type=int, default=3,
                   help="warm timed transformers runs per mode (median), after one cold timed run")
    p.add_argument("--real-rates", default=REAL_RATES,
                   help="the real-cpu profile's per-position rates, comma-separated, one per position up to the "
                        "largest k (default: the real pair's on CPU at k = 8); 'none' leaves the profile out")
    p.add_argument("--flat-rates", default="",
                   help="also time the profiles flat-a: every unconditional per-position rate a (a_i = a, so "
                        "the draft acceptance rate, accepted / drafted, is a), comma-separated values of a")
    p.add_argument("--sections", default="target,synthetic,eps,hf",
                   help="comma list of target, synthetic, eps, hf, serving (continuous batching), watermark, "
                        "verification (block against standard, sampled), invariance (batch_invariant against the "
                        "default engine); the last four not in the default")
    p.add_argument("--serving-batches", default="8,32", help="the serving section's max_num_seqs values")
    p.add_argument("--serving-rate", type=float, default=0.8, help="the serving section's uniform acceptance")
    p.add_argument("--serving-k-schedule", action="append", default=[], metavar="A-B:K,...|auto",
                   help="also serve with num_speculative_tokens_per_batch_size, e.g. 1-16:4,17-48:2,49-512:0, "
                        "or auto (repeatable: one more engine each)")
    p.add_argument("--serving-repeats", type=int, default=1,
                   help="the serving section's warm runs per engine (their median wall time is reported)")
    p.add_argument("--serving-profile", default="", metavar="KINDS",
                   help="the serving section: cProfile the launches of these step kinds (e.g. mixed) in a third run")
    p.add_argument("--ab-gemv", action="store_true",
                   help="at batch 1 also measure with cuBLAS for one-row linears (graphs recaptured)")
    p.add_argument("--env-ab", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="at every batch (target-only, and synthetic at uniform 0.8) also measure with these "
                        "environment settings, graphs recaptured (repeatable), e.g. TANDEM_PDL=0")
    p.add_argument("--ks", default=None, help="k values for the synthetic sweep (default 1..8)")
    p.add_argument("--target-quantizations", default="none",
                   help="comma list of the target's LLM(quantization=...) for the target and synthetic sections: "
                        "none, fp8 (its target-only runs are the baseline of its speculative ones)")
    p.add_argument("--draft-quantization", default="none",
                   help="comma list of the synthetic section's draft quantizations: none, fp8 (speculative_config)")
    p.add_argument("--draft-vocab-sizes", default="none",
                   help="comma list of the synthetic section's draft_vocab_size: none (the whole head) or ids kept")
    p.add_argument("--batches", default=None, help="batch sizes, comma-separated (default 1,8,32,64; synthetic 1,8)")
    p.add_argument("--watermark-eps", type=lambda t: [float(x) for x in t.split(",")], default=[0.02],
                   help="the watermark and verification sections' eps values (k = 4 on the eps pair at temperature 1)")
    p.add_argument("--watermark-config", default='{"key": 20261201}',
                   help="the watermark section's watermark_config, as JSON")
    p.add_argument("--pairs", default="llama,qwen",
                   help="the synthetic section's target / draft shapes: llama (8B / 1B), qwen (Qwen2.5-Coder 1.5B / "
                        "0.5B); the target section runs the 8B and these pairs' targets")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    results = {"env": environment(), "target_only": [], "synthetic": [], "eps_pair": [], "hf": [], "serving": [],
               "watermark": [], "verification": [], "invariance": []}
    bw = copy_bandwidth()
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.quick:
        spec_pairs = [(("tiny", TINY), ("tiny-draft", TINY_DRAFT))]
    else:
        unknown = set(args.pairs.split(",")) - set(PAIRS)
        if unknown:
            p.error(f"--pairs: unknown {sorted(unknown)}; use some of {sorted(PAIRS)}")
        spec_pairs = [PAIRS[name] for name in args.pairs.split(",")]
    target, draft = spec_pairs[0] if args.quick else PAIRS["llama"]  # the roofline bar, eps pair and peer
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    real = [float(x) for x in args.real_rates.split(",")] if args.real_rates not in (None, "", "none") else None
    ks = [int(k) for k in args.ks.split(",")] if args.ks else ([1, 2, 4] if args.quick else list(range(1, 9)))
    if real and "synthetic" in sections and max(ks) > len(real):
        p.error(f"--real-rates gives {len(real)} positions and --ks reaches {max(ks)}: give a rate for every "
                "position, or --real-rates none")

    def profiles(k):
        out = [(f"uniform-{a}", [a ** (i + 1) for i in range(k)]) for a in (0.6, 0.8, 0.9)]
        out += [(f"flat-{a}", [float(a)] * k) for a in args.flat_rates.split(",") if a]
        if real:  # measured rates only: no position is made up (main refuses a k past them)
            out.append(("real-cpu", real[:k]))
        return out

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # the 8B, and the other pairs' targets (--pairs llama: the 8B alone)
        shapes = [target] if args.quick else [target] + [t for t, _ in spec_pairs if t[0] != target[0]]
        full = "target" in sections
        spec_batches = [1] if args.quick else [1, 8]  # the synthetic section's batches need a baseline
        if args.batches:
            spec_batches = batches
        pair_targets = [t for t, _ in spec_pairs] if "synthetic" in sections else []
        needed = shapes if full else list({name: (name, shape) for name, shape in [target] + pair_targets}.values())
        base_batches = batches if full else spec_batches
        if sections & {"eps", "hf"} and 1 not in base_batches:  # their ratios are over target-only at batch 1
            base_batches = [1] + base_batches
        base = target_only(root, needed, base_batches, args, bw, results)
        write_json(args.out, results)
        if "synthetic" in sections:
            for pair_target, pair_draft in spec_pairs:
                synthetic(root, pair_target, pair_draft, base, ks, profiles, spec_batches, args, results)
        write_json(args.out, results)
        if "eps" in sections:
            eps_pair(root, target[1], target[0], base, [0.1, 0.05, 0.02, 0.0], args, results)
        write_json(args.out, results)
        if "watermark" in sections:
            watermark(root, target[1], target[0], batches, args, results)
            write_json(args.out, results)
        if "verification" in sections:
            verification(root, target[1], target[0], batches, args, results)
            write_json(args.out, results)
        if "invariance" in sections:
            invariance(root, target, draft, args, results)
            write_json(args.out, results)
        if "hf" in sections:
            hf_peer(target[1], draft[1], args, results)
        if "serving" in sections:
            serving_batches = [int(b) for b in args.serving_batches.split(",")]
            serving(root, target, draft, serving_batches, args, results)
    write_json(args.out, results)
    rows = [(r["model"], r["kv_cache_dtype"], r["batch"], f"{r['ms_per_step']:.2f}",
             f"{r.get('sync_ms_per_step', float('nan')):.2f}", f"{r['graph_ms']:.2f}", f"{r['tok_s']:.0f}",
             f"{r['kv_read_gb']:.2f}", f"{r['roofline_frac']:.2f}", f"{r['roofline_frac_with_kv']:.2f}")
            for r in results["target_only"]]
    print_table(["model", "kv cache", "batch", "ms/step", "sync ms/step", "graph ms", "tok/s", "kv GB read",
                 "roofline", "with kv"], rows)
    rows = [(f"{r['target']} / {r['draft']}", r["k"], r["batch"], r["profile"],
             " ".join(filter(None, [r.get("draft_quantization"),
                                    r.get("draft_vocab_size") and f"head {r['draft_vocab_size']}"])) or "-",
             f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}", f"{r['speedup_at_expected']:.2f}",
             f"{r['mean_acceptance_length']:.2f} / {r['expected_acceptance_length']:.2f}",
             f"{r['acceptance_rate']:.2f} / {r['expected_acceptance_rate']:.2f}",
             f"{r['verify_over_decode']:.2f}", f"{r['draft_step_ms']:.2f}") for r in results["synthetic"]]
    if rows:
        print_table(["pair", "k", "batch", "profile", "draft", "tok/s", "speedup", "at expected AL",
                     "AL real / expected", "accept rate real / expected", "verify/decode", "draft ms/step"], rows)
    rows = [(r["eps"], f"{r['tok_s']:.0f}", f"{r['mean_acceptance_length']:.2f}", f"{r['speedup']:.2f}")
            for r in results["eps_pair"]]
    if rows:
        print_table(["eps", "tok/s", "accept len", "speedup"], rows)
    rows = [(r["config"], r["batch"], f"{r['ms_per_step']:.2f}", f"{r['tok_s']:.0f}",
             f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-", f"{r['speedup']:.2f}")
            for r in results["watermark"] + results["verification"]]
    if rows:
        print_table(["temperature 1", "batch", "ms/step", "tok/s", "accept len", "vs target-only"], rows)
    rows = [(r["engine"], r["max_num_seqs"], r["requests"], r["output_tokens"], f"{r['seconds']:.2f}",
             f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}" if "speedup" in r else "-", f"{r['cold_tok_s']:.0f}",
             f"{r['graph_steps']} / {r['steps']}") for r in results["serving"]]
    if rows:
        print_table(["serving", "max_num_seqs", "requests", "tokens", "warm s", "warm tok/s", "speedup", "cold tok/s",
                     "graph steps"], rows)
        rows = [(r["engine"], r["max_num_seqs"], run, kind, v["steps"], f"{v['seconds']:.2f}",
                 "-" if v["median_ms"] is None else f"{v['median_ms']:.1f}",
                 "-" if v["median_host_ms"] is None else f"{v['median_host_ms']:.1f}", f"{v['median_tokens']:.0f}",
                 f"{v['compiles']} in {v['compile_steps']} steps, {v['compile_step_seconds']:.2f} s "
                 f"{','.join(v['compiled_kernels'])}")
                for r in results["serving"] for run in ("cold", "warm") for kind, v in r[f"{run}_kinds"].items()]
        print_table(["serving", "max_num_seqs", "run", "step kind", "steps", "device s", "median ms", "host ms",
                     "median tokens", "Triton compiles"], rows)
        rows = [(r["engine"], r["max_num_seqs"], " ".join(f"{K}:{n}" for K, n in enumerate(r["steps_by_drafts"])),
                 " ".join(f"{v:.2f}" for v in r["estimated_survival"]), r["step_costs"])
                for r in results["serving"] if "steps_by_drafts" in r]
        if rows:
            print_table(["adaptive", "max_num_seqs", "steps by K", "estimated S_j", "step ms by size: K=0..k"], rows)
    rows = [("on" if r["batch_invariant"] else "off", r["prompt_tokens"], f"{r['prefill_ms']:.1f}", r["tokens"],
             "same" if r["batched_first_difference"] is None else f"token {r['batched_first_difference']}",
             "same" if r["speculative_first_difference"] is None else f"token {r['speculative_first_difference']}")
            for r in results["invariance"]]
    if rows:
        print_table(["batch_invariant", "prompt", "prefill ms", "greedy tokens", "batched vs alone",
                     "speculative vs alone"], rows)
    if results["hf"]:
        ours = next((r["tok_s"] for r in results["target_only"] if r["model"] == target[0] and r["batch"] == 1), None)
        ratio = lambda t: f"{ours / t:.1f}x" if ours else "-"  # noqa: E731
        print_table(["peer", "warm tok/s", "tandem b=1 / warm", "cold tok/s", "tandem b=1 / cold"],
                    [(r["engine"], f"{r['tok_s']:.1f}", ratio(r["tok_s"]), f"{r['cold_tok_s']:.1f}",
                      ratio(r["cold_tok_s"])) for r in results["hf"]])
        results["peer_ratios"] = peer_ratios(results, target[0])
        if results["peer_ratios"]:
            write_json(args.out, results)
            print_table(["tandem, batch 1", "tok/s", "/ generate warm", "/ generate cold"],
                        [(r["run"], f"{r['tok_s']:.0f}", f"{r['over_warm']:.1f}x", f"{r['over_cold']:.1f}x")
                         for r in results["peer_ratios"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())

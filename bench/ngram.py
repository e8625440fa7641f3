"""N-gram and suffix lookup (speculative_config method="ngram" / "suffix") on the GPU: what the
lookup costs, and the step times and tokens/s it gives, side by side with target-only in one run.

    python3 bench/ngram.py --out $OUT/ngram.json        # on the H200: the 8B shape, dummy weights
    python3 bench/ngram.py --quick                      # tiny shapes (a CPU works too)
    python bench/ngram.py --sections real               # CPU: the real Qwen2.5-Coder pair, interleaved

Sections:
- lookup: the lookup alone over B contexts of L tokens (median wall time, device synchronised),
  as torch ops (`ngram_drafts`, the CPU path) and as the Triton kernel the GPU path runs; and
  suffix lookup's torch ops (`suffix_drafts`, the CPU path) and its Triton kernel (the GPU path)
  over the same contexts and a full corpus (suffix_decoding_corpus_tokens, 65536 by default);
- engine: batch B, k drafts, n-gram lookup 2..5 (vLLM's defaults are 5..5) and suffix lookup
  (vLLM's defaults; its corpus fills with the benchmark's own finished requests), each measured as
  bench/gpu_bench.measure_steps does (median step time after warm-up, tokens per step), on
  * "dummy": the dummy weights' own output (an 8B shape's is random text: the lookup rarely finds a match, so
    this is what lookup costs when it does not pay),
  * "repeating": the LM head zeroed, so the target emits one token again and again and every
    draft is accepted (the ceiling: k + 1 tokens a step, each verification as one graph).
- real (CPU): the real Qwen2.5-Coder 1.5B at batch 1, greedy, target-only, its 0.5B draft,
  each --real-lookups n-gram lookup and suffix lookup twice: on the request's own tokens only
  (suffix_decoding_max_cached_requests=0), and with its corpus, which holds the responses of its
  earlier passes over the same prompts (a workload that repeats itself: agent loops, RL rollouts),
  all loaded, then timed round-robin over one prompt class at a time
  (bench/real_pair.py's prompts; "edit" asks to rewrite given code, so the answer repeats it):
  tokens/s, acceptance, and whether the tokens are target-only's.
  Speedups are over target-only at the same batch in the same run (its steps planned ahead of
  the previous result, as a lookup's cannot be; "target-only, not planned ahead" shows that
  share). Real acceptance comes from real text: bench/real_pair.py --ngram on the CPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, print_table, write_json  # noqa: E402
from bench.gpu_bench import LLAMA_8B, TINY, free, measure_steps, write_config  # noqa: E402


def time_lookup(batch: int, length: int, k: int, lookup: tuple[int, int], device: torch.device, repeats: int,
                way: str) -> float:
    """Median microseconds of one lookup over `batch` random contexts of `length` tokens: way
    "torch" (ngram_drafts), "kernel" (the Triton kernel, CUDA), "suffix" (suffix_drafts with a
    full default-sized corpus) or "suffix_kernel" (its Triton kernel, CUDA; random text: the last
    token's occurrences are few, so it scans every context and the whole corpus). Wall time around
    the call, the device synchronised after it: the torch ops are launch-bound, so their launches count."""
    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.ngram import ngram_drafts
    from tandem.spec.suffix import NUM_CANDIDATES, NUM_OCCURRENCES, suffix_drafts

    g = torch.Generator().manual_seed(batch * 7919 + length)
    tokens = torch.randint(0, 32000, (batch, length), generator=g, dtype=torch.int32).to(device)
    lens = torch.full((batch,), length, dtype=torch.int64, device=device)
    slots = torch.arange(batch, device=device)
    want = torch.full((batch,), k, dtype=torch.int64, device=device)
    drafts = torch.zeros(batch, k, dtype=torch.int64, device=device)
    suffix = SpeculativeConfig.from_user({"method": "suffix", "num_speculative_tokens": k}, length + k)
    corpus = torch.randint(0, 32000, (suffix.suffix_decoding_corpus_tokens,), generator=g, dtype=torch.int32).to(device)

    tables = None
    if way == "suffix_kernel":  # made once, as the speculator makes them (not timed)
        from tandem.kernels.suffix import walk_tables

        tables = walk_tables(suffix.suffix_decoding_max_tree_depth, k, suffix.suffix_decoding_max_spec_factor,
                             suffix.suffix_decoding_min_token_prob, NUM_CANDIDATES, device)

    def call():
        if way == "kernel":
            from tandem.kernels.ngram import ngram_lookup

            ngram_lookup(tokens, lens, slots, want, drafts, lookup[0], lookup[1], length + k)
        elif way == "suffix_kernel":
            from tandem.kernels.suffix import suffix_lookup

            suffix_lookup(tokens, lens, corpus, slots, want, drafts, tables, suffix.suffix_decoding_max_tree_depth,
                          length + k, NUM_OCCURRENCES, NUM_CANDIDATES)
        elif way == "suffix":
            suffix_drafts(tokens, lens, corpus, suffix.suffix_decoding_max_tree_depth, k,
                          suffix.suffix_decoding_max_spec_factor, suffix.suffix_decoding_min_token_prob, length + k)
        else:
            ngram_drafts(tokens, lens, lookup[0], lookup[1], k, length + k)

    times = []
    for i in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def engine_runs(target: str, batches: list[int], ks: list[int], lookup: tuple[int, int], args, results) -> None:
    from tandem import LLM

    def make(spec, **kw):
        return LLM(target, dtype="bfloat16" if torch.cuda.is_available() else "float32", load_format="dummy",
                   max_model_len=args.max_model_len, max_num_seqs=max(batches), kv_cache_memory_bytes=args.kv_gib << 30,
                   speculative_config=spec, enable_prefix_caching=False, **kw)

    # target-only steps are planned ahead of the previous result (async scheduling); a lookup's are
    # not (its drafts follow that result), so target-only without it shows what the lookup itself costs
    configs = [("target-only", None), ("target-only, not planned ahead", "sync")] + [
        (f"ngram {lookup[0]}:{lookup[1]} k={k}", dict(method="ngram", num_speculative_tokens=k,
                                                      prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1]))
        for k in ks] + [(f"suffix k={k}", dict(method="suffix", num_speculative_tokens=k)) for k in ks]
    for name, spec in configs:
        llm = make(None, async_scheduling=False) if spec == "sync" else make(spec)
        head = llm.engine.runner.model.lm_head.weight
        original = head.detach().clone()
        for text in ("dummy", "repeating"):
            with torch.no_grad():
                head.copy_(original if text == "dummy" else torch.zeros_like(original))
            for b in batches:
                r = measure_steps(llm, b, args.prompt_len, args.steps)  # (drafted, accepted: the timed steps')
                r.update(config=name, text=text, batch=b, drafted=r.get("drafted", 0), accepted=r.get("accepted", 0))
                base = next((x for x in results["engine"] if x["config"] == "target-only" and x["text"] == text
                             and x["batch"] == b), None)
                r["speedup"] = r["tok_s"] / base["tok_s"] if base else 1.0
                results["engine"].append(r)
                print(f"[engine] {name} {text} b={b}: {r['ms_per_step']:.2f} ms/step, {r['tokens_per_step']:.2f} "
                      f"tokens/step, {r['tok_s']:.0f} tok/s, x{r['speedup']:.2f}", flush=True)
                write_json(args.out, results)
        del llm, original, head  # every name bound to the engine's memory
        free()


def real_pair(args, results) -> None:
    """The real pair on CPU, interleaved timing per prompt class (bench/real_pair.time_variants)."""
    from bench.real_pair import DRAFT, time_variants

    k = int(args.ks.split(",")[0])
    specs = {"target-only": None, f"draft k={k}": dict(model=DRAFT, num_speculative_tokens=k)}
    for lookup in args.real_lookups.split(","):
        lo, hi = (int(v) for v in lookup.split(":"))
        specs[f"ngram {lo}:{hi} k={k}"] = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                                              prompt_lookup_max=hi)
    ks = args.real_suffix_ks.split(",") if args.real_suffix_ks else []
    for sk in map(int, ks):
        specs[f"suffix k={sk}, own tokens"] = dict(method="suffix", num_speculative_tokens=sk,
                                                   suffix_decoding_max_cached_requests=0)
        specs[f"suffix k={sk}, corpus"] = dict(method="suffix", num_speculative_tokens=sk)
    for cls in args.classes.split(","):
        engines, prompts, series, outputs = time_variants(specs, args.real_tokens, args.real_prompts,
                                                          args.repeats, classes=(cls,))
        ref = [o.outputs[0].token_ids for o in outputs["target-only"]]
        base = series["target-only"].median
        for name in engines:
            outs = outputs[name]
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            accepted = sum(o.metrics.num_accepted_tokens for o in outs)
            rounds = sum(o.metrics.num_draft_rounds for o in outs)
            s = series[name].summary()
            results["real"].append(dict(
                cls=cls, config=name, tok_s=args.real_tokens * len(prompts) / s["median_s"], spread=s["spread"],
                speedup=base / s["median_s"], acceptance_rate=accepted / drafted if drafted else None,
                mean_acceptance_length=1 + accepted / rounds if rounds else None,
                drafting_rounds_per_token=rounds / (args.real_tokens * len(prompts)),
                identical=[o.outputs[0].token_ids for o in outs] == ref))
            print(f"[real] {results['real'][-1]}", flush=True)
            write_json(args.out, results)
        del engines
        free()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/ngram.json")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few steps")
    p.add_argument("--sections", default="lookup,engine")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ks", default="2,4")
    p.add_argument("--lookup", default="2:5", help="prompt_lookup_min:prompt_lookup_max")
    p.add_argument("--lengths", default="1024,8192,32768", help="the lookup section's context lengths")
    p.add_argument("--lookup-batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=12)
    p.add_argument("--classes", default="code,chat,edit", help="the real section's prompt classes")
    p.add_argument("--real-lookups", default="1:3,2:5", help="the real section's n-gram lookups, MIN:MAX each")
    p.add_argument("--real-suffix-ks", default="8", help="the real section's suffix lookups' k (\"\": none)")
    p.add_argument("--real-prompts", type=int, default=3, help="the real section's prompts per class")
    p.add_argument("--real-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="the real section's timed passes per engine")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    lookup = tuple(int(v) for v in args.lookup.split(":"))
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.quick:
        batches, ks, lengths, args.steps, args.kv_gib = [1, 4], [2], [256, 1024], 8, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {"env": environment(), "config": vars(args), "lookup": [], "engine": [], "real": []}
    if "lookup" in sections:
        for b in [int(x) for x in args.lookup_batches.split(",")]:
            for n in lengths:
                r = dict(batch=b, length=n, k=max(ks))
                ways = ("torch", "kernel", "suffix", "suffix_kernel") if device.type == "cuda" else ("torch", "suffix")
                for way in ways:
                    r[f"{way}_us"] = time_lookup(b, n, max(ks), lookup, device, 5 if args.quick else 20, way)
                results["lookup"].append(r)
                print(f"[lookup] {r}", flush=True)
        write_json(args.out, results)
    if "engine" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            shape = TINY if args.quick else LLAMA_8B
            target = write_config(Path(tmp), "tiny" if args.quick else "llama-8b", shape)
            engine_runs(target, batches, ks, lookup, args, results)
    if "real" in sections:
        real_pair(args, results)
    write_json(args.out, results)
    if results["lookup"]:
        print_table(["lookup batch", "context tokens", "k", "ngram torch ops us", "ngram Triton kernel us",
                     "suffix torch ops us", "suffix Triton kernel us"],
                    [(r["batch"], r["length"], r["k"], f"{r['torch_us']:.1f}",
                      f"{r['kernel_us']:.1f}" if "kernel_us" in r else "-", f"{r['suffix_us']:.1f}",
                      f"{r['suffix_kernel_us']:.1f}" if "suffix_kernel_us" in r else "-")
                     for r in results["lookup"]])
    if results["engine"]:
        print_table(["config", "text", "batch", "ms/step", "tokens/step", "tok/s", "accepted / drafted", "speedup"],
                    [(r["config"], r["text"], r["batch"], f"{r['ms_per_step']:.2f}", f"{r['tokens_per_step']:.2f}",
                      f"{r['tok_s']:.0f}", f"{r['accepted']} / {r['drafted']}", f"{r['speedup']:.2f}")
                     for r in results["engine"]])
    if results["real"]:
        print_table(["class", "config", "tok/s", "spread", "speedup", "acceptance", "mean AL", "rounds/token", "same"],
                    [(r["cls"], r["config"], f"{r['tok_s']:.2f}", f"{r['spread']:.2f}", f"{r['speedup']:.2f}",
                      "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}",
                      "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
                      f"{r['drafting_rounds_per_token']:.2f}", "yes" if r["identical"] else "NO")
                     for r in results["real"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())

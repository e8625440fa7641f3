"""CPU speculative decoding sweep: tokens/s with and without a draft for k = 1..8.

    python bench/spec_cpu.py                          # eps pair from SmolLM2-135M (real weights)
    python bench/spec_cpu.py --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct
    python bench/spec_cpu.py ... --auto                # also each step's drafts chosen in 0..max(--ks)
    python bench/spec_cpu.py ... --temperature 1 --watermark-key 42   # sampled, with the keyed draws

The default pair is built from one real checkpoint so acceptance is controlled: the draft is
SmolLM2-135M's first 4 layers (with its embeddings, final norm and head) and the target is the
full model with the output projections (o_proj, down_proj) of layers 5 and up (0-based index >= 4) scaled by eps,
so the two agree more often as eps shrinks. Greedy (or --temperature, seeded), batch 1, the same
prompts for every configuration; one warm-up, then the median of --repeats timed runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)
import torch  # noqa: E402

from bench.common import environment, print_table, write_json  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "The three primary colors are",
    "import numpy as np\n\ndef normalize(v):\n",
    "Once upon a time, in a small village,",
]


def build(args, k: int | str | None):
    """k: drafts per step; None: the target alone; "auto": up to the largest of --ks, chosen each step."""
    from tandem import LLM

    spec = None
    if k is not None:
        draft = args.draft or args.target
        spec = dict(model=draft, num_speculative_tokens=k, draft_sample_method=args.draft_sample_method)
        if k == "auto":
            spec.update(num_speculative_tokens=max(int(v) for v in args.ks.split(",")),
                        num_speculative_tokens_per_batch_size="auto")
    watermark = {"key": args.watermark_key} if args.watermark_key is not None else None
    llm = LLM(args.target, dtype=args.dtype, max_model_len=1024, max_num_seqs=4, speculative_config=spec,
              watermark_config=watermark)
    if args.draft is None and k is not None:
        eps_pair(llm, args.eps, args.draft_layers)
    elif args.draft is None:
        damp(llm.engine.runner.model, args.eps, args.draft_layers)
    return llm


def damp(model, eps: float, first: int) -> None:
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if i >= first:
                layer.self_attn.o_proj.weight.mul_(eps)
                layer.mlp.down_proj.weight.mul_(eps)


def eps_pair(llm, eps: float, first: int) -> None:
    """Turn (target, copy of target) into (damped target, first-layers draft)."""
    target = llm.engine.runner.model
    spec = llm.engine.runner.speculator
    damp(target, eps, first)
    draft = spec.model
    del draft.model.layers[first:]
    spec.kv.k, spec.kv.v = spec.kv.k[:first], spec.kv.v[:first]


def run(llm, prompts, tokens, temperature=0.0):
    from tandem import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    m = [o.metrics for o in outs]
    rounds = sum(x.num_draft_rounds for x in m)
    drafts = sum(x.num_draft_tokens for x in m)
    acc = sum(x.num_accepted_tokens for x in m)
    return {"tok_s": n / dt, "seconds": dt, "tokens": n, "acceptance_rate": acc / drafts if drafts else None,
            "mean_acceptance_length": 1 + acc / rounds if rounds else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", default=None, help="draft model (default: the eps pair built from --target)")
    p.add_argument("--eps", type=float, default=0.01)
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--auto", action="store_true",
                   help="also num_speculative_tokens_per_batch_size=\"auto\" with k = the largest of --ks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy; sampled output equals target-only only with the watermark)")
    p.add_argument("--watermark-key", type=int, default=None, help="watermark_config={'key': K} for every engine")
    p.add_argument("--draft-sample-method", default="greedy", choices=["greedy", "probabilistic"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench/results/spec_cpu.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"env": environment(), "config": vars(args), "runs": []}
    configs = [None] + [int(k) for k in args.ks.split(",")] + (["auto"] if args.auto else [])
    rows = []
    base = None
    for k in configs:
        llm = build(args, k)
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok(t).input_ids} for t in PROMPTS] if tok else PROMPTS
        run(llm, prompts[:1], 8, args.temperature)  # warm-up
        reps = [run(llm, prompts, args.tokens, args.temperature) for _ in range(args.repeats)]
        med = statistics.median(r["tok_s"] for r in reps)
        r = dict(reps[0], tok_s=med, tok_s_runs=[x["tok_s"] for x in reps], k=k)
        if k is None:
            base = r
        r["speedup"] = med / base["tok_s"]
        r["identical_to_target"] = r["token_ids"] == base["token_ids"]
        if llm.engine.adaptive is not None:  # over the warm-up and every timed run
            r.update(llm.engine.adaptive.summary())
            print(llm.engine.adaptive.log_line(), flush=True)
        results["runs"].append({key: v for key, v in r.items() if key != "token_ids"})
        rows.append(("target only" if k is None else k, f"{med:.2f}", f"{r['speedup']:.2f}",
                     "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}",
                     "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
                     r["identical_to_target"]))
        print(rows[-1], flush=True)
        del llm
        write_json(args.out, results)
    print_table(["k", "tok/s", "speedup", "accept rate", "accept len", "same tokens"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

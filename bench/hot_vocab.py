"""A pruned draft head on the real Qwen2.5-Coder pair (CPU): acceptance and speed, side by side.

    python bench/hot_vocab.py                               # whole head, 65536 and 32768 ids, k = 3
    python bench/hot_vocab.py --sizes none,65536,16384 --k 4 --repeats 5

Every variant is a speculative engine (greedy, batch 1: one prompt at a time, the 5 code and 5
chat prompts of bench/real_pair.py) whose draft scores the first N token ids (speculative_config draft_vocab_size
N) or all of them ("none"). All engines are loaded first, then timed round-robin (one pass over
the prompts each, --repeats times after a warm-up), so a shared machine's drift hits each alike;
medians are reported, wall and CPU time (the CPU time of this process, the steadier figure on a
shared box). "in set": the share of the output tokens (the target's own, every variant gives the
same) inside the draft's hot set, the ceiling on what it can draft.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)

from bench.common import environment, print_table, write_json  # noqa: E402
from bench.real_pair import DRAFT, time_variants  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="none,65536,32768", help="comma list of draft_vocab_size (none: the whole head)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=5, help="prompts per class")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/hot_vocab.json")
    args = p.parse_args(argv)
    specs = {}
    for size in args.sizes.split(","):
        vocab = None if size == "none" else int(size)
        specs[f"head {vocab}" if vocab else "whole head"] = dict(model=DRAFT, num_speculative_tokens=args.k,
                                                                 draft_vocab_size=vocab)
    engines, prompts, series, outputs = time_variants(specs, args.tokens, args.prompts, args.repeats)
    ref = [o.outputs[0].token_ids for o in outputs["whole head"]] if "whole head" in outputs else None
    tokens = args.tokens * len(prompts)
    results = {"env": environment(), "config": vars(args), "runs": []}
    base = series["whole head"].median if "whole head" in series else None
    for name, llm in engines.items():
        outs = outputs[name]
        ids = [o.outputs[0].token_ids for o in outs]
        sp = llm.engine.runner.speculator
        hot = set(sp.hot_ids.tolist()) if sp.hot_ids is not None else None
        flat = [t for row in ids for t in row]
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        rounds = sum(o.metrics.num_draft_rounds for o in outs)
        s = series[name].summary()
        results["runs"].append(dict(
            config=name, head_rows=len(hot) if hot else llm.engine.runner.speculator.head_cols,
            tok_s=tokens / s["median_s"], cpu_ms_per_token=1e3 * s["cpu_median_s"] / tokens, spread=s["spread"],
            speedup_over_whole_head=base / s["median_s"] if base else None,
            acceptance_rate=accepted / drafted, mean_acceptance_length=1 + accepted / rounds,
            in_hot_set=sum(t in hot for t in flat) / len(flat) if hot else 1.0,
            identical_to_whole_head=ids == ref if ref is not None else None, timing=s))
        print(results["runs"][-1] | {"timing": None}, flush=True)
    write_json(args.out, results)
    print_table(["draft head", "rows", "tok/s", "CPU ms/token", "spread", "x whole head", "acceptance", "mean AL",
                 "in set", "same tokens"],
                [(r["config"], r["head_rows"], f"{r['tok_s']:.2f}", f"{r['cpu_ms_per_token']:.1f}",
                  f"{r['spread']:.2f}", f"{r['speedup_over_whole_head']:.3f}" if r["speedup_over_whole_head"] else "-",
                  f"{r['acceptance_rate']:.3f}", f"{r['mean_acceptance_length']:.2f}", f"{r['in_hot_set']:.3f}",
                  {True: "yes", False: "NO", None: "-"}[r["identical_to_whole_head"]]) for r in results["runs"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Confidence-based early stop on the real Qwen2.5-Coder pair (CPU): drafts, acceptance and speed, side by side.

    python bench/confidence_stop.py                                   # k = 4: no stop, tau 0.3 and 0.5
    python bench/confidence_stop.py --thresholds none,0.2,0.4 --k 6 --repeats 5
    python bench/confidence_stop.py --k 6 --adaptive --thresholds none,0.6 --fixed-k 4   # with "auto" speculation

Every variant is a speculative engine (greedy, batch 1: one prompt at a time, the 5 code and 5 chat
prompts of bench/real_pair.py) whose rounds end each request's chain of drafts at its first draft
with a top-1 draft probability below tau (speculative_config draft_confidence_threshold), or never
("none"). All engines are loaded first, then timed round-robin (one pass over the prompts each,
--repeats times after a warm-up), so a shared machine's drift hits each alike; medians are
reported, wall and CPU time (the CPU time of this process, the steadier figure on a shared box).
"drafts a round": the drafts verified per round (k without a stop, less max_tokens' cuts).
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
    p.add_argument("--thresholds", default="none,0.3,0.5", help="comma list of draft_confidence_threshold")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--adaptive", action="store_true",
                   help="every variant drafts 0..k a step, chosen as num_speculative_tokens_per_batch_size='auto'")
    p.add_argument("--fixed-k", type=int, default=None, help="also (first) a variant drafting this k, without a stop")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=5, help="prompts per class")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/confidence_stop.json")
    args = p.parse_args(argv)
    specs = {}
    if args.fixed_k is not None:
        specs[f"k={args.fixed_k}, no stop"] = dict(model=DRAFT, num_speculative_tokens=args.fixed_k)
    auto = dict(num_speculative_tokens_per_batch_size="auto") if args.adaptive else {}
    for value in args.thresholds.split(","):
        tau = None if value == "none" else float(value)
        specs[f"tau {tau}" if tau else "no stop"] = dict(model=DRAFT, num_speculative_tokens=args.k,
                                                         draft_confidence_threshold=tau, **auto)
    engines, prompts, series, outputs = time_variants(specs, args.tokens, args.prompts, args.repeats)
    first = next(iter(engines))
    ref = [o.outputs[0].token_ids for o in outputs[first]]
    tokens = args.tokens * len(prompts)
    base = series[first].summary()
    results = {"env": environment(), "config": vars(args), "runs": []}
    for name in engines:
        outs = outputs[name]
        row = {"config": name}
        for cls in ("code", "chat"):
            sel = [o.metrics for (c, _), o in zip(prompts, outs) if c == cls]
            rounds, drafts = sum(m.num_draft_rounds for m in sel), sum(m.num_draft_tokens for m in sel)
            accepted = sum(m.num_accepted_tokens for m in sel)
            row |= {f"{cls}_drafts_per_round": drafts / rounds, f"{cls}_acceptance_rate": accepted / drafts,
                    f"{cls}_mean_acceptance_length": 1 + accepted / rounds}
        s = series[name].summary()
        row |= dict(tok_s=tokens / s["median_s"], cpu_ms_per_token=1e3 * s["cpu_median_s"] / tokens,
                    spread=s["spread"], speedup=base["median_s"] / s["median_s"],
                    cpu_speedup=base["cpu_median_s"] / s["cpu_median_s"],
                    identical=[o.outputs[0].token_ids for o in outs] == ref, timing=s)
        adaptive = engines[name].engine.adaptive
        if adaptive is not None:  # what "auto" chose and believed, its step costs measured at start-up
            row["adaptive"] = adaptive.summary() | {"expected_costs_b1": adaptive.expected_costs(1)}
        results["runs"].append(row)
        print(row | {"timing": None}, flush=True)
    write_json(args.out, results)
    print_table(["variant", "tok/s", "CPU ms/token", "spread", f"x {first}", f"CPU x {first}", "code drafts/round",
                 "code acc", "code AL", "chat drafts/round", "chat acc", "chat AL", "same tokens"],
                [(r["config"], f"{r['tok_s']:.2f}", f"{r['cpu_ms_per_token']:.1f}", f"{r['spread']:.2f}",
                  f"{r['speedup']:.3f}", f"{r['cpu_speedup']:.3f}", f"{r['code_drafts_per_round']:.2f}",
                  f"{r['code_acceptance_rate']:.3f}", f"{r['code_mean_acceptance_length']:.2f}",
                  f"{r['chat_drafts_per_round']:.2f}", f"{r['chat_acceptance_rate']:.3f}",
                  f"{r['chat_mean_acceptance_length']:.2f}", "yes" if r["identical"] else "NO")
                 for r in results["runs"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())

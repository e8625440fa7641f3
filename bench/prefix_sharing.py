"""In-batch prefix sharing: a batch of prompts that share a prefix nobody has computed yet.

    python bench/prefix_sharing.py                         # the real Qwen2.5-Coder pair, 4 prompts
    python bench/prefix_sharing.py --prompts 8 --shared-examples 40 --repeats 3
    python bench/prefix_sharing.py --no-draft              # the target alone

The prompts are one few-shot preamble (--shared-examples short code examples) followed by a
different task each. One engine runs the batch with the scheduler's in-batch sharing on (a
prompt sharing SHARED_PREFIX_WAIT_TOKENS or more uncached tokens with the blocks another request
fills waits one step and hits them) and off (the threshold set past any prompt: every prompt
admitted together computes the preamble itself), alternated A B B A ..., the prefix cache reset
before every run. Reported: the median wall seconds of the whole batch, each prompt's cached
tokens, and whether both give the same tokens (greedy).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, environment, log, median, print_table, time_call, write_json  # noqa: E402

TASKS = ["sum", "max", "min", "mean", "median", "product", "range", "mode", "variance", "length", "first", "last"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--no-draft", action="store_true")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--shared-examples", type=int, default=20, help="few-shot examples in the shared preamble")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per prompt (greedy)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each mode")
    p.add_argument("--out", default=str(RESULTS_DIR / "prefix_sharing.json"))
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(TASKS):
        p.error(f"--prompts must be in 1..{len(TASKS)}")

    import tandem.scheduler.scheduler as scheduler
    from tandem import LLM, SamplingParams

    spec = None if args.no_draft else {"model": args.draft, "num_speculative_tokens": args.k}
    llm = LLM(args.model, dtype=args.dtype, speculative_config=spec)
    preamble = "".join(f"# Example {i}: a function that returns {i} squared\ndef square_{i}():\n    return {i} * {i}\n\n"
                       for i in range(args.shared_examples))
    prompts = [preamble + f"# Task: write a function that returns the {t} of a list\ndef " for t in TASKS[:args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    threshold = scheduler.SHARED_PREFIX_WAIT_TOKENS
    modes = {"shared": threshold, "each its own": 1 << 62}

    def run(mode: str):
        scheduler.SHARED_PREFIX_WAIT_TOKENS = modes[mode]
        llm.reset_prefix_cache()
        try:
            return llm.generate(prompts, params, use_tqdm=False)
        finally:
            scheduler.SHARED_PREFIX_WAIT_TOKENS = threshold

    run("shared")  # warm-up
    times: dict[str, list[float]] = {m: [] for m in modes}
    outs: dict[str, list] = {}
    for r in range(args.repeats):
        for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            t = time_call(lambda: run(mode))
            times[mode].append(t.seconds)
            outs[mode] = t.value
            log(f"  {mode:<13} run {r}: {t.seconds:.2f} s")
    tokens = {m: [o.outputs[0].token_ids for o in outs[m]] for m in modes}
    prompt_len = len(outs["shared"][0].prompt_token_ids)
    rows, results = [], []
    for mode in modes:
        med = median(times[mode])
        cached = [o.metrics.num_cached_tokens for o in outs[mode]]
        results.append(dict(mode=mode, median_s=med, times_s=times[mode], cached_tokens=cached))
        rows.append([mode, f"{med:.2f}", f"{args.prompts * args.tokens / med:.1f}", cached])
    same = tokens["shared"] == tokens["each its own"]
    print_table(["batch", "seconds (median)", "tok/s", "cached tokens a prompt"], rows,
                title=f"{args.prompts} prompts of {prompt_len} tokens sharing a few-shot preamble, {args.tokens} new "
                      f"tokens each ({'target alone' if spec is None else f'draft k = {args.k}'}); same tokens: {same}; "
                      f"speedup {results[1]['median_s'] / results[0]['median_s']:.2f}x")
    report = dict(env=environment(), args=vars(args), prompt_tokens=prompt_len, same_tokens=same, results=results)
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()

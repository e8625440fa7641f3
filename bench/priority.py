"""Priority scheduling: how long urgent requests wait behind a backlog, fcfs against priority.

    python bench/priority.py                 # a random SmolLM2-135M-shaped model, bf16, CPU
    python bench/priority.py --model DIR --slots 8 --backlog 32 --urgent 8

A backlog of --backlog requests (priority 1, --backlog-tokens new tokens each) is queued at once;
from step --first on, an urgent request (priority 0, --urgent-tokens new tokens) arrives every
--every steps, --urgent of them. Each policy runs the same arrivals on its own engine (same
weights, same seeds, greedy): the table gives the urgent requests' wait for their first token in
engine steps and seconds (median and worst), their end-to-end seconds, the backlog's mean
end-to-end seconds, the preemptions, the whole run's tokens/s, and whether every output equals
the other policy's (scheduling must not change a token).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, SMOLLM2_135M, build_random_model, environment, print_table, write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: random SmolLM2-135M-shaped weights)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--slots", type=int, default=4, help="max_num_seqs (default 4)")
    p.add_argument("--backlog", type=int, default=16, help="low-priority requests queued at the start (default 16)")
    p.add_argument("--backlog-tokens", type=int, default=64)
    p.add_argument("--urgent", type=int, default=4, help="urgent requests (default 4)")
    p.add_argument("--urgent-tokens", type=int, default=16)
    p.add_argument("--first", type=int, default=4, help="the step the first urgent request arrives at")
    p.add_argument("--every", type=int, default=24, help="steps between urgent arrivals")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out", default=str(RESULTS_DIR / "priority.json"))
    return p.parse_args(argv)


def run(path: str, policy: str, args) -> dict:
    import torch

    from tandem import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype=args.dtype, max_num_seqs=args.slots, scheduling_policy=policy,
              max_model_len=args.prompt_len + max(args.backlog_tokens, args.urgent_tokens) + 8)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size

    def prompt() -> list[int]:
        return torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    urgent_prompts = [prompt() for _ in range(args.urgent)]
    for i in range(args.backlog):
        engine.add_request(f"low{i}", prompt(), params(args.backlog_tokens), priority=1 if policy == "priority" else 0)
    arrivals = {args.first + i * args.every: i for i in range(args.urgent)}
    added_step, first_step, finals = {}, {}, {}
    step, t0 = 0, time.monotonic()
    while engine.has_unfinished_requests() or len(added_step) < args.urgent:
        if step in arrivals:
            i = arrivals[step]
            engine.add_request(f"urgent{i}", urgent_prompts[i], params(args.urgent_tokens))
            added_step[f"urgent{i}"] = step
        for out in engine.step():
            if out.request_id.startswith("urgent") and out.request_id not in first_step and out.outputs[0].token_ids:
                first_step[out.request_id] = step + 1 - added_step[out.request_id]
            if out.finished:
                finals[out.request_id] = out
        step += 1
    wall = time.monotonic() - t0
    urgent = [finals[f"urgent{i}"] for i in range(args.urgent)]
    low = [finals[f"low{i}"] for i in range(args.backlog)]
    waits = [o.metrics.first_token_time - o.metrics.arrival_time for o in urgent]
    steps = [first_step[o.request_id] for o in urgent]
    return {
        "policy": policy,
        "urgent_wait_steps": steps,
        "urgent_wait_s": waits,
        "urgent_e2e_s": [o.metrics.finished_time - o.metrics.arrival_time for o in urgent],
        "backlog_e2e_s_mean": statistics.mean(o.metrics.finished_time - o.metrics.arrival_time for o in low),
        "preemptions": engine.scheduler.num_preemptions,
        "steps": step,
        "tokens_per_s": (args.backlog * args.backlog_tokens + args.urgent * args.urgent_tokens) / wall,
        "tokens": {rid: o.outputs[0].token_ids for rid, o in finals.items()},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(build_random_model(Path(tmp) / "model", SMOLLM2_135M, dtype=args.dtype))
        results = [run(path, policy, args) for policy in ("fcfs", "priority")]
    same = results[0]["tokens"] == results[1]["tokens"]
    rows = []
    for r in results:
        rows.append([r["policy"], statistics.median(r["urgent_wait_steps"]), max(r["urgent_wait_steps"]),
                     f"{statistics.median(r['urgent_wait_s']):.2f}", f"{max(r['urgent_wait_s']):.2f}",
                     f"{statistics.median(r['urgent_e2e_s']):.2f}", f"{r['backlog_e2e_s_mean']:.2f}",
                     r["preemptions"], f"{r['tokens_per_s']:.1f}", "yes" if same else "NO"])
        del r["tokens"]
    write_json(args.out, {"benchmark": "priority", "env": environment(), "config": vars(args), "results": results})
    print_table(["policy", "urgent wait steps (median)", "(worst)", "urgent wait s (median)", "(worst)",
                 "urgent e2e s (median)", "backlog e2e s (mean)", "preemptions", "tok/s", "same tokens"], rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

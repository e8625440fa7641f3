"""Suffix lookup's drafting rule against Arctic Inference's (vLLM's suffix decoding), offline, on
real greedy outputs: how many target steps each needs.

    python bench/suffix_rules.py                           # the real Qwen2.5-Coder 1.5B, CPU
    python bench/suffix_rules.py --outputs /tmp/o.json     # keep (or reuse) the generated outputs

Greedy verification accepts the longest prefix of the drafts that the target's own output
continues with, then one token more; so given the target-only output of each request, the steps
a rule needs follow from its drafts alone, with no model in the loop. The outputs come from
tandem target-only (greedy, EOS honoured) on bench/real_pair.py's prompts, all classes.

Rules, k drafts at most, vLLM's defaults (depth 24, spec factor 1, min token probability 0.1):
- tandem: `tandem.spec.suffix.suffix_drafts` itself (the longest match, its most frequent
  continuation; sources: the request's own tokens, and the finished responses);
- arctic: this file's brute-force reading of Arctic Inference's path speculation: for every match
  length m of the context's last depth - 1 tokens, follow the most frequent continuation while its
  estimated probability (occurrences continuing so / occurrences of the match, the request's own
  trailing occurrence counted) stays >= min_token_prob, at most floor(m * factor) tokens, paths no
  deeper than the tree (m + drafts <= depth); score = the sum of those probabilities; the best
  score wins (ties: the longer match), between the request's own tokens and the responses (its
  own response so far among them, as Arctic caches active responses) the responses only when
  strictly better. Ties among continuations go to the most recent occurrence (Arctic's hash
  order is unspecified).

Workloads: "own" (no responses kept), "pass 1" (each request sees the responses of the requests
before it: other prompts), "pass 2" (the same prompts again: every answer seen before).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, print_table, write_json  # noqa: E402

SEP = -1


def arctic_source(seqs: list[list[int]]) -> np.ndarray:
    """Sequences concatenated, each followed by the separator."""
    out = []
    for s in seqs:
        out += list(s) + [SEP]
    return np.array(out, dtype=np.int64)


def arctic_speculate(src: np.ndarray, pattern: list[int], k: int, depth: int, factor: float,
                     min_prob: float) -> tuple[list[int], float]:
    """The best-scoring path draft over every match length in src (separator-joined sequences)."""
    pattern = pattern[-depth:]
    n = len(src)
    # run[e]: how many of the pattern's last tokens end at e (matching backwards)
    run = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    for j in range(len(pattern)):
        shifted = np.full(n, SEP - 1, dtype=np.int64)
        shifted[j:] = src[: n - j]
        alive &= shifted == pattern[-1 - j]
        if not alive.any():
            break
        run += alive
    best, best_score = [], 0.0
    for m in range(1, len(pattern)):
        ends = np.flatnonzero(run >= m)  # occurrences of the last m tokens, by end
        if len(ends) == 0:
            break
        total = len(ends)
        limit = min(k, int(m * factor + 1e-6))
        draft, score, cur = [], 0.0, ends
        while len(draft) < limit and m + len(draft) < depth:
            nxt = cur + 1
            nxt = nxt[nxt < n]
            toks = src[nxt]
            keep = toks != SEP
            nxt, toks = nxt[keep], toks[keep]
            if len(toks) == 0:
                break
            values, counts = np.unique(toks, return_counts=True)
            top = counts.max()
            latest = {}
            for pos, t in zip(nxt, toks):  # the most recent occurrence among the most frequent
                if counts[np.searchsorted(values, t)] == top:
                    latest[t] = pos
            t = max(latest, key=latest.get)
            prob = top / total
            if prob < min_prob:
                break
            draft.append(int(t))
            score += prob
            cur = nxt[toks == t]
        if draft and score >= best_score:
            best, best_score = draft, score
    return best, best_score


def steps_for(output: list[int], propose) -> tuple[int, int, int]:
    """(steps, drafted, accepted) to emit output when propose(i) drafts after output[:i]."""
    i = steps = drafted = accepted = 0
    while i < len(output):
        drafts = propose(i)[: len(output) - i - 1]  # none past the output's end
        a = 0
        while a < len(drafts) and drafts[a] == output[i + a]:
            a += 1
        steps, drafted, accepted, i = steps + 1, drafted + len(drafts), accepted + a, i + a + 1
    return steps, drafted, accepted


def simulate(rule: str, requests: list[tuple[list[int], list[int]]], corpus_passes: int, k: int, depth: int,
             factor: float, min_prob: float) -> list[dict]:
    """requests: (prompt, output) in arrival order, run one at a time; corpus_passes: 0 keeps no
    responses, else that many passes over the requests, the responses of each finished request kept.
    -> per pass: steps, drafted, accepted, tokens."""
    from tandem.spec.suffix import suffix_drafts

    finished: list[list[int]] = []
    results = []
    for _ in range(max(corpus_passes, 1)):
        steps = drafted = accepted = tokens = 0
        for prompt, output in requests:
            corpus = arctic_source(finished) if corpus_passes else None
            tc = torch.tensor(corpus, dtype=torch.int32) if corpus is not None and len(corpus) else None

            def propose(i):
                context = prompt + output[:i]
                if rule == "tandem":
                    drafts, counts = suffix_drafts(torch.tensor([context]), torch.tensor([len(context)]), tc, depth, k,
                                                   factor, min_prob, 1 << 30)
                    return drafts[0, : int(counts[0])].tolist()
                own, own_score = arctic_speculate(np.array(context, dtype=np.int64), context, k, depth, factor,
                                                  min_prob)
                if corpus_passes:  # the responses, this request's own so far among them
                    glob, glob_score = arctic_speculate(arctic_source(finished + [output[:i]]), context, k, depth,
                                                        factor, min_prob)
                    if glob_score > own_score:
                        return glob
                return own

            s, d, a = steps_for(output, propose)
            steps, drafted, accepted, tokens = steps + s, drafted + d, accepted + a, tokens + len(output)
            if corpus_passes:
                finished.append(output)
        results.append(dict(steps=steps, drafted=drafted, accepted=accepted, tokens=tokens))
    return results


def generate(num_prompts: int, max_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """Target-only greedy outputs of the real target (EOS honoured) -> (class, prompt, output)."""
    from bench.real_pair import CLASSES, TARGET, prompt_ids
    from tandem import LLM, SamplingParams

    llm = LLM(TARGET, dtype="bfloat16", max_model_len=2048, max_num_seqs=16)
    prompts = prompt_ids(llm.get_tokenizer(), num_prompts, CLASSES)
    outs = llm.generate([{"prompt_token_ids": ids} for _, ids in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [(cls, ids, list(o.outputs[0].token_ids)) for (cls, ids), o in zip(prompts, outs)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", default=None, help="a JSON file of generated outputs: read if it exists, else written")
    p.add_argument("--prompts", type=int, default=5, help="prompts per class")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ks", default="4,8")
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--out", default="bench/results/suffix_rules.json")
    args = p.parse_args(argv)
    path = Path(args.outputs) if args.outputs else None
    if path is not None and path.exists():
        data = json.loads(path.read_text())
    else:
        data = generate(args.prompts, args.max_tokens)
        if path is not None:
            path.write_text(json.dumps(data))
    requests = [(prompt, output) for _, prompt, output in data]
    results = {"env": environment(), "config": vars(args), "rows": []}
    for k in [int(x) for x in args.ks.split(",")]:
        for rule in ("tandem", "arctic"):
            t0 = time.perf_counter()
            own = simulate(rule, requests, 0, k, args.depth, 1.0, 0.1)
            passes = simulate(rule, requests, 2, k, args.depth, 1.0, 0.1)
            for name, r in zip(("own", "pass 1", "pass 2"), own + passes):
                results["rows"].append(dict(k=k, rule=rule, workload=name, **r))
            print(f"[rule] k={k} {rule}: {time.perf_counter() - t0:.0f} s", flush=True)
            write_json(args.out, results)
    print_table(["k", "workload", "rule", "tokens", "steps", "tokens / step", "drafted / step", "acceptance"],
                [(r["k"], r["workload"], r["rule"], r["tokens"], r["steps"], f"{r['tokens'] / r['steps']:.2f}",
                  f"{r['drafted'] / r['steps']:.2f}", f"{r['accepted'] / max(r['drafted'], 1):.3f}")
                 for r in sorted(results["rows"], key=lambda r: (r["k"], r["workload"], r["rule"]))])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU benchmark on the real Qwen2.5-Coder pair (issue 4): tandem vs transformers, side by side.

    python bench/real_pair.py                     # 10 prompts (5 code, 5 chat), 128 tokens, bf16
    python bench/real_pair.py --tokens 32 --prompts 2   # a quick look
    python bench/real_pair.py --cpu-matmuls avx2,fbgemm --ks 4 --skip-hf   # CPU kernels side by side
    python bench/real_pair.py --ks 6 --default-k 6 --draft-quantizations none,fp8 --skip-hf   # fp8 draft's acceptance
    python bench/real_pair.py --ks 4 --tensor-parallel-sizes 1,2 --skip-hf   # two CPU ranks against one
    python bench/real_pair.py --ks 3 --draft-vocab-sizes none,32768,16384 --skip-hf   # a pruned draft head
    python bench/real_pair.py --ks 4 --temperature 1 --draft-sample-method probabilistic \
        --rejection-sample-methods standard,block --skip-hf   # sampled: block verification's acceptance
    python bench/real_pair.py --classes code,chat,edit --ks 4 --ngram 1:3,2:5 --skip-hf   # n-gram lookup too
    python bench/real_pair.py --ks 4 --quantizations none,fp8 --skip-hf   # the target in fp8: agreement, acceptance

Prompt classes (--classes): code (complete a function), chat (answer a question), edit (rewrite
a given piece of code: the answer copies much of the prompt, where n-gram lookup drafts well).

Configurations: (a) tandem target-only, (b) tandem with the 0.5B draft at each k in --ks (and
with n-gram lookup, method="ngram", at each --ngram min:max and k),
(c) transformers `generate` target-only, (d) transformers assisted generation with the same
draft (its default assistant settings). Greedy, batch 1, exactly --tokens new tokens for every
prompt (EOS ignored on both sides). Each configuration runs over all prompts after one
warm-up generation; tokens/s is per prompt class (tokens / seconds over its prompts). "same":
the share of prompts whose tokens equal target-only's with the same CPU kernel (in parentheses,
for another kernel's target-only run: its tokens against the first kernel's). A target-only run
after the first also scores the first run's outputs teacher-forced (prompt_logprobs): "top-1"
is the share of those tokens that are its own argmax too, "nll" its mean negative log-likelihood
of them (the first run's own nll beside it), a measure of what a quantization or cache dtype
changes that does not hang on where two greedy trajectories part.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)
import torch  # noqa: E402

from bench.common import environment, print_table, write_json  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CLASSES = ("code", "chat", "edit")
CODE = [
    "def quicksort(arr):\n",
    "def is_prime(n: int) -> bool:\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n",
    "import csv\n\ndef read_rows(path):\n",
]
CHAT = [
    "Explain what a Python generator is, with a short example.",
    "Write a function that reverses a linked list and explain how it works.",
    "What is the difference between a list and a tuple in Python?",
    "How do I read a JSON file in Python and handle errors?",
    "Give three tips for writing fast NumPy code.",
]

SNIPPETS = [
    "def total(xs):\n    t = 0\n    for x in xs:\n        t = t + x\n    return t\n\n\n"
    "def mean(xs):\n    if len(xs) == 0:\n        return 0\n    return total(xs) / len(xs)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        data = json.load(f)\n"
    "    return data\n\n\ndef save(path, data):\n    with open(path, 'w') as f:\n        json.dump(data, f)\n",
    "def fib(n):\n    a, b = 0, 1\n    for i in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def fibs(n):\n    out = []\n    for i in range(n):\n        out.append(fib(i))\n    return out\n",
    "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n"
    "    return x\n\n\ndef scale(xs, k):\n    return [clamp(x * k, 0, 100) for x in xs]\n",
]
EDITS = ["Add type hints to every function", "Add a docstring to every method", "Add a docstring to every function",
         "Rename the variable `i` to `step`", "Add a docstring to every function"]


def prompt_ids(tok, n: int, classes=("code", "chat")):
    def chat(text):
        t = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok(t, add_special_tokens=False).input_ids

    out = []
    if "code" in classes:
        out += [("code", tok(p).input_ids) for p in CODE[:n]]
    if "chat" in classes:
        out += [("chat", chat(p)) for p in CHAT[:n]]
    if "edit" in classes:
        out += [("edit", chat(f"{e} in this Python code; reply with the whole code only.\n\n```python\n{c}```"))
                for e, c in zip(EDITS[:n], SNIPPETS)]
    return out


def run_tandem(llm, prompts, tokens, temperature=0.0, seeds=1):
    """seeds: each prompt is run with seeds 0 .. seeds - 1 (sampled runs: more trajectories)."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate({"prompt_token_ids": prompts[0][1]}, params.clone(max_tokens=8), use_tqdm=False)
    rows = []
    for (cls, ids), seed in [(p, s) for p in prompts for s in range(seeds)]:
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, params.clone(seed=seed), use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        m = out.metrics
        rows.append(dict(cls=cls, seconds=dt, tokens=len(out.outputs[0].token_ids), token_ids=out.outputs[0].token_ids,
                         rounds=m.num_draft_rounds, drafts=m.num_draft_tokens, accepted=m.num_accepted_tokens,
                         accepted_per_position=list(m.accepted_per_position)))
    return rows


def time_variants(specs: dict, tokens: int, num_prompts: int, repeats: int, classes=("code", "chat")):
    """One batch-1 speculative engine per speculative_config (name -> spec; None: target-only), all
    loaded first, then timed round-robin (bench.common.run_interleaved: one greedy pass over the
    prompts of `classes` each, `tokens` new tokens a prompt), so a shared machine's drift hits each
    alike -> (engines, prompts, series by name, each engine's outputs of its last pass)."""
    from bench.common import run_interleaved
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engines, prompts = {}, None
    for name, spec in specs.items():
        engines[name] = LLM(TARGET, dtype="bfloat16", max_model_len=1024, max_num_seqs=1, speculative_config=spec)
        prompts = prompts or prompt_ids(engines[name].get_tokenizer(), num_prompts, classes)
    outputs = {}

    def one_pass(name):
        def run(i):
            outputs[name] = [engines[name].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                             for _, ids in prompts]
        return run

    series = run_interleaved([(name, one_pass(name)) for name in engines], repeats,
                             log=lambda line: print(line, flush=True))
    return engines, prompts, series, outputs


def run_hf(model, prompts, tokens, assistant=None):
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    model.generate(torch.tensor([prompts[0][1]]), **dict(kw, max_new_tokens=8, min_new_tokens=8))
    rows = []
    for cls, ids in prompts:
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([ids]), **kw)
        dt = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        rows.append(dict(cls=cls, seconds=dt, tokens=len(new), token_ids=new))
    return rows


def score(llm, prompts, rows) -> dict:
    """Teacher-forced: llm's mean negative log-likelihood of each row's tokens after its prompt,
    and the share of them that are llm's argmax (prompt_logprobs=1), over all prompts."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    nll, top1, n = 0.0, 0, 0
    for (_, ids), row in zip(prompts, rows):
        out = llm.generate({"prompt_token_ids": ids + row["token_ids"]}, params, use_tqdm=False)[0]
        for pos in range(len(ids), len(ids) + len(row["token_ids"])):
            entries, token = out.prompt_logprobs[pos], (ids + row["token_ids"])[pos]
            nll -= entries[token].logprob
            top1 += entries[token].rank == 1
            n += 1
    return dict(nll=nll / n, top1=top1 / n)


def summarize(name, rows, ref_rows=None):
    out = {"config": name}
    for cls in CLASSES:
        sel = [r for r in rows if r["cls"] == cls]
        if not sel:
            continue
        out[f"{cls}_tok_s"] = sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel)
        rounds = sum(r.get("rounds", 0) for r in sel)
        drafts = sum(r.get("drafts", 0) for r in sel)
        acc = sum(r.get("accepted", 0) for r in sel)
        if drafts:
            out[f"{cls}_acceptance_rate"] = acc / drafts
            out[f"{cls}_mean_acceptance_length"] = 1 + acc / rounds
            width = max(len(r["accepted_per_position"]) for r in sel)
            per_pos = [sum(r["accepted_per_position"][i] for r in sel if i < len(r["accepted_per_position"]))
                       for i in range(width)]
            # unconditional: P(the first i+1 drafts of a round are accepted), the synthetic mode's input
            out[f"{cls}_acceptance_per_position"] = [a / rounds for a in per_pos]
    if ref_rows is not None:
        out["identical_to_target"] = sum(a["token_ids"] == b["token_ids"] for a, b in zip(rows, ref_rows)) / len(rows)
    return out


def close(llm) -> None:
    """Stop a tensor-parallel engine's other ranks (their cores are the next engine's)."""
    if hasattr(llm.engine, "close"):
        llm.engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=5, help="prompts per class")
    p.add_argument("--ks", default="2,4,6")
    p.add_argument("--default-k", type=int, default=None, help="k of `tandem generate` (default: cli.DEFAULT_K)")
    p.add_argument("--cpu-matmuls", default="auto", help="comma list of LLM(cpu_matmul=...) to compare")
    p.add_argument("--draft-quantizations", default="none",
                   help="comma list of the draft's speculative_config quantization: none, fp8")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (seeded; 0: greedy)")
    p.add_argument("--seeds", type=int, default=1, help="runs of each prompt, seeds 0 .. SEEDS - 1 (sampled runs)")
    p.add_argument("--draft-sample-method", default="greedy", choices=["greedy", "probabilistic"])
    p.add_argument("--rejection-sample-methods", default="standard",
                   help="comma list of speculative_config rejection_sample_method: standard, block")
    p.add_argument("--draft-vocab-sizes", default="none",
                   help="comma list of speculative_config draft_vocab_size: none (the whole head) or a number of ids")
    p.add_argument("--tensor-parallel-sizes", default="1",
                   help="comma list of LLM(tensor_parallel_size=...) to compare (ranks share the CPU's cores)")
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="comma list of LLM(kv_cache_dtype=...) to compare (auto,fp8: the fp8 cache's trajectories "
                        "against the model dtype's, and speculation's against target-only's over it)")
    p.add_argument("--quantizations", default="none",
                   help="comma list of the target's LLM(quantization=...): none, fp8 (each run after the first scores "
                        "the first's outputs teacher-forced: top-1 agreement and nll)")
    p.add_argument("--classes", default="code,chat", help=f"comma list of prompt classes: {', '.join(CLASSES)}")
    p.add_argument("--ngram", default="",
                   help="comma list of n-gram lookups MIN:MAX (speculative_config method='ngram', "
                        "prompt_lookup_min:prompt_lookup_max), each run at every k of --ks; none by default")
    p.add_argument("--skip-draft", action="store_true", help="no draft-model runs (target-only and --ngram only)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out", default="bench/results/real_pair.json")
    args = p.parse_args(argv)
    classes = args.classes.split(",")
    if set(classes) - set(CLASSES):
        p.error(f"--classes: {sorted(set(classes) - set(CLASSES))} unknown; use {', '.join(CLASSES)}")
    lookups = [tuple(int(v) for v in x.split(":")) for x in args.ngram.split(",") if x]
    from tandem import LLM
    from tandem.cli import DEFAULT_K

    default_k = args.default_k or DEFAULT_K
    ks = sorted({int(k) for k in args.ks.split(",")} | {default_k})
    results = {"env": environment(), "config": vars(args) | {"default_k": default_k}, "runs": []}
    matmuls = args.cpu_matmuls.split(",")
    tps = [int(n) for n in args.tensor_parallel_sizes.split(",")]
    kvs = args.kv_cache_dtypes.split(",")
    quants = args.quantizations.split(",")
    first = None  # the first kernel's target-only rows
    for matmul, tp, kv, quant in [(m, n, c, q) for m in matmuls for n in tps for c in kvs for q in quants]:
        tag = "".join([f" [{matmul}]" if len(matmuls) > 1 else "", f" [tp={tp}]" if len(tps) > 1 else "",
                       f" [kv {kv}]" if len(kvs) > 1 else "", f" [{quant}]" if len(quants) > 1 else ""])
        common = dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=4, cpu_matmul=matmul,
                      tensor_parallel_size=tp, kv_cache_dtype=kv, quantization=None if quant == "none" else quant)
        t0 = time.perf_counter()
        llm = LLM(TARGET, **common)
        load_s = time.perf_counter() - t0
        prompts = prompt_ids(llm.get_tokenizer(), args.prompts, classes)
        rows = run_tandem(llm, prompts, args.tokens, args.temperature, args.seeds)
        base = rows  # speculative runs are compared with this kernel's target-only tokens
        first = first or rows
        run = summarize("tandem target-only" + tag, rows, first) | {"load_s": load_s}
        if rows is not first:  # another kernel, rank count or cache dtype rounds otherwise: near-ties may flip
            run["identical_to_first_kernel"] = run.pop("identical_to_target")
            if len(quants) > 1 or len(kvs) > 1:
                run["scores_of_first"] = score(llm, prompts, first)
                print("teacher-forced on the first run's outputs:", run["scores_of_first"], flush=True)
        elif len(quants) > 1 or len(kvs) > 1:
            run["scores_of_first"] = score(llm, prompts, first)
        results["runs"].append(run)
        print(results["runs"][-1], flush=True)
        close(llm)
        variants = [] if args.skip_draft else [
            (q, v, r, k) for q in args.draft_quantizations.split(",") for v in args.draft_vocab_sizes.split(",")
            for r in args.rejection_sample_methods.split(",") for k in ks]
        variants += [(lookup, None, None, k) for lookup in lookups for k in ks]
        for quant, vocab, verify, k in variants:
            if isinstance(quant, tuple):  # an n-gram lookup (min, max)
                spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=quant[0],
                            prompt_lookup_max=quant[1])
                name = f"tandem ngram {quant[0]}:{quant[1]} k={k}" + tag
            else:
                quant = None if quant == "none" else quant
                vocab = None if vocab == "none" else int(vocab)
                spec = dict(model=DRAFT, num_speculative_tokens=k, quantization=quant, draft_vocab_size=vocab,
                            draft_sample_method=args.draft_sample_method, rejection_sample_method=verify)
                name = (f"tandem k={k}" + (f" {quant} draft" if quant else "") + (f" head {vocab}" if vocab else "")
                        + (f" {verify}" if verify != "standard" else "") + (" (default)" if k == default_k else "")
                        + tag)
            t0 = time.perf_counter()
            llm = LLM(TARGET, speculative_config=spec, **common)
            load_s = time.perf_counter() - t0
            rows = run_tandem(llm, prompts, args.tokens, args.temperature, args.seeds)
            results["runs"].append(summarize(name, rows, base) | {"load_s": load_s})
            print(results["runs"][-1], flush=True)
            close(llm)
            write_json(args.out, results)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from tandem.models.hub import resolve_model

        hf_t = AutoModelForCausalLM.from_pretrained(resolve_model(TARGET, torch.bfloat16), dtype=torch.bfloat16).eval()
        hf_d = AutoModelForCausalLM.from_pretrained(resolve_model(DRAFT, torch.bfloat16), dtype=torch.bfloat16).eval()
        for m in (hf_t, hf_d):
            m.generation_config.eos_token_id = None
        rows = run_hf(hf_t, prompts, args.tokens)
        results["runs"].append(summarize("transformers generate", rows, first))
        print(results["runs"][-1], flush=True)
        rows = run_hf(hf_t, prompts, args.tokens, assistant=hf_d)
        results["runs"].append(summarize("transformers assisted", rows, first))
        print(results["runs"][-1], flush=True)
    write_json(args.out, results)
    table = []
    for r in results["runs"]:
        table.append([r["config"]] + [f"{r.get(f'{c}_tok_s', 0):.2f}" for c in classes]
                     + [v for c in classes for v in (
                         f"{r[f'{c}_acceptance_rate']:.3f}" if f"{c}_acceptance_rate" in r else "-",
                         f"{r[f'{c}_mean_acceptance_length']:.2f}" if f"{c}_mean_acceptance_length" in r else "-")]
                     + [f"{r['identical_to_target']:.2f}" if "identical_to_target" in r else
                        f"({r['identical_to_first_kernel']:.2f})" if "identical_to_first_kernel" in r else "-",
                        f"{r['load_s']:.1f}" if "load_s" in r else "-",
                        f"{r['scores_of_first']['top1']:.4f}" if "scores_of_first" in r else "-",
                        f"{r['scores_of_first']['nll']:.4f}" if "scores_of_first" in r else "-"])
    print_table(["config"] + [f"{c} tok/s" for c in classes] + [h for c in classes for h in (f"{c} acc", f"{c} AL")]
                + ["same", "load s", "top-1 on first", "nll of first"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

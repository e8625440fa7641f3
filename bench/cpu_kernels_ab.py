"""CPU: our C kernels for norms, rotary, attention and SiLU-and-mul against PyTorch's ops, A/B in one process.

    python bench/cpu_kernels_ab.py                    # the real Qwen pair, k = 3, 2 prompts x 48 tokens, 5 rounds
    python bench/cpu_kernels_ab.py --ks 0,3,5 --rounds 3

The 2-core dev machine's speed drifts by 10-20% within minutes, so separate processes cannot
compare small changes. Here each engine (target-only, and with the 0.5B draft at each k) is
loaded once, and every round runs each engine twice: with the modules' `cpu_isa` set (our C
kernels, the default beside our GEMM) and with it cleared (the PyTorch reference ops). Both
use our GEMM. Greedy, batch 1, EOS ignored; reported: median tokens/s over the rounds, the
ratio, and whether the two modes gave the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)

from bench.common import environment, print_table, write_json  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["def quicksort(arr):\n", "class LRUCache:\n    def __init__(self, capacity: int):\n"]


def kernel_modules(llm) -> list:
    runner = llm.engine.runner
    models = [runner.model] + ([runner.speculator.model] if runner.speculator is not None else [])
    return [m for model in models for m in model.modules() if hasattr(type(m), "cpu_isa")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", default="0,3", help="comma list of k; 0 is target-only")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench/results/cpu_kernels_ab.json")
    args = p.parse_args(argv)
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engines = {}
    for k in (int(k) for k in args.ks.split(",")):
        spec = dict(model=DRAFT, num_speculative_tokens=k) if k else None
        engines[k] = LLM(TARGET, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, speculative_config=spec)
        engines[k].generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    isas = {m.cpu_isa for llm in engines.values() for m in kernel_modules(llm)}
    if None in isas or len(isas) != 1:
        print(f"our C kernels are not in use here ({isas}): nothing to compare")
        return 1
    isa = isas.pop()
    tok_s = {(k, mode): [] for k in engines for mode in ("torch", "C")}
    tokens = {}
    for _ in range(args.rounds):
        for k, llm in engines.items():
            for mode in ("torch", "C"):
                for m in kernel_modules(llm):
                    m.cpu_isa = isa if mode == "C" else None
                t0 = time.perf_counter()
                outs = [llm.generate(prompt, params, use_tqdm=False)[0] for prompt in PROMPTS]
                tok_s[(k, mode)].append(len(PROMPTS) * args.tokens / (time.perf_counter() - t0))
                tokens[(k, mode)] = [o.outputs[0].token_ids for o in outs]
    rows, results = [], {"env": environment(), "config": vars(args) | {"isa": isa}, "runs": []}
    for k in engines:
        torch_ops, c_kernels = (statistics.median(tok_s[(k, mode)]) for mode in ("torch", "C"))
        same = tokens[(k, "torch")] == tokens[(k, "C")]
        name = f"k={k}" if k else "target-only"
        results["runs"].append({"config": name, "torch_tok_s": torch_ops, "c_tok_s": c_kernels,
                                "ratio": c_kernels / torch_ops, "same_tokens": same,
                                "rounds": {mode: tok_s[(k, mode)] for mode in ("torch", "C")}})
        rows.append((name, f"{torch_ops:.2f}", f"{c_kernels:.2f}", f"{c_kernels / torch_ops:.3f}",
                     "yes" if same else "no"))
    write_json(args.out, results)
    print_table(["engine", "torch ops tok/s", "C kernels tok/s", "ratio", "same tokens"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU: the C kernels of another source revision against this tree's, A/B in one process.

    python bench/cpu_build_ab.py --base HEAD~1                       # the real Qwen pair: bf16 target-only and k = 3
    python bench/cpu_build_ab.py --base 0be7471 --configs fp8-target,fp8-both --rounds 3
    python bench/cpu_build_ab.py --base HEAD~1 --configs spec --temperature 0.8

The 2-core dev machine's speed drifts by 10-40% within minutes, so a kernel change cannot be judged
by two processes. Here the base revision's C sources (tandem/kernels/cpu_*.c and cpu_common.h, read
with `git show`) are built with this tree's flags into a temporary directory beside this tree's own
build; each engine is loaded once, and every round runs each engine once with each library (every
wrapper asks `cpu_build.library` for it at call time), the two in alternating order. An entry point
the base lacks is taken from this tree's build (listed in the output). Batch 1, EOS ignored, seed 0.
Reported: median tokens/s over the rounds, their ratio, the range of the round-by-round ratios (the
noise: `--base HEAD`, the same sources twice, read 0.77-1.22 a round and 1.06x / 1.10x in medians
over 4 rounds on that machine, so take only large ratios from few rounds), and whether the two builds
gave the same tokens (a build whose sums round differently may part at a near-tie; within a build
speculation equals target-only).

Configs: target (bf16 target alone), spec (bf16 target, bf16 draft), fp8-target (the target in fp8
alone), fp8-draft (bf16 target, fp8 draft), fp8-both (both in fp8); the draft proposes --k tokens.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)

from bench.common import environment, print_table, write_json  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["def quicksort(arr):", "The three primary colors are"]
CONFIGS = {  # name -> (target quantization, draft quantization or "none" for no draft)
    "target": (None, "none"), "spec": (None, None), "fp8-target": ("fp8", "none"),
    "fp8-draft": (None, "fp8"), "fp8-both": ("fp8", "fp8"),
}
REPO = Path(__file__).resolve().parent.parent


class _Mixed:
    """The base build's entry points, this tree's for those the base lacks."""

    def __init__(self, base: ctypes.CDLL, tree: ctypes.CDLL, names: list[str]):
        self.functions = {name: getattr(base, name) if hasattr(base, name) else getattr(tree, name) for name in names}
        self.from_tree = [name for name in names if not hasattr(base, name)]

    def __getattr__(self, name: str):
        return self.functions[name]


def build_base(rev: str, isa: str, workdir: Path) -> _Mixed:
    """Compile `rev`'s C kernels for `isa` into workdir; -> its entry points (this tree's where it has none)."""
    from tandem.kernels import cpu_build

    sources = []
    for path in cpu_build._SOURCES + cpu_build._HEADERS:
        rel = path.relative_to(REPO)
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel.as_posix()}"], capture_output=True,
                               text=True)
        if shown.returncode != 0:  # a file the base does not have (a later kernel)
            continue
        (workdir / path.name).write_text(shown.stdout)
        if path.suffix == ".c":
            sources.append(str(workdir / path.name))
    out = workdir / f"base-{isa}.so"
    subprocess.run([os.environ.get("CC") or "cc", *cpu_build._FLAGS, *cpu_build.ISAS[isa], "-o", str(out), *sources, "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    for name, (argtypes, restype) in cpu_build._ENTRY_POINTS.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return _Mixed(lib, cpu_build.library(isa), list(cpu_build._ENTRY_POINTS))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare against (e.g. HEAD~1)")
    p.add_argument("--configs", default="target,spec", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="bench/results/cpu_build_ab.json")
    args = p.parse_args(argv)
    from tandem import LLM, SamplingParams
    from tandem.kernels import cpu_build

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    isa = cpu_build.best_isa()
    if isa is None:
        print(f"tandem's CPU kernels cannot run here: {cpu_build.load_error('avx2')}")
        return 1
    tree = cpu_build.library(isa)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, isa, Path(tmp))
    libs = {"base": base, "tree": tree}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, seed=0)
    engines = {}
    for name in names:
        target_q, draft_q = CONFIGS[name]
        spec = None if draft_q == "none" else dict(model=DRAFT, num_speculative_tokens=args.k, quantization=draft_q)
        engines[name] = LLM(TARGET, dtype="bfloat16", quantization=target_q, max_model_len=1024, max_num_seqs=1,
                            speculative_config=spec)
        engines[name].generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    tok_s = {(name, build): [] for name in engines for build in libs}
    tokens = {}
    library = cpu_build.library
    try:
        for r in range(args.rounds):
            for build in ("base", "tree") if r % 2 == 0 else ("tree", "base"):  # ABBA: drift cancels
                cpu_build.library = lambda _isa, _lib=libs[build]: _lib
                for name, llm in engines.items():
                    t0 = time.perf_counter()
                    outs = [llm.generate(prompt, params, use_tqdm=False)[0] for prompt in PROMPTS]
                    tok_s[(name, build)].append(len(PROMPTS) * args.tokens / (time.perf_counter() - t0))
                    tokens[(name, build)] = [o.outputs[0].token_ids for o in outs]
    finally:
        cpu_build.library = library
    rows = []
    results = {"env": environment(), "config": vars(args) | {"isa": isa, "from_tree": base.from_tree}, "runs": []}
    for name in engines:
        b, t = (statistics.median(tok_s[(name, build)]) for build in libs)
        same = tokens[(name, "base")] == tokens[(name, "tree")]
        results["runs"].append({"config": name, "base_tok_s": b, "tree_tok_s": t, "ratio": t / b, "same_tokens": same,
                                "rounds": {build: tok_s[(name, build)] for build in libs}})
        paired = [x / y for x, y in zip(tok_s[(name, "tree")], tok_s[(name, "base")])]
        rows.append((name, f"{b:.2f}", f"{t:.2f}", f"{t / b:.2f}x", f"{min(paired):.2f}-{max(paired):.2f}",
                     "yes" if same else "no"))
    write_json(args.out, results)
    if base.from_tree:
        print(f"entry points the base lacks, taken from this tree: {', '.join(base.from_tree)}")
    print_table(["config", f"{args.base} tok/s", "this tree tok/s", "ratio", "round by round", "same tokens"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

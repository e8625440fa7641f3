"""GPU memory benchmark (issue 5): does gpu_memory_utilization bound what the process holds?

    python3 bench/gpu_memory.py --out $OUT/gpu_memory.json      # on the H200

For each engine (dummy weights, real shapes): what the KV budget set aside for what follows
the pool (the runner's and speculator's buffers, the CUDA graphs and the sampler's
temporaries, measured by a rehearsal over a scratch KV pool of a few blocks), what capturing
the real graphs took, the start-up time, and, after a run of long prompts, the device's used
memory against total * gpu_memory_utilization.
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, print_table, write_json  # noqa: E402
from bench.gpu_bench import LLAMA_1B, LLAMA_8B, TINY, TINY_DRAFT, write_config  # noqa: E402

GiB = 1 << 30


def measure(target: str, draft: str | None, method: str, max_num_seqs: int, util: float, max_model_len: int) -> dict:
    """draft: a draft model's path (method: its draft_sample_method), "ngram" (n-gram lookup, k = 8) or None."""
    from tandem import LLM, SamplingParams

    spec = None
    if draft == "ngram":
        spec = dict(method="ngram", num_speculative_tokens=8)
    elif draft is not None:
        spec = dict(model=draft, num_speculative_tokens=4, draft_load_format="dummy", draft_sample_method=method)
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    t0 = time.monotonic()
    llm = LLM(target, dtype="bfloat16", load_format="dummy", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              gpu_memory_utilization=util, speculative_config=spec, enable_prefix_caching=False)
    start_s = time.monotonic() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (max_model_len // 4,), generator=g).tolist()}
               for _ in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    used = total - torch.cuda.mem_get_info()[0]
    engine = llm.engine
    row = {"max_num_seqs": max_num_seqs, "draft": ("ngram" if draft == "ngram" else method) if draft else None,
           "start_s": start_s,
           "set_aside_gib": engine.after_pool_estimate / GiB, "graphs_gib": engine.graph_memory_bytes / GiB,
           "kv_blocks": engine.cfg.cache.num_blocks, "used_gib": used / GiB, "allowed_gib": util * total / GiB,
           "over_mib": (used - util * total) / 2**20}
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization")
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    p.add_argument("--cases", default="target,greedy,probabilistic",
                   help="engines: target (target-only, 64 sequences), greedy (k = 4, 64), probabilistic (k = 4, 256), "
                        "ngram (n-gram lookup, k = 8, 256: verification graphs for each of 1..8 drafts)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's start-up lines
    target_shape, draft_shape = (TINY, TINY_DRAFT) if args.quick else (LLAMA_8B, LLAMA_1B)
    max_model_len = 1024 if args.quick else 4096
    with tempfile.TemporaryDirectory() as tmp:
        target = write_config(Path(tmp), "target", target_shape)
        draft = write_config(Path(tmp), "draft", draft_shape)
        cases = {"target": (None, "greedy", 64), "greedy": (draft, "greedy", 64),
                 "probabilistic": (draft, "probabilistic", 256), "ngram": ("ngram", "greedy", 256)}
        rows = [measure(target, *cases[c], args.util, max_model_len) for c in args.cases.split(",")]
    headers = ["engine", "max_num_seqs", "set aside GiB", "graphs took GiB", "start s", "used GiB", "allowed GiB",
               "over MiB"]
    names = {None: "target-only", "ngram": "ngram lookup, k = 8"}
    table = [[names.get(r["draft"], f"k = 4, {r['draft']} drafts"), r["max_num_seqs"],
              f"{r['set_aside_gib']:.2f}", f"{r['graphs_gib']:.2f}", f"{r['start_s']:.1f}", f"{r['used_gib']:.2f}",
              f"{r['allowed_gib']:.2f}", f"{r['over_mib']:.0f}"] for r in rows]
    print_table(headers, table, title=f"gpu_memory_utilization={args.util}")
    if args.out:
        write_json(args.out, {"environment": environment(), "util": args.util, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

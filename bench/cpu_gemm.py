"""CPU linear kernels side by side: tandem's kernel (each build this CPU runs: AVX-512, AVX2), FBGEMM's fp16 GEMM, torch bf16.

    python bench/cpu_gemm.py                 # Qwen2.5-Coder-1.5B / 0.5B layer shapes
    python bench/cpu_gemm.py --rows 1,5 --quick

Per layer shape (bf16 weights) and row count: the median time of y = x W^T over rotating copies
of W (together larger than the last-level cache, as in a real forward pass, which streams every
weight from memory), each kernel timed round-robin with the others. Reports ms and the weight
bandwidth it implies (weight bytes / time), and the load-time cost of each kernel's weight
preparation per weight (FBGEMM repacks to fp16; our kernel and torch use W as loaded).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: F401,E402  (before torch: it sets the OpenMP wait policy)
import torch  # noqa: E402

from bench.common import environment, median, print_table, write_json  # noqa: E402

# (name, N, K) of the Qwen2.5-Coder pair's linears (q/k/v and gate/up packed as in tandem).
SHAPES = [
    ("1.5B qkv", 2048, 1536), ("1.5B o", 1536, 1536), ("1.5B gate_up", 17920, 1536), ("1.5B down", 1536, 8960),
    ("1.5B lm_head", 151936, 1536), ("0.5B gate_up", 9728, 896), ("0.5B down", 896, 4864),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,5,6,16,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache-bytes", type=float, default=256e6, help="rotate weight copies totalling this much")
    p.add_argument("--quick", action="store_true", help="two shapes, fewer repeats")
    p.add_argument("--out", default="bench/results/cpu_gemm.json")
    args = p.parse_args(argv)
    from tandem.kernels import cpu_build, cpu_gemm
    from tandem.layers.cpu_linear import fbgemm_available

    isas = [isa for isa in cpu_build.ISAS if cpu_build.load_error(isa) is None]
    if not isas:
        print(f"tandem's CPU kernel cannot run here: {cpu_build.load_error('avx2')}")
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = SHAPES[2:4] if args.quick else SHAPES
    repeats = 2 if args.quick else args.repeats
    results = {"env": environment(), "config": vars(args), "rows": []}
    table = []
    g = torch.Generator().manual_seed(0)
    for name, n, k in shapes:
        copies = max(2, int(args.cache_bytes // (n * k * 2)) + 1)
        ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        t0 = time.perf_counter()
        packs = [torch.ops.quantized.linear_prepack_fp16(w.float(), None) for w in ws] if fbgemm_available() else []
        pack_ns = (time.perf_counter() - t0) / (copies * n * k) * 1e9 if packs else float("nan")
        for m in rows_list:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            xf = x.float()
            kernels = {isa: (lambda w, i, isa=isa: cpu_gemm.gemm_w16(x, w, None, torch.bfloat16, isa)) for isa in isas}
            kernels["torch bf16"] = lambda w, i: torch.nn.functional.linear(x, w)
            if packs:
                kernels["fbgemm"] = lambda w, i: torch.ops.quantized.linear_dynamic_fp16(xf, packs[i]).bfloat16()
            if m > 16:
                kernels.pop("torch bf16")  # seconds per call on AVX2-only CPUs: costs one row per row
            times = {name_: [] for name_ in kernels}
            for rep in range(repeats + 1):
                for kname, fn in kernels.items():
                    for i, w in enumerate(ws):
                        t = time.perf_counter()
                        fn(w, i)
                        if rep:  # the first round warms up
                            times[kname].append(time.perf_counter() - t)
            row = {"layer": name, "n": n, "k": k, "rows": m, "fbgemm_pack_ns_per_weight": pack_ns}
            for kname, ts in times.items():
                row[f"{kname}_ms"] = median(ts) * 1e3
            results["rows"].append(row)
            cells = []
            for kname in (*isas, "fbgemm", "torch bf16"):
                ms = row.get(f"{kname}_ms")
                cells.append("-" if ms is None else f"{ms:.2f} ({n * k * 2 / ms / 1e6:.0f} GB/s)")
            table.append([name, m, *cells])
            print(table[-1], flush=True)
        del ws, packs
    write_json(args.out, results)
    print_table(["layer", "rows", *(f"{isa} ms (weight GB/s)" for isa in isas), "fbgemm ms", "torch bf16 ms"], table,
                title=f"CPU linears, bf16 weights, {torch.get_num_threads()} threads, weights streamed from memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())

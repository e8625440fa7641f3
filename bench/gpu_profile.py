"""GPU profile of target decode steps (issue 5): where a step's time goes.

    python3 bench/gpu_profile.py --out $OUT/gpu_profile.json

Views of the 8B-shaped target (dummy weights, bf16) at batch 1, plus the 1B draft shape:
(1) host time per engine phase, between one step's sync and the next (the GPU idles there);
(2) device time per kernel family for eager decode steps (torch.profiler), against the
    captured graph's replay time (the difference is launch gaps inside the graph);
    `--quantization fp8`: the same for the target in fp8 (and in (6));
(3) each linear layer shape at M = batch as a graph of repeated calls over rotating weights,
    as achieved bandwidth (what the matmul library gives us at this shape);
(4) a speculative round (8B + 1B draft, k = 4, every draft accepted): step time against the
    sum of its graphs (verify, the draft round), and the kernels of an eager round;
(5) `--sections gaps [--batch B] [--timeline PREFIX]`: the device timeline of real engine steps
    (graphs included), target-only and speculative: busy and idle time per step and the longest
    idle gaps, then the host's time in the same steps by function (cProfile); --timeline writes
    every activity (offset, duration, name) to PREFIX.<label>.txt;
(6) `--sections verify [--batch B] [--env-ab VAR=VALUE]`: the verification, draft catch-up and
    draft round graphs of a k = 4 round (and the target's decode graph), kernel by kernel
    (offsets and durations of one replay), per environment variant;
(7) `--sections eager [--eager-batch B]`: host time of eager steps (what a serving run's mixed
    steps pay): step time, Triton launches a step, cProfile by own time;
(8) `--sections tables [--pair P] [--table-cases B:CTX,...]`: decode step time of B requests at
    CTX tokens of context, target-only and speculative (k = 4, every draft accepted), with the
    persistent block table against block tables sent whole from host lists every step (the
    same engine, the two alternating in blocks of steps).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, print_table, write_json  # noqa: E402
from bench.gpu_bench import (LLAMA_1B, LLAMA_8B, PAIRS, copy_bandwidth, graph_time, make_llm,  # noqa: E402
                              write_config)


def drive(llm, batch: int, prompt_len: int, steps: int, hook=None) -> list[float]:
    """Run `batch` requests to decode and time `steps` engine steps (host clock)."""
    from tandem import SamplingParams

    engine = llm.engine
    k = llm.engine.runner.speculator.k if llm.engine.runner.speculator is not None else 0
    params = SamplingParams(temperature=0, max_tokens=(steps + 13) * (k + 1) + 64, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    ids = [f"p{time.monotonic_ns()}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(10, 30000, (prompt_len,), generator=g).tolist(), params)
    for _ in range(12):
        engine.step()
    times = []
    if hook is not None:
        hook(True)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if hook is not None:
        hook(False)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return times


class PhaseTimer:
    """Wraps methods to accumulate host time per phase."""

    def __init__(self):
        self.total = defaultdict(float)
        self.on = False

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[label] += time.perf_counter() - t0

        setattr(obj, name, timed)


def host_phases(llm, args) -> dict:
    import tandem.runner.model_runner as mr

    engine, runner = llm.engine, llm.engine.runner
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "schedule_ahead", "schedule_ahead")
    timer.wrap(engine.scheduler, "update", "update")
    timer.wrap(runner, "_logits", "forward (launch)")
    timer.wrap(runner, "_copy_results", "copy_results")
    timer.wrap(runner, "collect", "collect (incl. wait)")
    orig_build = mr.build_batch

    def build(*a, **kw):
        t0 = time.perf_counter()
        try:
            return orig_build(*a, **kw)
        finally:
            if timer.on:
                timer.total["build_batch"] += time.perf_counter() - t0

    mr.build_batch = build

    def hook(on):
        timer.on = on

    steps = drive(llm, 1, args.prompt_len, args.steps, hook)
    mr.build_batch = orig_build
    out = {k: v / args.steps * 1e3 for k, v in timer.total.items()}
    out["step"] = statistics.median(steps) * 1e3
    prof = cProfile.Profile()
    drive(llm, 1, args.prompt_len, 20, lambda on: prof.enable() if on else prof.disable())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    out["cprofile"] = s.getvalue()
    return out


def kernel_table(llm, args, batch: int = 1) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    steps = 5
    prof = profile(activities=[ProfilerActivity.CUDA])
    drive(llm, batch, args.prompt_len, steps, lambda on: prof.start() if on else (torch.cuda.synchronize(), prof.stop()))
    agg = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.key][0] += t
            agg[e.key][1] += e.count
    rows = sorted(((k[:90], v[0] / steps, v[1] // steps) for k, v in agg.items()), key=lambda r: -r[1])
    return rows


def linear_shapes(shape: dict) -> list[tuple[str, int, int]]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim", h // heads)
    return [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * i, h), ("down", h, i),
            ("lm_head", shape["vocab_size"], h)]


def linear_bench(shape: dict, m: int, bw: float) -> list[dict]:
    out = []
    for name, n, k in linear_shapes(shape):
        nbytes = 2 * n * k
        reps = max(4, min(64, (3 << 30) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"layer": name, "n": n, "k": k, "m": m}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for w in ws:
                F.linear(x, w)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for w in ws:
                    F.linear(x, w)
            ms = graph_time(g) / reps
            row[f"{lib}_us"] = ms * 1e3
            row[f"{lib}_frac"] = nbytes / (ms / 1e3) / bw
            del g
        torch.backends.cuda.preferred_blas_library("cublas")
        out.append(row)
        del ws
        torch.cuda.empty_cache()
    return out


def spec_round(root: Path, args, results: dict) -> None:
    from tandem import LLM

    tdir, ddir = write_config(root, "llama-8b", LLAMA_8B), write_config(root, "llama-1b", LLAMA_1B)
    k = 4
    spec = dict(model=ddir, num_speculative_tokens=k, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[1.0] * k, draft_load_format="dummy")
    llm = make_llm(tdir, spec, 4, args.max_model_len)
    times = drive(llm, 1, args.prompt_len, args.steps)
    runner, sp = llm.engine.runner, llm.engine.runner.speculator
    n = runner.graphs[1].bucket(1)
    parts = {"verify": graph_time(runner.graphs[1 + k].graphs[n]),
             "draft_round": graph_time(sp.graphs[k].rounds[sp.graphs[k].bucket(1)])}
    out = {"step_ms": statistics.median(times) * 1e3, **{f"{k_}_ms": v for k_, v in parts.items()}}
    out["exposed_ms"] = out["step_ms"] - sum(parts.values())
    print("[spec k=4 b=1]", {k_: round(v, 3) for k_, v in out.items()}, flush=True)
    del llm, runner, sp
    torch.cuda.empty_cache()
    eager = LLM(tdir, dtype="bfloat16", load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=4,
                kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False, enforce_eager=True,
                speculative_config=spec)
    rows = kernel_table(eager, args)
    out["kernels"] = rows
    print(f"[spec k=4 b=1] eager round kernels: total {sum(r[1] for r in rows) / 1e3:.3f} ms")
    print_table(["kernel", "us/step", "calls/step"], [(k_, f"{t:.1f}", c) for k_, t, c in rows[:30]])
    results["spec_round"] = out
    del eager
    torch.cuda.empty_cache()


def eager_host(root: Path, args, results: dict) -> None:
    """Host time of eager steps (no CUDA graphs), where a serving run's mixed prefill + decode
    steps go: 8B target-only and 8B + 1B k = 4 (synthetic 0.8) at --eager-batch decodes; median
    step time, Triton launches per step, and the cProfile functions by own time."""
    from tandem import LLM

    tdir, ddir = write_config(root, "llama-8b", LLAMA_8B), write_config(root, "llama-1b", LLAMA_1B)
    k, b = 4, args.eager_batch
    spec = dict(model=ddir, num_speculative_tokens=k, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[0.8 ** (i + 1) for i in range(k)], draft_load_format="dummy")
    out = {}
    for label, sp in (("target-only", None), (f"k={k}", spec)):
        llm = LLM(tdir, dtype="bfloat16", load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=b,
                  kv_cache_memory_bytes=8 << 30, enable_prefix_caching=False, enforce_eager=True,
                  speculative_config=sp)
        times = drive(llm, b, args.prompt_len, args.steps)
        prof = cProfile.Profile()
        drive(llm, b, args.prompt_len, 10, lambda on: prof.enable() if on else prof.disable())
        st = pstats.Stats(prof)
        launches = sum(v[1] for (f, _, name), v in st.stats.items() if name == "run" and f.endswith("jit.py"))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        r = dict(batch=b, step_ms=statistics.median(times) * 1e3, triton_launches_per_step=launches / 10,
                 cprofile=text.getvalue())
        print(f"[eager {label} b={b}] step {r['step_ms']:.2f} ms, {r['triton_launches_per_step']:.0f} Triton "
              f"launches a step", flush=True)
        print(r["cprofile"][:3000])
        rows = kernel_table(llm, args, b)
        r["device_ms"], r["kernels"] = sum(t for _, t, _ in rows) / 1e3, rows
        print(f"[eager {label} b={b}] device time {r['device_ms']:.2f} ms a step")
        print_table(["kernel", "us/step", "calls/step"], [(k_, f"{t:.1f}", c) for k_, t, c in rows[:25]])
        out[label] = r
        del llm
        torch.cuda.empty_cache()
    results["eager_host"] = out


def device_gaps(llm, args, label: str) -> dict:
    """Where the GPU idles during real engine steps (CUDA graphs and all): the device timeline of
    `args.steps` steps from torch.profiler, its busy time, and the longest idle gaps with the
    activities on either side."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    times = drive(llm, args.batch, args.prompt_len, args.steps,
                  lambda on: prof.start() if on else (torch.cuda.synchronize(), prof.stop()))
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > 0),
                 key=lambda e: e.time_range.start)
    gaps, busy, end, prev = [], 0.0, None, None
    for e in evs:
        s_, e_ = e.time_range.start, e.time_range.end
        if end is not None and s_ > end:
            gaps.append((s_ - end, prev.name[:48], e.name[:48]))
        busy += max(0.0, e_ - max(s_, end if end is not None else s_))
        if end is None or e_ > end:
            end, prev = e_, e
    span = (evs[-1].time_range.end - evs[0].time_range.start) if evs else 0.0
    if args.timeline and evs:  # every device activity: start offset, duration, name (one line each)
        t0 = evs[0].time_range.start
        with open(f"{args.timeline}.{''.join(c if c.isalnum() else '_' for c in label)}.txt", "w") as f:
            for e in evs:
                f.write(f"{e.time_range.start - t0:10.1f} {e.time_range.end - e.time_range.start:8.1f} {e.name[:90]}\n")
    gaps.sort(reverse=True)
    out = {"step_ms": statistics.median(times) * 1e3, "busy_ms_per_step": busy / args.steps / 1e3,
           "idle_ms_per_step": (span - busy) / args.steps / 1e3, "num_kernels": len(evs),
           "top_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:12]]}
    print(f"[{label}] step {out['step_ms']:.3f} ms, device busy {out['busy_ms_per_step']:.3f} ms, "
          f"idle {out['idle_ms_per_step']:.3f} ms per step ({len(evs)} activities)", flush=True)
    print_table(["gap us", "after", "before"], out["top_gaps_us"])
    host = cProfile.Profile()  # the same steps again: where the host's time goes
    drive(llm, args.batch, args.prompt_len, args.steps, lambda on: host.enable() if on else host.disable())
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[:6000], flush=True)
    return out


def gaps_section(root: Path, args, results: dict) -> None:
    k = 4
    tdir, ddir = write_config(root, "llama-8b", LLAMA_8B), write_config(root, "llama-1b", LLAMA_1B)
    llm = make_llm(tdir, None, max(4, args.batch), args.max_model_len)
    results["gaps_target"] = device_gaps(llm, args, f"target-only b={args.batch}")
    del llm
    torch.cuda.empty_cache()
    spec = dict(model=ddir, num_speculative_tokens=k, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[1.0] * k, draft_load_format="dummy")
    llm = make_llm(tdir, spec, max(4, args.batch), args.max_model_len)
    results["gaps_spec"] = device_gaps(llm, args, f"spec k={k} b={args.batch}")
    del llm
    torch.cuda.empty_cache()


def graph_timeline(graph, label: str, first: int = 14, skip: int = 0) -> dict:
    """One replay of a captured graph under torch.profiler: its kernels in order (start offset,
    duration), per-kernel-name totals, and the span; prints `first` kernels after the first `skip`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > 0),
                 key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start
    span = evs[-1].time_range.end - t0
    agg = defaultdict(lambda: [0.0, 0])
    for e in evs:
        agg[e.name[:60]][0] += e.time_range.end - e.time_range.start
        agg[e.name[:60]][1] += 1
    print(f"[{label}] span {span / 1e3:.3f} ms, {len(evs)} kernels, sum of durations "
          f"{sum(v[0] for v in agg.values()) / 1e3:.3f} ms", flush=True)
    listed = evs[skip : skip + first]
    print_table(["kernel", "start us", "us"], [(e.name[:60], f"{e.time_range.start - t0:.1f}",
                                               f"{e.time_range.end - e.time_range.start:.1f}") for e in listed])
    print_table(["kernel", "total us", "count"], sorted(((k, f"{v[0]:.0f}", v[1]) for k, v in agg.items()),
                                                       key=lambda r: -float(r[1]))[:12])
    return {"span_ms": span / 1e3, "kernels": {k: v for k, v in agg.items()}}


def verify_section(root: Path, args, results: dict) -> None:
    """The verification and catch-up graphs of a k = 4 round at batch --batch, kernel by
    kernel, under each `--env-ab` variant (graphs recaptured) and as built; and the target's
    one-token decode graph beside them, where the engine captured one."""
    from bench.gpu_bench import env_variant

    k = 4
    (tname, tshape), (dname, dshape) = PAIRS[args.pair]
    tdir, ddir = write_config(root, tname, tshape), write_config(root, dname, dshape)
    spec = dict(model=ddir, num_speculative_tokens=k, rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[0.8] * k, draft_load_format="dummy")
    b = args.batch
    llm = make_llm(tdir, spec, max(4, b), args.max_model_len, quantization=args.quantization)
    for variant in [None] + args.env_ab:
        label = variant or "as built"
        if variant:
            ctx = env_variant(llm, variant)
            ctx.__enter__()
        drive(llm, b, args.prompt_len, 10)
        runner, sp = llm.engine.runner, llm.engine.runner.speculator
        dg = sp.graphs[k]  # the draft graphs of k drafts
        out = {}
        if 1 in runner.graphs:  # the one-token decode step, as the target runs it without drafts
            out["decode"] = graph_timeline(runner.graphs[1].graphs[runner.graphs[1].bucket(b)], f"decode, {label}")
        out |= {"verify": graph_timeline(runner.graphs[1 + k].graphs[runner.graphs[1 + k].bucket(b)],
                                        f"verify, {label}"),
               "catchup": graph_timeline(dg.catchup.graphs[dg.catchup.bucket(b)], f"catch-up, {label}"),
               "draft_round": graph_timeline(dg.rounds[dg.bucket(b)],
                                             f"draft round (catch-up + k - 1 forwards), {label}",
                                             first=args.first, skip=args.skip)}
        results[f"verify_{label}"] = out
        if variant:
            ctx.__exit__(None, None, None)
    del llm
    torch.cuda.empty_cache()


def tables_section(tmp: Path, args, results: dict) -> None:
    """(8): the persistent block table against host-built tables, in one engine per mode."""
    from tandem import LLM, SamplingParams

    cases = [tuple(int(x) for x in c.split(":")) for c in args.table_cases.split(",")]
    (tname, tshape), (dname, dshape) = PAIRS[args.pair]
    target, draft = write_config(tmp, tname, tshape), write_config(tmp, dname, dshape)
    max_seqs = max(b for b, _ in cases)
    max_len = max(c for _, c in cases) + 1024
    rows, results["tables"] = [], []
    for mode in ("target", "spec k=4"):
        spec = None
        if mode != "target":
            spec = dict(model=draft, num_speculative_tokens=4, rejection_sample_method="synthetic",
                        synthetic_acceptance_rates=[1.0] * 4, draft_load_format="dummy")
        llm = LLM(target, dtype="bfloat16", load_format="dummy", max_model_len=max_len, max_num_seqs=max_seqs,
                  max_num_batched_tokens=16384, kv_cache_memory_bytes=args.table_kv_gib << 30,
                  enable_prefix_caching=False, speculative_config=spec)
        engine, backend = llm.engine, llm.engine.runner.attn_backend
        # the draft's backend may be a view of the target's (AttnBackend.fast): both switch tables
        speculator = getattr(engine.runner, "speculator", None)
        backends = {id(b): b for b in (backend, getattr(speculator, "attn_backend", None)) if b is not None}
        table = backend.block_table
        for batch, ctx in cases:
            g = torch.Generator().manual_seed(batch)
            params = SamplingParams(temperature=0, max_tokens=(args.steps * 2 + 64) * 5, ignore_eos=True)
            ids = [f"t{time.monotonic_ns()}-{i}" for i in range(batch)]
            for rid in ids:
                engine.add_request(rid, torch.randint(10, 30000, (ctx,), generator=g).tolist(), params)
            while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
                engine.step()  # the prefill
            for _ in range(8):
                engine.step()
            times = {"persistent": [], "host lists": []}
            for _ in range(max(1, args.steps // 10)):
                for name, t in (("persistent", table), ("host lists", None)):
                    for b in backends.values():
                        b.block_table = t
                    for _ in range(5):
                        t0 = time.perf_counter()
                        engine.step()
                        times[name].append(time.perf_counter() - t0)
            for b in backends.values():
                b.block_table = table
            if args.table_profile:  # where the host's time goes now
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    engine.step()
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.table_profile)
                print(f"[tables] {mode} b={batch} ctx={ctx}: host, 10 steps\n" + out.getvalue(), flush=True)
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            r = dict(mode=mode, batch=batch, context=ctx, persistent_ms=ms["persistent"],
                     host_lists_ms=ms["host lists"], ratio=ms["host lists"] / ms["persistent"])
            results["tables"].append(r)
            rows.append((mode, batch, ctx, f"{r['persistent_ms']:.2f}", f"{r['host_lists_ms']:.2f}", f"{r['ratio']:.2f}"))
            print(f"[tables] {rows[-1]}", flush=True)
        del llm, engine, backend, table
        torch.cuda.empty_cache()
    print(f"decode step time, {tname} / {dname} (median ms a step)")
    print_table(["mode", "batch", "context", "persistent", "host lists", "ratio"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/gpu_profile.json")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--sections", default="linear,target,spec")
    p.add_argument("--eager-batch", type=int, default=32, help="--sections eager: decodes a step")
    p.add_argument("--timeline", default="", metavar="PREFIX",
                   help="--sections gaps: write each profile's device timeline to PREFIX.<label>.txt")
    p.add_argument("--pair", default="llama", choices=sorted(PAIRS),
                   help="--sections verify: the target / draft shapes (llama: 8B / 1B, qwen: Qwen2.5-Coder 1.5B / 0.5B)")
    p.add_argument("--batch", type=int, default=1, help="--sections verify, gaps: requests a step")
    p.add_argument("--first", type=int, default=14,
                   help="--sections verify: kernels of the draft round listed in order")
    p.add_argument("--skip", type=int, default=0,
                   help="--sections verify: draft round kernels skipped before that list (past the catch-up)")
    p.add_argument("--env-ab", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="--sections verify: also under these environment settings")
    p.add_argument("--table-cases", default="32:2048,256:2048,64:16384",
                   help="--sections tables: batch:context pairs")
    p.add_argument("--table-kv-gib", type=int, default=60, help="--sections tables: the KV pool")
    p.add_argument("--table-profile", type=int, default=0, metavar="N",
                   help="--sections tables: also cProfile 10 steps of each case, N functions by own time")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="--sections target, verify: the target's LLM(quantization=...) (the fp8 target)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    results = {"env": environment()}
    bw = copy_bandwidth()
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for m in (1, 5) if "linear" in sections else ():
        results[f"linear_8b_m{m}"] = linear_bench(LLAMA_8B, m, bw)
        results[f"linear_1b_m{m}"] = linear_bench(LLAMA_1B, m, bw)
    for key in [k for k in results if k.startswith("linear_")]:
        print(key)
        print_table(["layer", "n", "k", "cublas us", "frac", "cublasLt us", "frac"],
                    [(r["layer"], r["n"], r["k"], f"{r['cublas_us']:.1f}", f"{r['cublas_frac']:.2f}",
                      f"{r['cublaslt_us']:.1f}", f"{r['cublaslt_frac']:.2f}") for r in results[key]])
    with tempfile.TemporaryDirectory() as tmp:
        if "gaps" in sections:
            gaps_section(Path(tmp), args, results)
        if "verify" in sections:
            verify_section(Path(tmp), args, results)
        if "spec" in sections:
            spec_round(Path(tmp), args, results)
        if "eager" in sections:
            eager_host(Path(tmp), args, results)
        if "tables" in sections:
            tables_section(Path(tmp), args, results)
        for name, shape in (("llama-8b", LLAMA_8B), ("llama-1b", LLAMA_1B)) if "target" in sections else ():
            path = write_config(Path(tmp), name, shape)
            llm = make_llm(path, None, 4, args.max_model_len, quantization=args.quantization)
            phases = host_phases(llm, args)
            g = llm.engine.runner.graphs[1]
            phases["graph_replay"] = graph_time(g.graphs[g.bucket(1)])
            print(f"[{name}] host phases (ms per step):", {k: round(v, 3) for k, v in phases.items()
                                                         if k != "cprofile"})
            print(phases["cprofile"])
            results[f"{name}_phases"] = phases
            del llm
            torch.cuda.empty_cache()
            from tandem import LLM

            eager = LLM(path, dtype="bfloat16", load_format="dummy", max_model_len=args.max_model_len,
                        max_num_seqs=4, kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False,
                        enforce_eager=True, quantization=args.quantization)
            rows = kernel_table(eager, args)
            total = sum(r[1] for r in rows)
            print(f"[{name}] eager kernels per step: total {total / 1e3:.3f} ms; graph replay "
                  f"{phases['graph_replay']:.3f} ms")
            print_table(["kernel", "us/step", "calls/step"], [(k, f"{t:.1f}", c) for k, t, c in rows[:25]])
            results[f"{name}_kernels"] = rows
            del eager
            torch.cuda.empty_cache()
            write_json(args.out, results)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

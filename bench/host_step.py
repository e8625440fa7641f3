"""The host's share of an engine step: where its time goes per running request, and the pauses
of full garbage collections with the start-up heap frozen (the engine's way) or not.

    python bench/host_step.py                            # batches 64 and 256, this machine's device
    python bench/host_step.py --batch-sizes 256 --block-steps 100 --device cpu
    python bench/host_step.py --tokenizer ~/.cache/tandem/converted/qwen2.5-coder-1.5b-instruct-*  # + detokenizing

A tiny model (its device work small beside the host's) decodes `--batch-sizes` requests with
async scheduling and DELTA outputs (what the server asks for); with `--tokenizer` its vocabulary
is that tokenizer's and the engine detokenizes every token, as it would serve (the larger head
then adds to `launch` on a CPU). On a CPU the engine is switched
to the block-table attention metadata the GPU uses, so the host builds what it builds there.
Each batch runs blocks of `--block-steps` steps, alternating the heap frozen (as the engine
leaves it) and thawed (gc.unfreeze), `--blocks` of each, in the order ABBA... (the contexts
grow). Reported per mode: the step time's median, p99 and max, the time in each phase (host
work, plus `launch`, which on a CPU includes the model's forward) in us per request per step,
and the full (generation 2) collections.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS_DIR, TINY_LLAMA, build_random_model, environment, log, print_table, write_json,
)

PHASES = ("schedule", "schedule_ahead", "build_batch", "launch", "collect", "update", "_emit", "_outputs")


class PhaseClock:
    """Wraps the engine's phases (methods of its scheduler, runner and itself) to add up their time."""

    def __init__(self, engine):
        import tandem.runner.model_runner as model_runner

        self.total: dict[str, float] = defaultdict(float)
        for owner, name in ((engine.scheduler, "schedule"), (engine.scheduler, "schedule_ahead"),
                            (engine.scheduler, "update"), (engine.runner, "launch"), (engine.runner, "collect"),
                            (engine, "_emit"), (engine, "_outputs")):
            setattr(owner, name, self._timed(name, getattr(owner, name)))
        model_runner.build_batch = self._timed("build_batch", model_runner.build_batch)

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0
        return timed


class Pauses:
    """The full collections' durations while enabled."""

    def __init__(self):
        self.durations: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.durations.append(time.perf_counter() - self._start)


def run_batch(model: Path, n: int, args) -> list[dict]:
    import torch

    from tandem import LLM, SamplingParams
    from tandem.layers.backend import AttnBackend
    from tandem.sampling_params import RequestOutputKind

    total_steps = args.warmup + 2 * args.blocks * args.block_steps
    llm = LLM(str(model), tokenizer=args.tokenizer, dtype="float32", device=args.device, max_num_seqs=n,
              max_model_len=args.prompt_len + total_steps + 8, max_num_batched_tokens=max(2048, n * args.prompt_len),
              async_scheduling=True,
              kv_cache_memory_bytes=1 << 30)  # plenty for the tiny model; on a GPU, no share of it (batches in turn)
    engine = llm.engine
    if engine.cfg.device.type == "cpu":  # the GPU's metadata path: the host builds what it builds there
        backend = AttnBackend(engine.cfg.cache.block_size, engine.cfg.device, use_table=True, use_triton=False,
                              max_num_seqs=n, max_model_len=engine.cfg.sched.max_model_len)
        engine.runner.attn_backend = backend
    clock, pauses = PhaseClock(engine), Pauses()
    params = SamplingParams(temperature=0, max_tokens=total_steps + 4, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    g = torch.Generator().manual_seed(n)
    vocab = len(llm.get_tokenizer()) if args.tokenizer else TINY_LLAMA["vocab_size"]
    for i in range(n):
        engine.add_request(str(i), torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist(), params)
    for _ in range(args.warmup):
        engine.step()
    modes = {"frozen": dict(steps=[], phases=defaultdict(float), pauses=[]),
             "thawed": dict(steps=[], phases=defaultdict(float), pauses=[])}
    for block in range(args.blocks):
        for mode in ("frozen", "thawed") if block % 2 == 0 else ("thawed", "frozen"):  # ABBA: contexts grow
            acc = modes[mode]
            if mode == "thawed":
                gc.unfreeze()
            clock.total.clear()
            pauses.durations.clear()
            for _ in range(args.block_steps):
                t0 = time.perf_counter()
                engine.step()
                acc["steps"].append(time.perf_counter() - t0)
            for name, seconds in clock.total.items():
                acc["phases"][name] += seconds
            acc["pauses"] += pauses.durations
            if mode == "thawed":
                gc.freeze()
    gc.callbacks.remove(pauses._callback)
    rows = []
    for mode, acc in modes.items():
        steps = sorted(acc["steps"])
        count = len(steps)
        rows.append(dict(
            batch=n, heap=mode, steps=count,
            step_p50_ms=statistics.median(steps) * 1e3,
            step_p99_ms=steps[min(count - 1, int(0.99 * count))] * 1e3,
            step_max_ms=steps[-1] * 1e3,
            step_mean_ms=statistics.fmean(steps) * 1e3,
            full_collections=len(acc["pauses"]),
            full_collection_max_ms=max(acc["pauses"], default=0.0) * 1e3,
            us_per_request={name: acc["phases"].get(name, 0.0) / count / n * 1e6 for name in PHASES},
        ))
    del engine, llm
    gc.collect()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=3, help="blocks of each heap mode, alternated")
    ap.add_argument("--block-steps", type=int, default=50)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory: the engine detokenizes with it")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    ap.add_argument("--json", default=str(RESULTS_DIR / "host_step.json"))
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(TINY_LLAMA, num_hidden_layers=1, max_position_embeddings=8192)
        if args.tokenizer:
            from transformers import AutoTokenizer

            shape["vocab_size"] = len(AutoTokenizer.from_pretrained(args.tokenizer))
        model = build_random_model(Path(tmp) / "tiny", shape, dtype="float32")
        for n in (int(b) for b in args.batch_sizes.split(",")):
            log(f"batch {n}")
            results += run_batch(model, n, args)
    write_json(args.json, dict(environment=environment(), args=vars(args), results=results))
    print_table(
        ["batch", "heap", "step p50 ms", "p99", "max", "mean", "full GCs (max ms)"] + [f"{p} us/req" for p in PHASES],
        [[r["batch"], r["heap"], f"{r['step_p50_ms']:.2f}", f"{r['step_p99_ms']:.2f}", f"{r['step_max_ms']:.2f}",
          f"{r['step_mean_ms']:.2f}", f"{r['full_collections']} ({r['full_collection_max_ms']:.1f})"]
         + [f"{r['us_per_request'][p]:.2f}" for p in PHASES] for r in results],
        title="host time per engine step (tiny model; DELTA outputs; async scheduling)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU decode throughput: tandem vs transformers `generate` on the same model and weights.

    python bench/cpu_throughput.py                      # SmolLM2-135M shape, random bf16 weights
    python bench/cpu_throughput.py --model DIR --dtype float32 --batch-sizes 1,4,16
    python bench/cpu_throughput.py --quick              # tiny model, seconds (smoke test)

Per batch size: one warm-up run of each engine, then `--repeats` timed runs interleaved
(tandem, HF, tandem, HF, ...); the median wall time gives generated tokens/s
(batch * new_tokens / seconds, end to end including prefill). Time to first token (prefill)
is recorded too, from tandem's request metrics and from a timing streamer on the HF side, so
decode-only throughput is reported separately.

Equal work on both sides:
- prompts are random token ids of one length (no padding); every row and every run gets
  fresh ids (seeded), so tandem's prefix cache never hits across rows or runs, and each run
  pair (tandem, HF) sees the same prompts;
- both generate exactly `--new-tokens` tokens greedily with no EOS masking: tandem with
  ignore_eos=True, HF with its generation_config EOS cleared (min_new_tokens would otherwise
  mask EOS logits, which tandem's ignore_eos does not, and could change greedy choices);
- the greedy tokens are compared sequence by sequence (identical in fp32; in bf16 the
  fraction of identical sequences and the mean agreeing prefix are reported).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    SMOLLM2_135M,
    TINY_LLAMA,
    build_random_model,
    count_parameters,
    environment,
    load_average,
    log,
    print_table,
    run_interleaved,
    write_json,
)

QUICK = dict(new_tokens=16, repeats=1, prompt_len=32, batch_sizes="1,4")
FULL = dict(new_tokens=128, repeats=3, prompt_len=128, batch_sizes="1,16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: random SmolLM2-135M-shaped model)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--batch-sizes", help=f"comma-separated (default {FULL['batch_sizes']})")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {FULL['prompt_len']})")
    p.add_argument("--new-tokens", type=int, help=f"generated tokens per sequence (default {FULL['new_tokens']})")
    p.add_argument("--repeats", type=int, help=f"timed runs per engine (default {FULL['repeats']})")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per engine first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="tiny model, 16 tokens, 1 repeat: a smoke test")
    p.add_argument("--out", default=str(RESULTS_DIR / "cpu_throughput.json"), help="JSON results path")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must list positive integers")
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# --------------------------------------------------------------------------- engines


class TandemRunner:
    def __init__(self, path: str, dtype: str, max_model_len: int, max_num_seqs: int, seed: int):
        from tandem import LLM

        self.kwargs = dict(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed)
        t0 = time.perf_counter()
        self.llm = LLM(path, device="cpu", **self.kwargs)
        self.load_s = time.perf_counter() - t0

    def config(self) -> dict:
        cfg = self.llm.config
        return {
            **self.kwargs,
            "block_size": cfg.cache.block_size,
            "num_kv_blocks": cfg.cache.num_blocks,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "max_num_batched_tokens": cfg.sched.max_num_batched_tokens,
        }

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        from tandem import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        t0 = time.monotonic()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        end = time.monotonic()
        first = min(o.metrics.first_token_time for o in outs)
        return {"tokens": [o.outputs[0].token_ids for o in outs], "ttft_s": first - t0, "total_s": end - t0}


class _TimingStreamer:
    """HF streamer that only records when generate hands it tokens (the prompt first, then each step)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


class HFRunner:
    def __init__(self, path: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.load_s = time.perf_counter() - t0
        gc = self.model.generation_config
        # No EOS: exactly max_new_tokens tokens with no EOS logit masking (tandem's ignore_eos).
        gc.eos_token_id = None
        gc.pad_token_id = 0 if gc.pad_token_id is None else gc.pad_token_id
        self.attn_impl = getattr(self.model.config, "_attn_implementation", None)

    def config(self) -> dict:
        return {"attn_implementation": self.attn_impl, "num_parameters": count_parameters(self.model)}

    def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
        torch = self.torch
        input_ids = torch.tensor(prompts, dtype=torch.int64)
        attention_mask = torch.ones_like(input_ids)
        streamer = _TimingStreamer()
        t0 = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=streamer,
            )
        end = time.monotonic()
        first = streamer.times[1] if len(streamer.times) > 1 else end
        return {"tokens": out[:, input_ids.shape[1]:].tolist(), "ttft_s": first - t0, "total_s": end - t0}


# --------------------------------------------------------------------------- benchmark


def make_prompts(seed: int, batch: int, run: int, prompt_len: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 1009 + run)
    # Skip the lowest ids (special tokens in real vocabularies).
    low = min(16, vocab - 1)
    return torch.randint(low, vocab, (batch, prompt_len), generator=g).tolist()


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """-> (identical sequences, sum over sequences of the agreeing-prefix fraction)."""
    same, prefix = 0, 0.0
    for x, y in zip(a, b):
        same += x == y
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        prefix += n / max(len(x), len(y), 1)
    return same, prefix


def bench_batch(tandem: TandemRunner, hf: HFRunner, batch: int, args, vocab: int) -> dict:
    n = args.new_tokens
    records: dict[str, list[dict]] = {"tandem": [], "hf": []}
    prompts_of = lambda run: make_prompts(args.seed, batch, run, args.prompt_len, vocab)  # noqa: E731

    def case(name, runner):
        def fn(run):
            rec = runner.generate(prompts_of(run), n)
            rec["run"] = run
            lengths = {len(t) for t in rec["tokens"]}
            if lengths != {n} or len(rec["tokens"]) != batch:
                raise RuntimeError(f"{name}: expected {batch} sequences of {n} tokens, got lengths {sorted(lengths)}")
            records[name].append(rec)

        return name, fn

    log(f"batch {batch}: {args.warmup} warm-up + {args.repeats} timed runs each, interleaved")
    series = run_interleaved([case("tandem", tandem), case("hf", hf)], args.repeats, args.warmup, log=log)

    result = {"batch_size": batch, "generated_tokens_per_run": batch * n}
    for name in ("tandem", "hf"):
        timed = [r for r in records[name] if r["run"] >= args.warmup]
        s = series[name]
        ttft = sorted(r["ttft_s"] for r in timed)[len(timed) // 2]
        decode_s = s.median - ttft
        result[name] = {
            **s.summary(),
            "tokens_per_s": batch * n / s.median,
            "tokens_per_cpu_s": batch * n / s.cpu_median if s.cpu_median > 0 else None,
            "ttft_s": ttft,
            "ttft_times_s": [r["ttft_s"] for r in timed],
            "decode_tokens_per_s": batch * (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "ms_per_decode_step": 1000 * decode_s / (n - 1) if n > 1 else None,
        }
    t, h = result["tandem"], result["hf"]
    result["ratio_tandem_over_hf"] = t["tokens_per_s"] / h["tokens_per_s"]
    # Each tandem run against the HF run right after it (same prompts, nearly the same machine
    # load): the median of these ratios resists load that drifts over the benchmark.
    pairs = [b / a for a, b in zip(series["tandem"].seconds, series["hf"].seconds) if a > 0]
    result["paired_ratio_median"] = sorted(pairs)[len(pairs) // 2] if pairs else None
    result["paired_ratios"] = pairs
    result["cpu_time_ratio_tandem_over_hf"] = (
        t["tokens_per_cpu_s"] / h["tokens_per_cpu_s"] if t["tokens_per_cpu_s"] and h["tokens_per_cpu_s"] else None
    )
    result["decode_ratio_tandem_over_hf"] = (
        t["decode_tokens_per_s"] / h["decode_tokens_per_s"] if t["decode_tokens_per_s"] and h["decode_tokens_per_s"] else None
    )
    result["prefill_ratio_tandem_over_hf"] = h["ttft_s"] / t["ttft_s"] if t["ttft_s"] > 0 else None

    same = total = 0
    prefix = 0.0
    for rt, rh in zip(records["tandem"], records["hf"]):  # every run, warm-up included: same prompts
        assert rt["run"] == rh["run"]
        s, p = compare_tokens(rt["tokens"], rh["tokens"])
        same, prefix, total = same + s, prefix + p, total + len(rt["tokens"])
    result["greedy_match"] = {
        "sequences": total,
        "identical_sequences": same,
        "identical_fraction": same / total,
        "mean_agreeing_prefix_fraction": prefix / total,
    }
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    tmp = None
    if args.model:
        path = args.model
        model_desc = {"source": "path", "path": path}
    else:
        shape = TINY_LLAMA if args.quick else SMOLLM2_135M
        tmp = tempfile.TemporaryDirectory(prefix="tandem-bench-")
        log(f"building a random {'tiny' if args.quick else 'SmolLM2-135M-shaped'} model ({args.dtype}) in {tmp.name}")
        t0 = time.perf_counter()
        path = str(build_random_model(Path(tmp.name) / "model", shape, args.dtype, args.seed))
        model_desc = {
            "source": "random",
            "shape_name": "tiny-llama" if args.quick else "SmolLM2-135M",
            "shape": shape,
            "seed": args.seed,
            "build_s": time.perf_counter() - t0,
        }
    try:
        import json

        hf_cfg = json.loads((Path(path) / "config.json").read_text())
        vocab = hf_cfg["vocab_size"]
        max_len = args.prompt_len + args.new_tokens
        log(f"loading tandem and transformers ({args.dtype}, {torch.get_num_threads()} threads)")
        tandem = TandemRunner(path, args.dtype, max_len, max(args.batch_sizes), args.seed)
        hf = HFRunner(path, args.dtype)
        model_desc["num_parameters"] = hf.config()["num_parameters"]

        results = [bench_batch(tandem, hf, b, args, vocab) for b in args.batch_sizes]
    finally:
        if tmp is not None:
            tmp.cleanup()

    report = {
        "benchmark": "cpu_throughput",
        "env": env,
        "config": {
            "model": model_desc,
            "dtype": args.dtype,
            "batch_sizes": args.batch_sizes,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "seed": args.seed,
            "quick": args.quick,
            "greedy": True,
            "tandem": tandem.config(),
            "hf": hf.config(),
        },
        "load_s": {"tandem": tandem.load_s, "hf": hf.load_s},
        "loadavg_end": load_average(),
        "results": results,
    }
    out = write_json(args.out, report)
    log(f"wrote {out}")

    rows = []
    for r in results:
        t, h, m = r["tandem"], r["hf"], r["greedy_match"]
        rows.append([
            r["batch_size"],
            f"{t['tokens_per_s']:.1f}",
            f"{h['tokens_per_s']:.1f}",
            f"{r['ratio_tandem_over_hf']:.2f}",
            f"{r['paired_ratio_median'] or 0:.2f}",
            f"{1000 * t['ttft_s']:.0f}/{1000 * h['ttft_s']:.0f}",
            f"{t['decode_tokens_per_s'] or 0:.1f}/{h['decode_tokens_per_s'] or 0:.1f}",
            f"{100 * max(t['spread'], h['spread']):.0f}%",
            f"{m['identical_sequences']}/{m['sequences']} ({100 * m['mean_agreeing_prefix_fraction']:.0f}%)",
        ])
    name = model_desc.get("shape_name") or Path(path).name
    print_table(
        ["batch", "tandem tok/s", "HF tok/s", "tandem/HF", "paired", "TTFT ms (t/HF)", "decode tok/s (t/HF)", "spread",
         "same seqs (prefix)"],
        rows,
        title=(
            f"\nCPU throughput: {name}, {args.dtype}, prompt {args.prompt_len}, {args.new_tokens} new tokens greedy, "
            f"median of {args.repeats}, {env['torch_threads']} threads, {env['cpu']['model']}, "
            f"load avg {env['loadavg'][0] if env['loadavg'] else '?'} -> {report['loadavg_end'][0] if report['loadavg_end'] else '?'}"
        ),
    )
    return report


if __name__ == "__main__":
    main()

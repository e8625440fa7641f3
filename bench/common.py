"""Shared helpers for the benchmarks: random model building, interleaved median timing,
environment capture, table printing and JSON output.

Kept free of tandem imports so a benchmark can import it before deciding what to load.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def ensure_repo_on_path() -> None:
    """Make `import tandem` and `import bench` work when a script is run as `python bench/x.py`."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


# --------------------------------------------------------------------------- model shapes

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json), the real small shape we benchmark on.
SMOLLM2_135M = dict(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    bos_token_id=0,
    eos_token_id=0,
    initializer_range=0.02,
)

# A tiny shape for smoke tests (seconds end to end). A larger init range keeps greedy
# choices decisive, so fp32 outputs of two implementations agree exactly.
TINY_LLAMA = dict(
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
    initializer_range=0.2,
)


def build_random_model(path: str | os.PathLike, shape: dict, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Random-init a transformers model of `shape`, save it (safetensors, `dtype`) into path.

    No tokenizer is written: benchmarks feed token ids. Returns the directory.
    """
    import torch
    import transformers

    shape = dict(shape)
    arch = shape.pop("architecture")
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    rope_theta = shape.pop("rope_theta", None)
    config = cfg_cls(**shape)
    if rope_theta is not None:  # transformers 5 keeps it in rope_parameters; older versions take the kwarg
        if isinstance(getattr(config, "rope_parameters", None), dict):
            config.rope_parameters["rope_theta"] = rope_theta
        else:
            config.rope_theta = rope_theta
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model = model.to(getattr(torch, dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def count_parameters(model) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --------------------------------------------------------------------------- timing


@dataclass
class Timed:
    """One timed call: wall seconds and whatever the callable returned."""

    seconds: float
    value: Any = None
    cpu_seconds: float = 0.0  # CPU time of this process (all threads) during the call


def time_call(fn: Callable[[], Any]) -> Timed:
    c0, t0 = time.process_time(), time.perf_counter()
    value = fn()
    t1, c1 = time.perf_counter(), time.process_time()
    return Timed(t1 - t0, value, c1 - c0)


@dataclass
class Series:
    """The timed runs of one case (warm-up excluded)."""

    name: str
    runs: list[Timed] = field(default_factory=list)

    @property
    def seconds(self) -> list[float]:
        return [r.seconds for r in self.runs]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_median(self) -> float:
        return statistics.median(r.cpu_seconds for r in self.runs)

    @property
    def spread(self) -> float:
        """(max - min) / median: the run-to-run noise a difference must beat."""
        s = self.seconds
        return (max(s) - min(s)) / self.median if len(s) > 1 and self.median > 0 else 0.0

    def summary(self) -> dict:
        s = self.seconds
        return {
            "times_s": s,
            "median_s": self.median,
            "min_s": min(s),
            "max_s": max(s),
            "spread": self.spread,
            # CPU seconds of this process per run. With one thread this barely depends on other
            # load on the machine, so it is the robust figure on a shared box.
            "cpu_times_s": [r.cpu_seconds for r in self.runs],
            "cpu_median_s": self.cpu_median,
            # CPU seconds per wall second: near the thread count when the process had the cores
            # to itself, lower when other processes competed for them.
            "cpu_per_wall": [r.cpu_seconds / r.seconds for r in self.runs if r.seconds > 0],
        }


def run_interleaved(
    cases: Sequence[tuple[str, Callable[[int], Any]]],
    repeats: int,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
) -> dict[str, Series]:
    """Warm every case up, then time them round-robin (A, B, A, B, ...) `repeats` times.

    Each callable gets the run index (0 .. warmup + repeats - 1), so it can rotate inputs:
    the warm-up runs use indices < warmup, timed run r uses index warmup + r, and every case
    sees the same index in the same round (side-by-side comparisons use equal inputs).
    """
    series = {name: Series(name) for name, _ in cases}
    for i in range(warmup + repeats):
        for name, fn in cases:
            t = time_call(lambda: fn(i))
            timed = i >= warmup
            if timed:
                series[name].runs.append(t)
            if log is not None:
                log(
                    f"  {name:<12} {'run ' + str(i - warmup) if timed else 'warm-up':<8} {t.seconds:8.3f} s"
                    f"  (cpu/wall {t.cpu_seconds / max(t.seconds, 1e-9):.2f})"
                )
    return series


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


# --------------------------------------------------------------------------- environment


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_info() -> dict:
    """CPU model, logical CPUs and the vector-extension flags that decide fp32/bf16 matmul speed."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    interesting = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": model or platform.processor() or None,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "flags": [f for f in interesting if f in flags],
    }


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews CPU timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict:
    import torch

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "cpu": cpu_info(),
        "loadavg": load_average(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            env[var] = os.environ[var]
    return env


# --------------------------------------------------------------------------- output


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table; floats are printed as given (format them before)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    if title:
        print(title)
    print(format_table(headers, rows), flush=True)


def print_results(headers: Sequence[str], results: Sequence[dict]) -> None:
    """Result dicts as a table of the headers' keys: floats to 3 significant digits, missing ones "-"."""
    def cell(v: Any) -> Any:
        return f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else v)

    print_table(headers, [[cell(r.get(h)) for h in headers] for r in results])


def log(msg: str) -> None:
    """Progress to stderr, so stdout ends with the table."""
    print(msg, file=sys.stderr, flush=True)

"""Build and load tandem's C kernels for x86-64 CPUs: one shared library per instruction set.

The library is cpu_gemm.c (small-batch GEMM with 16-bit weights, tandem.kernels.cpu_gemm),
cpu_rows.c (RMSNorm, rotary, SiLU-and-mul rows, tandem.kernels.cpu_rows), cpu_attention.c
(paged attention, tandem.kernels.cpu_attention) and cpu_gumbel.c (the sampler's uniforms,
tandem.kernels.cpu_gumbel), compiled together with cpu_common.h. It has
three builds (ISAS): "avx2" (AVX2 + FMA + F16C), "avx512" (AVX-512F, twice the lanes in the
GEMM) and "avx512bf16" (the same, its GEMM multiplying bf16 rows by bf16 weights with
VDPBF16PS: twice the multiply-adds an instruction, which prefill is bound by). Each is compiled once per source version and compiler into
``$TANDEM_CACHE/kernels/cpu_kernels-<isa>-<hash>.so`` (written under a temporary name, then
renamed, so an interrupted build is never loaded) and called through ctypes, which releases the
GIL. It needs a C compiler (``$CC``, else ``cc``) with OpenMP; `load_error(isa)` says what is
missing where a build is not available, and `best_isa()` names the best that is.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

from tandem.models.hub import cache_root

_DIR = pathlib.Path(__file__).parent
_SOURCES = [_DIR / "cpu_gemm.c", _DIR / "cpu_rows.c", _DIR / "cpu_attention.c", _DIR / "cpu_gumbel.c"]
_HEADERS = [_DIR / "cpu_common.h"]
# -ffp-contract=off: every multiply and add rounds where the source says (no FMA contraction);
# -fno-trapping-math lets GCC vectorize the row ops' selects (it changes no result).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-shared",
          "-fPIC"]
# The builds and their extra flags, best first: AVX-512 whose GEMM multiplies bf16 rows by bf16
# weights with VDPBF16PS, the 16-lane AVX-512 form, the 8-lane AVX2 form.
_AVX512 = ["-mavx512f", "-mprefer-vector-width=512", "-DTANDEM_AVX512"]
ISAS = {"avx512bf16": _AVX512 + ["-mavx512bw", "-mavx512bf16", "-DTANDEM_AVX512BF16"], "avx512": _AVX512, "avx2": []}

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Entry points: (argument types, result type), as declared in the C sources.
_ENTRY_POINTS = {
    "tandem_gemm_w16": ([_P, _I64, _INT] + [_P] * 4 + [_I64] * 3 + [_INT] * 3, _INT),
    "tandem_gemm_w8": ([_P, _I64, _INT] + [_P] * 5 + [_I64] * 3 + [_INT] * 2, _INT),
    "tandem_rms_norm": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _F32, _INT, _INT], None),
    "tandem_rotary": ([_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _INT, _INT], None),
    "tandem_silu_mul": ([_P, _I64, _P, _I64, _I64, _INT, _INT], None),
    "tandem_paged_attention": ([_P, _I64, _P, _P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64,
                                _I64, _F32, _INT, _INT, _P], _INT),
    "tandem_uniform_rows": ([_P, _I64, _I64, _P, _INT], None),
}

# The 16-bit element kinds the C side takes (cpu_common.h).
HALF_KIND = {torch.bfloat16: 0, torch.float16: 1}


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def _cpu_runs(isa: str) -> bool:
    """Whether this CPU runs the build (as PyTorch's own kernel dispatch sees it; the BF16
    extension, which PyTorch does not report, from the kernel's flags)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if isa == "avx512bf16":
        return capability == "AVX512" and "avx512_bf16" in _cpu_flags()
    return capability == "AVX512" if isa == "avx512" else capability in ("AVX2", "AVX512")


def _compile(cc: str, isa: str) -> pathlib.Path:
    flags = _FLAGS + ISAS[isa]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [p.read_text() for p in _SOURCES + _HEADERS]
    digest = hashlib.sha256("\0".join([*texts, version, *flags]).encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"cpu_kernels-{isa}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-cpu_kernels-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, _SOURCES), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def _load(isa: str) -> tuple[ctypes.CDLL | None, str | None]:
    """(that build's library, None), or (None, why it is unavailable). Built at most once per process."""
    if not _cpu_runs(isa):
        lacks = {"avx512bf16": "AVX-512 with BF16 (avx512_bf16)", "avx512": "AVX-512"}.get(isa, "AVX2/FMA")
        return None, f"this CPU lacks {lacks} (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler: {cc!r} is not on PATH (install gcc or set $CC)"
    try:
        lib = ctypes.CDLL(str(_compile(cc, isa)))
        for name, (argtypes, restype) in _ENTRY_POINTS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building the CPU kernels ({', '.join(p.name for p in _SOURCES)}) for {isa} failed: {e}"
    return lib, None


def library(isa: str) -> ctypes.CDLL:
    """The loaded `isa` build; RuntimeError (with the reason) where it cannot run."""
    lib, err = _load(isa)
    if lib is None:
        raise RuntimeError(f"tandem's CPU kernels ({isa}) are unavailable: {err}")
    return lib


def load_error(isa: str) -> str | None:
    """None when that build can run here, else the reason it cannot."""
    return _load(isa)[1]


def best_isa() -> str | None:
    """The best build that runs here ("avx512bf16", "avx512", then "avx2"), or None."""
    return next((isa for isa in ISAS if load_error(isa) is None), None)

"""Build, load and call cpu_gemm.c: small-batch GEMM with bf16/fp16 weights on x86-64 CPUs.

The C file has two builds (ISAS): "avx2" (AVX2 + FMA + F16C) and "avx512" (AVX-512F, twice the
lanes). Each is compiled once per source version and compiler into
``$TANDEM_CACHE/kernels/cpu_gemm-<isa>-<hash>.so`` (written under a temporary name, then renamed,
so an interrupted build is never loaded) and called through ctypes, which releases the GIL. It
needs a C compiler (``$CC``, else ``cc``) with OpenMP; `load_error(isa)` says what is missing
where a build is not available, and `best_isa()` names the widest that is.
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
from torch import Tensor

from tandem.models.hub import cache_root

_SOURCE = pathlib.Path(__file__).with_name("cpu_gemm.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
# The builds of cpu_gemm.c and their extra flags, widest first: its 16-lane AVX-512 form, its
# 8-lane AVX2 form.
ISAS = {"avx512": ["-mavx512f", "-DTANDEM_AVX512"], "avx2": []}
_WEIGHT_KIND = {torch.bfloat16: 0, torch.float16: 1}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _cpu_runs(isa: str) -> bool:
    """Whether this CPU runs the build (as PyTorch's own kernel dispatch sees it)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability == "AVX512" if isa == "avx512" else capability in ("AVX2", "AVX512")


def _compile(cc: str, isa: str) -> pathlib.Path:
    flags = _FLAGS + ISAS[isa]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256("\0".join([_SOURCE.read_text(), version, *flags]).encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"cpu_gemm-{isa}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-cpu_gemm-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(_SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def _load(isa: str) -> tuple[object | None, str | None]:
    """(the C entry point of that build, None), or (None, why it is unavailable). Built at most
    once per process."""
    if not _cpu_runs(isa):
        return None, (f"this CPU lacks {'AVX-512' if isa == 'avx512' else 'AVX2/FMA'} (PyTorch reports "
                      f"{torch.backends.cpu.get_cpu_capability()})")
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler: {cc!r} is not on PATH (install gcc or set $CC)"
    try:
        path = _compile(cc, isa)
        fn = ctypes.CDLL(str(path)).tandem_gemm_w16
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building {_SOURCE.name} for {isa} failed: {e}"
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    fn.restype = ctypes.c_int
    return fn, None


def load_error(isa: str) -> str | None:
    """None when that build of the kernel can run here, else the reason it cannot."""
    return _load(isa)[1]


def best_isa() -> str | None:
    """The widest build that runs here ("avx512", then "avx2"), or None."""
    return next((isa for isa in ISAS if load_error(isa) is None), None)


def gemm_w16(x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype, isa: str) -> Tensor:
    """y = x weight^T (+ bias) on the CPU, by the `isa` build of the kernel.

    x: [M, K] any float dtype (widened to fp32); weight: [N, K] bf16 or fp16, contiguous;
    bias: [N] fp32 or None. Returns [M, N] in out_dtype (fp32, bf16 or fp16), fp32 accumulation,
    each row bit-identical to computing it alone (with the same build)."""
    fn, err = _load(isa)
    if fn is None:
        raise RuntimeError(f"cpu_gemm ({isa}) is unavailable: {err}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or not weight.is_contiguous() or weight.dtype not in _WEIGHT_KIND:
        raise ValueError(f"gemm_w16: weight must be a contiguous bf16/fp16 [N, {K}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"gemm_w16: bias must be a contiguous fp32 [{N}]")
    xf = x.to(torch.float32).contiguous()  # [M, K]
    y = torch.empty(M, N, dtype=out_dtype)  # [M, N]
    if M == 0:
        return y
    scratch = torch.empty(M * K, dtype=torch.float32)  # x split for bf16 weights (see split_x)
    rc = fn(xf.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
            y.data_ptr(), scratch.data_ptr(), M, K, N, _WEIGHT_KIND[weight.dtype], _OUT_KIND[out_dtype],
            torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_w16: unsupported dtypes {weight.dtype} -> {out_dtype}")
    return y


def gemm_w16_ref(x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """Plain-torch reference: fp32 matmul of the widened weights, one rounding to out_dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)

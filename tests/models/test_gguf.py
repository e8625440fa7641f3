"""GGUF -> HF conversion (tandem.models.gguf).

Fast tests use tiny synthetic GGUF files written with gguf.GGUFWriter; the real-model tests fetch
SmolLM2-135M-Instruct (98 MB) once per session (or reuse $TANDEM_CACHE) and check the conversion
against transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tandem.models import gguf as G
from tandem.models.hub import ModelFormatError, fetch_known_gguf, resolve_model
from tests.tiny_gguf import write_tiny_gguf

SMOL = "smollm2-135m-instruct"


def _cache_entries(d: pathlib.Path) -> list[str]:
    """What a cache folder holds, apart from lock files."""
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".lock-")) if d.exists() else []


# --------------------------------------------------------------------------- synthetic files


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_head, rows, cols in [(4, 64, 48), (3, 192, 576), (1, 8, 5)]:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        p = G.permute_llama_qk(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(G.unpermute_llama_qk(p, n_head), w)
    b = rng.standard_normal(64).astype(np.float32)  # 1-D (bias) works too
    np.testing.assert_array_equal(G.unpermute_llama_qk(G.permute_llama_qk(b, 4), 4), b)
    with pytest.raises(ModelFormatError, match="permutation"):
        G.unpermute_llama_qk(np.zeros((10, 4), np.float32), 4)


def test_name_mapping():
    assert G.hf_name_for("token_embd.weight") == "model.embed_tokens.weight"
    assert G.hf_name_for("output.weight") == "lm_head.weight"
    assert G.hf_name_for("output_norm.weight") == "model.norm.weight"
    assert G.hf_name_for("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert G.hf_name_for("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert G.hf_name_for("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert G.hf_name_for("rope_freqs.weight") is None


@pytest.mark.parametrize(
    "arch,qtype,tied",
    [
        ("llama", None, True),
        ("llama", "Q8_0", False),
        ("llama", "Q4_0", True),
        ("llama", "F16", False),
        ("qwen2", "Q8_0", False),
        ("qwen2", "BF16", True),
        ("qwen2", "Q5_1", False),
    ],
)
def test_synthetic_round_trip(tmp_path, arch, qtype, tied):
    src = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(src, arch=arch, qtype=qtype, tied=tied)
    out = resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)

    sd = load_file(out / "model.safetensors")
    assert set(sd) == set(expected)
    for k, v in expected.items():
        assert torch.equal(sd[k], v), k
    assert ("lm_head.weight" in sd) == (not tied)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in sd and "model.layers.1.self_attn.v_proj.bias" in sd

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (64, 2, 4, 2)
    assert (cfg["head_dim"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == (16, 96, 256)
    assert cfg["vocab_size"] == expected["model.embed_tokens.weight"].shape[0]
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["torch_dtype"] == "float32"
    assert cfg["eos_token_id"] == cfg["vocab_size"] - 1

    # transformers loads the directory with no missing / unexpected weights and runs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("the cat sat on the mat", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "the cat sat on the mat"
    assert tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_matches_transformers_gguf_loader_on_synthetic(tmp_path):
    """Independent check of the llama q/k un-permutation: transformers' own GGUF loader agrees."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate (test extra)")
    from transformers import AutoModelForCausalLM

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, arch="llama", n_head=4, n_kv_head=1, qtype="Q8_0")
    out = resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name, dtype=torch.float32).state_dict()
    mine = load_file(out / "model.safetensors")
    assert set(mine) <= set(ref)
    for k in mine:
        assert torch.equal(mine[k], ref[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_are_cast_once(tmp_path, dtype):
    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, arch="qwen2", qtype="Q8_0")
    out = resolve_model(src, dtype, cache_dir=tmp_path / "cache", progress=False)
    assert out.name.endswith({torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            assert t.dtype == dtype
            assert torch.equal(t, expected[k].to(dtype)), k
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")


def test_unsupported_architecture(tmp_path):
    src = tmp_path / "phi.gguf"
    write_tiny_gguf(src, arch="phi3")
    with pytest.raises(ModelFormatError, match=r"architecture 'phi3' is not supported.*llama.*qwen2"):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache" / "converted") == []


def test_unsupported_rope_scaling_is_refused_before_converting(tmp_path, monkeypatch):
    import gguf

    add_dims = gguf.GGUFWriter.add_rope_dimension_count

    def with_yarn(self, n):
        add_dims(self, n)
        self.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        self.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", with_yarn)
    src = tmp_path / "yarn.gguf"
    write_tiny_gguf(src)
    with pytest.raises(ModelFormatError, match=r"RoPE scaling type 'yarn' is not supported"):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache" / "converted") == []


@pytest.mark.parametrize("keys", [{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
                                  {"rope.scaling.factor": 4.0}, {"rope.scale_linear": 4.0},
                                  {"rope.dimension_count": 8}])
def test_rope_metadata_as_llama_cpp_reads_it(tmp_path, monkeypatch, keys):
    """A RoPE factor without a scaling type is linear scaling, under either key (llama.cpp's reading;
    early converters wrote rope.scale_linear alone); a rope.dimension_count short of head_dim (a
    partial rotary) is refused by name."""
    import gguf

    add_dims = gguf.GGUFWriter.add_rope_dimension_count

    def with_keys(self, n):
        add_dims(self, keys.get("rope.dimension_count", n))
        for key, value in keys.items():
            if key == "rope.scaling.type":
                self.add_string(f"{self.arch}.{key}", value)
            elif key != "rope.dimension_count":
                self.add_float32(f"{self.arch}.{key}", value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", with_keys)
    src = tmp_path / "scaled.gguf"
    write_tiny_gguf(src)
    if "rope.dimension_count" in keys:
        with pytest.raises(ModelFormatError, match=r"rope.dimension_count=8 .*\(head_dim 16\)"):
            resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
        return
    out = resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert (scaling["rope_type"], scaling["factor"]) == ("linear", 4.0)


def test_unsupported_tensor_type(tmp_path):
    src = tmp_path / "int.gguf"
    write_tiny_gguf(src, extra_tensors={"blk.0.attn_q.bias": np.arange(64, dtype=np.int8)})
    with pytest.raises(ModelFormatError, match=r"tensor type\(s\) I8.*supported types:.*Q4_K"):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)


def test_an_unknown_tensor_is_named_when_converting_unchecked(tmp_path):
    """convert_gguf of a file read without check_arch names the tensor it cannot map (the shape check
    before it met None: a TypeError)."""
    from tandem.models.gguf import convert_gguf, read_gguf

    src = tmp_path / "rope.gguf"
    write_tiny_gguf(src, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelFormatError, match="unsupported tensor 'rope_freqs.weight'"):
        convert_gguf(src, tmp_path / "out", torch.float32, progress=False, info=read_gguf(src, check_arch=False))


def test_unsupported_extra_tensor(tmp_path):
    src = tmp_path / "rope.gguf"
    write_tiny_gguf(src, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelFormatError, match="rope_freqs"):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)


@pytest.mark.parametrize("arch, dropped", [("llama", "blk.1.attn_v.weight"), ("llama", "blk.0.ffn_gate.weight"),
                                            ("qwen2", "blk.1.attn_k.bias")])
def test_a_missing_layer_tensor_is_named_before_anything_is_converted(tmp_path, monkeypatch, arch, dropped):
    import gguf

    add = gguf.GGUFWriter.add_tensor
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor",
                        lambda self, name, *a, **kw: None if name == dropped else add(self, name, *a, **kw))
    src = tmp_path / "incomplete.gguf"
    write_tiny_gguf(src, arch=arch)
    monkeypatch.undo()
    with pytest.raises(ModelFormatError, match=f"required tensor\\(s\\) '{re.escape(dropped)}' of its 2 layers"):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache" / "converted") == []


def test_a_tensor_whose_shape_the_metadata_does_not_imply_is_refused_before_converting(tmp_path, monkeypatch):
    """(it was converted and cached, then refused at load naming the cached copy, every time)"""
    import gguf

    add = gguf.GGUFWriter.add_tensor

    def narrower(self, name, tensor, *a, **kw):
        return add(self, name, tensor[: tensor.shape[0] // 2] if name == "blk.0.ffn_up.weight" else tensor, *a, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", narrower)
    src = tmp_path / "narrow.gguf"
    write_tiny_gguf(src)
    monkeypatch.undo()
    with pytest.raises(ModelFormatError, match=r"narrow.gguf: tensor 'blk.0.ffn_up.weight' has shape \(48, 64\) .* "
                                               r"implies \(96, 64\)"):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache" / "converted") == []


@pytest.mark.parametrize("cut", ["data", "header", "garbage"])
def test_truncated_or_corrupt_gguf(tmp_path, cut):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    raw = src.read_bytes()
    if cut == "data":
        src.write_bytes(raw[: len(raw) - 1000])
        pattern = "truncated"
    elif cut == "header":
        src.write_bytes(raw[:2000])  # inside the tokenizer metadata
        pattern = "truncated or corrupt"
    else:
        src.write_bytes(b"this is not a gguf file" * 10)
        pattern = "neither a GGUF file"
    with pytest.raises(ModelFormatError, match=pattern):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache" / "converted") == []


@pytest.mark.parametrize("damage", ["string length", "dimension", "block_count", "type id"])
def test_a_damaged_header_field_is_refused_as_corrupt(tmp_path, damage):
    """One damaged number in the header: a token's string length past 2^56 (an OverflowError
    escaped as a traceback), a tensor dimension whose product wraps around in int64 (it passed the
    size check, then failed to reshape mid-conversion), a block_count of millions (every layer's
    missing tensors were listed until memory ran out): each a ModelFormatError, nothing cached."""
    import struct

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    raw = bytearray(src.read_bytes())
    if damage == "string length":  # the top byte of the vocabulary's first string length
        at = raw.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 16
        raw[at + 7] = 0xFF
        pattern = "truncated or corrupt"
    elif damage == "dimension":  # d0 * (d1 + 2^58) == d0 * d1 mod 2^64 when d0 is a multiple of 64
        at = raw.index(b"token_embd.weight") + len("token_embd.weight")
        _, d0, d1 = struct.unpack_from("<IQQ", raw, at)
        assert d0 % 64 == 0
        struct.pack_into("<Q", raw, at + 12, d1 + (1 << 58))
        pattern = "truncated"
    elif damage == "type id":  # F32 data said to be F16: read, it was half its bytes (NaN weights), a gap after it
        at = raw.index(b"blk.0.ffn_up.weight") + len("blk.0.ffn_up.weight")
        (n_dims,) = struct.unpack_from("<I", raw, at)
        assert struct.unpack_from("<I", raw, at + 4 + 8 * n_dims) == (0,)
        struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 1)
        pattern = "'blk.0.ffn_down.weight' .* starts at data offset"
    else:
        at = raw.index(b"llama.block_count") + len("llama.block_count")
        vtype, count = struct.unpack_from("<II", raw, at)
        assert (vtype, count) == (4, 2)
        struct.pack_into("<I", raw, at + 4, count | 1 << 24)
        pattern = "block_count=16777218 but its tensors hold 2 layers"
    src.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=pattern):
        resolve_model(src, torch.float32, cache_dir=tmp_path / "cache", progress=False)
    assert _cache_entries(tmp_path / "cache" / "converted") == []


def test_streaming_safetensors_writer_is_readable(tmp_path):
    ts = {"a": torch.randn(3, 5), "b.c": torch.randn(7), "d": torch.randn(2, 2, 2)}
    size = G.write_safetensors(tmp_path / "x.safetensors", [(k, tuple(v.shape)) for k, v in ts.items()],
                               iter(ts.items()), torch.float32)
    assert size == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], v) for k, v in ts.items())


# --------------------------------------------------------------------------- SmolLM2-135M (real, 98 MB)


@pytest.fixture(scope="module")
def smol(tandem_cache):
    gguf_path = fetch_known_gguf(SMOL, cache_dir=tandem_cache, progress=False)
    conv = resolve_model(SMOL, torch.float32, cache_dir=tandem_cache, progress=False)
    return gguf_path, conv


@pytest.fixture(scope="module")
def smol_models(smol):
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate (test extra)")
    from transformers import AutoModelForCausalLM

    gguf_path, conv = smol
    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    mine = AutoModelForCausalLM.from_pretrained(conv, dtype=torch.float32).eval()
    return ref, mine


def test_smollm2_state_dict_equals_transformers_gguf(smol, smol_models):
    _, conv = smol
    ref, _ = smol_models
    ref_sd = ref.state_dict()
    mine = load_file(conv / "model.safetensors")
    assert "lm_head.weight" not in mine  # tied
    assert set(mine) | {"lm_head.weight"} == set(ref_sd)
    for k, v in mine.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, ref_sd[k]), k
    cfg = json.loads((conv / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 576, 9, 3)
    assert (cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (49152, True, 100000.0)


def test_smollm2_logits_and_greedy_paris(smol, smol_models):
    from transformers import AutoTokenizer

    _, conv = smol
    ref, mine = smol_models
    tok = AutoTokenizer.from_pretrained(conv)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ref(ids).logits, mine(ids).logits
    assert torch.equal(a, b)
    out = mine.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")


def test_smollm2_tokenizer_round_trip(smol):
    from transformers import AutoTokenizer

    gguf_path, conv = smol
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(conv)
    texts = [
        "The capital of France is",
        "def f(x):\n    return x ** 2  # héllo 世界 🙂",
        "  leading spaces, tabs\tand <|im_start|>special<|im_end|> tokens",
    ]
    for s in texts:
        assert tok(s).input_ids == ref(s).input_ids
        assert tok.decode(tok(s).input_ids) == s
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == (ref.eos_token, 2, 1)
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template and tok.chat_template == ref.chat_template
    msgs = [{"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    gen = json.loads((conv / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2

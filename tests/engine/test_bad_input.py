"""User mistakes raise a clear ConfigError / RequestError naming the field, before any work
starts, and an invalid request never disturbs the others."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

import tandem.engine.llm as llm_module
from tandem import LLM, SamplingParams
from tandem.config import SUPPORTED_ARCHITECTURES, read_arch_config
from tandem.errors import ConfigError, RequestError, TandemError
from tests.helpers import make_hf_model

MAX_LEN = 128
VOCAB = 320
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("bad_input") / "m", "llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of two prompts, each run alone."""
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the weights start loading: the error must come before any work."""

    def forbidden(*args, **kwargs):
        raise AssertionError("load_model was called: the bad argument was not caught up front")

    monkeypatch.setattr(llm_module, "load_model", forbidden)


def assert_idle(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.has_unfinished and eng.scheduler.requests == {}
    assert eng.scheduler.blocks.num_free_blocks == eng.scheduler.blocks.num_blocks


def test_error_types_are_value_errors():
    assert issubclass(ConfigError, TandemError) and issubclass(RequestError, TandemError)
    assert issubclass(TandemError, ValueError)


# ---------------------------------------------------------------- the model


def test_missing_model_path(tmp_path, no_loading):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="does not exist") as e:
        LLM(str(missing), dtype="float32")
    assert str(missing) in str(e.value)


def test_directory_without_config_json(tmp_path, no_loading):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json") as e:
        LLM(str(empty), dtype="float32")
    assert str(empty) in str(e.value)


@pytest.mark.parametrize("kind", ["missing", "no_config"])
def test_bad_model_path_is_a_config_error(tmp_path, kind, no_loading):
    path = tmp_path / "x"
    if kind == "no_config":
        path.mkdir()
    with pytest.raises(ConfigError, match="model"):
        LLM(str(path), dtype="float32")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, no_loading):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(ConfigError, match="architecture") as e:
        LLM(str(d), dtype="float32")
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    assert all(a in msg for a in SUPPORTED_ARCHITECTURES)


def test_invalid_config_json(tmp_path, no_loading):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        LLM(str(d), dtype="float32")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_model_file_that_cannot_be_read_is_named(model_dir, tmp_path, name, no_loading):
    """config.json or generation_config.json that is a directory (or unreadable): a ConfigError naming it
    (IsADirectoryError / PermissionError tracebacks before)."""
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / name).unlink(missing_ok=True)
    (d / name).mkdir()
    with pytest.raises(ConfigError, match=f"{name} could not be read .*make it a readable file"):
        LLM(str(d), dtype="float32")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_model_file_that_is_a_pipe_is_named_not_waited_on(model_dir, tmp_path, name, no_loading):
    """A named pipe in a model file's place: a ConfigError, not a read that blocks until a writer comes."""
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    with pytest.raises(ConfigError, match=f"{name} is not a regular file .*make it a readable file"):
        LLM(str(d), dtype="float32")


def test_weights_stored_as_integers_are_refused(model_dir, tmp_path):
    """A tensor stored as integers, bools or fp8 (no scales) was cast to the model's dtype and ran as garbage:
    refused, named."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (st,) = d.glob("*.safetensors")
    tensors = load_file(st)
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    for dtype, stored in ((torch.int64, "I64"), (torch.bool, "BOOL"), (torch.float8_e4m3fn, "F8_E4M3")):
        save_file(tensors | {name: tensors[name].to(dtype)}, st)
        with pytest.raises(ConfigError, match=f"tensor '{name}' in .* is stored as {stored}; expected floating point"):
            LLM(str(d), dtype="float32")


def test_weight_files_the_folder_cannot_give_are_named(model_dir, tmp_path):
    """An index whose weight_map names no file, or a weight file that is a broken link: named ("no
    *.safetensors files ... load_format='dummy'" before, though the files were there)."""
    d = tmp_path / "index"
    shutil.copytree(model_dir, d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ConfigError, match="index.json is not a valid safetensors index .*names no file"):
        LLM(str(d), dtype="float32")
    d = tmp_path / "link"
    shutil.copytree(model_dir, d)
    (st,) = d.glob("*.safetensors")
    st.unlink()
    st.symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(ConfigError, match=f"{st} is not a readable file .*re-download it"):
        LLM(str(d), dtype="float32")


def test_running_out_of_memory_for_the_rotary_tables_names_max_model_len(model_dir, tmp_path, monkeypatch):
    """Out of memory while loading a model whose max_model_len makes its rotary tables large (GiBs of
    positions): the fix names max_model_len (only a smaller model or dtype before)."""
    import tandem.models.loader as loader

    d = _copy_with_config(model_dir, tmp_path / "long", lambda c: c | {"max_position_embeddings": 2**24})

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(loader, "_build", out_of_memory)
    with pytest.raises(ConfigError, match=r"ran out of .*or a smaller max_model_len \(its 16777216 positions' rotary"):
        LLM(str(d), dtype="float32")
    with pytest.raises(ConfigError, match=r"ran out of .*smaller dtype$"):  # a short context: not named
        LLM(str(d), dtype="float32", max_model_len=4096)


def test_a_config_transformers_refuses_is_named_not_the_tokenizer(model_dir, tmp_path):
    """AutoTokenizer reads config.json too, and transformers checks it: a field it refuses (bos_token_id "x")
    read as a broken tokenizer ("check or re-download its tokenizer files"); now config.json and the field."""
    d = _copy_with_config(model_dir, tmp_path / "bos", lambda c: c | {"bos_token_id": "x"})
    assert any((d / n).exists() for n in ("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ConfigError, match=r"config.json does not pass transformers' checks.*bos_token_id"):
        LLM(str(d), dtype="float32")


def _copy_with_config(src, dst, change):
    """A copy of the model directory src whose config.json is change(config) (a dict or anything)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(change(raw)))
    return dst


@pytest.mark.parametrize("change,match", [
    (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"}, "num_attention_heads"),
    (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "vocab_size"),
    (lambda c: [c], "not a JSON object"),
    (lambda c: c | {"max_position_embeddings": 0}, "max_position_embeddings"),
    (lambda c: c | {"hidden_size": "64"}, "hidden_size"),
    (lambda c: c | {"num_attention_heads": 0}, "num_attention_heads"),
    (lambda c: c | {"num_key_value_heads": 3}, "num_key_value_heads"),
    (lambda c: c | {"rope_scaling": "linear"}, "rope_scaling"),
    (lambda c: c | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}}, "low_freq_factor"),
    (lambda c: c | {"rope_scaling": {"type": "linear"}}, "'factor'"),
    (lambda c: c | {"rope_scaling": {"type": "linear", "factor": float("inf")}}, "'factor', got inf"),
    (lambda c: c | {"rope_scaling": {"type": "linear", "factor": 0.001}}, r"factor=0.001 .* must be in \[1, 1024\]"),
    (lambda c: c | {"rope_scaling": {"type": "linear", "factor": 1e300}}, r"factor=1e\+300 .* must be in"),
    (lambda c: c | {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_theta=inf"),
    (lambda c: c | {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),  # was ignored: every dim rotated
    (lambda c: c | {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
     "per layer type \\('full_attention'\\)"),  # was read as plain RoPE, theta 10000
    (lambda c: c | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    (lambda c: c | {"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "rope_theta"),
    (lambda c: c | {"rms_norm_eps": None}, "rms_norm_eps"),
    (lambda c: c | {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    (lambda c: c | {"hidden_act": "gelu"}, r"hidden_act='gelu'.*'silu'"),
    (lambda c: c | {"attention_bias": "yes"}, "attention_bias"),
    (lambda c: c | {"head_dim": 9}, r"head_dim=9 .* is odd"),
    (lambda c: {k: v for k, v in c.items() if k != "head_dim"} | {"hidden_size": 60},
     r"head_dim=15 .*hidden_size=60 over num_attention_heads=4.* is odd"),
    (lambda c: c | {"eos_token_id": "</s>"}, "eos_token_id='</s>'"),
    (lambda c: c | {"eos_token_id": [1, 2.5]}, "eos_token_id"),
    (lambda c: c | {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}},
     r"quantized checkpoint \(quantization_config, quant_method 'fp8'\).*quantization='fp8'"),
], ids=["no-heads", "no-vocab", "list", "positions=0", "hidden-str", "heads=0", "kv-heads-3", "rope-str",
        "llama3-no-low-freq", "linear-no-factor", "factor-inf", "factor-below-1", "factor-huge", "theta-inf",
        "partial-rotary", "partial-rotary-in-rope", "nested-rope",
        "theta-null", "eps-null", "tie-str", "gelu", "bias-str",
        "head-dim-9", "head-dim-15", "eos-str", "eos-float", "pre-quantized"])
def test_malformed_config_json_names_the_key(model_dir, tmp_path, change, match, no_loading):
    d = _copy_with_config(model_dir, tmp_path / "m", change)
    with pytest.raises(ConfigError, match=match) as e:
        LLM(str(d), dtype="float32")
    assert "config.json" in str(e.value)


def test_linear_rope_scaling_stretches_the_context(model_dir, tmp_path):
    """Linear RoPE scaling by a factor takes factor x max_position_embeddings positions (vLLM's derived
    length): the default context and the limit."""
    d = _copy_with_config(model_dir, tmp_path / "linear", lambda c: c | {
        "max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert LLM(str(d), dtype="float32").config.sched.max_model_len == 256
    with pytest.raises(ConfigError, match=r"max_position_embeddings=64 \(times the linear rope factor: 256\)"):
        LLM(str(d), dtype="float32", max_model_len=257)


def test_rope_scaling_without_a_theta_keeps_the_checkpoints(model_dir, tmp_path):
    """transformers 5 keeps rope_theta in rope_parameters alone: a rope_scaling set beside it (edited in, or by
    hf_overrides) without a theta keeps that theta, not 10000 (which moved every logit of a 4k prompt by up to 8.7)."""
    d = _copy_with_config(model_dir, tmp_path / "m", lambda c: {k: v for k, v in c.items() if k != "rope_theta"} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    override = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    edited = _copy_with_config(d, tmp_path / "edited", lambda c: c | override)
    for arch in (read_arch_config(d, overrides=override), read_arch_config(edited)):
        assert arch.rope_theta == 1e6 and arch.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert read_arch_config(d).rope_theta == 1e6 and read_arch_config(d).rope_scaling is None
    # a top-level theta beside them is the one transformers takes (an hf_overrides of it, say)
    assert read_arch_config(d, overrides={"rope_theta": 5e5, **override}).rope_theta == 5e5
    # hf_overrides' rope_theta wins over rope_parameters' own (transformers 5 would drop it), over a rope_scaling's too
    assert read_arch_config(d, overrides={"rope_theta": 5e5}).rope_theta == 5e5
    theirs = {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3e5}}
    assert read_arch_config(d, overrides=theirs).rope_theta == 3e5
    assert read_arch_config(d, overrides={"rope_theta": 5e5, **theirs}).rope_theta == 5e5
    edited_theta = _copy_with_config(d, tmp_path / "edited_theta", lambda c: c | {"rope_theta": 5e5})
    assert read_arch_config(edited_theta).rope_theta == 1e6  # (a file's own: rope_parameters' wins, as transformers)


def test_generation_config_eos_of_the_wrong_type_is_named(model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ConfigError, match=r"eos_token_id=\['</s>'\] in .*generation_config.json must be a token id"):
        LLM(str(d), dtype="float32", max_model_len=MAX_LEN)


def test_architectures_given_as_a_string(model_dir, tmp_path):
    d = _copy_with_config(model_dir, tmp_path / "m", lambda c: c | {"architectures": "LlamaForCausalLM"})
    assert read_arch_config(d).architecture == "LlamaForCausalLM"


def test_broken_weight_files(model_dir, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(model_dir, truncated)
    (weights,) = truncated.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="not a valid safetensors file"):
        LLM(str(truncated), dtype="float32", max_model_len=MAX_LEN)
    (truncated / "extra.safetensors").mkdir()  # a folder of that name is no weight file
    with pytest.raises(ConfigError, match="truncated/model.safetensors is not a valid safetensors file"):
        LLM(str(truncated), dtype="float32", max_model_len=MAX_LEN)
    pickled = tmp_path / "pickled"
    shutil.copytree(model_dir, pickled)
    weights = next(pickled.glob("*.safetensors"))
    weights.rename(pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pytorch_model.bin.*convert them to safetensors"):
        LLM(str(pickled), dtype="float32", max_model_len=MAX_LEN)


def test_weight_files_are_the_ones_the_index_names(model_dir, tmp_path, reference):
    """A sharded checkpoint reads the files model.safetensors.index.json names, whatever else the
    folder holds (a stale copy, Mistral's consolidated.safetensors); a tensor met twice, a shard the
    index names but lacks, or a broken index is an error, never a silent pick."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    names = sorted(weights)
    half = {n: weights[n] for n in names[: len(names) // 2]}
    rest = {n: weights[n] for n in names[len(names) // 2:]}
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    save_file(half, str(sharded / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(rest, str(sharded / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {},
             "weight_map": {n: f"model-0000{1 if n in half else 2}-of-00002.safetensors" for n in names}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({n: torch.zeros_like(w) for n, w in weights.items()}, str(sharded / "model.safetensors"))  # stale
    prompts, outputs = reference
    got = LLM(str(sharded), dtype="float32", max_model_len=MAX_LEN).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == outputs
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="lacks the weight files .*model-00002-of-00002"):
        LLM(str(sharded), dtype="float32", max_model_len=MAX_LEN)
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid safetensors index"):
        LLM(str(sharded), dtype="float32", max_model_len=MAX_LEN)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {names[0]: 7}}))
    with pytest.raises(ConfigError, match="not a valid safetensors index .*names the file 7"):
        LLM(str(sharded), dtype="float32", max_model_len=MAX_LEN)
    (sharded / "model.safetensors.index.json").unlink()  # no index: every file, and the stale copy clashes
    with pytest.raises(ConfigError, match="appears twice"):
        LLM(str(sharded), dtype="float32", max_model_len=MAX_LEN)


@pytest.mark.parametrize("name,shape", [("model.layers.0.self_attn.q_proj.weight", (64, 32)),
                                        ("model.layers.0.self_attn.k_proj.weight", (32, 1)),
                                        ("model.layers.0.mlp.up_proj.weight", (128,))])
def test_packed_projection_of_the_wrong_shape(model_dir, tmp_path, name, shape):
    """q/k/v and gate/up load into one packed weight: each must have the whole shape the config
    implies, not only its rows (a (32, 1) k_proj used to broadcast silently)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    weights = load_file(str(d / "model.safetensors"))
    weights[name] = torch.zeros(shape)
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=re.escape(f"{name}' has shape {tuple(shape)}") + ".*the config implies"):
        LLM(str(d), dtype="float32", max_model_len=MAX_LEN)


def test_draft_errors_name_the_draft(model_dir, tmp_path):
    draft = _copy_with_config(model_dir, tmp_path / "d", lambda c: c | {"architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ConfigError, match=r"^speculative_config.model: architecture \['GemmaForCausalLM'\]"):
        LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN,
            speculative_config={"model": str(draft), "num_speculative_tokens": 2})


def test_tokenizer_larger_than_the_vocabulary(tmp_path):
    """A tokenizer with ids the embedding table lacks fails at load, not at every string prompt."""
    d = make_hf_model(tmp_path / "m", vocab_size=256)
    with pytest.raises(ConfigError, match="tokens but the model's embedding table only 256 rows"):
        LLM(str(d), dtype="float32", max_model_len=MAX_LEN)


def test_a_dtype_alias_converts_to_that_dtype(monkeypatch, tmp_path):
    """A GGUF file or known name is converted to the dtype asked for, by any of its names."""
    import tandem.models.hub as hub
    from tandem.models.source import resolve_model_dir

    asked = []
    monkeypatch.setattr(hub, "resolve_model", lambda model, dtype, **kw: asked.append(dtype) or tmp_path)
    for name in ("float", "fp32", "half", "fp16", "bf16", "auto", torch.float16):
        resolve_model_dir(str(tmp_path / "x.gguf"), name)
    assert asked == [torch.float32, torch.float32, torch.float16, torch.float16, torch.bfloat16, torch.bfloat16,
                     torch.float16]


@pytest.mark.parametrize("arch, model_type", [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                                              ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")])
def test_keys_a_config_leaves_out_take_transformers_defaults(tmp_path, arch, model_type):
    """num_key_value_heads, head_dim and max_position_embeddings left out of config.json: each
    architecture's own default, as its transformers config class reads it (Qwen3's head_dim 128,
    Mistral's 8 KV heads and 131072 positions, Qwen2/3's 32768)."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": model_type, "hidden_size": 2048, "num_attention_heads": 32,
        "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 256}))
    ours, ref = read_arch_config(tmp_path), AutoConfig.from_pretrained(tmp_path)
    assert ours.num_kv_heads == ref.num_key_value_heads
    assert ours.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert ours.max_position_embeddings == ref.max_position_embeddings


@pytest.mark.parametrize("checkpoint, asked, runs", [
    ("float32", "auto", torch.bfloat16),  # vLLM's "auto": a float32 checkpoint runs in half precision
    (None, "auto", torch.bfloat16),  # no dtype named: float32, as transformers reads it
    ("float16", "auto", torch.bfloat16),  # (float16 is slow on a CPU)
    ("bfloat16", "auto", torch.bfloat16),
    ("float32", "float32", torch.float32),
    ("bfloat16", "float32", torch.float32),
])
def test_auto_dtype_runs_a_float32_checkpoint_in_half_precision(model_dir, checkpoint, asked, runs):
    import dataclasses

    from tandem.config import resolve_dtype

    arch = dataclasses.replace(read_arch_config(model_dir), torch_dtype=checkpoint)
    assert resolve_dtype(asked, arch, torch.device("cpu")) == runs


def test_auto_dtype_on_a_gpu_without_bfloat16(model_dir, tmp_path, monkeypatch):
    """A GPU without bfloat16 (a T4, a V100): "auto" runs a bfloat16 or float32 checkpoint in float16
    (vLLM's rule), and converts a GGUF file or known name to float16 (they failed: converted to
    bfloat16, then refused); bfloat16 asked by name is refused naming float16."""
    import dataclasses

    import tandem.models.hub as hub
    from tandem.config import resolve_dtype
    from tandem.models.source import resolve_model_dir

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    gpu = torch.device("cuda")
    for checkpoint in ("bfloat16", "float32", "float16", None):
        arch = dataclasses.replace(read_arch_config(model_dir), torch_dtype=checkpoint)
        assert resolve_dtype("auto", arch, gpu) == torch.float16
    with pytest.raises(ConfigError, match="use dtype='float16'"):
        resolve_dtype("bfloat16", read_arch_config(model_dir), gpu)
    asked = []
    monkeypatch.setattr(hub, "resolve_model", lambda model, dtype, **kw: asked.append(dtype) or tmp_path)
    resolve_model_dir(str(tmp_path / "x.gguf"), "auto", device=gpu)
    resolve_model_dir(str(tmp_path / "x.gguf"), "auto", device=torch.device("cpu"))
    assert asked == [torch.float16, torch.bfloat16]


def test_hf_overrides_set_config_keys_over_the_files(model_dir, tmp_path):
    """hf_overrides (vLLM's; --hf-overrides): keys set over config.json's, checked as its own: a
    shorter context, a window (then the cap), a value the file could not hold refused by name."""
    assert LLM(str(model_dir), dtype="float32", hf_overrides={"max_position_embeddings": 64}).config.sched.max_model_len \
        == 64
    with pytest.raises(ConfigError, match="max_model_len=128"):
        LLM(str(model_dir), dtype="float32", max_model_len=128, hf_overrides={"max_position_embeddings": 64})
    with pytest.raises(ConfigError, match=r"hidden_act='gelu'.*as hf_overrides=\{'hidden_act': 'gelu'\} sets it"):
        LLM(str(model_dir), dtype="float32", hf_overrides={"hidden_act": "gelu"})
    from tandem.cli import build_parser

    args = build_parser().parse_args(["serve", str(model_dir), "--hf-overrides", '{"max_position_embeddings": 64}'])
    assert args.hf_overrides == {"max_position_embeddings": 64}


def test_broken_tokenizer_and_generation_config(model_dir, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(model_dir, d)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(str(d), dtype="float32", max_model_len=MAX_LEN)
    g = tmp_path / "gen"
    shutil.copytree(model_dir, g)
    (g / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json"):
        LLM(str(g), dtype="float32", max_model_len=MAX_LEN)


def test_tokenizer_argument_must_hold_a_tokenizer(model_dir, tmp_path, no_loading):
    with pytest.raises(ConfigError, match="tokenizer=.*does not exist"):
        LLM(str(model_dir), tokenizer=str(tmp_path / "missing"), dtype="float32", max_model_len=MAX_LEN)
    with pytest.raises(ConfigError, match="tokenizer=.*could not be loaded"):  # nor fetched (a hub id)
        LLM(str(model_dir), tokenizer="no-such-org/no-such-tokenizer", dtype="float32", max_model_len=MAX_LEN)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="tokenizer=.*not a directory"):
        LLM(str(model_dir), tokenizer=str(tmp_path / "file"), dtype="float32", max_model_len=MAX_LEN)
    with pytest.raises(ConfigError, match="tokenizer=.*no tokenizer files"):
        LLM(str(model_dir), tokenizer=str(tmp_path), dtype="float32", max_model_len=MAX_LEN)


def test_sliding_window_caps_the_context(tmp_path):
    """Sliding-window attention is not implemented: the context stays within the window (where the
    window changes nothing) by default, and a longer one is refused."""
    mistral = make_hf_model(tmp_path / "mistral", "mistral")
    d = _copy_with_config(mistral, tmp_path / "windowed", lambda c: c | {"sliding_window": 64})
    assert LLM(str(d), dtype="float32").config.sched.max_model_len == 64
    with pytest.raises(ConfigError, match="sliding_window=64"):
        LLM(str(d), dtype="float32", max_model_len=128)
    # A Mistral config.json without the key has transformers' default window; null means none.
    absent = _copy_with_config(mistral, tmp_path / "absent",
                               lambda c: {k: v for k, v in c.items() if k != "sliding_window"})
    assert read_arch_config(absent).sliding_window == 4096
    null = _copy_with_config(mistral, tmp_path / "null", lambda c: c | {"sliding_window": None})
    assert read_arch_config(null).sliding_window is None
    qwen = make_hf_model(tmp_path / "qwen", "qwen2")
    # A draft with both limits: one error naming both and the lower, which then suffices (it used to
    # advise 256, whose error then advised 64).
    draft = _copy_with_config(mistral, tmp_path / "draft",
                              lambda c: c | {"sliding_window": 64, "max_position_embeddings": 256})
    spec = dict(model=str(draft), num_speculative_tokens=2)
    with pytest.raises(ConfigError, match=r"supports 256 positions and sliding_window=64 .* lower max_model_len to 64"):
        LLM(str(qwen), dtype="float32", speculative_config=spec)
    assert LLM(str(qwen), dtype="float32", max_model_len=64, speculative_config=spec).config.spec.k == 2


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("keys", [
    {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
    {"use_sliding_window": True, "max_window_layers": 1},  # no sliding_window: transformers' 4096
    {"use_sliding_window": True, "sliding_window": 64},  # no max_window_layers: 28, past both layers
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]},
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0,
     "layer_types": ["full_attention", "full_attention"]},
])
def test_qwen_window_is_the_one_transformers_applies(tmp_path, model_type, keys):
    """Qwen2/3 slide only with use_sliding_window, and then only the layers from max_window_layers
    on (or those layer_types names), over sliding_window (4096 when left out): tandem's window (the
    context it caps, sliding-window attention not being implemented) is the one some layer of the
    transformers model applies, or none."""
    from transformers import AutoConfig

    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": model_type, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 256, **keys}))
    ref = AutoConfig.from_pretrained(tmp_path)
    applied = ref.sliding_window if "sliding_attention" in ref.layer_types else None
    assert read_arch_config(tmp_path).sliding_window == applied


def test_null_kv_heads_means_one_a_query_head(tmp_path):
    """"num_key_value_heads": null is multi-head attention (transformers' rule); the architecture's
    own default (Qwen2's 32) is for a config.json that leaves the key out."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": None, "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 256}))
    assert read_arch_config(tmp_path).num_kv_heads == AutoConfig.from_pretrained(tmp_path).num_key_value_heads == 4


def test_dtype_is_checked_before_the_model_is_fetched(monkeypatch, no_loading):
    def forbidden(*args, **kwargs):
        raise AssertionError("the model was resolved (fetched or converted) before the dtype was checked")

    monkeypatch.setattr(llm_module, "resolve_model_dir", forbidden)
    with pytest.raises(ConfigError, match="dtype='int8'"):
        LLM("qwen2.5-coder-1.5b-instruct", dtype="int8")


# ---------------------------------------------------------------- engine arguments


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(dtype="fp8"), "dtype"),
        (dict(dtype=torch.float64), "dtype"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(dtype=["auto"]), "dtype"),  # was a bare TypeError (unhashable)
        (dict(speculative_config={"model": "d", "num_speculative_tokens": 2, "dtype": {}}), "dtype"),
        (dict(reasoning_parser=["qwen3"]), "reasoning_parser"),
        (dict(tokenizer=5), "tokenizer"),
        (dict(enable_prefix_caching="no"), "enable_prefix_caching"),  # was read as True
        (dict(enforce_eager="no"), "enforce_eager"),
        (dict(device="tpu"), "device"),
        (dict(max_model_len=1024), "max_model_len"),  # max_position_embeddings is 512
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=True), "max_model_len"),
        (dict(max_model_len=64.0), "max_model_len"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=-16), "block_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(block_size="16"), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_seqs=True), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=-0.2), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization"),
        (dict(load_format="pt"), "load_format"),
        (dict(enable_chunked_prefill=False), "enable_chunked_prefill"),
        (dict(swap_space=-1), "swap_space"),
        (dict(disable_log_stats="no"), "disable_log_stats"),
        (dict(enable_lora=True), "enable_lora"),  # a vLLM argument tandem does not take: named, not a TypeError
        (dict(foo_option="x", bar_option=1), "bar_option, foo_option"),
        (dict(hf_overrides=lambda c: c), "hf_overrides"),
        (dict(hf_overrides={1: 2}), "hf_overrides"),
        (dict(download_dir=""), "download_dir"),
        (dict(load_format="safetensors"), "load_format"),
        (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
        (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
        (dict(quantization="awq"), "quantization='awq' is not supported; use 'fp8'"),
        (dict(quantization="FP8"), "quantization"),
        (dict(quantization=True), "quantization"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**70), "seed"),
        (dict(per_request_spec_decode_metrics="full"), "per_request_spec_decode_metrics"),
        (dict(per_request_spec_decode_metrics=None), "per_request_spec_decode_metrics"),
        (dict(per_request_spec_decode_metrics="summary"), "per_request_spec_decode_metrics='summary' needs a draft"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_bad_engine_argument(model_dir, kwargs, field, no_loading):
    args = dict(dtype="float32", max_model_len=MAX_LEN) | kwargs
    with pytest.raises(ConfigError, match=field):
        LLM(str(model_dir), **args)


def test_vllm_arguments_that_ask_for_nothing_more_are_taken(model_dir):
    """vLLM's arguments at values that ask for nothing tandem lacks run as without them: its EngineArgs'
    None defaults, reasoning_parser "", tokenizer_mode "hf", and vLLM-only arguments at their defaults
    (tandem/engine/vllm_args.py); the engine's tokenizer by vLLM's LLMEngine.get_tokenizer()."""
    from tandem.engine.vllm_args import VLLM_ONLY_ARGS

    quiet = dict(tokenizer_revision=None, task="generate", runner="auto",
                 convert="none", model_impl="auto", enable_lora=False, max_loras=1, max_lora_rank=16,
                 cpu_offload_gb=0, data_parallel_size=1, max_seq_len_to_capture=8192,
                 compilation_config=None, enable_sleep_mode=False, preemption_mode=None, use_tqdm_on_load=True,
                 disable_cascade_attn=True, enable_log_requests=False, calculate_kv_scales=False, revision="main",
                 hf_token=True, cuda_graph_sizes=[512], limit_mm_per_prompt={"image": 0}, allowed_local_media_path="",
                 guided_decoding_backend="llguidance", pooler_config=None, disable_async_output_proc=False)
    assert set(quiet) <= set(VLLM_ONLY_ARGS)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, enable_chunked_prefill=True, swap_space=4,
              disable_custom_all_reduce=True, disable_log_stats=False, max_num_seqs=None, block_size=None,
              enable_prefix_caching=None, reasoning_parser="", tokenizer_mode="hf",
              structured_outputs_config={"reasoning_parser": "", "disable_fallback": False,
                                         "disable_any_whitespace": False, "reasoning_parser_plugin": ""}, **quiet)
    assert (llm.engine.cfg.sched.max_num_seqs, llm.engine.cfg.cache.block_size) == (256, 16)
    assert llm.engine.cfg.cache.enable_prefix_caching and llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs,says", [
    (dict(revision="v2.0"), "revision='v2.0' is not supported: tandem loads a local folder"),
    (dict(served_model_name="auto"), "served_model_name='auto' is not supported"),  # "auto" only where vLLM has it
    (dict(task="embed"), "task='embed' is not supported: tandem generates text only"),
    (dict(enable_lora=True), "enable_lora=True is not supported: tandem serves no LoRA adapters"),
    (dict(max_lora_rank=64), "max_lora_rank=64 is not supported: tandem serves no LoRA adapters"),
    (dict(limit_mm_per_prompt={"image": 1}), "tandem runs text-only models"),
    (dict(cpu_offload_gb=4), "cpu_offload_gb=4 is not supported: tandem keeps every weight on the device"),
    (dict(compilation_config={"level": 3}), "enforce_eager turns them off"),
    (dict(rope_theta=1e6), "pass it in hf_overrides"),
    (dict(data_parallel_size=2), "one engine a process"),
    (dict(hf_token="hf_x"), "set HF_TOKEN in the environment"),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode='mistral' is not supported; leave it out or set 'auto' or 'hf'"),
    (dict(structured_outputs_config={"disable_any_whitespace": True}), "set it per request"),
    (dict(bogus_argument=1), "LLM() got bogus_argument: not an argument tandem takes"),
], ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_vllm_arguments_tandem_does_not_take_say_why(model_dir, kwargs, says, no_loading):
    with pytest.raises(ConfigError, match=re.escape(says)):
        LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(model_dir, no_loading):
    with pytest.raises(ConfigError, match="device='cuda'.*not available"):
        LLM(str(model_dir), dtype="float32", device="cuda")


@pytest.mark.parametrize("head_dim,ok", [(8, False), (12, False), (16, True), (80, True), (100, False),
                                         (256, True), (512, False)])
def test_head_dims_the_cuda_kernels_do_not_take_are_refused(model_dir, head_dim, ok):
    """Checked from config.json before any CUDA work (the GPU side runs head_dim 80: tests/gpu)."""
    import dataclasses

    from tandem.config import check_device_support, read_arch_config

    arch = dataclasses.replace(read_arch_config(model_dir), head_dim=head_dim)
    check_device_support(arch, torch.device("cpu"))  # the CPU reference takes any
    if ok:
        check_device_support(arch, torch.device("cuda"))
    else:
        with pytest.raises(ConfigError, match=rf"^speculative_config.model: head_dim={head_dim} is not supported on "
                                              r"CUDA \(.*\); run it with device='cpu'$"):
            check_device_support(arch, torch.device("cuda"), "speculative_config.model")


@pytest.mark.parametrize("kwargs,field", [(dict(gpu_memory_utilization=True), "gpu_memory_utilization"),
                                          (dict(seed=True), "seed")])
def test_bool_engine_argument(model_dir, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, **kwargs)


def test_kv_budget_too_small_for_one_request(model_dir):
    with pytest.raises(ConfigError, match=r"raise kv_cache_memory_bytes or lower max_model_len \(or set "
                                          r"kv_cache_dtype='fp8': a byte a cached value\)$") as e:
        LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, kv_cache_memory_bytes=10_000)
    assert f"max_model_len={MAX_LEN}" in str(e.value)


def test_too_few_override_blocks_names_the_argument(model_dir):
    with pytest.raises(ConfigError, match="raise num_gpu_blocks_override or lower max_model_len$"):
        LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, num_gpu_blocks_override=1)
    # The draft's lookahead stops at max_model_len: a pool of max_model_len tokens holds a request at any k.
    spec = dict(model=str(model_dir), num_speculative_tokens=8)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_LEN, block_size=16,
              num_gpu_blocks_override=MAX_LEN // 16, speculative_config=spec)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, ignore_eos=True, max_tokens=None),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_LEN - 3


# ---------------------------------------------------------------- sampling parameters

BAD_PARAMS = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=False), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=4.0), "max_tokens"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=True), "seed"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, False]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[1], []]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1], [True]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1], [-2]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1], 2]), "bad_words_token_ids"),
    (dict(n=0), "n"),
    (dict(n=True), "n"),
    (dict(n=2.0), "n"),
    (dict(n=2, temperature=0), "n"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(temperature=float("inf")), "temperature"),  # was taken: masked logits became NaN, masks ignored
    (dict(temperature=1e39), "temperature"),  # finite, but inf in float32: the same NaNs
    (dict(repetition_penalty=1e-50), "repetition_penalty"),  # 0 in float32: -inf * 0 let masked tokens through
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(bad_words=["ok", "\ud800"]), "bad_words"),  # a lone surrogate: the tokenizer's bare TypeError
    (dict(bad_words=["ok", ""]), "bad_words"),
    (dict(bad_words=[" \n"]), "bad_words"),  # (whitespace alone: its message says so, not "non-empty")
    (dict(ignore_eos="no"), "ignore_eos"),  # was read as True
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={5: float("inf")}), "logit_bias"),  # the token at inf: its processed row NaN
    (dict(logit_bias={5: 1e39}), "logit_bias"),  # inf in float32
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3.0]), "allowed_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[repr(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(RequestError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [(dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
                                          (dict(logit_bias={"a": 1.0}), "logit_bias"),
                                          (dict(logit_bias={"--5": 1.0}), "logit_bias"),
                                          (dict(logit_bias={"\u00b2": 1.0}), "logit_bias"),
                                          (dict(logit_bias={"9" * 5000: 1.0}), "logit_bias"),
                                          (dict(logit_bias=[1]), "logit_bias"),
                                          (dict(allowed_token_ids=5), "allowed_token_ids")],
                         ids=["stop=5", "stop_token_ids=5", "logit_bias-str-key", "logit_bias-double-minus",
                              "logit_bias-superscript-digit", "logit_bias-5000-digits", "logit_bias-list", "allowed=5"])
def test_malformed_sampling_params(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_valid_edge_sampling_params_are_accepted():
    ok = [
        SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1.0, max_tokens=1, min_tokens=1, seed=0, logprobs=20),
        SamplingParams(max_tokens=None, min_tokens=1000, logprobs=0, stop="x", n=3, seed=2**63 - 1),
    ]
    assert ok[0].greedy and ok[1].stop == ["x"]


# ---------------------------------------------------------------- requests through LLM.generate


@pytest.mark.parametrize(
    "prompt,match",
    [
        ({"prompt_token_ids": [5] * MAX_LEN}, "max_model_len"),
        ({"prompt_token_ids": [5] * (MAX_LEN + 50)}, "max_model_len"),
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": [5, VOCAB]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1, 5]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, 6.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": ["5"]}, "prompt_token_ids"),
        ({"prompt_token_ids": "5 6 7"}, "prompt_token_ids"),
        ([123], "prompt"),
        ({"text": "hi"}, "prompt_token_ids"),
        ({"prompt": "hi", "multi_modal_data": {"image": 1}}, "multi_modal_data.*text-only"),  # was dropped
        ({"prompt": "hi", "promt": "x"}, "'promt' is not one of them"),
    ],
    ids=["len=max", "len>max", "empty-ids", "empty-str", "id=vocab", "id<0", "float-id", "str-id", "ids-str",
         "int-prompt", "dict-without-ids", "multi-modal-data", "unknown-key"],
)
def test_bad_prompt(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_text_that_is_not_unicode_is_a_request_error(llm):
    """A lone surrogate in a prompt or a chat message: a RequestError that says where, not the
    tokenizer's TypeError."""
    for prompt in ("ab\ud800", {"prompt": "ab\ud800"}):
        with pytest.raises(RequestError, match=r"the prompt holds '\\ud800' at index 2, a lone surrogate"):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="rendered conversation holds '\\\\udfff'"):
        llm.chat([{"role": "user", "content": "hi \udfff"}], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_top_k_past_the_vocabulary_is_off(llm, reference):
    """top_k as large as the vocabulary or larger, even past int64, samples from all of it (vLLM):
    it used to fail the step and end the requests batched with it."""
    prompts, outs = reference
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": prompts[0]}, p, use_tqdm=False)[0].outputs[0].token_ids
    for top_k in (VOCAB, 2**63, 10**30):
        got = llm.generate([{"prompt_token_ids": q} for q in prompts], [p.clone(top_k=top_k), GREEDY],
                           use_tqdm=False)
        assert got[0].outputs[0].token_ids == want and got[1].outputs[0].token_ids == outs[1]


def test_prompts_argument_not_a_sequence(llm):
    with pytest.raises(RequestError, match="prompt"):
        llm.generate(123, GREEDY, use_tqdm=False)


def test_longest_prompt_that_fits(llm):
    (out,) = llm.generate({"prompt_token_ids": [5] * (MAX_LEN - 1)}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_allowed_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(RequestError, match="allowed_token_ids"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(allowed_token_ids=[5, VOCAB]), use_tqdm=False)
    assert_idle(llm)


def test_long_token_id_lists_are_checked_and_copied_fast(monkeypatch):
    """Token-id lists of plain ints are checked and copied at C speed, not an int at a time (a
    request's 1M stop ids or 600k bad words took a second of Python every time its params were
    copied, on the engine loop's thread too); other integer types still become ints, and a copy
    shares no list."""
    import tandem.sampling_params as sp

    calls = []
    as_int = sp._as_int
    monkeypatch.setattr(sp, "_as_int", lambda x: (calls.append(x), as_int(x))[1])
    words = [[i % 30000, (7 * i) % 30000] for i in range(100_000)]
    p = SamplingParams(stop_token_ids=list(range(100_000)), allowed_token_ids=[3] * 100_000,
                       bad_words_token_ids=words)
    q = p.clone(max_tokens=3)
    assert len(calls) < 50  # the scalar fields' (400k a copy before)
    assert q.bad_words_token_ids == words and q.bad_words_token_ids[0] is not words[0]
    assert q.stop_token_ids == p.stop_token_ids and q.stop_token_ids is not p.stop_token_ids
    p = SamplingParams(stop_token_ids=[np.int64(3), 4], allowed_token_ids=(np.int32(1),),
                       bad_words_token_ids=[(np.int64(2),), [5]])
    assert p.stop_token_ids == [3, 4] and p.allowed_token_ids == [1] and p.bad_words_token_ids == [[2], [5]]
    assert all(type(t) is int for t in p.stop_token_ids + p.allowed_token_ids + p.bad_words_token_ids[0])


def test_numpy_token_ids_are_integers(llm, reference):
    prompts, outs = reference
    out = llm.generate({"prompt_token_ids": list(np.array(prompts[0]))}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == outs[0]
    out = llm.generate({"prompt_token_ids": np.array(prompts[0])}, GREEDY, use_tqdm=False)[0]  # an array, as vLLM
    assert out.outputs[0].token_ids == outs[0]
    allowed = np.array(sorted(set(outs[0])))
    p = SamplingParams(temperature=0, max_tokens=len(outs[0]), allowed_token_ids=allowed, stop_token_ids=np.array([1]),
                       logprobs=False)  # False is 0, as vLLM reads it: the sampled token's logprob alone
    assert (p.allowed_token_ids, p.stop_token_ids, p.logprobs) == (allowed.tolist(), [1], 0)


def test_a_request_id_is_a_string(llm):
    with pytest.raises(RequestError, match="request_id must be a string"):  # an int came back as int
        llm.engine.add_request(5, [5, 6], GREEDY)
    assert_idle(llm)


def test_chat_takes_message_dicts(llm):
    for bad in ("hello", ["hello"], [[{"content": "no role"}]]):
        with pytest.raises(RequestError, match="conversation"):
            llm.chat(bad, GREEDY, use_tqdm=False)
    for bad, match in (({"role": None, "content": "x"}, "role None"), ({"role": "user", "content": 5}, "content 5")):
        with pytest.raises(RequestError, match=match):  # were rendered as they were
            llm.chat([bad], GREEDY, use_tqdm=False)


def test_chat_template_errors_are_request_errors(llm):
    """A template that does not parse, raises, or reads past the messages: a RequestError, not jinja's."""
    ok = [{"role": "user", "content": "hi"}]
    for template, match in (("{% for %}", "TemplateSyntaxError"), ("{{ raise_exception('no') }}", "no"),
                            ("{{ messages[5].content }}", "Undefined")):
        with pytest.raises(RequestError, match=match):
            llm.chat(ok, GREEDY, use_tqdm=False, chat_template=template)
    assert_idle(llm)


def test_bool_token_id(llm):
    with pytest.raises(RequestError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [5, True]}, GREEDY, use_tqdm=False)


def test_mismatched_number_of_sampling_params(llm):
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}]
    with pytest.raises(RequestError, match="sampling_params has 3 entries for 2 prompts"):
        llm.generate(prompts, [GREEDY] * 3, use_tqdm=False)
    with pytest.raises(RequestError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(prompts, [GREEDY], use_tqdm=False)
    assert_idle(llm)


def test_sampling_params_of_the_wrong_type(llm):
    for bad in ([{"temperature": 0}], 5, {"temperature": 0}):  # 5 was a bare TypeError (not iterable)
        with pytest.raises(RequestError, match="sampling_params must be a SamplingParams"):
            llm.generate([{"prompt_token_ids": [5, 6]}], bad, use_tqdm=False)
    assert_idle(llm)


def test_batch_with_one_bad_request_runs_nothing(llm, reference, monkeypatch):
    prompts, expected = reference
    steps = []
    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or real_step())
    batch = [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}, {"prompt_token_ids": [5, 9999]}]
    with pytest.raises(RequestError, match="prompt_token_ids"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    bad_params = [GREEDY, GREEDY, "greedy"]
    with pytest.raises(RequestError, match="sampling_params"):
        llm.generate(batch[:2] + [{"prompt_token_ids": [5]}], bad_params, use_tqdm=False)
    with pytest.raises(RequestError, match="prompt"):
        llm.generate(batch[:2] + [None], GREEDY, use_tqdm=False)
    assert steps == []  # not a single engine step ran
    assert_idle(llm)
    # The engine is intact: the good prompts still give their reference outputs.
    outs = llm.generate(batch[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert steps


def test_bad_request_via_engine_api_leaves_running_requests_alone(llm, reference):
    prompts, expected = reference
    eng = llm.engine
    eng.add_request("a", prompts[0], GREEDY)
    eng.add_request("b", prompts[1], GREEDY)
    done = {}
    for _ in range(2):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert not done and eng.scheduler.running  # a and b are mid-flight
    before = (sorted(eng.scheduler.requests), [r.req_id for r in eng.scheduler.running], len(eng.scheduler.waiting))
    bad = [
        ("c", [5, VOCAB + 1], GREEDY, "prompt_token_ids"),
        ("c", [], GREEDY, "empty"),
        ("c", [5] * (MAX_LEN + 1), GREEDY, "max_model_len"),
        ("c", [5, 6], {"temperature": 0}, "sampling_params"),
        ("a", [5, 6], GREEDY, "request_id 'a' is already in use"),
    ]
    for rid, ids, params, match in bad:
        with pytest.raises(RequestError, match=match):
            eng.add_request(rid, ids, params)
        state = (sorted(eng.scheduler.requests), [r.req_id for r in eng.scheduler.running], len(eng.scheduler.waiting))
        assert state == before
    assert "c" not in eng._requests
    # A failed id is not burned: a valid "c" can still be added, and everything completes.
    eng.add_request("c", prompts[0], GREEDY)
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"a", "b", "c"}
    assert done["a"].outputs[0].token_ids == expected[0]
    assert done["b"].outputs[0].token_ids == expected[1]
    assert done["c"].outputs[0].token_ids == expected[0]
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    assert_idle(llm)


# ---------------------------------------------------------------- no tokenizer


@pytest.fixture(scope="module")
def llm_no_tok(tmp_path_factory):
    path = make_hf_model(tmp_path_factory.mktemp("bad_input_notok") / "m", "llama", tokenizer=False)
    return LLM(str(path), dtype="float32", max_model_len=64)


def test_string_prompt_without_tokenizer(llm_no_tok):
    assert llm_no_tok.get_tokenizer() is None
    with pytest.raises(RequestError, match="tokenizer"):
        llm_no_tok.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="tokenizer"):
        llm_no_tok.generate([{"prompt_token_ids": [5, 6]}, "hello"], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="tokenizer"):
        llm_no_tok.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert_idle(llm_no_tok)
    # Token-id prompts still work without a tokenizer (no text, but tokens).
    (out,) = llm_no_tok.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


def test_bad_words_without_tokenizer(llm_no_tok):
    with pytest.raises(RequestError, match="bad_words_token_ids instead"):
        llm_no_tok.generate({"prompt_token_ids": [5, 6]}, GREEDY.clone(bad_words=["x"]), use_tqdm=False)
    out = llm_no_tok.generate({"prompt_token_ids": [5, 6]}, GREEDY.clone(bad_words_token_ids=[[7]]), use_tqdm=False)
    assert 7 not in out[0].outputs[0].token_ids


def test_numbers_past_a_floats_range_and_huge_n_are_request_errors():
    """(were a bare OverflowError, at once or mid-search, and n = 10**7 filled memory making sequences)"""
    from tandem.sampling_params import MAX_N, BeamSearchParams

    for kw, field in [(dict(logit_bias={5: 10**400}), "logit_bias"), (dict(logit_bias={5: -10**400}), "logit_bias"),
                      (dict(n=MAX_N + 1, temperature=1.0), "n"), (dict(temperature=10**400), "temperature")]:
        with pytest.raises(RequestError, match=f"SamplingParams.{field}="):
            SamplingParams(**kw)
    assert SamplingParams(n=MAX_N, temperature=1.0).n == MAX_N
    with pytest.raises(RequestError, match="BeamSearchParams.length_penalty="):
        BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=10**400)


def test_engine_add_request_takes_the_token_ids_generate_takes(llm, reference):
    """Engine.add_request (the streaming API) takes a numpy array, a tensor, numpy's integers, as LLM.generate
    does (they were bare ValueError / RuntimeError, or refused as not integers); other things by name."""
    from tandem.sampling_params import RequestOutputKind

    ids = reference[0][0]
    params = GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    for i, form in enumerate([np.array(ids), torch.tensor(ids), tuple(ids), [np.int64(t) for t in ids]]):
        llm.engine.add_request(f"forms-{i}", form, params)
        outs = []
        while llm.engine.has_unfinished_requests():
            outs += [o for o in llm.engine.step() if o.finished]
        assert outs[0].outputs[0].token_ids == reference[1][0], type(form)
    for bad, says in [((t for t in ids), "list of integers, got generator"), ([5.0, 6], r"integers in \[0")]:
        with pytest.raises(RequestError, match=says):
            llm.engine.add_request("bad-form", bad, params)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RequestError, match="'prompt' .* must be a string, got int"):
        llm.generate({"prompt_token_ids": ids, "prompt": 5}, GREEDY, use_tqdm=False)


def test_beam_search_checks_every_prompts_salt_first_and_a_callable_use_tqdm_makes_the_bar(llm, monkeypatch):
    from tandem.sampling_params import BeamSearchParams

    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9], "cache_salt": 5}]
    with pytest.raises(RequestError, match="cache_salt=5 must be a non-empty string"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=3), concurrency_limit=1)
    assert steps == []  # (the first prompt's whole search ran, then the second's salt was refused)
    made = []

    class Bar:
        def __init__(self, **kw):
            made.append(kw)

        def update(self, n):
            made.append(n)

        def close(self):
            made.append("closed")

    llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}], GREEDY, use_tqdm=Bar)
    assert made == [dict(total=2, desc="Processed prompts", dynamic_ncols=True), 1, 1, "closed"]


def test_config_dicts_with_keys_of_mixed_types_are_refused_by_name():
    """A Python caller's config dict with a non-string key beside string ones: each parser names the
    unknown keys (it sorted them, and str < int raised a TypeError)."""
    from tandem.config import parse_structured_outputs_config
    from tandem.models.source import check_generation_override
    from tandem.sampling.watermark import parse_watermark_config
    from tandem.spec.config import SpeculativeConfig

    for parse, config in [
        (lambda c: SpeculativeConfig.from_user(c, 128), {"model": "d", "num_speculative_tokens": 2}),
        (lambda c: parse_structured_outputs_config(c, None), {}),
        (check_generation_override, {"temperature": 0.5}),
        (parse_watermark_config, {"key": 42}),
    ]:
        with pytest.raises(ConfigError, match=re.escape("['zz', 1]")):
            parse({**config, 1: "x", "zz": "y"})
    from tandem.sampling_params import StructuredOutputsParams

    with pytest.raises(RequestError, match=re.escape("has no fields ['zz', 1]")):
        StructuredOutputsParams.from_dict({"json": {}, 1: "x", "zz": "y"})


def test_vllms_param_fields_tandem_does_not_take():
    """vLLM's SamplingParams / StructuredOutputsParams fields tandem lacks: at values that ask for nothing
    the params are as without them (clone keeps working); set, a RequestError says why (was a TypeError)."""
    from tandem.sampling_params import StructuredOutputsParams

    quiet = SamplingParams(n=2, best_of=2, logits_processors=[], guided_decoding=None, flat_logprobs=False)
    assert quiet == SamplingParams(n=2) and quiet.clone(temperature=0.5).temperature == 0.5
    assert StructuredOutputsParams(regex="a", disable_fallback=False, whitespace_pattern=None,
                                   structural_tag=None) == StructuredOutputsParams(regex="a")
    assert StructuredOutputsParams.from_dict({"regex": "a", "disable_fallback": False}).regex == "a"
    for make, says in [
        (lambda: SamplingParams(n=1, best_of=3), "SamplingParams.best_of=3 is not supported: n samples"),
        (lambda: SamplingParams(logits_processors=[print]), "no custom logits processors"),
        (lambda: SamplingParams(guided_decoding={"regex": "a"}), "pass the constraint as structured_outputs"),
        (lambda: SamplingParams(flat_logprobs=True), "flat_logprobs=True is not supported"),
        (lambda: StructuredOutputsParams(regex="a", whitespace_pattern=" "), "whitespace_pattern=' ' is not"),
        (lambda: StructuredOutputsParams(regex="a", structural_tag="{}"), "structural_tag='{}' is not supported"),
        (lambda: StructuredOutputsParams(regex="a", disable_fallback=True), "nothing to fall back from"),
    ]:
        with pytest.raises(RequestError, match=re.escape(says)):
            make()

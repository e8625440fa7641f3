"""Frozen engine configuration, built and validated once from the user's arguments.

Constructors receive only their section (`Scheduler(cfg.sched, cfg.cache)`), never the whole
EngineConfig. Values that depend on the loaded model or on memory profiling (num_blocks) are
filled in by the engine with dataclasses.replace, in one visible place.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.errors import ConfigError

logger = logging.getLogger("tandem")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ArchConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # frozen dict items, None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    sliding_window: int | None = None  # attention window in effect (Mistral's, or Qwen's when enabled)
    o_bias: bool = False  # o_proj has a bias (Llama's and Qwen3's attention_bias)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def max_positions(self) -> int:
        """The positions the model takes: max_position_embeddings, times the factor of linear RoPE
        scaling (vLLM's derived length; llama3's factor already stretches the trained length)."""
        scaling = self.rope_scaling_dict or {}
        if scaling.get("rope_type", scaling.get("type")) == "linear":
            return int(self.max_position_embeddings * scaling["factor"])
        return self.max_position_embeddings


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how: the resolved directory, shape, dtype and length limit."""

    path: str
    arch: ArchConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"  # "auto" | "dummy"
    seed: int = 0
    cpu_matmul: str = "auto"  # "auto" | "avx512bf16" | "avx512" | "avx2" | "fbgemm" | "torch": how bf16/fp16 linears run on CPU
    # "fp8": weight-only e4m3 linears (tandem/layers/quant.py). The target's (LLM(quantization="fp8"),
    # as vLLM's): its layers' linears, the LM head kept in the model dtype, and on a GPU the fp8 weights
    # alone. The draft's (speculative_config quantization): fp8_draft_layout, below.
    quantization: str | None = None
    # The draft's layout of fp8: the LM head rounded too, and on a GPU the model-dtype weights kept
    # beside the fp8 copies for the shapes cuBLAS runs faster (tandem/layers/gpu_linear.py).
    fp8_draft_layout: bool = False
    # Which distribution returned logprobs describe: "raw_logprobs" (the model's, as vLLM returns by
    # default) or "processed_logprobs" (after penalties, bias, temperature and truncation: the one sampled).
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask (-1: no cap), as vLLM
    # Tensor parallelism: the ranks sharing each layer (arch stays the checkpoint's whole shape;
    # each rank runs tandem.parallel.shard.shard_arch(arch, tp_size)).
    tp_size: int = 1
    # LLM(batch_invariant=True): a token's logits have the same bits whatever step computes it (decoded
    # alone or in a batch, verified among drafts, prefilled), on a GPU too (tandem/kernels/chunked_attention.py,
    # kernels/gemm_invariant.py); a CPU with tandem's C kernels computes that way already
    batch_invariant: bool = False


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, the memory budget, and (after profiling) the block count."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # None until the engine sizes the pool
    # "auto": K/V kept in the model's dtype; "fp8" (or "fp8_e4m3"): in float8 e4m3, saturated to
    # +-448 with no scale (vLLM's fp8 cache without calibrated scales), half the bytes a block
    cache_dtype: str = "auto"

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the K/V tensors of a model of model_dtype are kept in."""
        return torch.float8_e4m3fn if self.cache_dtype in ("fp8", "fp8_e4m3") else model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step and the limits of a batch."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    num_lookahead_tokens: int = 0  # KV slots reserved past the known tokens (k with a draft)
    # Plan and launch the next decode step before the current one's result reaches the host
    # (Scheduler.schedule_ahead), so host work overlaps device work. Target-only.
    async_scheduling: bool = False
    # "fcfs": requests run in arrival order; "priority": by Request.priority (lower first), then
    # arrival, and a waiting request preempts running ones of a strictly lower priority.
    scheduling_policy: str = "fcfs"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    sched: SchedulerConfig
    device: torch.device
    spec: Any = None  # tandem.spec.config.SpeculativeConfig, or None to run without a draft
    watermark: Any = None  # tandem.sampling.watermark.WatermarkConfig, or None: no keyed draws
    # a name of tandem.reasoning.REASONING_PARSERS: structured outputs hold from the end of the thinking
    reasoning_parser: str | None = None
    # vLLM's structured_outputs_config enable_in_reasoning: constraints hold from the first token,
    # the thinking too, whatever the reasoning parser (which still splits the reply)
    structured_outputs_in_reasoning: bool = False
    # vLLM's --per-request-spec-decode-metrics: "detailed" keeps each round's accepted and drafted
    # counts per request (RequestMetrics.per_step_*); the counts and histograms are always kept.
    per_request_spec_decode_metrics: str = "none"
    enforce_eager: bool = False  # no CUDA graphs for the target (the draft's: SpeculativeConfig.enforce_eager)
    max_cudagraph_tokens: int = 512  # the most tokens a piecewise graph of a mixed step captures (0: none)

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether the target's steps replay CUDA graphs (on a GPU, unless enforce_eager)."""
        return self.device.type == "cuda" and not self.enforce_eager


# What transformers' config classes take for a key config.json leaves out, where it is not the
# Llama default (num_key_value_heads = num_attention_heads, head_dim = hidden_size / heads, 2048
# positions): Mistral's, Qwen2's and Qwen3's own defaults.
ARCH_DEFAULTS: dict[str, dict[str, int]] = {
    "MistralForCausalLM": {"num_key_value_heads": 8, "max_position_embeddings": 131072},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128},
}
DEFAULT_WINDOW = 4096  # transformers' Mistral / Qwen2 / Qwen3 sliding_window when config.json leaves it out
QWEN_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2 / Qwen3 max_window_layers: the first layer that slides
# Supported rope_scaling types -> the keys each needs (numbers, read by tandem/layers/rotary.py).
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


MAX_ROPE_FACTOR = 1024  # a rope_scaling factor beyond this stretches positions past any context served


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def read_json(path: Path, field: str):
    """A model file's JSON (config.json, generation_config.json); a ConfigError naming field and path when it cannot
    be read (a directory, no permission, a pipe, which would block until a writer came) or parsed."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ConfigError(f"{field}: {path} is not a regular file (a pipe or a device); make it a readable file")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{field}: {path} is not valid JSON ({e})") from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"{field}: {path} could not be read ({e.strerror or e}); make it a readable file") from None


def read_arch_config(model_dir: str | os.PathLike, field: str = "model", overrides: dict | None = None) -> ArchConfig:
    """Parse config.json into an ArchConfig, refusing architectures we do not implement and
    missing or malformed fields (named, with the file). field: the setting that named the model,
    which the errors name; overrides: keys set over the file's (vLLM's hf_overrides, a shallow update;
    an error then names them too)."""
    if not overrides:
        return _read_arch_config(model_dir, field)
    try:
        return _read_arch_config(model_dir, field, overrides)
    except ConfigError as e:
        raise ConfigError(f"{e} (config.json as hf_overrides={overrides!r} sets it)") from None


def _read_arch_config(model_dir: str | os.PathLike, field: str = "model", overrides: dict | None = None) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"{field}: {model_dir} has no config.json; pass a Hugging Face model directory")
    raw = read_json(path, field)
    if not isinstance(raw, dict):
        raise ConfigError(f"{field}: {path} holds a {type(raw).__name__}, not a JSON object of settings")
    raw.update(overrides or {})
    archs = raw.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) if isinstance(archs, list) else None
    if arch is None:
        raise ConfigError(
            f"{field}: architecture {archs or '(none given)'} in {path} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if raw.get("mlp_bias"):
        raise ConfigError(f"{field}: mlp_bias=True in {path} is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":  # the MLP's kernels are SiLU-and-multiply
        raise ConfigError(f"{field}: hidden_act={act!r} in {path} is not supported (tandem's MLP is SwiGLU: 'silu')")
    attention_bias = raw.get("attention_bias", False)
    if not isinstance(attention_bias, bool):
        raise ConfigError(f"{field}: attention_bias={attention_bias!r} in {path} must be true or false")
    quantized = raw.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "unnamed") if isinstance(quantized, dict) else quantized
        raise ConfigError(f"{field}: {path} is a quantized checkpoint (quantization_config, quant_method {method!r}), "
                          "which tandem does not load; use the unquantized model (quantization='fp8' rounds its "
                          "linear layers to float8 e4m3 on load)")

    def count(key: str, default=None) -> int:
        """A positive integer setting (required when default is None)."""
        value = raw.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"{field}: {path} lacks {key!r}, which the model's shape needs")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{field}: {key}={value!r} in {path} must be a positive integer")
        return value

    num_heads = count("num_attention_heads")
    hidden = count("hidden_size")
    defaults = ARCH_DEFAULTS.get(arch, {})
    if "head_dim" not in raw and "head_dim" in defaults:
        head_dim = defaults["head_dim"]
    else:
        head_dim = count("head_dim", hidden // num_heads) if raw.get("head_dim") else hidden // num_heads
    if head_dim < 1:
        raise ConfigError(f"{field}: hidden_size={hidden} over num_attention_heads={num_heads} in {path} leaves no "
                          "head_dim")
    if head_dim % 2:
        raise ConfigError(f"{field}: head_dim={head_dim} in {path} (given, or hidden_size={hidden} over "
                          f"num_attention_heads={num_heads}) is odd; rotary embeddings rotate pairs of dimensions")
    # An explicit null means one KV head a query head (transformers' rule); the architecture's
    # default is for a config.json that leaves the key out.
    num_kv_heads = count("num_key_value_heads", num_heads if "num_key_value_heads" in raw
                         else defaults.get("num_key_value_heads", num_heads))
    if num_heads % num_kv_heads:
        raise ConfigError(f"{field}: num_attention_heads={num_heads} in {path} is not a multiple of "
                          f"num_key_value_heads={num_kv_heads}")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{field}: rope_scaling={rope!r} in {path} must be an object")
    rope = dict(rope)
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:  # transformers 5's per-layer-type form ({"full_attention": {...}, ...}): read flat, it loses them
        raise ConfigError(f"{field}: rope parameters per layer type ({', '.join(map(repr, nested))}) in {path} are not "
                          "supported; this model has one kind of attention layer")
    for partial in (raw.get("partial_rotary_factor"), rope.get("partial_rotary_factor")):
        if partial is not None and partial != 1:
            raise ConfigError(f"{field}: partial_rotary_factor={partial!r} in {path}: partial rotary embeddings are "
                              "not supported (every head dimension is rotated)")
    # The rope dict's rope_theta wins over a top-level one, as in transformers 5 (which keeps it in rope_parameters);
    # a rope_scaling without one takes the top level's, as transformers does, else (transformers 5's checkpoints:
    # no top-level key) rope_parameters' where transformers would take 10000 (an hf_overrides rope_scaling on
    # such a checkpoint: transformers' config object raises there). An hf_overrides rope_theta wins over them all:
    # the user asked for it (transformers 5 would keep rope_parameters' and drop it silently).
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    rope_theta = next((d["rope_theta"] for d in (overrides or {}, rope, raw, params) if "rope_theta" in d), 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{field}: rope_scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    if rope_type == "llama3":  # a top-level original length wins, and max_position_embeddings stands in (transformers)
        original = raw.get("original_max_position_embeddings")
        if original is not None:
            rope["original_max_position_embeddings"] = original
        elif "original_max_position_embeddings" not in rope and _positive_number(raw.get("max_position_embeddings")):
            rope["original_max_position_embeddings"] = raw["max_position_embeddings"]
    for key in ROPE_TYPES[rope_type]:
        if not _positive_number(rope.get(key)):
            raise ConfigError(f"{field}: rope_scaling of type {rope_type!r} in {path} needs a positive number "
                              f"{key!r}, got {rope.get(key)!r}")
    if "factor" in ROPE_TYPES[rope_type] and not 1 <= rope["factor"] <= MAX_ROPE_FACTOR:  # (transformers: >= 1)
        raise ConfigError(f"{field}: rope_scaling factor={rope['factor']!r} in {path} must be in "
                          f"[1, {MAX_ROPE_FACTOR}] (it stretches the trained positions)")
    if not _positive_number(rope_theta):
        raise ConfigError(f"{field}: rope_theta={rope_theta!r} in {path} must be a positive number")
    rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
    if not _positive_number(rms_norm_eps):
        raise ConfigError(f"{field}: rms_norm_eps={rms_norm_eps!r} in {path} must be a positive number")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{field}: tie_word_embeddings={tie!r} in {path} must be true or false")
    scaling = None if rope_type == "default" else tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta"))
    eos_ids = token_ids_setting(raw.get("eos_token_id"), f"{field}: eos_token_id", path)
    # Qwen2 has q/k/v biases always; attention_bias gives Llama and Qwen3 q/k/v and o biases (as
    # transformers builds them); Mistral's attention has none.
    qkv_bias = arch == "Qwen2ForCausalLM" or (attention_bias and arch != "MistralForCausalLM")
    o_bias = attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
    # Mistral applies sliding_window when set (absent: transformers' default, 4096; null: none);
    # Qwen2/3 configs carry one (absent: 4096) that applies only with use_sliding_window, and then
    # only to the layers from max_window_layers (absent: 28) on, or those layer_types names.
    if arch == "MistralForCausalLM":
        window = raw.get("sliding_window", DEFAULT_WINDOW)
    elif raw.get("use_sliding_window"):
        layer_types = raw.get("layer_types")
        if isinstance(layer_types, list):
            slides = "sliding_attention" in layer_types
        else:
            first = raw.get("max_window_layers")
            slides = count("num_hidden_layers") > (first if isinstance(first, int) else QWEN_MAX_WINDOW_LAYERS)
        window = raw.get("sliding_window", DEFAULT_WINDOW) if slides else None
    else:
        window = None
    return ArchConfig(
        architecture=arch,
        vocab_size=count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=count("intermediate_size"),
        num_layers=count("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(rms_norm_eps),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=count("max_position_embeddings", defaults.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tie,
        qkv_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        sliding_window=count("sliding_window", window) if window is not None else None,
        o_bias=o_bias,
    )


def token_ids_setting(value, what: str, path) -> tuple[int, ...]:
    """A config file's token id or list of ids (eos_token_id) -> a tuple; ConfigError for anything else."""
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
    if bad is not None:
        raise ConfigError(f"{what}={value!r} in {path} must be a token id (a non-negative integer) or a list of them")
    return tuple(ids)


STRUCTURED_OUTPUTS_KEYS = ("backend", "enable_in_reasoning", "reasoning_parser")
# vLLM's other structured_outputs_config keys -> (their defaults, what to do instead), as
# tandem.engine.vllm_args' table: at what asks for nothing they pass (a config written out for vLLM loads)
STRUCTURED_OUTPUTS_VLLM_KEYS = {
    "disable_fallback": ((), "llguidance is the one backend, so there is nothing to fall back from"),
    "disable_any_whitespace": ((), "set it per request (StructuredOutputsParams / the server's structured_outputs "
                                   "field)"),
    "disable_additional_properties": ((), "set it per request (StructuredOutputsParams / the server's "
                                          "structured_outputs field)"),
    "reasoning_parser_plugin": (("",), "tandem loads no parser plugins; reasoning_parser names its built-in ones"),
}


def parse_structured_outputs_config(config: dict | None, reasoning_parser: str | None) -> tuple[str | None, bool]:
    """vLLM's structured_outputs_config (its keys that mean something here) -> (the reasoning
    parser, whether constraints hold in the thinking too). backend: tandem's is llguidance
    ("guidance"; "auto" picks it)."""
    if config is None:
        return reasoning_parser, False
    if not isinstance(config, dict):
        raise ConfigError(f"structured_outputs_config={config!r} must be a dict, e.g. {{'enable_in_reasoning': True}}")
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_KEYS) - set(STRUCTURED_OUTPUTS_VLLM_KEYS), key=repr)
    if unknown:
        raise ConfigError(f"structured_outputs_config has unknown keys {unknown}; known keys: "
                          f"{list(STRUCTURED_OUTPUTS_KEYS)}")
    from tandem.engine.vllm_args import check_vllm_only

    check_vllm_only(config, STRUCTURED_OUTPUTS_VLLM_KEYS, prefix="structured_outputs_config.")
    if config.get("backend", "auto") not in ("auto", "guidance"):
        raise ConfigError(f"structured_outputs_config.backend={config['backend']!r} is not supported: tandem's "
                          "structured outputs run on llguidance; use 'guidance' or 'auto'")
    in_reasoning = config.get("enable_in_reasoning", False)
    if not isinstance(in_reasoning, bool):
        raise ConfigError(f"structured_outputs_config.enable_in_reasoning={in_reasoning!r} must be True or False")
    parser = config.get("reasoning_parser") or None  # (vLLM's default: "", no parser)
    if parser is not None and reasoning_parser is not None and parser != reasoning_parser:
        raise ConfigError(f"structured_outputs_config.reasoning_parser={parser!r} differs from reasoning_parser="
                          f"{reasoning_parser!r}; give one")
    return reasoning_parser if parser is None else parser, in_reasoning


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a device; use 'auto', 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"device={device!r} but {n} CUDA device(s) are visible here (cuda:0 .. cuda:{n - 1}); "
                          "pick one of those (CUDA_VISIBLE_DEVICES decides which GPUs they are)")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    return dev


def check_device_support(arch: ArchConfig, device: torch.device, field_name: str = "model") -> None:
    """Refuse a model shape that the device's kernels do not take (CUDA: the Triton attention and
    projection kernels need a head_dim that is a multiple of 8, from 16 to 256)."""
    d = arch.head_dim
    if device.type == "cuda" and (d % 8 or not 16 <= d <= 256):
        raise ConfigError(
            f"{field_name}: head_dim={d} is not supported on CUDA (its kernels take a multiple of 8 from 16 to "
            f"256); run it with device='cpu'"
        )


def check_dtype_name(dtype: str | torch.dtype, field_name: str = "dtype") -> None:
    """Refuse a dtype no model can take, before anything is fetched or converted for it."""
    if isinstance(dtype, torch.dtype):
        ok = dtype in (torch.float32, torch.bfloat16, torch.float16)
    else:
        ok = isinstance(dtype, str) and (dtype == "auto" or dtype in DTYPE_NAMES)
    if not ok:
        raise ConfigError(f"{field_name}={dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'")


def half_dtype(device: torch.device | None) -> torch.dtype:
    """The half dtype 'auto' runs in where the checkpoint's cannot: bfloat16, or float16 on a GPU without it."""
    no_bf16 = device is not None and device.type == "cuda" and not torch.cuda.is_bf16_supported()
    return torch.float16 if no_bf16 else torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype, arch: ArchConfig, device: torch.device,
                  field_name: str = "dtype") -> torch.dtype:
    """'auto' takes the checkpoint's half dtype (float16 becomes bfloat16 on CPU, where it is slow, and
    bfloat16 becomes float16 on a GPU without it); a float32 checkpoint, or one that names no dtype, runs in
    bfloat16 (float16 on a GPU without bfloat16), as vLLM's 'auto' does: half the memory and twice the
    speed of float32 for the same weights; dtype='float32' keeps them."""
    check_dtype_name(dtype, field_name)
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = DTYPE_NAMES.get(str(arch.torch_dtype).replace("torch.", ""), torch.float32)
        if resolved == torch.float32:
            resolved = half_dtype(device)
            logger.info("%s='auto': the float32 checkpoint runs in %s (as vLLM's 'auto'); %s='float32' keeps "
                        "float32", field_name, str(resolved).removeprefix("torch."), field_name)
        if resolved == torch.float16 and device.type == "cpu":
            resolved = torch.bfloat16
        if resolved == torch.bfloat16 and half_dtype(device) == torch.float16:
            resolved = torch.float16
            logger.info("%s='auto': this GPU has no bfloat16, so the bfloat16 checkpoint runs in float16 (as vLLM's "
                        "'auto')", field_name)
    else:
        resolved = DTYPE_NAMES[dtype]
    if resolved == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{field_name}='bfloat16' is not supported by this GPU; use {field_name}='float16'")
    return resolved


def resolve_max_model_len(requested: int | None, arch: ArchConfig, field_name: str = "max_model_len") -> int:
    """The context length: at most the model's positions (`ArchConfig.max_positions`), and at most
    its attention window (sliding-window attention is not implemented; within the window it changes nothing)."""
    limit = arch.max_positions
    window = arch.sliding_window
    if requested is None:
        if window is not None and window < limit:
            logger.warning("%s defaults to the model's sliding_window=%d (sliding-window attention is not "
                           "implemented; within the window it changes nothing)", field_name, window)
            return window
        return limit
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ConfigError(f"{field_name}={requested!r} must be a positive integer")
    if window is not None and requested > window:
        raise ConfigError(
            f"{field_name}={requested} exceeds the model's sliding_window={window}: sliding-window attention is not "
            f"supported, so tokens past the window would attend to too much; use {field_name}<={window}"
        )
    if requested > limit:
        raise ConfigError(
            f"{field_name}={requested} exceeds the model's max_position_embeddings={arch.max_position_embeddings}"
            + ("" if limit == arch.max_position_embeddings else f" (times the linear rope factor: {limit})") + "; "
            f"use {field_name}<={limit}"
        )
    return requested

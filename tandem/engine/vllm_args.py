"""vLLM's LLM() / EngineArgs arguments that tandem does not take.

Each passes at a value that asks for nothing: None, False, 0, an empty container (or a mapping of
counts all 0), or one of the values listed for it (vLLM's defaults, "auto" where vLLM has it), so a
call written for vLLM with its defaults spelled out runs. Set to anything else it is a ConfigError
that says why tandem does not take it and what to do instead. An argument this table does not know
stays "not an argument tandem takes" (LLM.__init__).
"""
from __future__ import annotations

from typing import Any

from tandem.errors import ConfigError

_HUB = "tandem loads a local folder, a GGUF file, a known name or a hub id's current files"
_TEXT = "tandem runs text-only models"
_LORA = "tandem serves no LoRA adapters"
_GRAPHS = ("tandem captures its own CUDA graphs (decode and verification steps by batch size, mixed steps "
           "piecewise): enforce_eager turns them off, max_cudagraph_tokens bounds the mixed steps'")
_TASK = "tandem generates text only (no pooling, embedding, classification or scoring)"
_SCHED = "tandem's scheduler chunks prompts by max_num_batched_tokens alone"
_ONE_ENGINE = "tandem runs one engine a process; start one per GPU group instead"

# name -> (vLLM's defaults, beyond the values that ask for nothing; why tandem does not take it)
VLLM_ONLY_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "revision": (("main",), _HUB),
    "tokenizer_revision": ((), _HUB),
    "code_revision": ((), "tandem runs no checkpoint code"),
    "hf_token": ((True,), "set HF_TOKEN in the environment (or log in) for a hub id's gated files"),
    "hf_config_path": ((), "config.json is read from the model's folder; hf_overrides sets its keys"),
    "config_format": (("auto", "hf"), "tandem reads config.json or a GGUF file's metadata, whichever the model has"),
    "skip_tokenizer_init": ((), "tandem detokenizes every output, so it needs the tokenizer"),
    "task": (("auto", "generate"), _TASK),
    "runner": (("auto", "generate"), _TASK),
    "convert": (("auto", "none"), _TASK),
    "pooler_config": ((), _TASK),
    "override_pooler_config": ((), _TASK),
    "model_impl": (("auto", "vllm"), "tandem runs its own model code (Llama, Mistral, Qwen2, Qwen3)"),
    "served_model_name": ((), "the server's --served-model-name names the model"),
    "enable_lora": ((), _LORA),
    "max_loras": ((1,), _LORA),
    "max_lora_rank": ((16,), _LORA),
    "max_cpu_loras": ((), _LORA),
    "fully_sharded_loras": ((), _LORA),
    "lora_dtype": (("auto",), _LORA),
    "limit_mm_per_prompt": ((), _TEXT),
    "mm_processor_kwargs": ((), _TEXT),
    "enable_multimodal_encoder_data_parallel": ((), _TEXT),
    "allowed_local_media_path": (("",), _TEXT),
    "allowed_media_domains": ((), _TEXT),
    "enable_prompt_embeds": ((), "prompts are text or token ids"),
    "data_parallel_size": ((1,), _ONE_ENGINE),
    "enable_expert_parallel": ((), "tandem runs dense models only"),
    "enable_return_routed_experts": ((), "tandem runs dense models only"),
    "decode_context_parallel_size": ((1,), "tandem splits a model across GPUs by tensor_parallel_size alone"),
    "cpu_offload_gb": ((), "tandem keeps every weight on the device; a smaller max_model_len or "
                           "quantization='fp8' leaves more room"),
    "enable_sleep_mode": ((), "tandem keeps its weights and KV cache for the engine's life"),
    "kv_transfer_config": ((), "tandem does not disaggregate prefill from decode"),
    "kv_events_config": ((), "tandem publishes no KV cache events"),
    "calculate_kv_scales": ((), "tandem's fp8 KV cache stores e4m3 saturated at +-448, with no scales"),
    "compilation_config": ((), _GRAPHS),
    "cuda_graph_sizes": (([512],), _GRAPHS),
    "max_seq_len_to_capture": ((8192,), _GRAPHS),
    "attention_backend": (("auto",), "tandem picks its attention kernels itself (Triton on a GPU, C or torch on a "
                                     "CPU)"),
    "attention_config": ((), "tandem picks its attention kernels itself (Triton on a GPU, C or torch on a CPU)"),
    "profiler_config": ((), "profile with torch.profiler around LLM.generate instead"),
    "disable_async_output_proc": ((True,), "outputs are processed as each step's result is collected"),
    "preemption_mode": (("recompute",), "a preemption recomputes the request (no swap)"),
    "num_scheduler_steps": ((1,), "every step is scheduled on its own (async_scheduling overlaps the host's work)"),
    "max_num_partial_prefills": ((1,), _SCHED),
    "max_long_partial_prefills": ((1,), _SCHED),
    "long_prefill_token_threshold": ((), _SCHED),
    "rope_scaling": ((), "pass it in hf_overrides ({'rope_scaling': ...})"),
    "rope_theta": ((), "pass it in hf_overrides ({'rope_theta': ...})"),
    "logits_processors": ((), "tandem runs no custom logits processors; SamplingParams' logit_bias, "
                              "allowed_token_ids, bad_words and min_tokens shape the logits"),
    "guided_decoding_backend": (("auto", "guidance", "llguidance"), "structured outputs run on llguidance "
                                                                    "(structured_outputs_config's backend)"),
    # (either value passes: the offline LLM logs no requests; the server's --enable-log-requests does)
    "enable_log_requests": ((True,), "the server logs requests (tandem serve --enable-log-requests)"),
    "disable_log_requests": ((True,), "the server logs requests (tandem serve --enable-log-requests)"),
    "use_tqdm_on_load": ((True,), "tandem shows no per-file loading bar"),
    "disable_cascade_attn": ((True,), "tandem has no cascade attention to turn off"),
    "disable_sliding_window": ((True,), "tandem runs no sliding window (max_model_len stays within it)"),
}


def _asks_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    if value is None or value is False or any(type(value) is type(d) and value == d for d in defaults):
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return True
    if isinstance(value, dict):  # (limit_mm_per_prompt={"image": 0}: vLLM's "no images")
        return all(isinstance(v, int) and not isinstance(v, bool) and v == 0 for v in value.values())
    return isinstance(value, (list, tuple)) and not value


def check_vllm_only(args: dict[str, Any], table: dict[str, tuple[tuple[Any, ...], str]] = VLLM_ONLY_ARGS,
                    prefix: str = "", then: str = "; leave it out") -> dict[str, Any]:
    """args: arguments (LLM()'s it does not have; a speculative_config dict with its own table). -> those
    the table does not name; one it names that asks for something is a ConfigError saying why (prefix
    before its name, then after the why), one that does not is dropped."""
    rest = {}
    for name, value in args.items():
        if name not in table:
            rest[name] = value
            continue
        defaults, why = table[name]
        if not _asks_nothing(value, defaults):
            raise ConfigError(f"{prefix}{name}={value!r} is not supported: {why}{then}")
    return rest

"""SpeculatorFactory: load and check the draft model, then build the DraftSpeculator.

Checks at start-up: the draft's tokenizer maps tokens to ids exactly as the target's does;
embedding tables may be padded to different sizes (sampling and verification use the
shared part); the draft's context covers the target's max_model_len.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from tandem.config import (CacheConfig, ModelConfig, SchedulerConfig, check_device_support, read_arch_config,
                           resolve_dtype)
from tandem.errors import ConfigError
from tandem.models.decoder import KVCache
from tandem.models.loader import load_model
from tandem.models.source import load_tokenizer, resolve_model_dir
from tandem.parallel.group import TPGroup
from tandem.parallel.shard import check_shardable, shard_arch
from tandem.spec.config import SpeculativeConfig
from tandem.spec.hot_vocab import hot_token_ids
from tandem.spec.speculator import DraftSpeculator

logger = logging.getLogger("tandem")


class SpeculatorFactory:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, target_tokenizer, device: torch.device,
                 tp: TPGroup | None = None, eos_token_ids: tuple[int, ...] | None = None,
                 download_dir: str | None = None):
        """tp: the target's tensor-parallel group; the draft is sharded over it as well, or whole on
        every rank when speculative_config.draft_tensor_parallel_size is 1. eos_token_ids: the
        engine's (None: the target config's), kept in a pruned draft head. download_dir: where a draft
        named by a known name, a GGUF file or a hub id is fetched and converted (LLM's)."""
        self.spec = spec
        self.device = device
        draft_dir = resolve_model_dir(spec.model, spec.dtype if spec.dtype != "auto" else target.dtype,
                                      "speculative_config.model", weights=spec.draft_load_format != "dummy",
                                      cache_dir=download_dir)
        arch = read_arch_config(draft_dir, "speculative_config.model")
        check_device_support(arch, device, "speculative_config.model")
        dtype = target.dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, arch, device,
                                                                        "speculative_config.dtype")
        max_len = spec.max_model_len or target.max_model_len
        if max_len < target.max_model_len:
            raise ConfigError(
                f"speculative_config.max_model_len={max_len} is below the target's max_model_len="
                f"{target.max_model_len}; a shorter draft context is not supported: lower max_model_len to {max_len}"
            )
        # Both limits in one error, so that following its advice once is enough.
        limits = [f"{arch.max_positions} positions"] + (
            [f"sliding_window={arch.sliding_window} (sliding-window attention is not supported)"]
            if arch.sliding_window is not None else [])
        limit = min(arch.max_positions, arch.sliding_window or arch.max_positions)
        if limit < max_len:
            raise ConfigError(
                f"the draft model {spec.model!r} supports {' and '.join(limits)}, fewer than max_model_len={max_len}; "
                f"lower max_model_len to {limit}"
            )
        self._check_vocab(target, target_tokenizer, draft_dir, arch)
        draft_tp = tp if tp is not None and spec.draft_tensor_parallel_size != 1 else None
        if draft_tp is not None:
            try:
                check_shardable(arch, draft_tp.size, "tensor_parallel_size", f"the draft model {spec.model!r}")
            except ConfigError as e:
                raise ConfigError(f"{e}; or set speculative_config.draft_tensor_parallel_size=1 (the whole draft on "
                                  f"each of the {draft_tp.size} ranks)") from None
        shared = min(target.arch.vocab_size, arch.vocab_size)
        self.hot_ids = hot_token_ids(spec.draft_vocab_size, spec.draft_token_map, shared, target_tokenizer,
                                     eos_token_ids if eos_token_ids is not None else target.arch.eos_token_ids)
        if self.hot_ids is not None and draft_tp is not None:
            raise ConfigError(
                "speculative_config.draft_vocab_size / draft_token_map prune the draft's LM head, which is not "
                f"sharded: set speculative_config.draft_tensor_parallel_size=1 (the whole draft on each of the "
                f"{draft_tp.size} ranks), or leave the draft's vocabulary whole"
            )
        if self.hot_ids is not None:
            logger.info("the draft scores %d of %d token ids (its LM head pruned to them)", len(self.hot_ids), shared)
        # batch_invariant: greedy drafts' numerics move acceptance, never the output (each token is the target's
        # argmax, or its seeded sample by coupling), so the draft keeps the fast linears and attention
        # (AttnBackend.fast); a probabilistic draft's probabilities pick which seeded token the rejection sampler
        # keeps, so it computes batch-invariantly too
        invariant = target.batch_invariant and spec.draft_sample_method == "probabilistic"
        if invariant and spec.num_speculative_tokens_per_batch_size is not None:
            raise ConfigError(
                "batch_invariant=True with draft_sample_method='probabilistic' needs one k for every step: "
                f"num_speculative_tokens_per_batch_size={spec.num_speculative_tokens_per_batch_size!r} drafts by the "
                "batch, and where a probabilistic draft's round ends picks another seeded token; leave it unset, or "
                "use greedy drafts (their output does not depend on k)"
            )
        if invariant and dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(
                f"batch_invariant=True with draft_sample_method='probabilistic' runs the draft batch-invariantly too, "
                f"which needs it in bfloat16 or float16 (speculative_config.dtype={spec.dtype!r} gives "
                f"{str(dtype).removeprefix('torch.')}): set speculative_config.dtype to 'auto' or 'bfloat16', or use "
                "greedy drafts"
            )
        self.draft_cfg = ModelConfig(str(draft_dir), arch, dtype, max_len, spec.draft_load_format, spec.seed,
                                     target.cpu_matmul, spec.quantization, fp8_draft_layout=True,
                                     tp_size=draft_tp.size if draft_tp is not None else 1, batch_invariant=invariant)
        self.model = load_model(self.draft_cfg, device, "speculative_config.model", "speculative_config.dtype",
                                tp=draft_tp, head_ids=self.hot_ids)
        if spec.rejection_sample_method == "block" and spec.draft_sample_method == "greedy":
            logger.info("rejection_sample_method='block' gains only with probabilistic drafts: greedy drafts are "
                        "verified by the standard (coupled) test, which keeps target-only's seeded tokens")
        if spec.synthetic:
            logger.warning(
                "speculative decoding runs with rejection_sample_method='synthetic' (acceptance rates %s): "
                "outputs are NOT distributed as the target model's; use it for benchmarks only",
                list(spec.synthetic_acceptance_rates),
            )

    def _check_vocab(self, target: ModelConfig, target_tok, draft_dir, arch) -> None:
        """The draft must share the target's token-to-id map; its embedding table may differ in size
        by padding rows past the tokenizer's tokens (Qwen2.5's 0.5B / 1.5B pad to 151936 rows, its 7B
        and larger to 152064): the target keeps its whole vocabulary, the draft gives the rows it
        lacks probability zero (DraftSpeculator). A GGUF's padding placeholders beside a Hugging Face
        tokenizer of the same family are no difference (_real_differences)."""
        t_size, d_size = target.arch.vocab_size, arch.vocab_size
        shared = min(t_size, d_size)
        # Byte-identical tokenizer files mean the same token-to-id map: skip loading it again.
        draft_tok = target_tok if _same_tokenizer_files(target.path, draft_dir) else load_tokenizer(draft_dir)
        names = f"target {target.path!r} and draft {self.spec.model!r}"
        if target_tok is not None and draft_tok is not None:
            t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
            diff = _real_differences(t_vocab, d_vocab)[:3] if t_vocab != d_vocab else []
            if diff:
                raise ConfigError(
                    f"the tokenizers of {names} differ ({len(t_vocab)} vs {len(d_vocab)} tokens; e.g. "
                    f"{diff}); the draft must share the target's token-to-id map"
                )
        tok = target_tok or draft_tok
        if tok is not None and len(tok) > shared:
            raise ConfigError(
                f"{names}: the tokenizer has {len(tok)} tokens but the smaller embedding table has only "
                f"{shared} rows ({t_size} vs {d_size}); the draft cannot score every token"
            )
        if tok is None and t_size != d_size:
            raise ConfigError(
                f"{names} have different vocabulary sizes ({t_size} vs {d_size}) and no tokenizer to prove "
                "the shared part matches"
            )

    def kv_bytes_per_block(self, cache: CacheConfig) -> int:
        return KVCache.bytes_per_block(shard_arch(self.draft_cfg.arch, self.draft_cfg.tp_size), cache.block_size,
                                       cache.kv_dtype(self.draft_cfg.dtype))

    def build(self, cache: CacheConfig, sched: SchedulerConfig, runner) -> DraftSpeculator:
        return DraftSpeculator(
            self.spec, self.draft_cfg, self.model, cache, sched, runner.state, self.device, runner.attn_backend,
            self.hot_ids,
        )


_PLACEHOLDER = re.compile(r"\[PAD\d+\]")


def _real_differences(a: dict[str, int], b: dict[str, int]) -> list[tuple[str, int]]:
    """The (token, id) pairs one token-to-id map has and the other lacks, less llama.cpp's padding
    placeholders ("[PAD<id>]" at an id the other map does not use: its converter fills a GGUF's
    vocabulary up to the embedding rows so, where the Hugging Face tokenizer of the same model
    stops at its last real token)."""
    a_ids, b_ids = set(a.values()), set(b.values())
    return sorted((tok, i) for tok, i in set(a.items()) ^ set(b.items())
                  if not (_PLACEHOLDER.fullmatch(tok) and (i in a_ids) != (i in b_ids)))


def _same_tokenizer_files(a, b) -> bool:
    """Same tokenizer.json bytes and the same added tokens: the token-to-id maps are equal
    (other tokenizer_config fields, such as model_max_length, do not change ids)."""
    a, b = Path(a), Path(b)
    ta, tb = a / "tokenizer.json", b / "tokenizer.json"
    if not ta.is_file() or not tb.is_file() or ta.read_bytes() != tb.read_bytes():
        return False
    if (a / "added_tokens.json").exists() or (b / "added_tokens.json").exists():
        return False

    def added(path: Path):
        cfg = path / "tokenizer_config.json"
        data = json.loads(cfg.read_text()) if cfg.is_file() else {}
        return data.get("added_tokens_decoder"), data.get("additional_special_tokens")

    try:
        return added(a) == added(b)
    except (OSError, ValueError):
        return False

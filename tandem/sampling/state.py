"""SamplingState: per-slot sampling parameters on the device, plus host mirrors for decisions.

Rows of a step gather their parameters through slot ids. Host mirrors (`params[slot]`) let the
sampler decide which optional stages to run without reading device memory.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.plan import NewReq
from tandem.upload import Uploader
from tandem.sampling.watermark import WatermarkConfig, WatermarkState
from tandem.sampling_params import FLOAT32_MAX, MIN_TEMPERATURE, SamplingParams


# A bias at or below this bans its token as -inf does (no temperature leaves it a chance), and divided by a
# temperature (>= MIN_TEMPERATURE) it may reach -inf anyway: it is taken as -inf, so that a row such biases
# empty ends the output (processors._end_if_empty) rather than drawing token 0.
_BANNING_BIAS = -FLOAT32_MAX * MIN_TEMPERATURE / 2

# A bias above this lifts its token where a temperature (>= MIN_TEMPERATURE) takes it past 1e8, whose fp32
# spacing (8) swamps the Gumbel noise (two such tokens would not be drawn evenly), or to inf (a NaN softmax):
# rows of such a slot are shifted by their maximum before the division (processors.divide_by_temperature).
_SHIFTING_BIAS = 1e6
# The raw logits of the models served stay below this: a repetition penalty p < 1 lifts a seen token's positive
# logit (its bias added) to (logit + bias) / p, so a slot whose (_LOGIT_BOUND + bias) / p passes _SHIFTING_BIAS is
# shifted too.
_LOGIT_BOUND = 1e3

# The fp32 per-slot parameters (attribute names of both SamplingParams and SamplingState).
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _float_bits(values: list[float]) -> list[int]:
    """Floats as the int64 bit patterns of their float64 values (the uploader moves int64)."""
    return torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()


def _from_bits(t: Tensor) -> Tensor:
    """_float_bits' values, uploaded -> fp32 (the rounding `buf[slot] = value` applies)."""
    return t.view(torch.float64).to(torch.float32)


def uses_processors(params: SamplingParams) -> bool:
    """Whether a request asks for any stage of processors.apply_logits_processors."""
    return steers(params) or params.has_penalties


def steers(params: SamplingParams) -> bool:
    """Whether a request asks for a processor that rules tokens in or out or moves them by a bias
    (allowed ids, bad words, logit bias, min_tokens): the ones its drafts follow too."""
    return bool(params.allowed_token_ids or params.bad_words_token_ids or params.logit_bias or params.min_tokens)


class SamplingState:
    """Fixed [max_num_seqs] buffers indexed by slot; penalty counts only for slots that use them."""

    def __init__(self, max_num_seqs: int, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 use_triton: bool = False, upload: Uploader | None = None, watermark: WatermarkConfig | None = None,
                 max_model_len: int = 2048):
        self.vocab_size = vocab_size
        self.device = device
        # Host index lists reach the device through the runner's pinned uploader: a plain
        # torch.tensor(list, device="cuda") would wait for all queued GPU work (a hidden sync).
        self.upload = upload or Uploader(device)
        self.use_triton = use_triton  # Triton sampling kernels (CUDA), else the torch reference
        self.eos_token_ids = eos_token_ids
        s = max_num_seqs
        self.temperature = torch.zeros(s, dtype=torch.float32, device=device)  # [max_num_seqs]
        self.top_k = torch.zeros(s, dtype=torch.int64, device=device)  # 0 = off
        self.top_p = torch.ones(s, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(s, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(s, dtype=torch.int64, device=device)
        self.repetition_penalty = torch.ones(s, dtype=torch.float32, device=device)
        self.frequency_penalty = torch.zeros(s, dtype=torch.float32, device=device)
        self.presence_penalty = torch.zeros(s, dtype=torch.float32, device=device)
        self.params: list[SamplingParams | None] = [None] * s  # host mirror
        self.seeds_cpu = [0] * s
        self.allowed_ids: dict[int, Tensor] = {}  # slot -> ids [m] int64, the only ones it may sample
        # slot -> (prefixes [w, width] int64, -1 = any token; last tokens [w] int64) of its bad words
        self.bad_words: dict[int, tuple[Tensor, Tensor]] = {}
        self.recent: dict[int, Tensor] = {}  # slot -> [width] int64 its last output tokens (-1 = none yet)
        self.logit_bias: dict[int, tuple[Tensor, Tensor]] = {}  # slot -> (ids [m] int64, bias [m] fp32)
        self.min_tokens_ids: dict[int, Tensor] = {}  # slot -> ids masked until min_tokens
        # slot -> its stop ids (EOS and stop_token_ids) [s], for min_tokens and for rows that
        # allowed_token_ids, bad words or a -inf bias could empty (processors._end_if_empty)
        self.stop_ids: dict[int, Tensor] = {}
        self.processed: set[int] = set()  # slots with any logits processor (uses_processors)
        self.steered: set[int] = set()  # of those, slots whose processors steer (steers): drafts follow them
        self.can_empty: set[int] = set()  # slots whose allowed ids, bad words or -inf (or near) biases may empty a row
        # slots a bias or a penalty lifts past _SHIFTING_BIAS: divide_by_temperature shifts them
        self.shifted: set[int] = set()
        self.output_counts: dict[int, Tensor] = {}  # slot -> [vocab] int32, output tokens
        self.prompt_mask: dict[int, Tensor] = {}  # slot -> [vocab] bool, tokens of the prompt
        # The keyed draw's context windows (None: the engine does not watermark).
        self.watermark = (WatermarkState(watermark, s, max_model_len, device, self.upload, use_triton)
                          if watermark is not None else None)

    def add(self, req: NewReq) -> None:
        self.add_all([req])

    def add_all(self, reqs: list[NewReq]) -> None:
        """Install new requests' parameters in their slots: one upload and one index_copy_ per
        buffer. (A per-slot `buf[slot] = value` copies a scalar from pageable host memory, which
        waits for every kernel queued on the stream: eight hidden syncs per new request.)"""
        if not reqs:
            return
        n = len(reqs)
        for req in reqs:
            self.params[req.slot] = req.params
            self.seeds_cpu[req.slot] = req.seed
        # top_k 0 is off; so is one as large as the vocabulary, however large (vLLM's rule)
        ints = [[r.params.top_k if 0 < r.params.top_k < self.vocab_size else 0 for r in reqs], [r.seed for r in reqs]]
        floats = [[getattr(r.params, name) for r in reqs] for name in _FLOAT_PARAMS]
        slot_t, int_t, float_t = self.upload([r.slot for r in reqs], [v for row in ints for v in row],
                                             _float_bits([v for row in floats for v in row]))
        float_t = _from_bits(float_t).view(len(_FLOAT_PARAMS), n)
        for buf, row in zip((self.top_k, self.seeds), int_t.view(2, n)):
            buf.index_copy_(0, slot_t, row)
        for name, row in zip(_FLOAT_PARAMS, float_t):
            getattr(self, name).index_copy_(0, slot_t, row)
        for req in reqs:
            self._add_extras(req)
        if self.watermark is not None:
            self.watermark.add_all(reqs)

    def _add_extras(self, req: NewReq) -> None:
        """The optional per-slot tensors: allowed ids, bad words, logit bias, min_tokens' stop ids,
        penalty counts."""
        p, slot = req.params, req.slot
        self.allowed_ids.pop(slot, None)
        self.bad_words.pop(slot, None)
        self.recent.pop(slot, None)
        self.logit_bias.pop(slot, None)
        self.min_tokens_ids.pop(slot, None)
        self.stop_ids.pop(slot, None)
        self.can_empty.discard(slot)
        self.shifted.discard(slot)
        self.output_counts.pop(slot, None)
        self.prompt_mask.pop(slot, None)
        self.processed.discard(slot)
        self.steered.discard(slot)
        if uses_processors(p):
            self.processed.add(slot)
        if steers(p):
            self.steered.add(slot)
        if p.allowed_token_ids:
            (self.allowed_ids[slot],) = self.upload(sorted({t for t in p.allowed_token_ids if t < self.vocab_size}))
        if p.bad_words_token_ids:
            self._add_bad_words(req)
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < self.vocab_size]
            biases = [p.logit_bias[t] if p.logit_bias[t] > _BANNING_BIAS else float("-inf") for t in ids]
            ids_t, bias_t = self.upload(ids, _float_bits(biases))
            self.logit_bias[slot] = (ids_t, _from_bits(bias_t))
        lift = max(biases, default=0.0) if p.logit_bias else 0.0  # the largest bias (of ids in the vocabulary)
        if lift > _SHIFTING_BIAS or (p.repetition_penalty < 1
                                     and (_LOGIT_BOUND + max(lift, 0.0)) / p.repetition_penalty > _SHIFTING_BIAS):
            self.shifted.add(slot)
        if p.allowed_token_ids or p.bad_words_token_ids or \
                (p.logit_bias and min(p.logit_bias.values()) <= _BANNING_BIAS):
            self.can_empty.add(slot)
        if p.min_tokens > 0 or slot in self.can_empty:
            # EOS too under ignore_eos, as vLLM's all_stop_token_ids: min_tokens holds back every stop id
            stop_ids = set(p.stop_token_ids) | set(self.eos_token_ids)
            (self.stop_ids[slot],) = self.upload(sorted(t for t in stop_ids if 0 <= t < self.vocab_size))
            if p.min_tokens > 0:
                self.min_tokens_ids[slot] = self.stop_ids[slot]
        if p.has_penalties:
            (ids,) = self.upload(req.token_ids)
            ids = ids.clamp(max=self.vocab_size - 1)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask.index_fill_(0, ids[: req.num_prompt_tokens], True)  # `mask[ids] = True` would copy True over
            counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
            counts.index_add_(0, ids[req.num_prompt_tokens :], torch.ones_like(ids[req.num_prompt_tokens :], dtype=torch.int32))
            self.prompt_mask[slot] = mask
            self.output_counts[slot] = counts

    def _add_bad_words(self, req: NewReq) -> None:
        words = req.params.bad_words_token_ids
        width = max(len(w) for w in words) - 1  # the longest prefix: output tokens to remember
        prefixes = [[-1] * (width - len(w) + 1) + w[:-1] for w in words]  # right-aligned
        outputs = req.token_ids[req.num_prompt_tokens :]
        recent = ([-1] * width + outputs)[len(outputs) :] if width else []
        pre_t, last_t, recent_t = self.upload([t for p in prefixes for t in p], [w[-1] for w in words], recent)
        self.bad_words[req.slot] = (pre_t.view(len(words), width), last_t)
        if width:
            self.recent[req.slot] = recent_t

    def remove(self, slot: int) -> None:
        self.params[slot] = None
        if self.watermark is not None:
            self.watermark.remove(slot)
        for d in (self.allowed_ids, self.bad_words, self.recent, self.logit_bias, self.min_tokens_ids,
                  self.stop_ids, self.output_counts, self.prompt_mask):
            d.pop(slot, None)
        self.can_empty.discard(slot)
        self.shifted.discard(slot)
        self.processed.discard(slot)
        self.steered.discard(slot)

    def record_outputs(self, slots: list[int], tokens: Tensor) -> None:
        """Count emitted tokens for penalty slots, and slide bad-word slots' windows over them.
        tokens [n, m] int64 (-1 = none; a slot's rows in order), no host sync."""
        for row, slot in enumerate(slots):
            window = self.recent.get(slot)
            if window is not None:
                for t in tokens[row]:
                    window.copy_(torch.where(t >= 0, torch.cat([window[1:], t[None]]), window))
            counts = self.output_counts.get(slot)
            if counts is None:
                continue
            t = tokens[row]
            ok = (t >= 0).to(torch.int32)
            counts.index_add_(0, t.clamp(min=0), ok)

"""Confidence-based early stop (speculative_config draft_confidence_threshold, vLLM's): a request's
chain of drafts ends at its first draft the draft model is unsure of; greedy output stays the
target's token for token. (Its sampled distribution: test_distribution.py.)"""
import math
import re
from collections import Counter

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.spec.confidence import ConfidenceStop
from tandem.spec.adaptive import StepCosts
from tandem.spec.config import SpeculativeConfig
from tests.helpers import make_spec_models

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("confidence"))


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in (4, 19, 64, 7, 33, 120)]


def _llm(models, **spec_kw):
    spec = dict(model=str(models["near"]), num_speculative_tokens=4, **spec_kw)
    return LLM(str(models["target"]), dtype="float32", max_model_len=256, block_size=8, speculative_config=spec,
               per_request_spec_decode_metrics="detailed")


def _logits(top: list[float], vocab: int = 8) -> torch.Tensor:
    """Rows whose top-1 probability is `top` (the rest spread evenly)."""
    rows = []
    for p in top:
        rest = (1 - p) / (vocab - 1)
        rows.append(torch.log(torch.tensor([p] + [rest] * (vocab - 1))))
    return torch.stack(rows)


def test_each_chain_ends_at_its_first_unsure_draft():
    stop = ConfidenceStop(0.5, [3, 3, 2, 0])  # the last request drafts nothing this round
    assert not stop.after(0, _logits([0.9, 0.2, 0.9, 0.9]))  # request 1 ends: a first draft is always kept
    assert stop.counts == [3, 1, 2, 0] and stop.alive == [True, False, True, False]
    assert stop.after(1, _logits([0.3, 0.99, 0.99, 0.99]))  # request 0 ends, its unsure draft left out
    assert stop.counts == [1, 1, 2, 0]  # (request 2 reached its plan)
    assert stop.steps == [2, 1, 2, 0]  # the step that drew an unsure draft ran: request 0 ran two, proposes one
    late = ConfidenceStop(0.5, [3])
    assert not late.after(0, _logits([0.6])) and not late.after(1, _logits([0.6])) and late.after(2, _logits([0.4]))
    assert late.counts == [2] and late.steps == [3]
    sure = ConfidenceStop(0.5, [3])
    assert not sure.after(0, _logits([0.6])) and not sure.after(1, _logits([0.51])) and sure.after(2, _logits([0.7]))
    assert sure.counts == [3] and sure.steps == [3]


def test_greedy_output_is_the_targets_and_unsure_rounds_are_cut(models):
    prompts = _prompts()
    base = [o.outputs[0].token_ids for o in LLM(str(models["target"]), dtype="float32", max_model_len=256,
                                                block_size=8).generate(prompts, PARAMS, use_tqdm=False)]
    drafted, rates = {}, {}
    for tau in (None, 1e-9, 0.3, 0.9):
        llm = _llm(models) if tau is None else _llm(models, draft_confidence_threshold=tau)
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == base, tau
        drafted[tau] = Counter(d for o in outs for d in o.metrics.per_step_drafted)
        rates[tau] = llm.engine.spec_metrics.acceptance_rate
    assert drafted[1e-9] == drafted[None]  # no draft is that unsure: every round as planned
    assert drafted[0.3][1] > 4 * drafted[None][1] and len(drafted[0.3]) == 4  # rounds of every length
    assert set(drafted[0.9]) == {1}  # the random draft is never that sure: one draft a round
    assert rates[0.9] > rates[0.3] > rates[None]  # the drafts left out were the likely rejections


def test_adaptive_speculation_prices_the_stop_from_the_chains_it_saw(models):
    """Under "auto" the step costs are measured with the stop off (whole rounds), and the rounds the
    stop cut teach the policy how far chains run (a sure-of-nothing draft: one draft a round)."""
    llm = _llm(models, draft_confidence_threshold=0.9, num_speculative_tokens_per_batch_size="auto")
    adaptive, speculator = llm.engine.adaptive, llm.engine.runner.speculator
    assert speculator.confidence_threshold == 0.9  # back on after the profile
    assert all(math.isfinite(ms) for row in adaptive.costs.ms for ms in row)  # every K was timed
    # The measured table decides whether deep rounds ever look worth planning: on a CPU whose draft
    # steps cost as much as the target's, K = 1 can win from the first step, and then no round is
    # ever cut. Costs in which a deeper round is cheap make the policy plan k, as on a GPU.
    adaptive.costs = StepCosts((1,), ((1.0, 1.0, 1.1, 1.2, 1.3),))
    outs = llm.generate(_prompts()[:2], PARAMS, use_tqdm=False)
    assert all(d == 1 for o in outs for d in o.metrics.per_step_drafted)
    assert adaptive.num_steps_by_k[4] >= 2  # deep rounds were planned, and the stop cut them
    alive = adaptive.proposals.survival()
    assert alive[0] == 1.0 and max(alive[1:]) < 0.5
    costs = adaptive.expected_costs(1)
    assert costs[4] - costs[1] <= 0.5 * (adaptive.costs.at(1)[4] - adaptive.costs.at(1)[1])


@pytest.mark.parametrize("kw, says", [
    (dict(draft_confidence_threshold=0), "draft_confidence_threshold=0 must be a number in (0, 1)"),
    (dict(draft_confidence_threshold=1.0), "draft_confidence_threshold=1.0 must be a number in (0, 1)"),
    (dict(draft_confidence_threshold="0.5"), "draft_confidence_threshold='0.5' must be a number in (0, 1)"),
    (dict(draft_confidence_threshold=0.5, draft_confidence_fallback_depth=2),
     "draft_confidence_fallback_depth is not needed"),
])
def test_bad_settings_are_named(kw, says):
    with pytest.raises(ConfigError, match="^" + re.escape(f"speculative_config.{says}")):
        SpeculativeConfig.from_user(dict(model="d", num_speculative_tokens=3, **kw), 128)

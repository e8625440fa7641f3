"""Scheduler unit tests, driven by a fake runner that turns a StepPlan into a StepResult.

Pure Python: must not import torch (nor tandem modules that do, such as tandem.config). The
fake runner also simulates the KV cache (one token id per block slot) and the runner's slot
table, so every step checks that a request only reads KV that holds its own tokens, only writes
blocks it owns exclusively, and that slots are released (freed_slots) exactly once.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import random
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tandem.plan import PENDING_TOKEN, StepPlan, StepResult
from tandem.sampling_params import SamplingParams
from tandem.scheduler.request import Request, Status
from tandem.scheduler.scheduler import Scheduler

ROOT = pathlib.Path(__file__).resolve().parents[2]
EOS = 1


@dataclass(frozen=True)
class SchedCfg:
    """Stand-in for tandem.config.SchedulerConfig (same attribute names)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 256
    num_lookahead_tokens: int = 0
    async_scheduling: bool = False
    scheduling_policy: str = "fcfs"


@dataclass(frozen=True)
class CacheCfg:
    """Stand-in for tandem.config.CacheConfig (same attribute names)."""

    block_size: int = 4
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_blocks: int | None = 256
    cache_dtype: str = "auto"


def default_token(req: Request, index: int) -> int:
    """The output token at index of req: deterministic, never EOS (1) nor small ids."""
    return 100 + (req.req_id * 37 + index * 11) % 200


class Harness:
    """A scheduler plus a fake runner that checks the scheduler's contract every step."""

    def __init__(self, sched=None, cache=None, k=0, token_fn=default_token, accept_fn=None, propose_fn=None,
                 k_for_batch=None, record_spec_steps=False):
        self.sched_cfg = sched or SchedCfg(num_lookahead_tokens=k)
        self.cache_cfg = cache or CacheCfg()
        self.k = k
        self.k_for_batch = k_for_batch
        self.s = Scheduler(self.sched_cfg, self.cache_cfg, num_speculative_tokens=k, k_for_batch=k_for_batch,
                           record_spec_steps=record_spec_steps)
        self.token_fn = token_fn
        self.accept_fn = accept_fn or (lambda req, item: item.num_drafts)
        self.propose_fn = propose_fn or (lambda req, item: item.num_next_drafts)
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token whose KV is there
        self.draft_kv: dict[tuple[int, int], int] = {}  # the same, in the draft model's cache
        self.slot_table: dict[int, int] = {}  # slot -> req_id, as the runner sees it
        self.reqs: dict[int, Request] = {}
        self.plans: list[StepPlan] = []
        self.finished: list[Request] = []
        self._next_id = 0

    # ------------------------------------------------------------ requests
    def add(self, prompt, max_tokens=16, eos=(EOS,), priority=0, **params) -> Request:
        params.setdefault("max_tokens", max_tokens)
        req = Request(
            req_id=self._next_id,
            prompt_token_ids=list(prompt),
            params=SamplingParams(**params),
            seed=self._next_id,
            max_tokens=max_tokens,
            eos_token_ids=tuple(eos),
            priority=priority,
        )
        self._next_id += 1
        self.reqs[req.req_id] = req
        self.s.add(req)
        return req

    # ------------------------------------------------------------ the step
    def step(self):
        plan = self.s.schedule()
        self.plans.append(plan)
        self.check_plan(plan)
        result = self.execute(plan)
        events = self.s.update(plan, result)
        for req, emitted in events:
            assert emitted, "an event always carries tokens"
            if req.is_finished:
                self.finished.append(req)
        self.check_state()
        return plan, result, events

    def run_async(self, arrivals=None, max_steps=10_000):
        """The engine's overlapped loop: plan the next step ahead of the current one's result
        when the scheduler allows it (the fake runner executes at launch, as a GPU would queue
        it). arrivals: {step index: [prompt, kwargs]} added between steps. -> steps planned ahead."""
        arrivals = arrivals or {}
        inflight, num_ahead = None, 0
        for i in range(max_steps):
            for p, kw in arrivals.get(i, []):
                self.add(p, **kw)
            if inflight is None:
                plan = self.s.schedule()
                if plan.is_empty:
                    self.check_plan(plan)  # takes the freed slots it reports
                    if not self.s.has_unfinished and not any(j > i for j in arrivals):
                        return num_ahead
                    continue
                self.check_plan(plan)
                inflight = (plan, self.execute(plan), False)
            plan, result, was_ahead = inflight
            inflight = None
            ahead = self.s.schedule_ahead(plan)
            if ahead is not None:
                for item in ahead.reqs:  # one token each, after what plan computes, fed on the device
                    prev = next(r for r in plan.reqs if r.req_id == item.req_id)
                    assert item.input_token_ids == [PENDING_TOKEN] and item.num_drafts == 0 and item.sample
                    assert item.start_pos == prev.start_pos + prev.num_new_tokens
                    assert item.num_output_tokens == prev.num_output_tokens + 1
                    assert len(item.block_ids) * self.cache_cfg.block_size > item.start_pos
                inflight = (ahead, self.execute(ahead), True)
                num_ahead += 1
            events = self.s.update(plan, result)
            for req, emitted in events:
                if req.is_finished:
                    self.finished.append(req)
            if was_ahead:  # now the state it was planned for: check what is still running
                for slot in plan.freed_slots:
                    del self.slot_table[slot]
            self.check_state()
        raise AssertionError("did not finish")

    def run(self, max_steps=10_000):
        for i in range(max_steps):
            if not self.s.has_unfinished:
                return i
            plan, _, _ = self.step()
            assert not plan.is_empty or self.s.has_unfinished is False, "scheduler made no progress"
        raise AssertionError("did not finish")

    def execute(self, plan: StepPlan) -> StepResult:
        """The fake runner: check reads against the simulated KV, write KV, emit tokens."""
        bs = self.cache_cfg.block_size
        sampled, proposed = [], []
        for item in plan.reqs:
            req = self.reqs[item.req_id]
            table = item.block_ids
            # Reads: everything before start_pos must be this request's own tokens.
            for pos in range(item.start_pos):
                got = self.kv.get((table[pos // bs], pos % bs))
                assert got == req.token_id(pos), f"req {req.req_id} reads stale KV at position {pos}"
            # Writes: the known input tokens, then the drafts verified behind them.
            n_out = item.num_output_tokens
            drafts = [self.token_fn(req, n_out + j) for j in range(item.num_drafts)]
            inputs = list(item.input_token_ids)
            if inputs == [PENDING_TOKEN]:  # planned ahead: the previous step's token, "on the device"
                inputs = [self.token_fn(req, n_out - 1)]
            for j, tok in enumerate(inputs + drafts):
                pos = item.start_pos + j
                self.kv[(table[pos // bs], pos % bs)] = tok
            if self.k:
                self.execute_draft(req, item, inputs + drafts)
            if not item.sample:
                sampled.append([])
                proposed.append(0)
                continue
            accepted = self.accept_fn(req, item) if item.num_drafts else 0
            assert 0 <= accepted <= item.num_drafts
            sampled.append([self.token_fn(req, n_out + j) for j in range(accepted + 1)])
            proposed.append(self.propose_fn(req, item))
        return StepResult(sampled_token_ids=sampled, logprobs=[None] * len(sampled), num_drafts_proposed=proposed)

    def execute_draft(self, req: Request, item, fed: list[int]) -> None:
        """The draft's side: it reads only its own KV of this request's tokens (a prefix hit's
        blocks included), takes the tokens it skipped before this step's, and writes them."""
        bs = self.cache_cfg.block_size
        table = item.block_ids
        if item.draft_skip and not item.draft_backfill:
            return
        start = item.draft_backfill_start if item.draft_backfill else item.start_pos
        for pos in range(start):
            got = self.draft_kv.get((table[pos // bs], pos % bs))
            assert got == req.token_id(pos), f"req {req.req_id}: the draft reads stale KV at position {pos}"
        if not item.draft_skip:
            assert start + len(item.draft_backfill) == item.start_pos, "the backfill must reach the step's tokens"
            fed = item.draft_backfill + fed
        else:
            fed = item.draft_backfill
        for j, tok in enumerate(fed):
            pos = start + j
            if j < len(item.draft_backfill):
                assert tok == req.token_id(pos), "a backfill token is not the request's"
            self.draft_kv[(table[pos // bs], pos % bs)] = tok

    # ------------------------------------------------------------ invariants
    def check_plan(self, plan: StepPlan) -> None:
        cfg, bs, s = self.sched_cfg, self.cache_cfg.block_size, self.s
        # Token budget (the draft's backfill counts) and batch size.
        num_backfill = sum(len(r.draft_backfill) for r in plan.reqs)
        assert plan.num_tokens + num_backfill <= cfg.max_num_batched_tokens
        assert sum(r.num_new_tokens for r in plan.reqs) == plan.num_tokens
        assert len(plan.reqs) <= cfg.max_num_seqs
        assert len(s.running) <= cfg.max_num_seqs
        # Slots: released ones are reported once (they were in use), then new ones are taken.
        for slot in plan.freed_slots:
            assert slot in self.slot_table, f"slot {slot} freed twice or never used"
            del self.slot_table[slot]
        for new in plan.new_reqs:
            assert new.slot not in self.slot_table, f"slot {new.slot} reused before being freed"
            assert 0 <= new.slot < cfg.max_num_seqs
            req = self.reqs[new.req_id]
            assert new.token_ids == req.all_token_ids
            assert new.num_prompt_tokens == len(req.prompt_token_ids)
            assert new.params is req.params and new.seed == req.seed
            self.slot_table[new.slot] = new.req_id
        assert len({r.req_id for r in plan.reqs}) == len(plan.reqs)
        # Each item: consistent with its request, and its blocks cover what it may write.
        writers = {}
        next_counts = set()
        for item in plan.reqs:
            req = self.reqs[item.req_id]
            assert req.status == Status.RUNNING and req in s.running
            assert self.slot_table.get(item.slot) == req.req_id and item.slot == req.slot
            assert item.start_pos == req.num_computed_tokens
            n = len(item.input_token_ids)
            assert n >= 1
            assert item.input_token_ids == req.all_token_ids[item.start_pos : item.start_pos + n]
            assert item.sample == (item.start_pos + n == req.num_tokens)
            assert item.num_output_tokens == len(req.output_token_ids)
            if self.k_for_batch is None:
                assert item.num_next_drafts == (self.k if item.sample else 0)
                assert not item.draft_skip and not item.draft_backfill
            else:
                assert 0 <= item.num_next_drafts <= self.k and (item.sample or not item.num_next_drafts)
                assert not (item.draft_skip and item.num_next_drafts), "a step that skips the draft drafts nothing"
                next_counts.add(item.num_next_drafts or None)
            if item.num_drafts:
                assert n == 1 and item.sample and item.num_drafts <= self.k
                assert item.num_drafts <= req.num_pending_drafts
                assert req.num_tokens + item.num_drafts + 1 <= cfg.max_model_len
            assert item.block_ids == req.block_ids
            end = item.start_pos + item.num_new_tokens + (self.k if item.sample else 0)
            assert len(item.block_ids) * bs >= min(end, cfg.max_model_len)  # drafts write below max_model_len
            # Written positions lie in blocks owned by this request alone.
            last = item.start_pos + item.num_new_tokens - 1 + (self.k if item.sample else 0)
            last = min(last, len(item.block_ids) * bs - 1)
            for b in item.block_ids[item.start_pos // bs : last // bs + 1]:
                assert s.blocks.ref_counts[b] == 1, f"req {req.req_id} writes shared block {b}"
                assert s.blocks.block_keys[b] is None, f"req {req.req_id} writes cached block {b}"
                assert b not in writers, f"block {b} written by two requests"
                writers[b] = req.req_id
        assert len(next_counts - {None}) <= 1, "every drafting request of a step drafts the same number"
        # Running requests that were left out only because the budget ran out.
        if plan.num_tokens + num_backfill < cfg.max_num_batched_tokens:
            scheduled = {r.req_id for r in plan.reqs}
            assert all(r.req_id in scheduled for r in s.running), "a running request was skipped with budget left"

    def check_state(self) -> None:
        s, bm = self.s, self.s.blocks
        holders = [0] * bm.num_blocks
        for r in s.running:
            for b in r.block_ids:
                holders[b] += 1
        for r in s.waiting:
            assert r.status == Status.WAITING and r.block_ids == [] and r.slot is None
            assert r.num_computed_tokens == 0
        assert holders == bm.ref_counts, "block reference counts do not match the running requests"
        assert bm.num_free_blocks == bm.num_blocks - sum(1 for h in holders if h)
        slots = [r.slot for r in s.running]
        assert len(set(slots)) == len(slots) and None not in slots
        assert sorted(slots + s.free_slots) == list(range(self.sched_cfg.max_num_seqs))
        assert set(s.requests) == {r.req_id for r in list(s.running) + list(s.waiting)}
        for r in self.finished:
            assert r.is_finished and r.block_ids == [] and r.slot is None

    def check_no_leaks(self) -> None:
        s = self.s
        assert not s.has_unfinished and not s.running and not s.waiting and s.requests == {}
        assert s.blocks.num_free_blocks == s.blocks.num_blocks
        assert s.blocks.ref_counts == [0] * s.blocks.num_blocks
        assert sorted(s.free_slots) == list(range(self.sched_cfg.max_num_seqs))
        # Released slots all reach the runner: one more (empty) plan reports the last ones.
        plan = s.schedule()
        assert plan.is_empty and not plan.new_reqs
        for slot in plan.freed_slots:
            assert slot in self.slot_table
            del self.slot_table[slot]
        assert self.slot_table == {}
        assert s.schedule().freed_slots == []


def expected_output(req: Request, n: int, token_fn=default_token) -> list[int]:
    return [token_fn(req, i) for i in range(n)]


def bounded(cond, limit=1000):
    """`while cond():` that fails instead of hanging when the scheduler stops making progress."""
    for i in range(limit):
        if not cond():
            return
        yield i
    raise AssertionError(f"no progress after {limit} steps")


def prompt(n: int, base: int = 2) -> list[int]:
    return [base + (i * 13) % 97 for i in range(n)]


# ---------------------------------------------------------------- structure


def test_scheduler_imports_without_torch():
    code = (
        "import sys; import tandem.scheduler.scheduler, tandem.scheduler.blocks, tandem.plan, "
        "tandem.sampling_params; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["test_scheduler.py", "test_blocks.py"])
def test_these_tests_do_not_import_torch(name):
    tree = ast.parse((pathlib.Path(__file__).parent / name).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert "tandem.scheduler.scheduler" in names or "tandem.scheduler.blocks" in names
    assert not [m for m in names if m.split(".")[0] == "torch" or m.startswith(("tandem.config", "tandem.engine"))]


def test_stand_in_configs_match_tandem_config():
    """The stand-ins carry exactly the fields of the real configs (read without importing torch)."""
    tree = ast.parse((ROOT / "tandem" / "config.py").read_text())
    fields = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("SchedulerConfig", "CacheConfig"):
            fields[node.name] = [
                s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    assert fields["SchedulerConfig"] == [f.name for f in dataclasses.fields(SchedCfg)]
    assert fields["CacheConfig"] == [f.name for f in dataclasses.fields(CacheCfg)]


# ---------------------------------------------------------------- budget, batch size, chunking


def test_simple_request_runs_to_length():
    h = Harness()
    req = h.add(prompt(10), max_tokens=5)
    plan, _, events = h.step()
    assert [n.req_id for n in plan.new_reqs] == [req.req_id]
    (item,) = plan.reqs
    assert item.start_pos == 0 and item.input_token_ids == req.prompt_token_ids and item.sample
    assert events == [(req, [default_token(req, 0)])]
    for i in range(1, 5):
        plan, _, _ = h.step()
        (item,) = plan.reqs
        assert not plan.new_reqs
        assert item.start_pos == 10 + i - 1 and item.input_token_ids == [req.output_token_ids[i - 1]]
    assert req.is_finished and req.finish_reason == "length" and req.stop_reason is None
    assert req.output_token_ids == expected_output(req, 5)
    h.check_no_leaks()


@pytest.mark.parametrize("budget,max_seqs,block_size", [(16, 4, 4), (7, 3, 2), (64, 8, 16), (5, 1, 3)])
def test_budget_and_max_num_seqs_are_respected(budget, max_seqs, block_size):
    rng = random.Random(budget * 31 + max_seqs)
    h = Harness(
        SchedCfg(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=128),
        CacheCfg(block_size=block_size, num_blocks=400),
    )
    reqs = [h.add(prompt(rng.randint(1, 60), base=rng.randint(2, 50)), max_tokens=rng.randint(1, 20)) for _ in range(20)]
    h.run()
    assert max(p.num_tokens for p in h.plans) == budget  # the budget was actually the limit
    assert max(len(p.reqs) for p in h.plans) <= max_seqs
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()


def test_max_num_seqs_limits_admission():
    h = Harness(SchedCfg(max_num_seqs=2, max_num_batched_tokens=100))
    reqs = [h.add(prompt(3), max_tokens=4) for _ in range(5)]
    plan, _, _ = h.step()
    assert [n.req_id for n in plan.new_reqs] == [0, 1]  # room in the budget, but only 2 slots
    assert len(h.s.waiting) == 3
    h.run()
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 4 for r in reqs)
    assert max(len(p.reqs) for p in h.plans) == 2
    h.check_no_leaks()


def test_chunked_prefill_of_a_long_prompt():
    h = Harness(SchedCfg(max_num_batched_tokens=16), CacheCfg(block_size=4))
    req = h.add(prompt(50), max_tokens=3)
    starts = []
    for _ in bounded(lambda: not req.output_token_ids):
        plan, _, events = h.step()
        (item,) = plan.reqs
        starts.append(item.start_pos)
        assert item.input_token_ids == req.prompt_token_ids[item.start_pos : item.start_pos + len(item.input_token_ids)]
        assert item.sample == (item.start_pos + len(item.input_token_ids) == 50)
        assert bool(events) == item.sample
        assert len(req.block_ids) == -(-(item.start_pos + len(item.input_token_ids)) // 4)  # grows per chunk
    assert starts == [0, 16, 32, 48]
    assert [len(p.reqs[0].input_token_ids) for p in h.plans] == [16, 16, 16, 2]
    assert [len(p.new_reqs) for p in h.plans] == [1, 0, 0, 0]
    h.run()
    assert req.output_token_ids == expected_output(req, 3)
    h.check_no_leaks()


def test_decodes_are_not_starved_by_a_long_prompt():
    h = Harness(SchedCfg(max_num_batched_tokens=8), CacheCfg(block_size=4))
    a = h.add(prompt(3), max_tokens=30)
    b = h.add(prompt(4, base=7), max_tokens=30)
    h.step()  # both prefill in one step (3 + 4 <= 8)
    assert len(a.output_token_ids) == 1 and len(b.output_token_ids) == 1
    long = h.add(prompt(40, base=20), max_tokens=2)
    for _ in bounded(lambda: not long.output_token_ids):
        out_a, out_b = len(a.output_token_ids), len(b.output_token_ids)
        plan, _, _ = h.step()
        by_id = {r.req_id: r for r in plan.reqs}
        # Both decodes get their token every step; the prompt only takes what is left.
        assert by_id[a.req_id].num_new_tokens == 1 and by_id[b.req_id].num_new_tokens == 1
        assert by_id[long.req_id].num_new_tokens == min(6, 40 - by_id[long.req_id].start_pos)
        assert len(a.output_token_ids) == out_a + 1 and len(b.output_token_ids) == out_b + 1
    h.run()
    h.check_no_leaks()


def test_decodes_first_then_prefills_regardless_of_running_order():
    """The policy itself: decodes, then prefill chunks, each in admission order. Admission can't
    put a partial prefill ahead of a decode (a partial chunk always ends the step's budget), so
    the running order is arranged by hand here."""
    h = Harness(SchedCfg(max_num_batched_tokens=8), CacheCfg(block_size=4))
    long = h.add(prompt(40, base=20), max_tokens=2)
    a = h.add(prompt(3), max_tokens=30)
    b = h.add(prompt(4, base=7), max_tokens=30)
    h.s.waiting.rotate(-1)  # admit a and b first ...
    h.step()
    h.step()  # ... then long, which takes the rest of the budget: a partial prefill
    assert [r.req_id for r in h.s.running] == [a.req_id, b.req_id, long.req_id] and long.is_prefilling
    h.s.running.insert(0, h.s.running.pop())  # the prefill now comes first in admission order
    plan, _, _ = h.step()
    assert [(r.req_id, r.num_new_tokens) for r in plan.reqs] == [(long.req_id, 6), (a.req_id, 1), (b.req_id, 1)]
    h.run()
    assert long.output_token_ids == expected_output(long, 2)
    h.check_no_leaks()


def test_requests_join_and_leave_every_step():
    rng = random.Random(5)
    h = Harness(SchedCfg(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96), CacheCfg(block_size=4, num_blocks=60))
    added, aborted = [], set()

    def on_step(i):
        if i < 60:
            for _ in range(rng.randint(0, 2)):
                added.append(h.add(prompt(rng.randint(1, 40), base=rng.randint(2, 9)), max_tokens=rng.randint(1, 12)))
        live = [r for r in added if not r.is_finished]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            assert h.s.abort(victim.req_id) is victim
            aborted.add(victim.req_id)

    for i in range(60):
        on_step(i)
        h.step()
    h.run()
    assert len(added) > 40 and aborted
    joined = [len(p.new_reqs) for p in h.plans]
    left = [len(p.freed_slots) for p in h.plans]
    assert sum(1 for j in joined if j) > 20 and sum(1 for f in left if f) > 20
    for r in added:
        assert r.is_finished
        if r.req_id in aborted:
            assert r.finish_reason == "abort"
        else:
            assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()


# ---------------------------------------------------------------- preemption


def test_preemption_by_recompute_keeps_outputs():
    # 10 blocks of 2 tokens; two requests of 4 + 12 tokens need 8 blocks each at the end.
    h = Harness(SchedCfg(max_num_batched_tokens=32, max_model_len=64),
                CacheCfg(block_size=2, num_blocks=10, enable_prefix_caching=False))
    a = h.add(prompt(4), max_tokens=12)
    b = h.add(prompt(4, base=50), max_tokens=12)
    seen_preempted = None
    for _ in bounded(lambda: h.s.has_unfinished):
        out_b = list(b.output_token_ids)
        plan, _, _ = h.step()
        if b.status == Status.WAITING and seen_preempted is None:
            # b (admitted last) was preempted for a: its outputs are kept, its blocks and slot freed.
            seen_preempted = out_b
            assert b.num_preemptions == 1 and h.s.num_preemptions == 1
            assert b.output_token_ids == out_b and len(out_b) > 0
            assert b.block_ids == [] and b.num_computed_tokens == 0 and b.slot is None
            assert h.s.waiting[0] is b
            assert b.req_id not in {r.req_id for r in plan.reqs}
            assert plan.new_reqs == []  # nothing is admitted in a step that preempted
        if seen_preempted is not None and b.req_id in {n.req_id for n in plan.new_reqs}:
            # Readmitted: it recomputes its whole prompt + output from position 0.
            (new,) = [n for n in plan.new_reqs if n.req_id == b.req_id]
            assert new.token_ids == b.prompt_token_ids + seen_preempted
            item = next(r for r in plan.reqs if r.req_id == b.req_id)
            assert item.start_pos == 0
            assert item.input_token_ids == b.prompt_token_ids + seen_preempted
            assert item.sample and item.num_output_tokens == len(seen_preempted)
    assert seen_preempted is not None
    assert a.num_preemptions == 0
    for r in (a, b):
        assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, 12)
    h.check_no_leaks()


def test_a_preempted_request_goes_back_ahead_of_later_arrivals():
    """A request preempted for blocks waits at the head of the queue (vLLM's prepend_request), so one
    that arrived after it, waiting for a slot all along, does not overtake it."""
    h = Harness(SchedCfg(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64),
                CacheCfg(block_size=2, num_blocks=10, enable_prefix_caching=False))
    a = h.add(prompt(4), max_tokens=12)
    b = h.add(prompt(4, base=50), max_tokens=12)
    c = h.add(prompt(2, base=90), max_tokens=2)  # waits for one of the two slots
    admitted = []
    for _ in bounded(lambda: h.s.has_unfinished):
        plan, _, _ = h.step()
        admitted += [n.req_id for n in plan.new_reqs]
    assert b.num_preemptions == 1
    assert admitted == [a.req_id, b.req_id, b.req_id, c.req_id]
    h.check_no_leaks()


def test_preemption_with_prefix_cache_reuses_computed_blocks():
    h = Harness(SchedCfg(max_num_batched_tokens=32, max_model_len=64), CacheCfg(block_size=2, num_blocks=12))
    a = h.add(prompt(6), max_tokens=14)
    b = h.add(prompt(6, base=50), max_tokens=14)
    readmits = []
    for _ in bounded(lambda: h.s.has_unfinished):
        plan, _, _ = h.step()
        for new in plan.new_reqs:
            if h.reqs[new.req_id].num_preemptions:
                item = next(r for r in plan.reqs if r.req_id == new.req_id)
                readmits.append((item.start_pos, len(new.token_ids)))
    assert h.s.num_preemptions > 0 and readmits
    for start, n in readmits:
        assert start % 2 == 0 and start < n  # whole cached blocks, >= 1 token recomputed
    for r in (a, b):
        assert r.output_token_ids == expected_output(r, 14)
        assert r.num_cached_tokens == 0  # the first admission's hit: a re-admission's own blocks do not count
    h.check_no_leaks()


def test_preemption_under_random_load_leaks_nothing():
    rng = random.Random(11)
    h = Harness(SchedCfg(max_num_seqs=5, max_num_batched_tokens=20, max_model_len=48),
                CacheCfg(block_size=4, num_blocks=14))
    reqs = [h.add(prompt(rng.randint(1, 30), base=rng.randint(2, 40)), max_tokens=rng.randint(5, 18)) for _ in range(25)]
    h.run()
    assert h.s.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == h.s.num_preemptions
    for r in reqs:
        assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()


def test_single_request_without_room_preempts_itself_and_waits():
    # 3 blocks of 2 tokens; the running request needs a 4th block once it has 7 tokens.
    h = Harness(SchedCfg(max_num_batched_tokens=8, max_model_len=64), CacheCfg(block_size=2, num_blocks=3))
    r = h.add(prompt(3), max_tokens=10)
    for _ in range(4):
        h.step()
    assert r.num_tokens == 7 and r.status == Status.RUNNING
    plan, _, _ = h.step()
    assert plan.is_empty and r.status == Status.WAITING and r.num_preemptions == 1
    assert plan.freed_slots == [0]
    assert h.s.blocks.num_free_blocks == 3
    assert 0 not in h.slot_table  # the fake runner saw the slot released
    plan = h.s.schedule()  # still cannot be admitted: it waits, nothing leaks
    assert plan.is_empty and list(h.s.waiting) == [r]
    assert h.s.abort(r.req_id) is r and r.finish_reason == "abort"
    assert h.s.blocks.num_free_blocks == 3 and not h.s.has_unfinished


# ---------------------------------------------------------------- abort


def test_abort_waiting_and_running():
    h = Harness(SchedCfg(max_num_seqs=2, max_num_batched_tokens=64))
    a = h.add(prompt(5), max_tokens=10)
    b = h.add(prompt(5, base=30), max_tokens=10)
    c = h.add(prompt(5, base=60), max_tokens=10)  # waits: only 2 slots
    h.step()
    assert a.status == b.status == Status.RUNNING and c.status == Status.WAITING
    free_before = h.s.blocks.num_free_blocks
    assert h.s.abort(c.req_id) is c
    assert c.finish_reason == "abort" and c.is_finished and c not in h.s.waiting
    assert h.s.blocks.num_free_blocks == free_before
    slot_a = a.slot
    assert h.s.abort(a.req_id) is a
    assert a.finish_reason == "abort" and a.slot is None and a.block_ids == []
    assert a not in h.s.running
    assert h.s.abort(a.req_id) is None  # finished requests are forgotten
    assert h.s.abort(12345) is None
    plan, _, _ = h.step()
    assert plan.freed_slots == [slot_a]
    assert [r.req_id for r in plan.reqs] == [b.req_id]
    plan, _, _ = h.step()
    assert plan.freed_slots == []  # reported once
    h.run()
    assert b.finish_reason == "length" and b.output_token_ids == expected_output(b, 10)
    assert c.output_token_ids == [] and len(a.output_token_ids) == 1
    h.check_no_leaks()


def test_abort_between_schedule_and_update_is_ignored():
    h = Harness()
    a = h.add(prompt(5), max_tokens=4)
    b = h.add(prompt(5, base=40), max_tokens=4)
    plan = h.s.schedule()
    h.check_plan(plan)
    result = h.execute(plan)
    h.s.abort(a.req_id)
    events = h.s.update(plan, result)
    assert [r for r, _ in events] == [b]
    assert a.output_token_ids == [] and a.finish_reason == "abort"
    h.check_state()
    h.run()
    h.check_no_leaks()


def test_abort_of_a_preempted_request():
    h = Harness(SchedCfg(max_num_batched_tokens=32), CacheCfg(block_size=2, num_blocks=10, enable_prefix_caching=False))
    a = h.add(prompt(4), max_tokens=12)
    b = h.add(prompt(4, base=50), max_tokens=12)
    for _ in bounded(lambda: b.status != Status.WAITING or not b.num_preemptions):
        h.step()
    assert b.output_token_ids
    assert h.s.abort(b.req_id) is b and b.finish_reason == "abort" and b not in h.s.waiting
    h.run()
    assert a.output_token_ids == expected_output(a, 12)
    h.check_no_leaks()


# ---------------------------------------------------------------- finish reasons


def scripted(script: dict[int, list[int]]):
    """token_fn that emits script[req_id][i] for the first outputs, then the default."""
    def fn(req, i):
        seq = script.get(req.req_id, [])
        return seq[i] if i < len(seq) else default_token(req, i)
    return fn


def test_finish_reasons():
    h = Harness(SchedCfg(max_model_len=20),
                token_fn=scripted({1: [5, EOS, 6], 2: [5, EOS, 6, 7], 3: [5, 77, 6], 4: [EOS, EOS, EOS, EOS],
                                   5: [77, 77, 77, 77], 6: [5, 5, EOS], 7: [5, EOS], 8: [5, 77], 9: [5, EOS],
                                   10: [5, EOS]}))
    length = h.add(prompt(4), max_tokens=3)
    eos = h.add(prompt(4), max_tokens=10)
    ignore = h.add(prompt(4), max_tokens=4, ignore_eos=True)
    stop_id = h.add(prompt(4), max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    min_tok = h.add(prompt(4), max_tokens=10, min_tokens=3)
    min_stop = h.add(prompt(4), max_tokens=10, min_tokens=2, stop_token_ids=[77])
    max_len = h.add(prompt(15), max_tokens=100, eos=())  # max_model_len=20 caps it at 5 outputs
    eos_at_max = h.add(prompt(4), max_tokens=2)  # a stop token that is also the last allowed: "stop" (vLLM's now)
    stop_at_max = h.add(prompt(4), max_tokens=2, stop_token_ids=[77])
    eos_listed = h.add(prompt(4), max_tokens=10, stop_token_ids=[EOS])  # EOS first: no stop_reason (vLLM)
    eos_listed_ignored = h.add(prompt(4), max_tokens=10, stop_token_ids=[EOS], ignore_eos=True)
    h.run()
    assert (length.finish_reason, length.stop_reason, len(length.output_token_ids)) == ("length", None, 3)
    assert (eos.finish_reason, eos.stop_reason, eos.output_token_ids) == ("stop", None, [5, EOS])
    assert (ignore.finish_reason, ignore.output_token_ids) == ("length", [5, EOS, 6, 7])
    assert (stop_id.finish_reason, stop_id.stop_reason, stop_id.output_token_ids) == ("stop", 77, [5, 77])
    # EOS is not a stop before min_tokens outputs exist.
    assert (min_tok.finish_reason, min_tok.output_token_ids) == ("stop", [EOS, EOS, EOS])
    assert (min_stop.finish_reason, min_stop.stop_reason, min_stop.output_token_ids) == ("stop", 77, [77, 77])
    assert max_len.finish_reason == "length" and max_len.num_tokens == 20 and len(max_len.output_token_ids) == 5
    assert (eos_at_max.finish_reason, eos_at_max.stop_reason, eos_at_max.output_token_ids) == ("stop", None, [5, EOS])
    assert (stop_at_max.finish_reason, stop_at_max.stop_reason, stop_at_max.output_token_ids) == ("stop", 77, [5, 77])
    assert (eos_listed.finish_reason, eos_listed.stop_reason) == ("stop", None)
    assert (eos_listed_ignored.finish_reason, eos_listed_ignored.stop_reason) == ("stop", EOS)
    h.check_no_leaks()


def test_eos_ids_come_from_the_request():
    """The first is the tokenizer's EOS (no stop_reason); another, config.json's or
    generation_config.json's, reports its id, as vLLM's stop_token_ids do."""
    h = Harness(token_fn=scripted({0: [3, 1, 4], 1: [3, 1, 4], 2: [3, 9, 4]}))
    a = h.add(prompt(4), max_tokens=5, eos=(4,))
    b = h.add(prompt(4), max_tokens=5, eos=())
    c = h.add(prompt(4), max_tokens=5, eos=(1, 9))
    h.run()
    assert a.output_token_ids == [3, 1, 4] and (a.finish_reason, a.stop_reason) == ("stop", None)
    assert len(b.output_token_ids) == 5 and b.finish_reason == "length"
    assert c.output_token_ids == [3, 9] and (c.finish_reason, c.stop_reason) == ("stop", 9)


def test_a_stop_string_in_a_step_that_ended_the_request_trims_its_finished_output():
    """The scheduler ends a request on EOS at the end of an accepted run; the detokenizer then finds a
    stop string earlier in that run: the response a lookup learns from (StepPlan.finished_outputs)
    keeps only the tokens that stand, and the reason becomes the stop string."""
    h = Harness(k=3, token_fn=scripted({0: [5, 6, 7, EOS]}))
    req = h.add(prompt(4), max_tokens=10)
    while not req.is_finished:
        h.step()
    assert req.output_token_ids == [5, 6, 7, EOS]
    h.s.finish(req, "stop", "ab", num_output_tokens=2)
    assert [(start, end) for _, start, end in h.s.schedule().finished_outputs] == [(4, 6)]
    assert (req.finish_reason, req.stop_reason) == ("stop", "ab")


# ---------------------------------------------------------------- planning ahead (async scheduling)


def test_schedule_ahead_gives_the_synchronous_outputs():
    """Steps planned before the previous result is known give every request the same tokens and
    finish reasons as the synchronous loop, through EOS, stop ids, max_tokens, max_model_len,
    arrivals mid-run and a block shortage; blocks and slots are all returned."""
    script = {1: [5, EOS, 6], 2: [5, 77, 6], 4: [5, 5, 5, 5, 5, 5, EOS]}

    def run(overlap: bool):
        h = Harness(SchedCfg(max_model_len=40), CacheCfg(block_size=4, num_blocks=24), token_fn=scripted(script))
        h.add(prompt(6), max_tokens=12)
        h.add(prompt(5), max_tokens=10)
        h.add(prompt(7), max_tokens=10, stop_token_ids=[77])
        h.add(prompt(30), max_tokens=100, eos=())  # max_model_len=40 caps it at 10 outputs
        arrivals = {5: [(prompt(9), dict(max_tokens=14))], 6: [(prompt(3), dict(max_tokens=1))]}
        if overlap:
            num_ahead = h.run_async(arrivals)
        else:
            for i in bounded(lambda: h.s.has_unfinished or i <= max(arrivals), 200):
                for p, kw in arrivals.get(i, []):
                    h.add(p, **kw)
                h.step()
            num_ahead = 0
        h.check_no_leaks()
        return {r.req_id: (r.output_token_ids, r.finish_reason, r.stop_reason) for r in h.reqs.values()}, num_ahead

    sync, _ = run(False)
    overlapped, num_ahead = run(True)
    assert overlapped == sync
    assert sync[1][0] == [5, EOS] and sync[2][1:] == ("stop", 77) and sync[3][1] == "length"
    assert num_ahead >= 5  # steady decoding between the arrivals and the stops was planned ahead


def test_schedule_ahead_declines_what_needs_the_result():
    h = Harness(SchedCfg(max_num_batched_tokens=24))
    a = h.add(prompt(40), max_tokens=5)
    plan, _, _ = h.step()  # a prefill chunk that does not reach the end: nothing sampled
    assert not plan.reqs[0].sample and h.s.schedule_ahead(plan) is None
    plan, _, _ = h.step()
    assert h.s.schedule_ahead(plan) is not None  # the last chunk samples: decode follows
    h.add(prompt(4))
    assert h.s.schedule_ahead(plan) is None  # a waiting request is admitted by schedule()
    h.run()
    assert len(a.output_token_ids) == 5
    # Drafts: what the next step verifies depends on what this one accepts.
    hk = Harness(k=2)
    hk.add(prompt(4), max_tokens=8)
    plan, _, _ = hk.step()
    assert hk.s.schedule_ahead(plan) is None


def test_prefix_cache_hit_through_the_scheduler():
    h = Harness(SchedCfg(max_num_batched_tokens=64), CacheCfg(block_size=4, num_blocks=40))
    shared = prompt(22)
    a = h.add(shared, max_tokens=6)
    h.step()  # a computes its 22 prompt tokens -> 5 full blocks cached
    b = h.add(shared[:20] + [200, 201, 202], max_tokens=6)
    plan, _, _ = h.step()
    item = next(r for r in plan.reqs if r.req_id == b.req_id)
    assert b.num_cached_tokens == 20 and item.start_pos == 20
    assert item.input_token_ids == [200, 201, 202]
    assert b.block_ids[:5] == a.block_ids[:5]
    assert all(h.s.blocks.ref_counts[x] == 2 for x in b.block_ids[:5])
    c = h.add(list(shared), max_tokens=6)  # identical prompt: the last block is recomputed
    plan, _, _ = h.step()
    item = next(r for r in plan.reqs if r.req_id == c.req_id)
    assert c.num_cached_tokens == 20 and item.input_token_ids == shared[20:]
    h.run()
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r, 6)
    h.check_no_leaks()
    assert len(h.s.blocks.evictable) > 0  # the content stays cached after everything finished


def test_prompts_sharing_a_new_prefix_in_one_step_compute_it_once():
    """Requests waiting together whose prompts share a prefix nobody has computed: the first is
    admitted, the others (from the first that shares SHARED_PREFIX_WAIT_TOKENS or more of the
    blocks it fills) wait one step and then hit those blocks; a shorter overlap, a request with
    prompt logprobs (it skips the cache) or a cache without prefix caching admits them together."""
    from tandem.scheduler.scheduler import SHARED_PREFIX_WAIT_TOKENS

    shared = prompt(40)
    assert SHARED_PREFIX_WAIT_TOKENS <= 36  # (the 9 full blocks of 4 the hit can take: one token left out)
    h = Harness(SchedCfg(max_num_batched_tokens=256), CacheCfg(block_size=4, num_blocks=80))
    other = h.add(prompt(20, base=300), max_tokens=4)  # nothing shared: admitted beside the first
    a = h.add(shared + [200, 201], max_tokens=4)
    b = h.add(shared + [202], max_tokens=4)
    c = h.add(list(shared), max_tokens=4)
    short = h.add(shared[:12] + prompt(20, base=400), max_tokens=4)
    plan, _, _ = h.step()
    assert [r.req_id for r in plan.new_reqs] == [other.req_id, a.req_id]  # b waits, and those after it
    plan, _, _ = h.step()
    assert [r.req_id for r in plan.new_reqs] == [b.req_id, c.req_id, short.req_id]
    assert (b.num_cached_tokens, c.num_cached_tokens, short.num_cached_tokens) == (40, 36, 12)
    h.run()
    for r in (other, a, b, c, short):
        assert r.output_token_ids == expected_output(r, 4)
    h.check_no_leaks()
    assert h.s.num_prefix_hits == 40 + 36 + 12

    for kw, cache in (({"prompt_logprobs": 1}, CacheCfg(block_size=4, num_blocks=80)),
                      ({}, CacheCfg(block_size=4, num_blocks=80, enable_prefix_caching=False))):
        h = Harness(SchedCfg(max_num_batched_tokens=256), cache)
        a, b = h.add(list(shared), max_tokens=4), h.add(list(shared), max_tokens=4, **kw)
        plan, _, _ = h.step()
        assert [r.req_id for r in plan.new_reqs] == [a.req_id, b.req_id]
        h.run()
        h.check_no_leaks()


def test_a_request_waits_for_a_shared_prefix_a_chunked_prefill_fills():
    """The prefix is filled a chunk a step by a running request: a request sharing it waits while
    the chunk in flight fills its next shared blocks (budget left for it or not), then hits them."""
    shared = prompt(120)
    h = Harness(SchedCfg(max_num_batched_tokens=64), CacheCfg(block_size=4, num_blocks=80))
    a = h.add(shared + [200], max_tokens=3)
    h.step()  # a: tokens 0..63
    b = h.add(shared + [201, 202], max_tokens=3)
    plan, _, _ = h.step()  # a: 64..120 (57 of the budget's 64), filling b's blocks 16..29: b waits
    assert [r.req_id for r in plan.new_reqs] == [] and plan.reqs[0].num_new_tokens == 57
    plan, _, _ = h.step()
    assert [r.req_id for r in plan.new_reqs] == [b.req_id] and b.num_cached_tokens == 120
    assert next(r for r in plan.reqs if r.req_id == b.req_id).input_token_ids == [201, 202]
    h.run()
    for r in (a, b):
        assert r.output_token_ids == expected_output(r, 3)
    h.check_no_leaks()


# ---------------------------------------------------------------- speculative bookkeeping


def spec_harness(k=4, sched=None, cache=None, **kw):
    sched = sched or SchedCfg(max_num_batched_tokens=64, num_lookahead_tokens=k)
    return Harness(sched, cache or CacheCfg(block_size=4), k=k, **kw)


def test_drafts_past_max_tokens_are_verified_and_dropped():
    """Every pending draft is verified even where max_tokens leaves room for fewer (so a batch
    with a request near its end stays uniform: one CUDA graph); update() ends the output at
    max_tokens exactly."""
    h = spec_harness(k=4)
    r = h.add(prompt(6), max_tokens=3)
    plan, _, _ = h.step()
    assert plan.reqs[0].num_drafts == 0 and plan.reqs[0].num_next_drafts == 4
    assert len(r.block_ids) * 4 >= 6 + 4  # lookahead blocks for the drafts to come
    assert r.num_pending_drafts == 4
    plan, _, events = h.step()
    assert plan.reqs[0].num_drafts == 4  # 1 output so far, room for 2 more: all 4 drafts verified
    assert plan.reqs[0].num_useful_drafts == 1
    assert len(events[0][1]) == 2
    assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, 3)
    # The metrics count the one draft that could become output, as if only it had been verified.
    assert (r.num_draft_rounds, r.num_draft_tokens, r.num_accepted_tokens) == (1, 1, 1)
    assert r.accepted_per_position == [1] and r.acceptance_by_num_drafts == {1: [0, 1]}
    h.check_no_leaks()


def test_drafts_limited_by_max_model_len():
    h = spec_harness(k=4, sched=SchedCfg(max_num_batched_tokens=64, max_model_len=20, num_lookahead_tokens=4))
    r = h.add(prompt(15), max_tokens=100)
    plan, _, _ = h.step()
    assert r.num_tokens == 16
    assert len(plan.reqs[0].block_ids) * h.cache_cfg.block_size <= 20  # the lookahead stops at max_model_len
    plan, _, _ = h.step()
    assert plan.reqs[0].num_drafts == 3  # 20 - 16 - 1
    assert len(plan.reqs[0].block_ids) * h.cache_cfg.block_size <= 20
    assert r.finish_reason == "length" and r.num_tokens == 20
    h.check_no_leaks()


def test_drafts_limited_by_pending_and_budget():
    h = spec_harness(k=4, sched=SchedCfg(max_num_batched_tokens=5, num_lookahead_tokens=4),
                     propose_fn=lambda req, item: 2)
    r = h.add(prompt(3), max_tokens=50)
    h.step()
    plan, _, _ = h.step()
    assert plan.reqs[0].num_drafts == 2  # only 2 proposed
    h2 = spec_harness(k=4, sched=SchedCfg(max_num_batched_tokens=5, num_lookahead_tokens=4))
    a = h2.add(prompt(2), max_tokens=50)
    b = h2.add(prompt(2, base=40), max_tokens=50)
    h2.step()
    plan, _, _ = h2.step()
    by_id = {i.req_id: i for i in plan.reqs}
    assert by_id[a.req_id].num_drafts == 4  # 5 tokens: all of a's
    assert b.req_id not in by_id  # budget exhausted: b waits a step
    plan, _, _ = h2.step()
    assert plan.num_tokens <= 5
    h.run()
    h2.run()
    assert r.output_token_ids == expected_output(r, 50)
    assert a.output_token_ids == expected_output(a, 50) and b.output_token_ids == expected_output(b, 50)
    h.check_no_leaks()
    h2.check_no_leaks()


@pytest.mark.parametrize("record_spec_steps", [False, True])
def test_acceptance_counters(record_spec_steps):
    script = iter([2, 0, 4, 1, 3, 3, 3, 3, 3, 3])
    h = spec_harness(k=4, accept_fn=lambda req, item: min(next(script), item.num_drafts),
                     record_spec_steps=record_spec_steps)
    r = h.add(prompt(5), max_tokens=1000)
    h.step()  # prefill: no verification yet
    assert r.num_draft_rounds == 0 and r.accepted_per_position == [] and r.acceptance_by_num_drafts == {}
    lengths = []
    for _ in range(5):
        _, _, events = h.step()
        lengths.append(len(events[0][1]))
    assert lengths == [3, 1, 5, 2, 4]
    assert r.num_draft_rounds == 5
    assert r.num_draft_tokens == 20
    assert r.num_accepted_tokens == 2 + 0 + 4 + 1 + 3
    assert r.accepted_per_position == [4, 3, 2, 1]  # accepted >= 1: 4 rounds, >= 2: 3, ...
    assert r.acceptance_by_num_drafts == {4: [1, 1, 1, 1, 1]}  # 4 drafts a round, accepting 2, 0, 4, 1, 3
    if record_spec_steps:  # each round in order (vLLM's "detailed" per-request metrics)
        assert r.per_step_accepted == [2, 0, 4, 1, 3] and r.per_step_drafted == [4] * 5
    else:  # not kept unless asked for
        assert r.per_step_accepted is None and r.per_step_drafted is None
    # Computed: the prompt, each round's input token and its accepted drafts; the bonus is pending.
    assert r.num_computed_tokens == 5 + 5 + 10 == r.num_tokens - 1
    assert r.output_token_ids == expected_output(r, 1 + sum(lengths))
    h.s.abort(r.req_id)
    h.check_no_leaks()


def test_stop_token_inside_accepted_run_truncates_exactly():
    def token_fn(req, i):
        return EOS if i == 3 else default_token(req, i)

    h = spec_harness(k=4, token_fn=token_fn)
    r = h.add(prompt(5), max_tokens=100)
    stop_tok = default_token(SimpleNamespace(req_id=1), 2)
    s = h.add(prompt(5, base=30), max_tokens=100, stop_token_ids=[stop_tok])
    assert s.req_id == 1 and stop_tok not in expected_output(s, 2)
    h.step()
    _, _, events = h.step()  # 4 drafts all accepted: outputs 1..5 would come, EOS at index 3
    emitted = dict((q.req_id, t) for q, t in events)
    assert emitted[r.req_id] == expected_output(r, 4, token_fn)[1:]
    assert r.output_token_ids == expected_output(r, 4, token_fn) and r.output_token_ids[-1] == EOS
    assert r.finish_reason == "stop" and r.stop_reason is None
    assert r.num_accepted_tokens == 4  # counted as verified, even though the run was cut
    assert s.output_token_ids[-1] == stop_tok and len(s.output_token_ids) == 3
    assert s.finish_reason == "stop" and s.stop_reason == stop_tok
    h.check_no_leaks()


def test_min_tokens_inside_accepted_run():
    h = spec_harness(k=4, token_fn=lambda req, i: EOS)
    r = h.add(prompt(5), max_tokens=100, min_tokens=4)
    h.step()
    h.step()
    assert r.output_token_ids == [EOS] * 4 and r.finish_reason == "stop"
    h.check_no_leaks()


@pytest.mark.parametrize("mode", ["fixed", "by size", "per step"])
def test_speculative_under_random_load_with_preemption(mode):
    """Dynamic modes draw drafts by batch size (none at 3 requests) or anew every step (0..3, as
    adaptive speculation may), with prompts that share a prefix: the harness checks every step's
    draft KV reads too."""
    dynamic = mode != "fixed"
    rng = random.Random(5 if dynamic else 3)
    per_step = random.Random(9)
    k_for_batch = {"fixed": None, "by size": by_size({1: 3, 2: 2, 3: 0}, 1),
                   "per step": lambda n: per_step.choice([0, 0, 1, 2, 3])}[mode]
    h = spec_harness(
        k=3,
        sched=SchedCfg(max_num_seqs=4, max_num_batched_tokens=12 if dynamic else 16, max_model_len=64,
                       num_lookahead_tokens=3),
        cache=CacheCfg(block_size=4, num_blocks=28 if dynamic else 24),
        accept_fn=lambda req, item: rng.randint(0, item.num_drafts),
        k_for_batch=k_for_batch,
    )
    shared = prompt(12, base=7)
    reqs = []
    for i in range(24 if dynamic else 20):
        if dynamic and i % 3 == 0:
            p = shared + prompt(rng.randint(0, 10), base=i)
        else:
            p = prompt(rng.randint(1, 40), base=rng.randint(2, 40))
        reqs.append(h.add(p, max_tokens=rng.randint(1, 24)))
    h.run()
    assert h.s.num_preemptions > 0
    assert any(r.num_draft_rounds for r in reqs)
    if dynamic:
        assert any(p.draft_backfill for plan in h.plans for p in plan.reqs)
        assert any(p.draft_skip and not p.draft_backfill for plan in h.plans for p in plan.reqs)
    for r in reqs:
        assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, r.max_tokens)
        assert r.num_accepted_tokens == sum(r.accepted_per_position)
        assert r.num_accepted_tokens <= r.num_draft_tokens
    h.check_no_leaks()


# ---------------------------------------------------------------- dynamic speculation


def by_size(table: dict[int, int], default: int):
    """k_for_batch from {batch size: drafts}."""
    return lambda n: table.get(n, default)


def test_drafts_follow_the_batch_size_and_the_draft_catches_up():
    """3 requests draft nothing, 2 draft 1, 1 drafts 4: decode steps without drafting skip the
    draft; the first step that drafts again feeds it every token it skipped (the harness checks
    that the draft then reads only its own KV of the request's tokens)."""
    h = spec_harness(k=4, k_for_batch=by_size({2: 1, 1: 4}, 0))
    a, b, c = (h.add(prompt(5, base=10 * i), max_tokens=m) for i, m in enumerate((6, 12, 40)))
    plan, _, _ = h.step()  # three prefills: the draft runs over every prompt, drafts none
    assert all(not i.draft_skip and i.num_next_drafts == 0 for i in plan.reqs)
    for _ in bounded(lambda: not a.is_finished):
        plan, _, _ = h.step()
        assert all(i.draft_skip and i.num_next_drafts == 0 and i.num_drafts == 0 for i in plan.reqs)
    assert c.draft_start == 5 and c.num_computed_tokens > 5
    plan, _, _ = h.step()  # two left: drafting resumes with the skipped tokens first
    item = next(i for i in plan.reqs if i.req_id == c.req_id)
    assert item.draft_backfill_start == 5 and item.draft_backfill == c.all_token_ids[5 : item.start_pos]
    assert not item.draft_skip and item.num_next_drafts == 1 and c.draft_start is None
    for _ in bounded(lambda: not b.is_finished):
        plan, _, _ = h.step()
    plan, _, _ = h.step()
    assert plan.reqs[0].num_drafts == 1 and plan.reqs[0].num_next_drafts == 4
    h.run()
    assert c.num_draft_rounds > 0 and max(len(c.accepted_per_position), 0) == 4
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()


def test_the_backfill_comes_out_of_the_token_budget():
    """A backfill longer than the budget leaves takes several steps, in which the request drafts
    nothing; it drafts again once the draft has caught up."""
    h = spec_harness(k=2, sched=SchedCfg(max_num_batched_tokens=8, num_lookahead_tokens=2),
                     k_for_batch=by_size({1: 2}, 0))
    short = h.add(prompt(3), max_tokens=30)
    long = h.add(prompt(3, base=50), max_tokens=60)
    for _ in bounded(lambda: not short.is_finished):
        h.step()
    lag = long.num_computed_tokens - long.draft_start
    assert lag > 8
    fed = []
    for _ in bounded(lambda: long.draft_start is not None):
        plan, _, _ = h.step()
        item = plan.reqs[0]
        assert item.num_new_tokens + len(item.draft_backfill) <= 8
        assert (item.num_next_drafts == 0) == item.draft_skip
        fed += item.draft_backfill
    assert len(fed) >= lag and fed == long.all_token_ids[3 : 3 + len(fed)]
    plan, _, _ = h.step()
    assert plan.reqs[0].num_drafts == 2 and not plan.reqs[0].draft_backfill
    h.run()
    assert long.output_token_ids == expected_output(long, 60)
    h.check_no_leaks()


def test_backfills_leave_room_for_every_decode():
    """When drafting resumes for many lagging requests at once, their backfills share what the
    decodes leave of the budget: every request still decodes in that step."""
    h = spec_harness(k=2, sched=SchedCfg(max_num_seqs=8, max_num_batched_tokens=40, num_lookahead_tokens=2),
                     cache=CacheCfg(block_size=4, num_blocks=128), k_for_batch=by_size({6: 2}, 0))
    first = h.add(prompt(3), max_tokens=12)
    rest = [h.add(prompt(3, base=10 * i), max_tokens=40) for i in range(1, 7)]
    for _ in bounded(lambda: not first.is_finished):
        h.step()
    assert sum(r.num_computed_tokens - r.draft_start for r in rest) > 40  # more backfill than budget
    plan, _, _ = h.step()
    assert {i.req_id for i in plan.reqs} == {r.req_id for r in rest}
    assert any(i.draft_skip for i in plan.reqs) and any(i.num_next_drafts == 2 for i in plan.reqs)
    h.run()
    for r in [first] + rest:
        assert r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()


def test_the_prefix_cache_takes_no_block_the_draft_skipped():
    """A cached block must hold valid KV of both models: blocks past draft_start are registered
    only once the draft has caught up on them."""
    h = spec_harness(k=2, cache=CacheCfg(block_size=4, num_blocks=64), k_for_batch=by_size({1: 2}, 0))
    a = h.add(prompt(6), max_tokens=14)
    b = h.add(prompt(6, base=30), max_tokens=30)
    for _ in bounded(lambda: not a.is_finished):
        h.step()
        assert len(b.block_hashes) * 4 <= (b.draft_start if b.draft_start is not None else b.num_computed_tokens)
    assert len(b.block_hashes) == 1 < b.num_computed_tokens // 4
    h.step()  # drafting again: the draft catches up, the blocks are registered
    assert b.draft_start is None and len(b.block_hashes) == b.num_computed_tokens // 4
    c = h.add(b.all_token_ids[:17], max_tokens=4)  # reuses b's blocks: the draft reads their KV (checked)
    h.run()
    assert c.num_cached_tokens == 16
    h.check_no_leaks()


def test_steps_without_drafts_are_planned_ahead():
    """Planning ahead with a draft model: only where the batch size turns drafting off, and the
    draft skips those steps; the outputs are the synchronous loop's."""
    def run(overlap: bool):
        h = spec_harness(k=2, cache=CacheCfg(block_size=4, num_blocks=64), k_for_batch=by_size({1: 2}, 0))
        a = h.add(prompt(5), max_tokens=12)
        b = h.add(prompt(7, base=30), max_tokens=30)
        num_ahead = h.run_async() if overlap else h.run()
        h.check_no_leaks()
        assert b.num_draft_rounds > 0  # alone, b drafts again (after its draft caught up: checked)
        return [a.output_token_ids, b.output_token_ids], num_ahead

    expected, _ = run(False)
    got, num_ahead = run(True)
    assert got == expected and num_ahead >= 5


# ---------------------------------------------------------------- slots


def test_freed_slots_reported_once_and_reused():
    h = Harness(SchedCfg(max_num_seqs=2))
    a = h.add(prompt(3), max_tokens=1)
    b = h.add(prompt(3, base=20), max_tokens=3)
    plan, _, _ = h.step()
    assert sorted(n.slot for n in plan.new_reqs) == [0, 1]
    assert a.is_finished and a.slot is None
    slot_a = plan.new_reqs[0].slot
    c = h.add(prompt(3, base=40), max_tokens=2)
    plan, _, _ = h.step()
    assert plan.freed_slots == [slot_a]
    assert [(n.req_id, n.slot) for n in plan.new_reqs] == [(c.req_id, slot_a)]  # freed, then reused
    plan, _, _ = h.step()
    assert plan.freed_slots == []
    h.run()
    assert b.output_token_ids == expected_output(b, 3) and c.output_token_ids == expected_output(c, 2)
    h.check_no_leaks()


def test_empty_schedule():
    h = Harness()
    plan = h.s.schedule()
    assert plan.is_empty and plan.new_reqs == [] and plan.freed_slots == [] and plan.num_tokens == 0
    assert not h.s.has_unfinished


# ---------------------------------------------------------------- priority scheduling


def by_priority(**kw) -> SchedCfg:
    return SchedCfg(scheduling_policy="priority", **kw)


def admissions(h: Harness) -> list[int]:
    """Request ids in the order they were admitted (re-admissions included)."""
    return [n.req_id for plan in h.plans for n in plan.new_reqs]

def run_and_check(h: Harness, *reqs: Request) -> None:
    """Run to the end: each request's output is its own, and nothing leaks."""
    h.run()
    for r in reqs:
        assert r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()



def test_priority_orders_the_waiting_queue():
    h = Harness(by_priority(max_num_seqs=1))
    a = h.add(prompt(3), max_tokens=2, priority=5)
    b = h.add(prompt(3, base=20), max_tokens=2, priority=0)
    c = h.add(prompt(3, base=40), max_tokens=2, priority=0)
    d = h.add(prompt(3, base=60), max_tokens=2, priority=-1)
    assert list(h.s.waiting) == [d, b, c, a]  # lower value first, then arrival
    h.run()
    assert admissions(h) == [d.req_id, b.req_id, c.req_id, a.req_id]
    assert h.s.num_preemptions == 0
    for r in (a, b, c, d):
        assert r.output_token_ids == expected_output(r, 2)
    h.check_no_leaks()


def test_fcfs_ignores_priority():
    h = Harness(SchedCfg(max_num_seqs=1))
    reqs = [h.add(prompt(3, base=20 * i), max_tokens=2, priority=p) for i, p in enumerate((5, 0, -1))]
    h.run()
    assert admissions(h) == [r.req_id for r in reqs] and h.s.num_preemptions == 0


def test_a_waiting_request_preempts_a_lower_priority_one_for_its_slot():
    h = Harness(by_priority(max_num_seqs=2))
    a = h.add(prompt(4), max_tokens=10, priority=1)
    b = h.add(prompt(4, base=30), max_tokens=10, priority=2)
    for _ in range(3):
        h.step()
    out_b, slot_b = list(b.output_token_ids), b.slot
    c = h.add(prompt(4, base=60), max_tokens=4, priority=0)
    plan, _, _ = h.step()
    # b, the lowest priority, gives its slot to c in the same step; a runs on.
    assert [n.req_id for n in plan.new_reqs] == [c.req_id] and plan.new_reqs[0].slot == slot_b
    assert plan.freed_slots == [slot_b]
    assert {r.req_id for r in plan.reqs} == {a.req_id, c.req_id}
    assert b.status == Status.WAITING and b.num_preemptions == 1 and b.output_token_ids == out_b
    assert a.num_preemptions == 0 and list(h.s.waiting) == [b]
    h.run()
    assert admissions(h)[-1] == b.req_id  # back once a slot is free
    for r in (a, b, c):
        assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()


@pytest.mark.parametrize("late_priority", [0, 1])
def test_equal_or_lower_priority_never_preempts(late_priority):
    h = Harness(by_priority(max_num_seqs=1))
    a = h.add(prompt(4), max_tokens=6, priority=0)
    h.step()
    b = h.add(prompt(4, base=30), max_tokens=3, priority=late_priority)
    h.run()
    assert admissions(h) == [a.req_id, b.req_id] and h.s.num_preemptions == 0


def test_a_planned_decode_is_preempted_only_to_make_room():
    # x (priority 0) and d (priority 1) decode, hi (priority 0) prefills in chunks of 4; when hi's
    # chunk finds no free block, d (planned already) goes and hi gets that chunk in the same step:
    # d's token, back in the budget, does not grow the chunk beyond the room d left.
    h = Harness(by_priority(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64),
                CacheCfg(block_size=4, num_blocks=5, enable_prefix_caching=False))
    x = h.add(prompt(4, base=70), max_tokens=12, priority=0)
    d = h.add(prompt(1, base=50), max_tokens=8, priority=1)
    h.step()
    hi = h.add(prompt(13, base=3), max_tokens=1, priority=0)
    for _ in bounded(lambda: d.num_preemptions == 0):
        plan, _, _ = h.step()
    assert hi.num_preemptions == 0 and next(r for r in plan.reqs if r.req_id == hi.req_id).num_new_tokens == 4
    run_and_check(h, x, d, hi)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_request_goes_ahead_of_a_lower_priority_prefill(policy):
    h = Harness(SchedCfg(max_num_batched_tokens=4, scheduling_policy=policy))
    d = h.add(prompt(2), max_tokens=12, priority=2)
    h.step()
    a = h.add(prompt(20, base=30), max_tokens=2, priority=1)  # a long prompt, four tokens a step
    plan, _, _ = h.step()
    assert [(r.req_id, r.num_new_tokens) for r in plan.reqs] == [(d.req_id, 1), (a.req_id, 3)]
    b = h.add(prompt(3, base=60), max_tokens=2, priority=0)
    plan, _, _ = h.step()
    got = sorted((r.req_id, r.num_new_tokens) for r in plan.reqs)
    # Decodes first either way (d, the lowest priority); then fcfs keeps feeding a's prompt while
    # b waits, and priority admits b ahead of it.
    assert got == ([(d.req_id, 1), (a.req_id, 3)] if policy == "fcfs" else [(d.req_id, 1), (b.req_id, 3)])
    assert h.s.num_preemptions == 0
    run_and_check(h, a, b, d)


@pytest.mark.parametrize("a,b,c,chunk", [
    # a and b hold 3 blocks each after their prompts; c needs 4 for its whole prompt: b, the lower
    # of the two, makes room enough, and a stays.
    ((prompt(5), 3, 1), (prompt(5, base=30), 3, 2), (prompt(7, base=60), 2, 0), 7),
    # a (of c's priority) holds 5 blocks, b 2: b's and the free one hold 6 of c's 8 tokens, so b
    # goes and c starts with a chunk of 6 in the same step.
    ((prompt(9), 2, 0), (prompt(3, base=30), 6, 9), (prompt(8, base=60), 2, 0), 6),
], ids=["whole-prompt", "a-chunk-of-it"])
def test_a_waiting_request_preempts_a_lower_priority_for_blocks(a, b, c, chunk):
    h = Harness(by_priority(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
                CacheCfg(block_size=2, num_blocks=8, enable_prefix_caching=False))
    a, b = (h.add(p, max_tokens=m, priority=q) for p, m, q in (a, b))
    h.step()
    c = h.add(c[0], max_tokens=c[1], priority=c[2])
    plan, _, _ = h.step()
    assert [n.req_id for n in plan.new_reqs] == [c.req_id]
    assert next(r for r in plan.reqs if r.req_id == c.req_id).num_new_tokens == chunk
    assert b.status == Status.WAITING and b.num_preemptions == 1  # the lower priority goes ...
    assert a.status != Status.WAITING and a.num_preemptions == 0  # ... and only as many as c needs
    run_and_check(h, a, b, c)


@pytest.mark.parametrize("budget,num_blocks,low,high", [
    # As test_preemption_by_recompute_keeps_outputs, but the request admitted first is the lower one.
    (32, 10, (prompt(4), 12, 1), (prompt(4, base=50), 12, 0)),
    # The lower one decodes, so the step plans it first; the higher one prefills a long prompt in
    # chunks and runs short of blocks: the decode goes (its tokens back to the budget), not it.
    (4, 8, (prompt(2), 12, 9), (prompt(14, base=40), 2, 0)),
], ids=["not-the-newest", "a-planned-decode"])
def test_a_block_shortage_preempts_the_lowest_priority(budget, num_blocks, low, high):
    h = Harness(by_priority(max_num_batched_tokens=budget, max_model_len=64),
                CacheCfg(block_size=2, num_blocks=num_blocks, enable_prefix_caching=False))
    lo = h.add(low[0], max_tokens=low[1], priority=low[2])
    h.step()
    hi = h.add(high[0], max_tokens=high[1], priority=high[2])
    run_and_check(h, lo, hi)
    assert lo.num_preemptions >= 1 and hi.num_preemptions == 0


@pytest.mark.parametrize("k", [0, 3])
def test_priority_under_random_load_keeps_outputs(k, monkeypatch):
    """Arrivals of random priorities over a scarce pool, with and without drafts: every output is
    the request's own, whatever preempted it, and nothing leaks."""
    rng = random.Random({0: 17, 3: 20}[k])
    h = spec_harness(k=k, sched=by_priority(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
                                            num_lookahead_tokens=k),
                     cache=CacheCfg(block_size=4, num_blocks=16),
                     accept_fn=lambda req, item: rng.randint(0, item.num_drafts))
    for_waiting = []  # (waiting, victim) of the preemptions made for a waiting request
    preempt_for = h.s._preempt_for

    def recorded(req, step):
        running = list(h.s.running)
        if not preempt_for(req, step):
            return False
        (victim,) = [r for r in running if r not in h.s.running]
        for_waiting.append((req, victim))
        return True

    monkeypatch.setattr(h.s, "_preempt_for", recorded)
    reqs = []
    for step in bounded(lambda: len(reqs) < 30 or h.s.has_unfinished, limit=5000):
        if len(reqs) < 30 and rng.random() < 0.5:
            reqs.append(h.add(prompt(rng.randint(1, 30), base=rng.randint(2, 40)), max_tokens=rng.randint(1, 16),
                              priority=rng.randint(0, 3)))
        if h.s.has_unfinished:
            before = {r.req_id: r.num_preemptions for r in reqs}
            num_for_waiting = len(for_waiting)
            plan, _, _ = h.step()
            # A request preempted in a step is not admitted again in it (its room was for another),
            # and one that preempted others for its room is admitted in it (never for nothing).
            admitted = {n.req_id for n in plan.new_reqs}
            assert not [i for i in admitted if h.reqs[i].num_preemptions > before[i]]
            assert {w.req_id for w, _ in for_waiting[num_for_waiting:]} <= admitted
    assert 0 < len(for_waiting) < h.s.num_preemptions  # both kinds happened
    assert all(victim.priority > req.priority for req, victim in for_waiting)
    for r in reqs:
        assert r.finish_reason == "length" and r.output_token_ids == expected_output(r, r.max_tokens)
    h.check_no_leaks()

"""End to end: the OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client.

One server (uvicorn on a background thread) serves the whole module: a tiny random target with a
tiny draft (the target's weights plus noise, so some drafts are accepted and some rejected). A
second LLM with the same configuration runs offline on the test thread as the reference.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.errors import RequestError  # noqa: E402
from tandem.server.api import DrainingServer, build_app  # noqa: E402
from tandem.spec.adaptive import StepCosts  # noqa: E402
from tests.helpers import make_hf_model  # noqa: E402

MODEL = "tiny-spec"
K = 3
LLM_KWARGS = dict(dtype="float32", max_model_len=128, block_size=8, max_num_seqs=64, seed=0)
PROMPTS = [
    "The quick brown fox", "def fib(n):", "Paris is the capital", "Speculative decoding drafts",
    "the lazy dog", "return n if n < 2", "verifies them in one pass", "capital of France.",
]


# ---------------------------------------------------------------- fixtures
def _perturbed_copy(src: Path, dst: Path, scale: float = 0.05) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    noisy = {k: v + scale * torch.randn(v.shape, generator=gen) * v.std().clamp_min(1e-3) for k, v in weights.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server_models")
    target = make_hf_model(root / "target", seed=0)
    return target, _perturbed_copy(target, root / "draft")


def _llm(model_dirs, **overrides) -> LLM:
    target, draft = model_dirs
    kwargs = {**LLM_KWARGS, **overrides}
    return LLM(str(target), speculative_config=dict(model=str(draft), num_speculative_tokens=K), **kwargs)


class LiveServer:
    """uvicorn serving build_app(llm) on a free port, on a background thread."""

    def __init__(self, llm: LLM, tls: dict | None = None, **app_kwargs):
        """tls: uvicorn's TLS arguments (ssl_settings): HTTPS."""
        self.llm = llm
        self.app = build_app(llm, MODEL, **app_kwargs)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5, **(tls or {}))
        self.server = DrainingServer(config, self.app)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not shut down"

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics as {(name, sorted labels without model_name): value}."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def post(self, path: str, timeout: float = 120, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def live(model_dirs):
    server = LiveServer(_llm(model_dirs))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(model_dirs) -> LLM:
    return _llm(model_dirs)


def offline(reference: LLM, prompts, **params):
    return reference.generate(prompts, SamplingParams(**params), use_tqdm=False)


def greedy(**kw) -> dict:
    return dict(temperature=0.0, **kw)


# ---------------------------------------------------------------- basic routes
def test_health_and_models(live):
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    assert httpx.get(live.url + "/ping").json() == httpx.post(live.url + "/ping").json() == {"status": "ok"}
    models = live.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 128


def test_invocations_routes_chat_and_completions(live):
    """/invocations (vLLM's, for SageMaker): a body with messages is a chat completion, one with prompt a
    completion, answered as those routes answer; a body with neither, or no JSON, is a 400 naming both."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, seed=1)
    cmpl = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    for body, path in ((chat, "/v1/chat/completions"), (cmpl, "/v1/completions")):
        got, want = live.post("/invocations", json=body).json(), live.post(path, json=body).json()
        for r in (got, want):
            r.pop("id"), r.pop("created")
        assert got == want and got["choices"][0]["finish_reason"] == "length", got
    r = live.post("/invocations", json={**chat, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()  # the chat route's own check
    for raw, says in ((b'{"model": "m", "input": "hi"}', "with 'messages'"), (b"[1, 2]", "with 'prompt'"),
                      (b"{not json", "not JSON")):
        r = live.post("/invocations", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- completions
def test_completion_matches_offline_greedy(live, reference):
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    ref = offline(reference, PROMPTS[0], **greedy(max_tokens=16))[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == r.usage.prompt_tokens + 16
    assert "metrics" not in r.model_extra  # per-request metrics are off unless the server turns them on (vLLM's)


def test_seeded_sampling_is_reproducible_and_matches_offline(live, reference):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    a = live.client.completions.create(**kw)
    b = live.client.completions.create(**kw)
    ref = offline(reference, PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)[0]
    assert a.choices[0].text == b.choices[0].text == ref.outputs[0].text
    # a negative seed (vLLM takes any int64) is as reproducible
    neg = [live.client.completions.create(**{**kw, "seed": -7}).choices[0].text for _ in range(2)]
    assert neg[0] == neg[1] == offline(reference, PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95,
                                       seed=-7)[0].outputs[0].text


def test_n_choices_match_offline(live, reference):
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, seed=7, n=3)
    ref = offline(reference, PROMPTS[2], max_tokens=8, temperature=1.0, seed=7, n=3)[0]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == 24


def test_prompt_forms(live, reference):
    tok = reference.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS[:2]]
    refs = offline(reference, PROMPTS[:2], **greedy(max_tokens=6))
    want = [o.outputs[0].text for o in refs]
    for prompt, expect in [(PROMPTS[:2], want), (ids[0], want[:1]), (ids, want)]:
        r = live.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert [c.index for c in r.choices] == list(range(len(expect)))
        assert [c.text for c in r.choices] == expect
        assert r.usage.prompt_tokens == sum(len(i) for i in ids[: len(expect)])


def test_stop_sequence(live, reference):
    base = offline(reference, PROMPTS[3], **greedy(max_tokens=24))[0].outputs[0].text
    stop = base[6:8]
    assert len(stop) == 2, base
    cut = base[: base.find(stop)]
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = live.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                            stop=stop, stream=True)
    streamed = list(chunks)
    assert "".join(c.choices[0].text for c in streamed) == cut  # no part of the stop string leaks out
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_allowed_token_ids_match_offline(live, reference):
    allowed = list(range(100, 300))
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                       extra_body={"allowed_token_ids": allowed})
    ref = offline(reference, PROMPTS[2], **greedy(max_tokens=8, allowed_token_ids=allowed))[0].outputs[0]
    assert set(ref.token_ids) <= set(allowed)
    assert r.choices[0].text == ref.text


def test_bad_words_and_grammars_are_prepared_off_the_engine_loop(live, reference, monkeypatch):
    """A request's bad words are tokenized and its grammar compiled on a tokenizing thread, not on
    the engine loop's thread, which steps every request (300k bad words held it 7.6 s, a 1 MB
    grammar about 1 s); the outputs are the offline engine's."""
    import tandem.engine.engine as engine_module

    engine = live.app.state.server.client.engine
    seen = []
    bad_word_ids, compile_, validate = engine_module.bad_word_ids, engine.grammars.compile, engine.grammars.validate
    monkeypatch.setattr(engine_module, "bad_word_ids", lambda tokenizer, words: (
        seen.append(("bad_words", threading.current_thread().name)), bad_word_ids(tokenizer, words))[1])
    monkeypatch.setattr(engine.grammars, "compile", lambda *a, **kw: (
        seen.append(("grammar", threading.current_thread().name)), compile_(*a, **kw))[1])
    monkeypatch.setattr(engine.grammars, "validate", lambda *a, **kw: (
        seen.append(("validate", threading.current_thread().name)), validate(*a, **kw))[1])
    base = offline(reference, PROMPTS[0], **greedy(max_tokens=12))[0].outputs[0]
    tok = reference.get_tokenizer()
    word = next(w for w in map(tok.decode, ([t] for t in base.token_ids)) if w.strip().isalnum())
    ref = offline(reference, PROMPTS[0], **greedy(max_tokens=12, bad_words=[word]))[0].outputs[0]
    assert word and ref.text != base.text
    seen.clear()
    r = live.post(C, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                           "bad_words": [word]}).json()
    assert r["choices"][0]["text"] == ref.text, r
    regex = "(ab|cd)+e"
    ref = offline(reference, PROMPTS[1], **greedy(max_tokens=12, structured_outputs={"regex": regex}))[0].outputs[0]
    r = live.post(C, json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                           "structured_outputs": {"regex": regex}}).json()
    assert r["choices"][0]["text"] == ref.text, r
    assert {what for what, _ in seen} == {"bad_words", "grammar", "validate"}
    assert all(thread.startswith("tandem-tokenize") for _, thread in seen), seen  # none on the engine loop's


def test_a_long_tokenizing_holds_up_its_own_request_only(live, monkeypatch):
    """Prompts are templated and tokenized on several threads, each with its own copy of the
    tokenizer: a prompt that takes long (10 MB: seconds) holds up its own request, not the next
    one (all of them waited behind it on the one thread before)."""
    server = live.app.state.server
    entered, release = threading.Event(), threading.Event()
    prompt_ = server._prompt

    def held_prompt(prompt, *args):
        if prompt == "HOLD":
            entered.set()
            release.wait(60)
        return prompt_(prompt, *args)

    monkeypatch.setattr(server, "_prompt", held_prompt)
    held = {}
    worker = threading.Thread(target=lambda: held.setdefault("r", live.post(
        C, json={"model": MODEL, "prompt": "HOLD", "max_tokens": 1})))
    worker.start()
    try:
        assert entered.wait(30)
        for body in ({"prompt": PROMPTS[0], "max_tokens": 2}, {"messages": [{"role": "user", "content": "hi"}]}):
            path = C if "prompt" in body else CH
            r = live.post(path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
            assert r.status_code == 200 and worker.is_alive(), r.text
        r = live.post("/tokenize", json={"prompt": PROMPTS[1], "return_token_strs": True}, timeout=30)
        assert r.status_code == 200 and len(r.json()["token_strs"]) == r.json()["count"] > 0, r.text
    finally:
        release.set()
        worker.join(60)
    assert held["r"].status_code == 200, held["r"].text


def test_prompt_logprobs_and_echo_with_logprobs(live, reference):
    """vLLM's prompt_logprobs (completions and chat), and OpenAI's echo with logprobs: the prompt's
    tokens lead the logprobs, the first without one."""
    ref = offline(reference, PROMPTS[1], **greedy(max_tokens=4, logprobs=2, prompt_logprobs=2))[0]
    want = [None] + [lp[t].logprob for lp, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]
    r = live.post(C, json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
                           "prompt_logprobs": 2}).json()
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want)
    assert [g[str(t)]["logprob"] for g, t in zip(got[1:], ref.prompt_token_ids[1:])] == pytest.approx(want[1:], abs=1e-4)
    assert all(len(g) <= 3 for g in got[1:])
    # echo with a wider logprobs does not widen the prompt_logprobs shown
    wide = live.post(C, json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0, "echo": True,
                              "logprobs": 5, "prompt_logprobs": 0}).json()["choices"][0]
    assert [list(g) for g in wide["prompt_logprobs"][1:]] == [[str(t)] for t in ref.prompt_token_ids[1:]]
    chat = live.post(CH, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                               "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    echo = live.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2,
                                          echo=True).choices[0]
    lp = echo.logprobs
    n = len(ref.prompt_token_ids)
    assert lp.token_logprobs[:n] == pytest.approx(want, abs=1e-4)
    assert lp.token_logprobs[n:] == pytest.approx([d[t].logprob for d, t in zip(ref.outputs[0].logprobs,
                                                                               ref.outputs[0].token_ids)], abs=1e-4)
    assert lp.top_logprobs[0] is None and len(lp.tokens) == n + 4
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[n] == lp.text_offset[n - 1] + len(lp.tokens[n - 1])  # the completion goes on from the prompt
    assert "".join(lp.tokens[:n]) == PROMPTS[1] and echo.text.startswith(PROMPTS[1])
    assert echo.model_extra.get("prompt_logprobs") is None  # not asked for
    # echo with max_tokens 0 scores the prompt alone
    scored = live.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=0, temperature=0, logprobs=1,
                                            echo=True)
    assert scored.choices[0].text == PROMPTS[1] and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    # ... streamed too: the prompt's text and logprobs, finish_reason "length", no completion tokens
    scored_chunks = list(live.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=0, temperature=0, logprobs=1, echo=True, stream=True,
        stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in scored_chunks if c.choices]
    assert "".join(c.text for c in choices) == PROMPTS[1] and choices[-1].finish_reason == "length"
    assert [x for c in choices if c.logprobs for x in c.logprobs.token_logprobs] == pytest.approx(want, abs=1e-4)
    assert scored_chunks[-1].usage.completion_tokens == 0
    # Streamed: the first chunk of the choice carries the prompt's part, then the completion follows.
    chunks = [c.choices[0] for c in live.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=2, echo=True, stream=True,
        extra_body={"prompt_logprobs": 2}) if c.choices]
    assert chunks[0].text == PROMPTS[1] and chunks[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    assert [g and {int(t): v["logprob"] for t, v in g.items()} for g in chunks[0].model_extra["prompt_logprobs"]] \
        == [g and {int(t): v["logprob"] for t, v in g.items()} for g in got]
    assert "".join(c.text for c in chunks) == echo.text
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    offsets = [x for c in chunks if c.logprobs for x in c.logprobs.text_offset]
    assert offsets == lp.text_offset


def test_truncate_prompt_tokens(live, reference):
    r = live.post(C, json={"model": MODEL, "prompt": [5] * 200, "max_tokens": 3, "temperature": 0,
                           "truncate_prompt_tokens": 50})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 50
    r = live.post(C, json={"model": MODEL, "prompt": [5] * 4, "max_tokens": 3, "truncate_prompt_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert "greater than max_model_len" in r.json()["error"]["message"], r.text


def test_echo_of_a_truncated_token_id_prompt_is_what_ran(live, reference):
    """echo with a cut token-id prompt gives the kept tokens' text (vLLM decodes the cut ids), in step
    with the echoed logprobs' tokens and offsets; it used to echo the whole prompt."""
    tok = reference.get_tokenizer()
    ids = tok(" ".join(PROMPTS), add_special_tokens=False).input_ids
    kept = tok.decode(ids[-4:])
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "n": 1,
            "truncate_prompt_tokens": 4, "logprobs": 0}
    r = live.post(C, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(kept) and "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert choice["logprobs"]["text_offset"][:4] == [len(tok.decode(ids[-4:-4 + i])) for i in range(4)]
    streamed = live.client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True,
                                              logprobs=0, stream=True, extra_body={"truncate_prompt_tokens": 4})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice["text"]
    bad = live.post(C, json={**body, "prompt": [5, 6, -1, 7], "truncate_prompt_tokens": 2})
    assert bad.status_code == 400 and "prompt_token_ids" in bad.text, bad.text  # was a 500 from decoding -1


def test_truncate_prompt_tokens_keeps_a_text_prompts_bos(tmp_path):
    """A text prompt is cut the way the tokenizer cuts from the left (as vLLM tokenizes): the BOS it
    adds stays, and counts; token-id prompts are cut as they are."""
    llm = LLM(str(make_hf_model(tmp_path / "bos", add_bos=True)), **LLM_KWARGS)
    text = " ".join(PROMPTS)
    full = llm.get_tokenizer()(text).input_ids
    bos = full[0]
    assert bos == llm.get_tokenizer().bos_token_id and len(full) > 20
    offline = llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=8), use_tqdm=False)[0]
    assert offline.prompt_token_ids == [bos] + full[-7:]  # LLM.generate cuts a text prompt the same way
    server = LiveServer(llm)
    try:
        def run(prompt):
            r = server.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0, "truncate_prompt_tokens": 8})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens"]

        kept = run([bos] + full[-7:])
        assert run(text) == kept and kept[1] == 8
        assert run(full) == run(full[-8:])  # ids: the last 8, whatever they are
    finally:
        server.stop()


def test_generation_config_defaults_fill_the_fields_a_request_leaves_out(model_dirs, tmp_path):
    """vLLM's --generation-config auto: the model's recommended sampling settings are the defaults
    of the fields a request leaves out (here top_k 1: greedy at any temperature); a request's own
    value wins; max_new_tokens caps max_tokens."""
    import json

    src, _ = model_dirs
    d = tmp_path / "m"
    shutil.copytree(src, d)
    config = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.7, "top_k": 1,
                                                          "max_new_tokens": 6}))
    server = LiveServer(LLM(str(d), **LLM_KWARGS))
    try:
        def text(**fields):
            r = server.post(C, json={"model": MODEL, "prompt": PROMPTS[0], "ignore_eos": True, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

        greedy = text(temperature=0)
        assert greedy[1] == 6  # max_tokens 16 (the default) capped by max_new_tokens
        assert [text(seed=s) for s in (1, 2, 3)] == [greedy] * 3
        assert text(max_tokens=3)[1] == 3
        assert any(text(seed=s, top_k=0, temperature=1.0) != greedy for s in (1, 2, 3))
    finally:
        server.stop()


def test_a_default_max_tokens_past_the_context_is_cut_to_the_room_not_refused(model_dirs):
    """A server default for max_tokens (max_new_tokens) is what a request gets when it sends none,
    cut to the room its prompt leaves, as vLLM's get_max_tokens does: only a max_tokens the client
    sent can be refused as past the context (it named a field the client never set)."""
    server = LiveServer(LLM(model_dirs[0], **LLM_KWARGS, override_generation_config={"max_new_tokens": 120}))
    try:
        prompt = {"prompt": PROMPTS[0], "ignore_eos": True}
        num = server.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["count"]
        room = LLM_KWARGS["max_model_len"] - num
        assert 0 < room < 120
        r = server.post(C, json={"model": MODEL, **prompt, "max_tokens": None})  # (left out: OpenAI's 16)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = server.post(C, json={"model": MODEL, **prompt, "max_tokens": room + 1})  # the client's own: refused
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert server.post(C, json={"model": MODEL, **prompt, "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "ignore_eos": True}
        r = server.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        r = server.post("/v1/responses", json={"model": MODEL, "input": PROMPTS[0]})
        assert r.status_code == 200, r.text
        r = server.post(C, json={"model": MODEL, "prompt": PROMPTS[0], "use_beam_search": True, "n": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2 * room, r.text
    finally:
        server.stop()


def test_a_developer_message_is_a_system_one_where_the_template_has_no_such_role(live, reference):
    """OpenAI's developer role (its newer name for system) reaches a template that names no such
    role (most: they would drop it) as a system message, in chat and /tokenize as offline; a
    template that names it gets it as it is."""
    from tandem.chat import developer_as_system

    as_dev = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    as_sys = [{**as_dev[0], "role": "system"}, as_dev[1]]
    ids = [live.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (as_dev, as_sys)]
    assert ids[0] == ids[1]
    tok = reference.get_tokenizer()
    assert ids[0] == tok(tok.apply_chat_template(as_sys, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids
    chats = [reference.chat(m, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0] for m in (as_dev, as_sys)]
    assert chats[0].prompt_token_ids == chats[1].prompt_token_ids
    harmony = "{% for m in messages %}{% if m.role == 'developer' %}# Instructions{% endif %}{% endfor %}"
    assert developer_as_system(as_dev, harmony) == as_dev and developer_as_system(as_dev, "{{ x }}") == as_sys
    assert developer_as_system(as_dev, "You help developers. {{ x }}") == as_sys  # the word alone is no role
    assert developer_as_system(as_dev, {"default": "{{ x }}", "tool_use": harmony}) == as_dev


def test_tokenize_detokenize_and_version(live, reference):
    tok = reference.get_tokenizer()
    r = live.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()
    assert r["tokens"] == tok(PROMPTS[0]).input_ids and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert "token_strs" not in r
    strs = live.post("/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()["token_strs"]
    assert strs == tok.convert_ids_to_tokens(r["tokens"])  # vLLM's return_token_strs
    messages = [{"role": "user", "content": "hi"}]
    chat = live.post("/tokenize", json={"messages": messages}).json()
    usage = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert live.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens"), ("/detokenize", {}, "tokens")):
        bad = live.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert live.post("/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404
    assert httpx.get(live.url + "/version").json()["version"]


def test_chat_template_and_its_kwargs(live, reference):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}"
    hi = [{"role": "user", "content": "hi"}]
    # A template sent in a request is code run on the server: refused unless the server trusts them (vLLM's rule).
    for body in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
        for path, extra in ((CH, {"max_tokens": 1}), ("/tokenize", {})):
            r = live.post(path, json={"model": MODEL, "messages": hi, **extra, **body})
            assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == next(iter(body))
    server = live.app.state.server
    server.trust_request_chat_template = True
    try:
        r = live.post(CH, json={"model": MODEL, "messages": hi, "max_tokens": 1, "chat_template": template,
                                "chat_template_kwargs": {"suffix": " there"}}).json()
        # reasoning_effort reaches the template as the Responses API's reasoning.effort does (a kwarg wins)
        effort, counts = "{{ reasoning_effort }}", []
        for body, rendered in [({"reasoning_effort": "medium"}, "medium"),
                               ({"reasoning_effort": "medium",
                                 "chat_template_kwargs": {"reasoning_effort": "x y z w v u t s"}}, "x y z w v u t s")]:
            got = live.post(CH, json={"model": MODEL, "messages": hi, "max_tokens": 1, "chat_template": effort,
                                      **body}).json()
            want = live.post("/tokenize", json={"model": MODEL, "messages": hi, "chat_template": effort,
                                                 "chat_template_kwargs": {"reasoning_effort": rendered}}).json()
            assert got["usage"]["prompt_tokens"] == want["count"], (got, want)
            tokenized = live.post("/tokenize", json={"model": MODEL, "messages": hi, "chat_template": effort, **body})
            assert tokenized.json()["count"] == want["count"], tokenized.text  # /tokenize renders as chat does
            counts = counts + [want["count"]] if body.get("chat_template_kwargs") else [want["count"]]
        assert counts[0] != counts[1]  # (the two renderings tell apart)
        broken = live.post(CH, json={"model": MODEL, "messages": hi, "chat_template": "{{ raise_exception('no') }}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages", broken.text
        # A slow template renders off the event loop: the server keeps answering meanwhile.
        slow = "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}hi"
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault("r", live.post(
            CH, json={"model": MODEL, "messages": hi, "max_tokens": 1, "chat_template": slow})))
        worker.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.get(live.url + "/health", timeout=30).status_code == 200
        health_s = time.monotonic() - t0
        still_rendering = worker.is_alive()
        worker.join(120)
        assert result["r"].status_code == 200, result["r"].text
        assert not still_rendering or health_s < 1.0, health_s
    finally:
        server.trust_request_chat_template = False
    want = reference.get_tokenizer()("hi there", add_special_tokens=False).input_ids
    assert r["usage"]["prompt_tokens"] == len(want)
    # kwargs override the request's own fields (vLLM's rule) instead of clashing with them
    r = live.post(CH, json={"model": MODEL, "messages": hi, "max_tokens": 1,
                            "chat_template_kwargs": {"add_generation_prompt": False, "tokenize": True}})
    assert r.status_code == 200, r.text


def test_messages_reach_the_template_as_vllm_prepares_them(live, reference):
    """vLLM's preparation of messages (chat_utils): null content is empty; text parts (plain
    strings and the Responses API's input_text too) are joined by newlines, or kept as parts for a
    template that loops over them; another part type is refused by name; an empty tool_calls list
    is dropped and empty arguments are {}; keys a template is not given are left out; documents
    reach the template."""
    tok = reference.get_tokenizer()
    server = live.app.state.server

    def prompt(messages, template, **extra) -> str:
        r = live.post("/tokenize", json={"messages": messages, "chat_template": template, **extra})
        assert r.status_code == 200, r.text
        return tok.decode(r.json()["tokens"])

    strings = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}|{{ 'tool_calls' in m }}|{{ 'x' in m }}" \
              "{% if 'tool_calls' in m %}|{{ m['tool_calls'][0]['function']['arguments'] }}{% endif %}]" \
              "{% endfor %}{% for d in documents or [] %}<{{ d['text'] }}>{% endfor %}"
    parts = "{% for m in messages %}{% for p in m['content'] %}({{ p['text'] }}){% endfor %}{% endfor %}"
    server.trust_request_chat_template = True
    try:
        got = prompt([{"role": "user", "content": None, "x": "hidden"},
                      {"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]},
                      {"role": "assistant", "content": "ok", "tool_calls": []},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]}],
                     strings, documents=[{"text": "doc"}])
        assert got == "[user:|False|False][user:a\nb|False|False][assistant:ok|False|False][assistant:|True|False|{}]" \
            "<doc>", got
        assert prompt([{"role": "user", "content": "ab"}, {"role": "user", "content": ["c", "d"]}], parts) == \
            "(ab)(c)(d)"
        # --chat-template-content-format (vLLM's) overrides the detection: "string" joins the parts
        server.chat_template_content_format = "string"
        assert prompt([{"role": "user", "content": ["a", "b"]}], strings).startswith("[user:a\nb|")
        server.chat_template_content_format = "openai"  # parts even to a template that does not loop over them
        assert prompt([{"role": "user", "content": "a"}], "{{ messages[0]['content'][0]['text'] }}") == "a"
        bad = live.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
        assert bad.status_code == 400 and "'image_url' part" in bad.json()["error"]["message"], bad.text
    finally:
        server.trust_request_chat_template = False
        server.chat_template_content_format = "auto"


def test_api_keys_and_the_servers_chat_template(model_dirs, reference):
    """api_keys (--api-key): a /v1 request without one of the keys is a 401 that reaches no handler,
    the other routes stay open; chat_template (--chat-template): the server's template is what chat
    and /tokenize render, a request's own (when trusted) still winning; a broken one fails at start."""
    from tandem.errors import ConfigError

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    server = LiveServer(_llm(model_dirs), api_keys=["sk-one", "sk-two"], chat_template=template, root_path="/tandem")
    try:
        hi = [{"role": "user", "content": "hi"}]
        for key in ("unused", "sk-one-more", "sk-on"):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                client.chat.completions.create(model=MODEL, messages=hi, max_tokens=1)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key", e.value.body
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/tandem/v1/models").status_code == 401  # under --root-path too
        assert httpx.get(server.url + "/tandem/v1/models", headers={"Authorization": "Bearer sk-one"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "sk-two"}).status_code == 401
        assert server.post("/invocations", json={"prompt": "hi", "max_tokens": 1}).status_code == 401  # it generates
        for path in ("/health", "/version", "/metrics"):
            assert httpx.get(server.url + path).status_code == 200, path
        assert server.metrics()[("tandem_request_errors_total", (("status", "401"),))] == 7
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-two", max_retries=0)
        chat = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=4, temperature=0)
        text = "<user>hi\n<assistant>"
        tok = reference.get_tokenizer()
        want = reference.generate([text], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        assert chat.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)
        assert chat.choices[0].message.content == want.outputs[0].text
        assert server.post("/tokenize", json={"messages": hi}).json()["tokens"] == \
               tok(text, add_special_tokens=False).input_ids
        unset = server.post("/tokenize", json={"messages": hi, "chat_template_kwargs": {"chat_template": None}})
        assert unset.json()["tokens"] == tok(text, add_special_tokens=False).input_ids  # not the tokenizer's
        server.app.state.server.trust_request_chat_template = True
        own = server.post("/tokenize", json={"messages": hi, "chat_template": "{{ messages[0]['content'] }}!"})
        assert own.json()["tokens"] == tok("hi!", add_special_tokens=False).input_ids
    finally:
        server.stop()
    with pytest.raises(ConfigError, match="--chat-template is not a valid Jinja template"):
        build_app(server.llm, MODEL, chat_template="{% for m in messages %}")


def test_a_broken_model_chat_template_is_the_servers_error(model_dirs, caplog):
    """The model's own chat template with a Jinja syntax error: the server starts (completions serve) with a
    warning naming --chat-template, and a chat is a 500 server_error saying so (a 400 blaming 'messages'
    before); a request's own broken template stays the client's 400; LLM.chat names chat_template=."""
    llm = _llm(model_dirs)
    llm.get_tokenizer().chat_template = "{% for m in messages %}{{ m['content'] }"
    with caplog.at_level("WARNING", logger="tandem.server"):
        server = LiveServer(llm)
    try:
        assert any("chat template is not valid Jinja" in r.message and "--chat-template" in r.message
                   for r in caplog.records), caplog.text
        hi = [{"role": "user", "content": "hi"}]
        r = server.post(CH, json={"model": MODEL, "messages": hi, "max_tokens": 1})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "--chat-template" in r.json()["error"]["message"]
        assert server.post(C, json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200
        server.app.state.server.trust_request_chat_template = True
        r = server.post(CH, json={"model": MODEL, "messages": hi, "max_tokens": 1, "chat_template": "{% if %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    finally:
        server.stop()
    with pytest.raises(RequestError, match="the model's template is broken: pass chat_template="):
        llm.chat(hi)


def test_fill_in_the_middle(model_dirs, tmp_path):
    """/v1/completions' suffix on a model whose tokenizer has FIM sentinels (Qwen2.5-Coder's here):
    the completion of <|fim_prefix|>PROMPT<|fim_suffix|>SUFFIX<|fim_middle|>, streamed or not, for
    each prompt of a list."""
    from transformers import AutoTokenizer

    from tandem.server.fim import FIM_SENTINELS, fim_sentinels

    model = tmp_path / "fim"
    shutil.copytree(model_dirs[0], model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": list(FIM_SENTINELS[0])})
    tok.save_pretrained(model)
    assert fim_sentinels(tok) == FIM_SENTINELS[0] and fim_sentinels(AutoTokenizer.from_pretrained(model_dirs[0])) is None
    llm = LLM(str(model), **LLM_KWARGS)
    server = LiveServer(llm)
    try:
        prompts, suffix = ["def fib(n):", "Paris is"], " the capital"
        body = {"model": MODEL, "prompt": prompts, "suffix": suffix, "max_tokens": 6, "temperature": 0}
        got = server.post(C, json=body).json()
        texts = [f"<|fim_prefix|>{p}<|fim_suffix|>{suffix}<|fim_middle|>" for p in prompts]
        want = server.llm.get_tokenizer()(texts[0]).input_ids
        assert want[0] == tok.convert_tokens_to_ids("<|fim_prefix|>")  # each sentinel one token
        assert want[-1] == tok.convert_tokens_to_ids("<|fim_middle|>")
        ref = LLM(str(model), **LLM_KWARGS).generate(texts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == [o.outputs[0].text for o in ref]
        assert got["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref)
        streamed = server.client.completions.create(model=MODEL, prompt=prompts[0], suffix=suffix, max_tokens=6,
                                                    temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == ref[0].outputs[0].text
        cut = server.post(C, json={**body, "truncate_prompt_tokens": 4})  # it would cut the sentinels off
        assert cut.status_code == 400 and cut.json()["error"]["param"] == "truncate_prompt_tokens", cut.text
    finally:
        server.stop()


def test_cors_docs_token_ids_and_prompt_tokens_details(model_dirs, live):
    """cors (--allowed-origins): a listed origin's preflight and requests get the CORS headers, another
    origin's preflight is refused; enable_docs=False: no /docs; enable_prompt_tokens_details: usage
    says how many prompt tokens the prefix cache served (none on a cold prompt, most when repeated);
    return_tokens_as_token_ids: logprobs name tokens "token_id:N", the same tokens at the same offsets."""
    server = LiveServer(_llm(model_dirs), cors=dict(allow_origins=["https://ui.example"], allow_methods=["*"],
                                                    allow_headers=["*"], allow_credentials=False),
                        enable_docs=False, enable_prompt_tokens_details=True, return_tokens_as_token_ids=True)
    try:
        ask = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
        ok = httpx.options(server.url + CH, headers=ask)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
        assert httpx.options(server.url + CH, headers={**ask, "Origin": "https://evil.example"}).status_code == 400
        models = httpx.get(server.url + "/v1/models", headers={"Origin": "https://ui.example"})
        assert models.headers["access-control-allow-origin"] == "https://ui.example"
        assert httpx.get(server.url + "/docs").status_code == 404
        prompt = "The quick brown fox jumps over the lazy dog, " * 4
        cold, warm = (server.post(C, json={"model": MODEL, "prompt": prompt, "max_tokens": 2}).json()["usage"]
                      for _ in range(2))
        assert cold["prompt_tokens_details"] == {"cached_tokens": 0}
        assert cold["prompt_tokens"] - 8 <= warm["prompt_tokens_details"]["cached_tokens"] < cold["prompt_tokens"]
        chat = server.post(CH, json=OK_CH).json()["usage"]
        assert set(chat["prompt_tokens_details"]) == {"cached_tokens"}
        assert "prompt_tokens_details" not in live.post(CH, json=OK_CH).json()["usage"]  # only when asked
        echoed = server.post(C, json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True}).json()
        assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a prompt scored, from the cache
        assert live.post(C, json={"model": MODEL, "prompt": "hi", "suffix": "", "max_tokens": 1}).status_code == 200
        ask = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True}
        ids, text = (s.post(C, json=ask).json()["choices"][0]["logprobs"] for s in (server, live))
        assert ids["text_offset"] == text["text_offset"] and ids["token_logprobs"] == text["token_logprobs"]
        ask = {**ask, "echo": False}
        streamed = [c.choices[0].logprobs for c in server.client.completions.create(**ask, stream=True)
                    if c.choices and c.choices[0].logprobs]  # offsets count the tokens' texts, not their names
        assert [o for lp in streamed for o in lp.text_offset] == live.post(C, json=ask).json()["choices"][0][
            "logprobs"]["text_offset"]
        tok = live.llm.get_tokenizer()
        assert [tok.decode([int(t.removeprefix("token_id:"))]) for t in ids["tokens"]] == text["tokens"]
        assert all(all(k.startswith("token_id:") for k in top) for top in ids["top_logprobs"][1:])
        chat = server.post(CH, json={**OK_CH, "logprobs": True, "top_logprobs": 2}).json()["choices"][0]["logprobs"]
        assert all(c["token"].startswith("token_id:") and c["bytes"] == list(c["token"].encode())
                   and all(t["token"].startswith("token_id:") for t in c["top_logprobs"]) for c in chat["content"])
        assert httpx.get(live.url + "/docs").status_code == 200 and "access-control-allow-origin" not in \
            httpx.get(live.url + "/v1/models", headers={"Origin": "https://ui.example"}).headers
    finally:
        server.stop()


def test_request_id_names_the_response(live):
    """vLLM's request_id: the response's id is cmpl-/chatcmpl- and it, streamed too; an X-Request-Id
    header wins over it; two requests in flight under one id both succeed."""
    import concurrent.futures
    assert live.post(C, json={**OK_C, "request_id": "abc"}).json()["id"] == "cmpl-abc"
    assert live.post(CH, json={**OK_CH, "request_id": "abc"}).json()["id"] == "chatcmpl-abc"
    head = live.post(CH, json={**OK_CH, "request_id": "abc"}, headers={"X-Request-Id": "trace-7"}).json()
    assert head["id"] == "chatcmpl-trace-7"
    assert live.post(C, json=OK_C).json()["id"].startswith("cmpl-")
    ids = {c.id for c in live.client.chat.completions.create(**OK_CH, stream=True, extra_body={"request_id": "s1"})}
    assert ids == {"chatcmpl-s1"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ask = {**OK_C, "max_tokens": 8, "ignore_eos": True, "request_id": "same"}
        replies = list(pool.map(lambda _: live.post(C, json=ask), range(4)))
    assert [(r.status_code, r.json()["id"]) for r in replies] == [(200, "cmpl-same")] * 4


def test_cache_salt_and_token_ids_per_request(model_dirs, live):
    """cache_salt (vLLM's): a prompt reaches the cached blocks of earlier prompts with its salt only
    (with another salt, or none, nothing is cached); an empty salt is refused by name.
    return_tokens_as_token_ids set by the request names tokens "token_id:N" without the server flag."""
    server = LiveServer(_llm(model_dirs), enable_prompt_tokens_details=True)
    try:
        prompt = "Paris is the capital of France. Speculative decoding drafts tokens, " * 3

        def cached(**salt) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **salt}
            return server.post(C, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(cache_salt="alice") == 0
        assert cached(cache_salt="alice") > 0
        assert cached(cache_salt="bob") == 0 and cached() == 0
        assert cached() > 0 and cached(cache_salt="bob") > 0
        chat = server.post(CH, json={**OK_CH, "cache_salt": "carol"}).json()["usage"]["prompt_tokens_details"]
        assert chat == {"cached_tokens": 0}
        bad = server.post(C, json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        ask = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "logprobs": 1}
        plain = live.post(C, json=ask).json()["choices"][0]["logprobs"]["tokens"]
        ids = live.post(C, json={**ask, "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]["tokens"]
        tok = live.llm.get_tokenizer()
        assert all(t.startswith("token_id:") for t in ids)
        assert [tok.decode([int(t.removeprefix("token_id:"))]) for t in ids] == plain
        chat = live.post(CH, json={**OK_CH, "logprobs": True, "return_tokens_as_token_ids": True}).json()
        assert all(c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"])
    finally:
        server.stop()


def test_return_token_ids(live):
    """return_token_ids (vLLM's): the prompt's token ids and each choice's, whole or streamed (the
    prompt's with a choice's first chunk, each chunk's own token ids), on completions and chat."""
    tok = live.llm.get_tokenizer()
    ask = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2,
           "ignore_eos": True, "return_token_ids": True}
    whole = live.post(C, json=ask).json()["choices"]
    assert whole[0]["prompt_token_ids"] == tok(PROMPTS[1]).input_ids
    ids = [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in live.post(
        C, json={**ask, "logprobs": 0, "return_tokens_as_token_ids": True}).json()["choices"]]
    assert [c["token_ids"] for c in whole] == ids and all(len(t) == 6 for t in ids)
    assert "token_ids" not in live.post(C, json={**ask, "return_token_ids": False}).json()["choices"][0]
    chunks = [c.model_dump() for c in live.client.completions.create(
        **{k: v for k, v in ask.items() if k not in ("return_token_ids", "ignore_eos")}, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})]
    for idx in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == idx]
        assert mine[0]["prompt_token_ids"] == whole[0]["prompt_token_ids"]
        assert all("prompt_token_ids" not in ch for ch in mine[1:])
        assert [t for ch in mine for t in ch["token_ids"]] == whole[idx]["token_ids"]
    chat = live.post(CH, json={**OK_CH, "max_tokens": 5, "temperature": 0, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = [c.model_dump() for c in live.client.chat.completions.create(
        model=MODEL, messages=OK_CH["messages"], max_tokens=5, temperature=0, stream=True,
        extra_body={"return_token_ids": True})]
    assert streamed[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in streamed for ch in c["choices"] for t in ch["token_ids"]] == chat["choices"][0]["token_ids"]


def _certificates(root: Path) -> None:
    """A CA (ca.pem), and a server certificate for 127.0.0.1 and a client one, both signed by it
    ({server,client}.pem, .key), made by the openssl command."""
    def openssl(*argv):
        subprocess.run(["openssl", *argv], cwd=root, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=tandem test CA")
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        (root / f"{name}.ext").write_text(extension + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
                f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_https_with_client_certificates(model_dirs, tmp_path):
    """--ssl-keyfile / --ssl-certfile serve HTTPS; --ssl-ca-certs with --ssl-cert-reqs 2 (mutual TLS)
    serves only clients whose certificate that CA signed: a client without one, or over plain
    HTTP, gets no answer."""
    from tandem.server import add_serve_args, check_serve_args
    from tandem.server.api import ssl_settings

    _certificates(tmp_path)
    argv = ["M", "--ssl-keyfile", str(tmp_path / "server.key"), "--ssl-certfile", str(tmp_path / "server.pem"),
            "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "2"]
    args = add_serve_args(argparse.ArgumentParser()).parse_args(argv)
    check_serve_args(args)
    server = LiveServer(_llm(model_dirs), tls=ssl_settings(args))
    try:
        trusted = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with httpx.Client(verify=trusted, timeout=60) as anonymous:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                anonymous.get(server.url + "/v1/models")
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(server.url.replace("https", "http") + "/v1/models", timeout=60)
        trusted.load_cert_chain(str(tmp_path / "client.pem"), str(tmp_path / "client.key"))
        with httpx.Client(verify=trusted, timeout=60) as client:
            assert client.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL
            done = client.post(server.url + C, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_chat_continue_final_message_echo_and_special_tokens(live, reference):
    """vLLM's chat fields: continue_final_message (the reply continues the last message), echo (the
    reply starts with that message, in the role it continues) and add_special_tokens."""
    tok = reference.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The quick"}]

    def tokens(**fields):
        r = live.post("/tokenize", json={"model": MODEL, "messages": messages, **fields})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    open_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                        continue_final_message=True)
    assert tokens(add_generation_prompt=False, continue_final_message=True) == \
        tok(open_text, add_special_tokens=False).input_ids
    assert open_text.endswith("The quick") and tokens(add_generation_prompt=False) != tokens(
        add_generation_prompt=False, continue_final_message=True)
    both = live.post(CH, json={"model": MODEL, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    body = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, add_generation_prompt=False,
                continue_final_message=True)
    plain = live.post(CH, json=body).json()
    echoed = live.post(CH, json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "The quick" + plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["role"] == "assistant"
    chunks = [c.choices[0].delta for c in live.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True}) if c.choices]
    assert chunks[0].role == "assistant" and "".join(d.content or "" for d in chunks) == \
        echoed["choices"][0]["message"]["content"]
    # echo repeats nothing when the last message is not in the reply's role
    asked = dict(model=MODEL, messages=messages[:1], max_tokens=2, temperature=0)
    assert live.post(CH, json={**asked, "echo": True}).json()["choices"][0]["message"] == \
        live.post(CH, json=asked).json()["choices"][0]["message"]
    assert tokens(add_generation_prompt=False, add_special_tokens=True) == tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)).input_ids


def test_completion_add_special_tokens(tmp_path):
    """add_special_tokens: false keeps the tokenizer's BOS off a text prompt (one rendered by the client)."""
    llm = LLM(str(make_hf_model(tmp_path / "bos", add_bos=True)), **LLM_KWARGS)
    tok = llm.get_tokenizer()
    server = LiveServer(llm)
    try:
        for special in (True, False):
            r = server.post(C, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1,
                                     "add_special_tokens": special})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(tok(PROMPTS[0], add_special_tokens=special).input_ids)
        assert len(tok(PROMPTS[0]).input_ids) == len(tok(PROMPTS[0], add_special_tokens=False).input_ids) + 1
    finally:
        server.stop()


def test_completion_logprobs(live, reference):
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=6, temperature=0, logprobs=3)
    ref = offline(reference, PROMPTS[4], **greedy(max_tokens=6, logprobs=3))[0].outputs[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    want = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: the chosen token is the top one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_top_logprobs_hold_the_sampled_token(live):
    r = live.client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=1.5, seed=5,
                                       logprobs=1)
    lp = r.choices[0].logprobs
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # OpenAI's: up to logprobs + 1 entries, the sampled token among them (tokens that decode alike share
        # an entry, which keeps the likeliest)
        assert 1 <= len(top) <= 2 and top[token] >= chosen - 1e-5


def test_masked_tokens_logprobs_read_the_floor_not_minus_infinity(model_dirs):
    """processed_logprobs with top_k below the logprobs asked for puts -inf among the alternatives;
    JSON has no -inf, so they read -9999.0 (as in vLLM), streamed or not, completions or chat."""
    server = LiveServer(_llm(model_dirs, logprobs_mode="processed_logprobs"))
    try:
        kw = dict(model=MODEL, max_tokens=3, top_k=2, seed=1)
        r = server.post(C, json={**kw, "prompt": PROMPTS[0], "logprobs": 5})
        assert r.status_code == 200, r.text
        tops = [v for top in r.json()["choices"][0]["logprobs"]["top_logprobs"] for v in top.values()]
        assert -9999.0 in tops and min(tops) == -9999.0
        r = server.post(CH, json={**kw, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                  "top_logprobs": 5})
        assert r.status_code == 200, r.text
        assert min(t["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]) \
            == -9999.0
        streamed = [c.choices[0].logprobs for c in server.client.completions.create(
            **{k: v for k, v in kw.items() if k != "top_k"}, prompt=PROMPTS[0], logprobs=5, stream=True,
            extra_body={"top_k": 2}) if c.choices and c.choices[0].logprobs]
        values = [v for lp in streamed for top in lp.top_logprobs for v in top.values()]
        assert values and None not in values and min(values) == -9999.0
        # a token forced by a bias of 100 and then seen, under the smallest repetition penalty accepted: its
        # logit divided by 1.2e-38 overflowed (NaN logprobs, a 500 "Out of range float values")
        r = server.post(C, json={**kw, "prompt": PROMPTS[0], "logprobs": 2, "temperature": 0, "logit_bias": {"17": 100},
                                 "repetition_penalty": 1.2e-38})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * 3
    finally:
        server.stop()


def test_streamed_logprobs_match_the_whole_response(live):
    """Text held back for a stop string does not shift the streamed tokens' text_offset."""
    kw = dict(model=MODEL, prompt=PROMPTS[6], max_tokens=16, temperature=0, logprobs=2, stop=["never-seen-stop"])
    whole = live.client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in live.client.completions.create(**kw, stream=True) if c.choices]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert "".join(c.text for c in chunks) == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_null_fields_take_their_defaults(live, reference):
    """OpenAI clients send explicit nulls; a null means the field's default."""
    nulls = dict.fromkeys(["n", "presence_penalty", "frequency_penalty", "stream", "top_k", "min_p",
                           "repetition_penalty", "stream_options", "ignore_eos", "min_tokens"])
    r = live.post(C, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "echo": None,
                           **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline(reference, PROMPTS[0], **greedy(max_tokens=6))[0].outputs[0].text
    r = live.post(CH, json={**OK_CH, "logprobs": None, "add_generation_prompt": None, "tools": None,
                            "tool_choice": "none", "response_format": {"type": "text"}, **nulls})
    assert r.status_code == 200, r.text
    r = live.post(C, json={**OK_C, "prompt": [5] * 100, "max_tokens": None})  # null: the room the prompt leaves
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 28, r.text


def test_streaming_completion(live, reference):
    ref = offline(reference, PROMPTS[5], **greedy(max_tokens=16))[0]
    chunks = list(live.client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # deltas as produced, not one blob
    assert "".join(c.choices[0].text for c in text_chunks) == ref.outputs[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 16
    assert usage.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_continuous_usage_stats(live, reference):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far
    (its prompt's tokens, the tokens it has streamed), growing to the final usage chunk's totals;
    only in a stream that reports usage at all (include_usage), as in vLLM."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                      stream=True, stream_options=opts))
    used = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and len({c.usage.prompt_tokens for c in chunks}) == 1
    assert used[0] == 0 and used == sorted(used) and used[-2] == used[-1] == 12  # the last content chunk: all 12
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    prompts = [PROMPTS[2], PROMPTS[3] + " and more words here"]
    lengths = [len(o.prompt_token_ids) for o in offline(reference, prompts, max_tokens=1)]
    assert lengths[0] != lengths[1]
    many = list(live.client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.7, n=2,
                                               seed=1, stream=True, stream_options=opts))
    seen: dict[int, list[int]] = {}
    for c in many[:-1]:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == lengths[choice.index // 2]  # the choice's own prompt
        seen.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3] and all(counts[-1] == 5 and counts == sorted(counts) for counts in seen.values())
    assert many[-1].choices == [] and many[-1].usage.completion_tokens == 20  # prompts counted once each:
    assert many[-1].usage.prompt_tokens == sum(lengths)
    alone = list(live.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0,
                                                stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)  # no include_usage: no usage anywhere


def test_detokenization_fields_reach_the_sampling_params():
    from tandem.server.protocol import ChatCompletionRequest, CompletionRequest

    p = CompletionRequest.model_validate({"prompt": "x", "skip_special_tokens": False,
                                          "spaces_between_special_tokens": False,
                                          "vllm_xargs": {"plugin": 1}}).to_sampling_params()
    assert p.skip_special_tokens is False and p.spaces_between_special_tokens is False
    assert p.extra_args == {"plugin": 1}  # vLLM's vllm_xargs
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.to_sampling_params().spaces_between_special_tokens is True  # vLLM's default


def test_sse_wire_format_ends_with_done(live):
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    json.loads(events[0][len("data: "):])
    # A chat delta holds only what it carries (vLLM's and OpenAI's shape): a call's later pieces only
    # their index and arguments, text pieces only content; no null reasoning, no empty tool_calls.
    body = {**OK_CH, "max_tokens": 20, "temperature": 0, "stream": True, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", live.url + CH, timeout=60, json=body) as r:
        deltas = [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {") and '"choices":[{' in line]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas[1:] if d]
    assert set(calls[0]) == {"index", "id", "type", "function"} and set(calls[0]["function"]) == {"name", "arguments"}
    assert all(c == {"index": 0, "function": {"arguments": c["function"]["arguments"]}} for c in calls[1:])
    assert all(set(d) <= {"tool_calls"} for d in deltas[1:])
    # "required": the text its parser holds back (the array around the calls) sends no empty delta (vLLM skips it)
    with httpx.stream("POST", live.url + CH, timeout=60, json={**body, "tool_choice": "required", "max_tokens": 80}) as r:
        choices = [json.loads(line[len("data: "):])["choices"][0] for line in r.iter_lines()
                   if line.startswith("data: {") and '"choices":[{' in line]
    assert all(c["delta"] or c["finish_reason"] for c in choices), choices
    assert any(c["delta"].get("tool_calls") for c in choices)


# ---------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is the capital of France?"}]


def test_chat_matches_offline(live, reference):
    ref = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 12

    chunks = list(live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert "metrics" not in chunks[-1].model_extra


def test_chat_content_parts_logprobs_and_n(live, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]  # joined by a newline
    r = live.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=5, temperature=0.8, seed=3, n=2,
                                            logprobs=True, top_logprobs=2)
    ref = reference.chat([{"role": "user", "content": "What is the capital\nof France?"}],
                         SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    assert [c.message.content for c in r.choices] == [o.text for o in ref.outputs]
    for choice, out in zip(r.choices, ref.outputs):
        content = choice.logprobs.content
        assert len(content) == len(out.token_ids) == 5
        assert [c.logprob for c in content] == pytest.approx(
            [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)], abs=1e-4)
        assert all(len(c.top_logprobs) == 2 for c in content)
    for logprobs in (False, None):  # top_logprobs 0 asks for nothing, so it needs no logprobs (vLLM's rule): no 400
        body = {k: v for k, v in {"logprobs": logprobs, "top_logprobs": 0}.items() if v is not None}
        r = live.post(CH, json={**OK_CH, **body})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_chat_logprobs_give_a_piece_of_a_character_its_own_bytes(tmp_path):
    """Chat logprobs' `bytes`, as OpenAI's: a token that is a piece of a character (its text
    U+FFFD) carries the bytes it stands for, so a client joining a reply's bytes gets its text back;
    another token its text's bytes; the server builds the table once, at start."""
    from transformers import AutoTokenizer

    from tandem.engine.grammar import Grammars
    from tandem.outputs import Logprob
    from tandem.server.render import chat_logprobs
    from tests.helpers import save_tokenizer

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "café 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    token_bytes = Grammars(tok, len(tok), (tok.eos_token_id,)).token_bytes()
    lps = [{t: Logprob(-0.5, 1, tok.decode([t])), 7: Logprob(-1.5, 2, tok.decode([7]))} for t in ids]
    content = chat_logprobs(ids, lps, 2, token_bytes=token_bytes).content
    assert sum("\ufffd" in c.token for c in content) >= 3  # the text has such pieces
    assert b"".join(bytes(c.bytes) for c in content).decode() == text
    assert all(c.bytes == list(c.token.encode()) for c in content if "\ufffd" not in c.token)
    assert all(c.top_logprobs[0].bytes == c.bytes and c.top_logprobs[1].bytes == list(tok.decode([7]).encode())
               for c in content)
    assert b"".join(bytes(c.bytes) for c in chat_logprobs(ids, lps, 2).content) != text.encode()  # U+FFFD's bytes
    assert Grammars(None, len(tok), (1,)).token_bytes() is None  # no tokenizer: the text's bytes


def test_a_served_piece_of_a_character_carries_its_bytes(live, reference):
    """Over the API: a reply that is the first byte of "é" (logit_bias makes it so) has that byte."""
    tok = reference.get_tokenizer()
    piece = tok.convert_tokens_to_ids("Ã")  # byte-level BPE's 0xC3, é's first byte
    assert tok.decode([piece]) == "\ufffd"
    r = live.post(CH, json={**OK_CH, "max_tokens": 1, "logprobs": True, "top_logprobs": 1,
                            "logit_bias": {str(piece): 100}}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "\ufffd" and content[0]["bytes"] == [0xC3], content


# ---------------------------------------------------------------- concurrency and disconnects
def test_50_concurrent_streams_match_offline_greedy(live, reference):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(50)]
    refs = offline(reference, prompts, **greedy(max_tokens=8))
    want = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in refs]

    async def one(client, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    running: list[float] = []

    async def watch(done: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            while not done.is_set():
                text = (await c.get(live.url + "/metrics")).text
                running.extend(s.value for f in text_string_to_metric_families(text) for s in f.samples
                               if s.name == "tandem_num_requests_running")
                await asyncio.sleep(0.05)

    async def run_all():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            results = await asyncio.gather(*(one(c, p) for p in prompts))
        done.set()
        await watcher
        return results

    results = asyncio.run(run_all())
    assert results == want
    assert max(running) >= 10  # the requests shared engine steps, not one after another


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


ABORTS = ("tandem_request_success_total", (("finished_reason", "abort"),))


def _wait_until_aborted_and_freed(live: LiveServer, aborts_before: float) -> None:
    def freed() -> bool:
        m = live.metrics()
        return (m[("tandem_num_requests_running", ())] == 0
                and m[("tandem_kv_cache_free_blocks", ())] == m[("tandem_kv_cache_total_blocks", ())]
                and m[ABORTS] == aborts_before + 1)

    _wait_for(freed)
    blocks = live.llm.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not live.llm.engine.has_unfinished_requests()


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(live):
    before = live.metrics()[ABORTS]
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert sum(line.startswith("data: {") for line in got) >= 2
        m = live.metrics()
        assert m[("tandem_num_requests_running", ())] == 1
        assert m[("tandem_kv_cache_free_blocks", ())] < m[("tandem_kv_cache_total_blocks", ())]
    _wait_until_aborted_and_freed(live, before)  # the connection closed mid-stream


def test_priority_scheduling_over_the_api(model_dirs, reference):
    """--scheduling-policy priority with one batch slot: a request of a higher priority (a lower
    value) takes the slot of a long one already streaming, which resumes after it; neither
    output changes."""
    server = LiveServer(_llm(model_dirs, max_num_seqs=1, max_model_len=512, scheduling_policy="priority"))
    try:
        low = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "temperature": 0,
               "priority": 5}
        text, urgent = "", None
        with httpx.stream("POST", server.url + "/v1/completions", json={**low, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if urgent is None:  # the long request holds the slot: now the urgent one comes
                        urgent = server.post("/v1/completions", json={
                            "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "priority": -1})
        assert urgent.status_code == 200, urgent.text
        assert urgent.json()["choices"][0]["text"] == offline(reference, [PROMPTS[1]], **greedy(max_tokens=8))[0] \
            .outputs[0].text
        assert server.metrics()[("tandem_num_preemptions_total", ())] == 1
        alone = server.post("/v1/completions", json=low)  # the slot to itself this time
        assert text == alone.json()["choices"][0]["text"]
        assert server.metrics()[("tandem_num_preemptions_total", ())] == 1
    finally:
        server.stop()


def test_tensor_parallel_serving(model_dirs, reference):
    """A server over two ranks (each step run on both, in rank 0's order): concurrent streams give
    the one-rank offline tokens, a bad request is refused and a client that disconnects frees its
    blocks on both ranks, the others going on."""
    server = LiveServer(_llm(model_dirs, tensor_parallel_size=2))
    try:
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(12)]
        want = [o.outputs[0].text for o in offline(reference, prompts, **greedy(max_tokens=8))]

        async def one(client, prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def run_all():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                          timeout=120) as c:
                return await asyncio.gather(*(one(c, p) for p in prompts))

        assert asyncio.run(run_all()) == want
        bad = server.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000})
        assert bad.status_code == 400
        before = server.metrics()[ABORTS]
        body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert sum(next(lines).startswith("data: {") for _ in range(4)) >= 2
        _wait_until_aborted_and_freed(server, before)
        again = server.client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
        assert again.choices[0].text == want[0]
    finally:
        server.stop()
        server.llm.engine.close()


def test_client_giving_up_on_a_plain_request_aborts_it(live):
    before = live.metrics()[ABORTS]
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # 100 tokens take ~0.8 s on a 2-core CPU: give up well before
        live.post("/v1/completions", json=body, timeout=0.2)
    _wait_until_aborted_and_freed(live, before)


def test_engine_failure_ends_requests_in_flight_but_not_the_loop(live, monkeypatch):
    engine = live.llm.engine
    real_step, calls = engine.step, []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine, "step", step_failing_once)
    r = live.post(C, json={**OK_C, "max_tokens": 3})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error" and "injected failure" in r.json()["error"]["message"]
    after = live.client.completions.create(model=MODEL, prompt="after", max_tokens=3, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 3
    assert httpx.get(live.url + "/health").status_code == 200
    blocks = engine.scheduler.blocks
    _wait_for(lambda: blocks.num_free_blocks == blocks.num_blocks)


def test_out_of_memory_in_a_step_names_the_settings(live, monkeypatch):
    """A CUDA out-of-memory error inside a step (injected into the runner) ends that step's
    requests with a message naming what to change; the server goes on."""
    engine = live.llm.engine
    real_launch, calls = engine.runner.launch, []

    def launch_failing_once(plan):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_launch(plan)

    monkeypatch.setattr(engine.runner, "launch", launch_failing_once)
    r = live.post(C, json={**OK_C, "max_tokens": 3})
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "ran out of GPU memory" in message and "max_num_batched_tokens=" in message, message
    after = live.client.completions.create(model=MODEL, prompt="after", max_tokens=3, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 3
    blocks = engine.scheduler.blocks
    _wait_for(lambda: blocks.num_free_blocks == blocks.num_blocks)


def test_a_device_error_stops_the_loop_and_health_says_so(model_dirs, monkeypatch):
    """A step error that leaves the GPU unusable (an illegal memory access) ends every request,
    stops the engine loop, and /health answers 503: a supervisor can restart the process."""
    server = LiveServer(_llm(model_dirs))
    try:
        engine = server.llm.engine
        monkeypatch.setattr(engine.runner, "collect", lambda launched: (_ for _ in ()).throw(
            torch.AcceleratorError("CUDA error: an illegal memory access was encountered")))
        r = server.post(C, json={**OK_C, "max_tokens": 3})
        assert r.status_code == 500 and "restart the process" in r.json()["error"]["message"], r.text
        _wait_for(lambda: not server.app.state.engine_client.is_running)
        for _ in range(3):  # a supervisor's probes are no request's errors
            assert httpx.get(server.url + "/health").status_code == 503 == httpx.get(server.url + "/ping").status_code
        assert server.post(C, json=OK_C).status_code == 503
        errors = {k[1]: v for k, v in server.metrics().items() if k[0] == "tandem_request_errors_total"}
        assert errors == {(("status", "500"),): 1, (("status", "503"),): 1}, errors
        # A request the loop finds queued behind its stop is refused, not left waiting for ever.
        from tandem.server.async_engine import EngineStopped, _Add, _Stop

        client = server.app.state.engine_client
        stream = _ForLoop()
        client._commands.put(_Stop())
        client._commands.put(_Add(stream, [5, 6], SamplingParams(), None))
        client._run()
        assert isinstance(stream.items[-1], EngineStopped)
    finally:
        server.stop()


class _ForLoop:
    """A request stream's put, recorded (what the loop thread hands the event loop)."""

    def __init__(self):
        self.items = []

    def put(self, item) -> bool:
        self.items.append(item)
        return True


# ---------------------------------------------------------------- bad input
C, CH = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
TOOL_F = {"type": "function", "function": {"name": "f"}}
OK_CH = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_INPUTS = [
    # (id, path, body (dict merged onto a good one, or raw bytes), status, param)
    ("malformed-json", C, b'{"prompt": "x",', 400, None),
    ("not-an-object", C, b"[1, 2]", 400, None),
    ("missing-prompt", C, {"prompt": None}, 400, "prompt"),
    ("max-tokens-type", C, {"max_tokens": "ten"}, 400, "max_tokens"),
    ("max-tokens-bool", C, {"max_tokens": True}, 400, "max_tokens"),
    ("prompt-type", C, {"prompt": 12}, 400, "prompt"),
    ("temperature", C, {"temperature": -0.5}, 400, "temperature"),
    ("temperature-infinite", C, b'{"model": "tiny-spec", "prompt": "x", "temperature": Infinity}', 400, "temperature"),
    # NaN / Infinity anywhere (Python's JSON reader takes them): a field echoed back made the reply invalid JSON
    ("responses-nan-echoed", "/v1/responses", b'{"model": "tiny-spec", "input": "x", "max_output_tokens": 2, '
     b'"reasoning": {"effort": NaN}}', 400, "reasoning.effort"),
    ("responses-overflow-echoed", "/v1/responses", b'{"model": "tiny-spec", "input": "x", "max_output_tokens": 2, '
     b'"reasoning": {"effort": -1e999}}', 400, "reasoning.effort"),  # (read as -inf)
    ("chat-infinity-in-a-schema", CH, b'{"model": "tiny-spec", "messages": [{"role": "user", "content": "hi"}], '
     b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "number", '
     b'"maximum": -Infinity}}}}', 400, "response_format.json_schema.schema.maximum"),
    ("top-p", C, {"top_p": 1.5}, 400, "top_p"),
    ("n-zero", C, {"n": 0}, 400, "n"),
    ("logprobs", C, {"logprobs": 21}, 400, "logprobs"),
    ("presence-penalty", C, {"presence_penalty": 3}, 400, "presence_penalty"),
    ("seed", C, {"seed": 2**63}, 400, "seed"),
    ("logit-bias-key", C, {"logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ("logit-bias-key-double-minus", C, {"logit_bias": {"--5": 1.0}}, 400, "logit_bias"),  # were 500s: int() refused
    ("logit-bias-key-superscript", CH, {"logit_bias": {"\u00b2": 1.0}}, 400, "logit_bias"),  # what isdigit() took
    ("logit-bias-key-5000-digits", C, {"logit_bias": {"9" * 5000: 1.0}}, 400, "logit_bias"),
    ("logit-bias-value", C, {"logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("empty-stop", C, {"stop": [""]}, 400, "stop"),
    ("suffix-without-fim-tokens", C, {"suffix": "x"}, 400, "suffix"),
    ("suffix-with-token-ids", C, {"prompt": [5, 6], "suffix": "x"}, 400, "suffix"),
    ("suffix-with-echo", C, {"suffix": "x", "echo": True}, 400, "echo"),
    ("min-tokens", C, {"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("prompt-too-long", C, {"prompt": [5] * 200}, 400, "prompt"),
    ("token-out-of-vocab", C, {"prompt": [5, 100000]}, 400, "prompt"),
    ("empty-prompt", C, {"prompt": ""}, 400, "prompt"),
    ("unknown-model", C, {"model": "gpt-4"}, 404, "model"),
    ("stream-options-without-stream", C, {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat-missing-messages", CH, {"messages": None}, 400, "messages"),
    ("chat-empty-messages", CH, {"messages": []}, 400, "messages"),
    ("chat-image-part", CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0"),
    ("chat-top-logprobs-alone", CH, {"top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-top-logprobs-range", CH, {"logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("chat-max-completion-tokens", CH, {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat-too-long", CH, {"messages": [{"role": "user", "content": "fox " * 300}]}, 400, "messages"),
    ("chat-unknown-model", CH, {"model": "nope"}, 404, "model"),
    ("context-length", C, {"prompt": [5] * 100, "max_tokens": 100}, 400, "max_tokens"),
    ("chat-response-format-type", CH, {"response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat-response-format-no-type", CH, {"response_format": {"json_schema": {"schema": {}}}}, 400,
     "response_format"),
    ("chat-response-format-empty", CH, {"response_format": {}}, 400, "response_format"),  # was no constraint
    ("chat-json-schema-shape", CH, {"response_format": {"type": "json_schema", "json_schema": []}}, 400,
     "response_format"),
    ("chat-auto-tools-not-enabled", CH, {"tools": [TOOL_F]}, 400, "tool_choice"),
    ("chat-tool-choice-without-tools", CH, {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat-tool-choice-unknown-function", CH, {"tools": [TOOL_F], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
     400, "tool_choice"),
    ("chat-tool-choice-word", CH, {"tools": [TOOL_F], "tool_choice": "always"}, 400, "tool_choice"),
    ("chat-tool-type", CH, {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools.0.type"),
    ("chat-tool-twice", CH, {"tools": [TOOL_F, TOOL_F], "tool_choice": "required"}, 400, "tools"),
    ("chat-tool-and-response-format", CH, {"tools": [TOOL_F], "tool_choice": "required",
                                           "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("chat-tool-schema-does-not-compile", CH, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strange"}}}], "tool_choice": "required"}, 400, "tools"),
    ("chat-tool-call-arguments-not-json", CH, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f",
                                                                                         "arguments": "{"}}]}]},
     400, "messages.1"),
    ("chat-context-length", CH, {"max_completion_tokens": 200}, 400, "max_completion_tokens"),
    ("allowed-token-ids-range", C, {"allowed_token_ids": [5, 100000]}, 400, "allowed_token_ids"),
    ("allowed-token-ids-empty", C, {"allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("bad-words-empty", C, {"bad_words": [" "]}, 400, "bad_words"),
    ("prompt-logprobs-range", C, {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("chat-prompt-logprobs-stream", CH, {"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("two-constraints", C, {"guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice"),
    ("guided-backend", C, {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, 400,
     "guided_decoding_backend"),
    ("structured-outputs-field", C, {"structured_outputs": {"regexp": "a"}}, 400, "structured_outputs"),
    ("structured-outputs-choice", C, {"structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    ("guided-choice-empty", C, {"guided_choice": []}, 400, "guided_choice"),  # was taken as unset
    ("guided-regex-empty", CH, {"guided_regex": ""}, 400, "guided_regex"),
    # constraints the grammar compiler refuses, named by the field that carried them
    ("guided-regex-compile", C, {"guided_regex": "("}, 400, "guided_regex"),
    ("guided-json-compile", CH, {"guided_json": "{not json"}, 400, "guided_json"),
    ("guided-grammar-compile", C, {"guided_grammar": "nonsense ::= ::="}, 400, "guided_grammar"),
    ("structured-outputs-compile", C, {"structured_outputs": {"json": "{bad"}}, 400, "structured_outputs"),
    ("response-format-compile", CH, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format"),
    ("truncate-zero", C, {"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("chat-template-untrusted", CH, {"chat_template": "{{ raise_exception('no') }}"}, 400, "chat_template"),
    ("continue-and-generation-prompt", CH, {"continue_final_message": True}, 400, "continue_final_message"),
    # beam search refuses what it does not take (vLLM ignores them)
    ("beam-search-top-p", C, {"use_beam_search": True, "top_p": 0.5}, 400, "top_p"),
    ("beam-search-stop", CH, {"use_beam_search": True, "stop": ["x"]}, 400, "stop"),
    ("beam-search-constraint", C, {"use_beam_search": True, "guided_regex": "a+"}, 400, "guided_regex"),
    ("beam-search-tool-choice", CH, {"use_beam_search": True, "tools": [TOOL_F], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("beam-search-width", C, {"use_beam_search": True, "n": 11}, 400, "n"),  # 22 logprobs a step, max_logprobs 20
    ("beam-search-echo-logprobs", C, {"use_beam_search": True, "echo": True, "logprobs": 1}, 400, "echo"),
    ("beam-search-length-penalty", C, {"use_beam_search": True, "length_penalty": "long"}, 400, "length_penalty"),
    ("length-penalty-without-beam-search", CH, {"length_penalty": 2.0}, 400, "length_penalty"),
    ("beam-search-temperature", C, {"use_beam_search": True, "temperature": -1}, 400, "temperature"),
    ("structural-tag", CH, {"structural_tag": '{"type": "structural_tag"}'}, 400, "structural_tag"),
    ("whitespace-pattern", C, {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}, 400,
     "guided_whitespace_pattern"),
    ("priority-without-the-policy", C, {"priority": 1}, 400, "priority"),
    ("chat-priority-type", CH, {"priority": "high"}, 400, "priority"),
    ("chat-guided-choice-type", CH, {"guided_choice": "yes"}, 400, "guided_choice"),
    # vLLM's fields that ask for what tandem does not do: refused on every route (chat took best_of silently)
    ("chat-best-of", CH, {"best_of": 3}, 400, "best_of"),
    ("kv-transfer-params", CH, {"kv_transfer_params": {"do_remote_decode": True}}, 400, "kv_transfer_params"),
    ("completion-kv-transfer-params", C, {"kv_transfer_params": {"do_remote_prefill": True}}, 400,
     "kv_transfer_params"),
    ("mm-processor-kwargs", CH, {"mm_processor_kwargs": {"num_crops": 4}}, 400, "mm_processor_kwargs"),
    ("prompt-embeds", C, {"prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ("chat-reasoning-effort", CH, {"reasoning_effort": "bogus"}, 400, "reasoning_effort"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_openai_error(live, path, body, status, param):
    if isinstance(body, bytes):
        r = live.post(path, content=body, headers={"content-type": "application/json"})
    else:
        merged = {**(OK_C if path == C else OK_CH), **body}
        r = live.post(path, json={k: v for k, v in merged.items() if v is not None})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"], error  # the message names the field too
    too_long = ("prompt-too-long", "chat-too-long", "context-length", "chat-context-length")  # OpenAI's code, a prompt alone too
    assert (error["code"] == "context_length_exceeded") == (body in [c[2] for c in BAD_INPUTS if c[0] in too_long])


@pytest.mark.parametrize("body", [
    {"stop_token_ids": ["x"] * 100_000}, {"prompt": [[1, 2], ["x"] * 100_000]}, {"stop": ["a"] + [3] * 100_000},
    {"messages": [{"role": "user", "content": "x"}] + [{"role": 3}] * 100_000},
    {"messages": [{"role": "user", "content": ["x"] + [3] * 100_000}]},
    {"tools": [TOOL_F] + [{"type": 3}] * 100_000},
], ids=["stop-token-ids", "prompt-ids", "stop", "messages", "content-parts", "tools"])
def test_a_long_list_of_bad_items_is_one_error(body):
    """A request's list stops validating at its first bad item: the error names that one, and a
    list of 5M wrong items is no longer 5M errors built on the event loop (a minute's stall)."""
    from pydantic import ValidationError

    from tandem.server.http_errors import validation_error
    from tandem.server.protocol import ChatCompletionRequest, CompletionRequest

    request = ChatCompletionRequest if "messages" in body or "tools" in body else CompletionRequest
    base = {"messages": [{"role": "user", "content": "hi"}]} if request is ChatCompletionRequest else {"prompt": "hi"}
    with pytest.raises(ValidationError) as e:
        request.model_validate_json(json.dumps({**base, **body}))
    assert e.value.error_count() <= 4  # one a member of the field's union, at most
    assert validation_error(e.value).param.split(".")[0] == next(iter(body))


def test_nan_and_infinity_inside_strings_are_text(live):
    r = live.post(C, content=b'{"model": "tiny-spec", "prompt": "NaN or -Infinity", "max_tokens": 2, "stop": ["NaN"]}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_structured_outputs_over_the_api(live, reference):
    """response_format, vLLM's structured_outputs and its guided_* fields constrain the output as
    the offline engine's StructuredOutputsParams does; a constraint that does not compile is a 400."""
    from tandem import StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    cases = [
        ({"guided_regex": r"[0-9]{3}-(yes|no)"}, StructuredOutputsParams(regex=r"[0-9]{3}-(yes|no)")),
        ({"guided_choice": ["fox", "dog"]}, StructuredOutputsParams(choice=["fox", "dog"])),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
         StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
        ({"guided_grammar": 'root ::= "def " [a-z]{1,5} "():"', "guided_decoding_backend": "auto"},
         StructuredOutputsParams(grammar='root ::= "def " [a-z]{1,5} "():"')),
    ]
    for extra, so in cases:
        r = live.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                           extra_body=extra)
        ref = offline(reference, PROMPTS[0], **greedy(max_tokens=40, structured_outputs=so))[0].outputs[0]
        assert r.choices[0].text == ref.text, extra
        assert r.choices[0].finish_reason == ref.finish_reason == "stop", (extra, ref)
    # Chat with OpenAI's response_format, streamed (a schema without room for whitespace, which the
    # JSON grammar otherwise allows between tokens and a random model pads with).
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["fox", "dog", 7]}}}
    messages = [{"role": "user", "content": "Answer in JSON"}]
    chunks = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                 response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text) in ("fox", "dog", 7), text
    r = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                            response_format=fmt)
    assert r.choices[0].message.content == text
    r = live.post(C, json={**OK_C, "guided_regex": "[0-9"})
    assert r.status_code == 400 and "regex does not compile" in r.json()["error"]["message"], r.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _streamed_calls(chunks) -> tuple[str, dict[int, dict], str | None]:
    """A streamed chat reply's content, tool calls (index -> id, name, arguments) and finish reason."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or tc.id
            call["name"] = call["name"] or (tc.function.name if tc.function else None)
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


def test_tool_calls_named_and_required(live, reference):
    """A named tool choice or "required" holds the output to the calls' JSON (json.dumps's layout),
    which the reply carries as tool_calls, streamed or not; the arguments are the offline engine's
    output under the same schema."""
    from tandem.server.tools import ToolChoice

    specs = tuple({"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in (WEATHER, CLOCK))
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, mode in ((named, ToolChoice("named", specs, name="get_weather")),
                         ("required", ToolChoice("required", specs, parallel=False))):
        kwargs = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0, tools=[WEATHER, CLOCK],
                      tool_choice=choice, parallel_tool_calls=False)
        r = live.client.chat.completions.create(**kwargs)
        ref = reference.chat(ASK, SamplingParams(temperature=0, max_tokens=80, structured_outputs=mode.constraint()),
                             use_tqdm=False)[0].outputs[0]
        message = r.choices[0].message
        assert message.content is None and len(message.tool_calls) == 1, message
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        if mode.mode == "named":
            assert call.function.name == "get_weather" and call.function.arguments == ref.text
            assert r.choices[0].finish_reason == "stop"
        else:
            assert [{"name": call.function.name, "parameters": json.loads(call.function.arguments)}] \
                == json.loads(ref.text)
            assert r.choices[0].finish_reason == "tool_calls"
        assert json.dumps(json.loads(call.function.arguments)) == call.function.arguments  # json.dumps's layout
        content, calls, finish = _streamed_calls(live.client.chat.completions.create(**kwargs, stream=True))
        assert content == "" and finish == r.choices[0].finish_reason
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
        assert calls[0]["id"].startswith("chatcmpl-tool-")
    # Cut short by max_tokens, the calls do not parse: the text comes back as content, as it stands.
    r = live.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                            tools=[WEATHER, CLOCK], tool_choice="required")
    cut = reference.chat(ASK, SamplingParams(temperature=0, max_tokens=12,
                                             structured_outputs=ToolChoice("required", specs).constraint()),
                         use_tqdm=False)[0].outputs[0]
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == cut.text and cut.text.startswith('[{"name": "g'), cut.text


def test_auto_tool_choice_parses_hermes_calls(live, reference):
    """tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice; the hermes parser
    then finds <tool_call> blocks in the model's free text (forced here with a regex, the random
    model would not write one), streamed or not; a reply without one stays plain text."""
    server = live.app.state.server
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'
    regex = r"Let me check\. " + re.escape(call).replace("Rome", "(Rome|Paris)")
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=99, temperature=0, tools=[WEATHER],
                  extra_body={"guided_regex": regex})
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        live.client.chat.completions.create(**kwargs)
    ref = reference.chat(ASK, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    none = live.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                               tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == ref.text and not none.choices[0].message.tool_calls
    server.tool_call_parser = "hermes"
    try:
        r = live.client.chat.completions.create(**kwargs)
        streamed = _streamed_calls(live.client.chat.completions.create(**kwargs, stream=True))
        plain = live.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                                    tools=[WEATHER], tool_choice="auto")
        strict_tool = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
        strict = live.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                                     tools=[strict_tool, CLOCK])
        with pytest.raises(openai.BadRequestError, match="'strict': true") as e:
            live.client.chat.completions.create(**{**kwargs, "tools": [strict_tool]})
        assert e.value.body["param"] == "tools"
    finally:
        server.tool_call_parser = None
    message = r.choices[0].message
    assert message.content == "Let me check. " and r.choices[0].finish_reason == "tool_calls", r
    assert [(c.function.name, json.loads(c.function.arguments)["days"]) for c in message.tool_calls] \
        == [("get_weather", 3)]
    content, calls, finish = streamed
    assert content == message.content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", message.tool_calls[0].function.arguments)]
    assert plain.choices[0].message.content == ref.text and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == ref.finish_reason
    # A strict tool holds "auto" to its grammar (text, or calls that fit): the offline engine under it agrees.
    from tandem.server.tools import ToolChoice

    specs = tuple({"name": t["function"]["name"], "parameters": t["function"]["parameters"], "strict": t is not CLOCK}
                  for t in (WEATHER, CLOCK))
    held = ToolChoice("auto", specs, parser="hermes").constraint()
    ref = reference.chat(ASK, SamplingParams(temperature=0, max_tokens=8, structured_outputs=held),
                         use_tqdm=False)[0].outputs[0]
    assert strict.choices[0].message.content == ref.text and strict.choices[0].finish_reason == ref.finish_reason


def test_hermes_auto_tool_choice_keeps_special_tokens(live):
    """As vLLM's hermes parser: with tools and the parser at work, skip_special_tokens is off (some
    tokenizers hold <tool_call> as a special token, which the text must keep); tool_choice "none"
    leaves it on. Shown with this tokenizer's special <s>, forced by a grammar."""
    server = live.app.state.server
    bos = live.llm.get_tokenizer().convert_tokens_to_ids("<s>")
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=20, temperature=0, tools=[WEATHER],
                  extra_body={"guided_grammar": f'start: "Hi " <[{bos}]> " there"'})
    server.tool_call_parser = "hermes"
    try:
        auto = live.client.chat.completions.create(**kwargs).choices[0].message.content
        none = live.client.chat.completions.create(**kwargs, tool_choice="none").choices[0].message.content
    finally:
        server.tool_call_parser = None
    assert (auto, none) == ("Hi <s> there", "Hi  there")


def test_auto_tool_choice_parses_llama3_json_calls(live, reference):
    """--tool-call-parser llama3_json: a reply that opens with {"name": ..., "parameters": ...}
    calls ("; " between them) is those calls, streamed or not (forced here with a regex); a reply
    that opens otherwise stays plain text."""
    server = live.app.state.server
    call = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    regex = re.escape(call).replace("UTC", "(UTC|CET)") + "; " + re.escape('{"name": "get_time", "arguments": {}}')
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=99, temperature=0, tools=[WEATHER, CLOCK],
                  extra_body={"guided_regex": regex})
    server.tool_call_parser = "llama3_json"
    try:
        r = live.client.chat.completions.create(**kwargs)
        streamed = _streamed_calls(live.client.chat.completions.create(**kwargs, stream=True))
        plain = live.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                                    tools=[WEATHER], extra_body={"guided_regex": "Sure, [a-z]+"})
    finally:
        server.tool_call_parser = None
    message = r.choices[0].message
    assert message.content is None and r.choices[0].finish_reason == "tool_calls", r
    assert [c.function.name for c in message.tool_calls] == ["get_time", "get_time"]
    assert json.loads(message.tool_calls[0].function.arguments)["tz"] in ("UTC", "CET")
    assert message.tool_calls[1].function.arguments == "{}"
    content, calls, finish = streamed
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert plain.choices[0].message.content.startswith("Sure, ") and not plain.choices[0].message.tool_calls


def test_reasoning_parser_splits_the_thinking(live):
    """With a reasoning parser a chat reply's <think> part is its "reasoning" (and the older
    "reasoning_content"), the rest its content, streamed or not (an empty one: none); include_reasoning false drops the
    thinking; tool calls are read from the answer alone. (Set on the server only, so a regex can
    force the whole reply: the engine's own parser would hold the regex after the thinking,
    tests/e2e/test_reasoning.py.)"""
    from tandem.reasoning import REASONING_PARSERS

    server = live.app.state.server
    reply = "<think>Paris is in France.</think>\n\nIt is sunny."
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=99, temperature=0,
                  extra_body={"guided_regex": re.escape(reply)})
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'  # (short: the context is 128 tokens)
    f = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    server.reasoning = REASONING_PARSERS["qwen3"]
    try:
        r = live.client.chat.completions.create(**kwargs)
        chunks = list(live.client.chat.completions.create(**kwargs, stream=True))
        hidden = live.client.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                                               "include_reasoning": False}})
        empty = live.client.chat.completions.create(**{**kwargs, "extra_body": {
            "guided_regex": re.escape("<think></think>It is sunny.")}})
        server.tool_call_parser = "hermes"
        tools = live.client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=99, temperature=0, tools=[f],
            extra_body={"guided_regex": re.escape(f"<think><tool_call>?</think>{call}")})
    finally:
        server.reasoning = server.tool_call_parser = None
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r
    assert message.reasoning == message.reasoning_content == "Paris is in France."
    assert message.content == "\n\nIt is sunny."
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert hidden.choices[0].message.reasoning is None and hidden.choices[0].message.content == message.content
    # An empty thinking is none, as its stream (which sends no empty delta) tells it.
    assert empty.choices[0].message.reasoning is empty.choices[0].message.reasoning_content is None
    assert empty.choices[0].message.content == "It is sunny."
    message = tools.choices[0].message
    assert message.reasoning == "<tool_call>?" and message.content is None, tools  # a tag in the thinking: no call
    assert tools.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("f", "{}")]


def test_tools_and_past_calls_reach_the_chat_template(live, reference):
    """The tools go to the template, and a past call's arguments (JSON text in OpenAI's messages)
    reach it as an object, as vLLM passes them."""
    template = ("{{ tools | map(attribute='function.name') | join(',') }}|"
                "{% for m in messages %}{{ m['role'] }}:{{ m['content'] or '' }}"
                "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
                "{% endfor %};{% endfor %}")
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    server = live.app.state.server
    server.trust_request_chat_template = True
    try:
        r = live.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER, CLOCK],
                                         "chat_template": template})
    finally:
        server.trust_request_chat_template = False
    assert r.status_code == 200, r.text
    text = reference.get_tokenizer().decode(r.json()["tokens"])
    assert text == "get_weather,get_time|user:Weather in Paris?;assistant:[get_weather Paris];tool:sunny;", text


def test_server_keeps_serving_after_errors(live):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        live.client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    r = live.client.completions.create(model=MODEL, prompt="still there?", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    errors = live.metrics()
    assert errors[("tandem_request_errors_total", (("status", "400"),))] >= 1
    assert errors[("tandem_request_errors_total", (("status", "404"),))] >= 1


# ---------------------------------------------------------------- metrics
def test_metrics_parse_and_move(live):
    before = live.metrics()
    live.client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=10, temperature=0)
    after = live.metrics()

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("tandem_request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("tandem_generation_tokens_total") == 10
    assert delta("tandem_prompt_tokens_total") > 0
    assert delta("tandem_time_to_first_token_seconds_count") == 1
    assert delta("tandem_inter_token_latency_seconds_count") > 0
    assert delta("tandem_e2e_request_latency_seconds_count") == 1
    assert delta("tandem_spec_decode_num_drafts_total") > 0
    assert delta("tandem_spec_decode_num_draft_tokens_total") > 0
    accepted = delta("tandem_spec_decode_num_accepted_tokens_total")
    per_pos = [after[("tandem_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(K)]
    assert per_pos == sorted(per_pos, reverse=True)  # accepting position i needs positions < i accepted
    assert sum(per_pos) == after[("tandem_spec_decode_num_accepted_tokens_total", ())]
    assert accepted >= 0 and after[("tandem_spec_decode_num_accepted_tokens_total", ())] > 0
    for gauge in ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_perc"):
        assert (gauge, ()) in after
    # Prefix-cache queries and hits, in prompt tokens (vLLM's prefix_cache_queries / _hits): a new prompt
    # misses, and the same prompt again hits all of its full blocks but the last token's.
    prompt = "metrics " + " ".join(PROMPTS)
    for hit in (False, True):
        before = after
        r = live.post(C, json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        after = live.metrics()
        num_prompt = r.json()["usage"]["prompt_tokens"]
        assert delta("tandem_prefix_cache_queries_total") == delta("tandem_prompt_tokens_total") == num_prompt
        hits = delta("tandem_prefix_cache_hits_total")
        assert (num_prompt - 16 <= hits < num_prompt) if hit else hits == 0, (num_prompt, hits)


def test_metrics_of_adaptive_speculation(model_dirs):
    """num_speculative_tokens_per_batch_size="auto": the steps by drafts proposed and the estimated
    acceptance by position."""
    target, draft = model_dirs
    llm = LLM(str(target), speculative_config=dict(model=str(draft), num_speculative_tokens=K,
                                                   num_speculative_tokens_per_batch_size="auto"),
              **{**LLM_KWARGS, "max_num_seqs": 4})
    # Every K costs the same: each step drafts k, so rounds get verified whatever the start-up
    # profile measured (on a loaded machine it can judge drafting not worth its cost, and then
    # nothing is estimated); this test reads the metrics, not the choice.
    llm.engine.adaptive.costs = StepCosts((1,), ((1.0,) * (K + 1),))
    server = LiveServer(llm)
    name = "tandem_spec_decode_steps_by_num_drafts_total"
    try:
        server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        deadline = time.monotonic() + 10  # the loop copies the figures just after it answers
        while True:
            after = server.metrics()
            steps = [after.get((name, (("num_drafts", str(k)),)), 0) for k in range(K + 1)]
            if steps == llm.engine.adaptive.num_steps_by_k or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        server.stop()
    assert steps == llm.engine.adaptive.num_steps_by_k and sum(steps) > 0
    estimated = [after[("tandem_spec_decode_estimated_acceptance", (("position", str(j)),))] for j in range(K)]
    assert estimated == pytest.approx(llm.engine.adaptive.estimator.survival())
    assert estimated == sorted(estimated, reverse=True) and estimated[0] < 1



def _samples(metrics, name: str) -> dict:
    """ServerMetrics' samples of one name: {sorted labels: value}."""
    from prometheus_client import generate_latest

    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in family.samples if s.name == name}


def test_every_series_shows_before_the_first_request_and_a_gap_is_one_observation():
    """As vLLM's: the token, latency and gauge series exist from the start; the inter-token latency
    takes one observation per output a sequence gets (the whole gap, however many tokens it brought:
    a speculative step's accepted drafts arrive together), not one per token."""
    from tandem.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", num_speculative_tokens=2)
    for name in ("tandem_prompt_tokens_total", "tandem_generation_tokens_total",
                 "tandem_time_to_first_token_seconds_count", "tandem_inter_token_latency_seconds_count",
                 "tandem_e2e_request_latency_seconds_count", "tandem_num_requests_running",
                 "tandem_kv_cache_usage_perc", "tandem_spec_decode_num_drafts_total"):
        assert _samples(metrics, name) == {(("model_name", "m"),): 0.0}, name
    metrics.on_tokens(1, None)
    metrics.on_tokens(3, 0.25)
    assert _samples(metrics, "tandem_inter_token_latency_seconds_count") == {(("model_name", "m"),): 1.0}
    assert _samples(metrics, "tandem_inter_token_latency_seconds_sum") == {(("model_name", "m"),): 0.25}
    assert _samples(metrics, "tandem_generation_tokens_total") == {(("model_name", "m"),): 4.0}


def test_an_aborted_request_counts_a_finished_sibling_by_its_own_reason():
    """n = 2: the first sequence stopped, then the client left while the second ran: one "stop"
    and one "abort" (vLLM counts each of n's child requests as it ends), not two aborts."""
    from tandem.outputs import CompletionOutput, RequestOutput
    from tandem.server.async_engine import AsyncEngine, RequestStream, _Tracked
    from tandem.server.metrics import ServerMetrics

    class Engine:
        def abort_request(self, request_id):
            pass

    async def run():
        metrics = ServerMetrics("m")
        client = AsyncEngine(Engine(), metrics=metrics)
        tracked = _Tracked(RequestStream("r", asyncio.get_running_loop()), [0, 0], [0.0, 0.0], [None, None])
        client._live["r"] = tracked
        seqs = [CompletionOutput(0, "a", [5, 6], None, None, finish_reason="stop", stop_reason="b"),
                CompletionOutput(1, "aa", [5, 5], None, None)]
        client._record(tracked, RequestOutput("r", None, [1], seqs, finished=False))
        client._abort("r", None)
        return metrics

    counts = _samples(asyncio.run(run()), "tandem_request_success_total")
    assert {labels[0][1]: v for labels, v in counts.items()} == {"stop": 1.0, "length": 0.0, "abort": 1.0,
                                                                  "error": 0.0}


def test_siblings_that_finish_in_different_steps_are_each_counted():
    """n = 2: the engine's DELTA outputs hold only the sequences with something new, so the last
    one names only the sibling that finished last; the first's reason still counts."""
    from tandem.outputs import CompletionOutput, RequestOutput
    from tandem.server.async_engine import AsyncEngine, RequestStream, _Tracked
    from tandem.server.metrics import ServerMetrics

    async def run():
        metrics = ServerMetrics("m")
        client = AsyncEngine(object(), metrics=metrics)
        tracked = _Tracked(RequestStream("r", asyncio.get_running_loop(), n=2), [0, 0], [0.0, 0.0], [None, None])
        client._live["r"] = tracked
        first = [CompletionOutput(0, "a", [5], None, None, finish_reason="stop", stop_reason=7),
                 CompletionOutput(1, "b", [6], None, None)]
        client._record(tracked, RequestOutput("r", None, [1], first, finished=False))
        last = [CompletionOutput(1, "c", [8], None, None, finish_reason="length")]
        client._record(tracked, RequestOutput("r", None, [1], last, finished=True))
        return metrics

    metrics = asyncio.run(run())
    counts = _samples(metrics, "tandem_request_success_total")
    assert {labels[0][1]: v for labels, v in counts.items()} == {"stop": 1.0, "length": 1.0, "abort": 0.0,
                                                                  "error": 0.0}
    # One end-to-end latency a sequence, as vLLM's child requests: the same count as the successes and TTFTs.
    assert sum(_samples(metrics, "tandem_e2e_request_latency_seconds_count").values()) == 2


# ---------------------------------------------------------------- per-request metrics
def test_per_request_metrics_in_vllms_shape(model_dirs, reference):
    """--enable-per-request-metrics with --per-request-spec-decode-metrics detailed: each response's
    `metrics` object has vLLM's timing fields and `speculative_decoding` block. Its acceptance
    figures are the offline engine's for the same greedy request, agree with each other, and sum to
    the Prometheus counters' moves; a stream carries them on its usage chunk (forced here, as
    --enable-force-include-usage); n > 1 and several prompts get null, as in vLLM, and so does
    echo's prompt scoring (max_tokens 0)."""
    server = LiveServer(_llm(model_dirs, per_request_spec_decode_metrics="detailed"),
                        enable_per_request_metrics=True, enable_force_include_usage=True)
    names = ("tandem_spec_decode_num_drafts_total", "tandem_spec_decode_num_draft_tokens_total",
             "tandem_spec_decode_num_accepted_tokens_total")
    try:
        before = server.metrics()
        r = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
        spec = r.model_extra["metrics"]["speculative_decoding"]
        want = [before.get((name, ()), 0.0) + spec[key] for name, key in
                zip(names, ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"))]
        deadline = time.monotonic() + 10  # the loop copies the counters just after it answers
        while [server.metrics().get((name, ()), 0.0) for name in names] != want and time.monotonic() < deadline:
            time.sleep(0.05)
        moved = [server.metrics()[(name, ())] for name in names]
        stream = list(server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                                            temperature=0, stream=True))  # no stream_options
        several = [server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0.8,
                                                    n=2),
                   server.client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0),
                   list(server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, n=2,
                                                         temperature=0.8, stream=True,
                                                         stream_options={"include_usage": True}))[-1],
                   # echo with max_tokens 0 scores the prompt: no generation to report on
                   server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=0, echo=True)]
    finally:
        server.stop()
    assert moved == want
    m = r.model_extra["metrics"]
    assert set(m) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                      "tokens_per_second", "speculative_decoding"}
    assert m["time_to_first_token_ms"] > 0 and m["generation_time_ms"] > 0 and m["queue_time_ms"] >= 0
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 15)
    inference_s = (m["time_to_first_token_ms"] + m["generation_time_ms"]) / 1e3
    assert m["tokens_per_second"] == pytest.approx(16 / inference_s)

    ref = offline(reference, PROMPTS[0], **greedy(max_tokens=16))[0].metrics
    hist, steps = spec["acceptance_histogram"], spec["num_spec_steps"]
    assert len(hist) == K + 1 and hist == ref.acceptance_histogram and steps == ref.num_draft_rounds > 0
    assert sum(hist) == steps and sum(j * c for j, c in enumerate(hist)) == spec["num_accepted_draft_tokens"]
    assert spec["num_draft_tokens"] == ref.num_draft_tokens and spec["num_spec_tokens"] == K
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(spec["num_accepted_draft_tokens"] / spec["num_draft_tokens"])
    assert spec["acceptance_histogram_by_draft_length"] == {str(n): row for n, row in
                                                            ref.acceptance_by_num_drafts.items()}
    assert len(spec["per_step_accepted"]) == len(spec["per_step_drafted"]) == steps
    assert sum(spec["per_step_accepted"]) == spec["num_accepted_draft_tokens"]
    assert sum(spec["per_step_drafted"]) == spec["num_draft_tokens"]

    usage = stream[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    assert usage.model_extra["metrics"]["time_to_first_token_ms"] > 0
    assert all("metrics" not in c.model_extra for c in stream[:-1])
    for resp in several:  # figures of one generation only
        assert "metrics" in resp.model_extra and resp.model_extra["metrics"] is None


def test_response_metrics_shapes():
    """What each setting puts in a response's `metrics` (vLLM's shapes): nothing when off or without
    a draft; the timing fields alone; speculative_decoding alone (summary: no per-step arrays;
    detailed: with them); null for more than one generation; a request that never drafted reads a
    mean acceptance length of 1.0 and an all-zero histogram."""
    from tandem.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from tandem.server.response_metrics import ResponseMetrics

    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, last_token_time=3.0,
                       num_generation_tokens=5, num_draft_rounds=2, num_draft_tokens=6, num_accepted_tokens=4,
                       acceptance_histogram=[0, 1, 0, 1], acceptance_by_num_drafts={3: [0, 1, 0, 1]},
                       per_step_accepted=[1, 3], per_step_drafted=[3, 3])

    def outputs(metrics, n=1, prompts=1):
        seqs = [CompletionOutput(i, "x", [1] * 5, None, None, "length") for i in range(n)]
        return [RequestOutput(str(p), "p", [1], seqs, True, metrics) for p in range(prompts)]

    one = outputs(m)
    assert ResponseMetrics().extra(one) == {}
    assert ResponseMetrics(spec_decode="summary", num_spec_tokens=0).extra(one) == {}  # no draft model
    timing = ResponseMetrics(timing=True).extra(one)["metrics"]
    assert timing == {"time_to_first_token_ms": 500.0, "generation_time_ms": 1000.0, "queue_time_ms": 500.0,
                      "mean_itl_ms": 250.0, "tokens_per_second": 5 / 1.5}
    summary = ResponseMetrics(spec_decode="summary", num_spec_tokens=3).extra(one)["metrics"]
    assert summary == {"speculative_decoding": {
        "mean_acceptance_length": 3.0, "draft_acceptance_rate": 4 / 6, "acceptance_histogram": [0, 1, 0, 1],
        "acceptance_histogram_by_draft_length": {"3": [0, 1, 0, 1]}, "num_spec_steps": 2,
        "num_accepted_draft_tokens": 4, "num_draft_tokens": 6, "num_spec_tokens": 3}}
    detailed = ResponseMetrics(spec_decode="detailed", num_spec_tokens=3).extra(one)["metrics"]["speculative_decoding"]
    assert detailed == {**summary["speculative_decoding"], "per_step_accepted": [1, 3], "per_step_drafted": [3, 3]}
    both = ResponseMetrics(timing=True, spec_decode="summary", num_spec_tokens=3)
    assert both.extra(one)["metrics"] == {**timing, **summary}
    assert both.extra(outputs(m, n=2)) == both.extra(outputs(m, prompts=2)) == {"metrics": None}
    never = both.extra(outputs(RequestMetrics(arrival_time=1.0)))["metrics"]["speculative_decoding"]
    assert never["mean_acceptance_length"] == 1.0 and never["draft_acceptance_rate"] == 0.0
    assert never["acceptance_histogram"] == [0, 0, 0, 0] and never["num_spec_steps"] == 0


def test_watermarked_serving_and_the_opt_out(model_dirs):
    """A --watermark-config server draws sampled tokens with the key (the offline engine's tokens,
    found by the detector); a request's `watermarking: false` opts out."""
    from tandem.detect import detect_watermark

    key = {"key": 5150}
    llm = _llm(model_dirs, watermark_config=key)
    server = LiveServer(llm)
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=1.0, seed=3)
    try:
        keyed = server.post("/v1/completions", json=body).json()
        opted_out = server.post("/v1/completions", json={**body, "watermarking": False}).json()
        bad = server.post("/v1/completions", json={**body, "watermarking": "sometimes"})
    finally:
        server.stop()
    want = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=48, temperature=1.0, seed=3), use_tqdm=False)[0]
    assert keyed["choices"][0]["text"] == want.outputs[0].text
    prompt_ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    assert detect_watermark(want.outputs[0].token_ids, key, prompt_token_ids=prompt_ids).p_value < 1e-4
    plain = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=48, temperature=1.0, seed=3, watermarking=False),
                         use_tqdm=False)[0]
    assert opted_out["choices"][0]["text"] == plain.outputs[0].text != want.outputs[0].text
    assert bad.status_code == 400 and "watermarking" in bad.text


# ---------------------------------------------------------------- beam search
def _offline_beams(reference: LLM, prompt_ids: list[int], **kw):
    from tandem import BeamSearchParams

    return reference.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(**kw))[0].sequences


def test_beam_search_over_the_api_matches_offline(live, reference):
    """use_beam_search (vLLM's): n beams, the request's n choices, the same sequences in the same
    order as LLM.beam_search's; each choice's logprobs are its tokens' and add up to its score's
    cum_logprob; streamed, the same choices."""
    tok = reference.tokenizer
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 6, "n": 3, "logprobs": 2, "use_beam_search": True,
            "length_penalty": 0.5, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = live.post(C, json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = tok(prompt).input_ids
        want = _offline_beams(reference, ids, beam_width=3, max_tokens=6, length_penalty=0.5)
        got = choices[3 * i:3 * i + 3]
        assert [c["text"] for c in got] == [s.text for s in want]
        assert [c["token_ids"] for c in got] == [s.tokens[len(ids):] for s in want]
        assert len({tuple(c["token_ids"]) for c in got}) == 3  # three different beams
        assert [c["finish_reason"] for c in got] == [s.finish_reason for s in want]
        for c, seq in zip(got, want):
            assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(seq.cum_logprob, abs=1e-4)
            tokens = c["logprobs"]["tokens"]
            assert tokens == [f"token_id:{t}" for t in c["token_ids"]]
            for token, top in zip(tokens, c["logprobs"]["top_logprobs"]):
                assert token in top and 2 <= len(top) <= 3  # the top 2, and the token's
    assert reply["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    streamed = {}
    for chunk in live.client.completions.create(**{k: v for k, v in body.items() if k in ("model", "prompt", "n")},
                                                max_tokens=6, stream=True,
                                                extra_body={"use_beam_search": True, "length_penalty": 0.5}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == [c["text"] for c in choices]


def test_chat_beam_search_matches_offline(live, reference):
    """Chat completions take use_beam_search too: the n choices are the offline search's over the
    prompt the chat template builds; the same request twice, the same reply."""
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = live.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    want = _offline_beams(reference, ids, beam_width=2, max_tokens=5)
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "n": 2, "use_beam_search": True, "temperature": 0}
    first, again = (live.post(CH, json=body).json() for _ in range(2))  # (greedy sampling's n = 1 rule is not beams')
    assert [c["message"]["content"] for c in first["choices"]] == [s.text for s in want]
    assert first["choices"] == again["choices"]
    assert first["usage"]["prompt_tokens"] == len(ids)


def test_more_logprobs_than_the_beams_take_change_no_beam(live, reference, monkeypatch):
    """logprobs above 2 * n show more alternatives, and the candidates stay each beam's 2 * n
    likeliest (and the drawn one): an EOS ranked below them completes no sequence."""
    ids = reference.tokenizer(PROMPTS[0]).input_ids
    first = reference.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, logprobs=5, temperature=0),
                               use_tqdm=False)[0].outputs[0].logprobs[0]
    eos = next(t for t, lp in first.items() if lp.rank == 4)  # past n = 1's two candidates
    for engine in (live.llm.engine, reference.engine):
        monkeypatch.setattr(engine, "eos_token_ids", (eos,))
    want = _offline_beams(reference, ids, beam_width=1, max_tokens=6)
    for logprobs in (None, 5):
        got = live.post(C, json={"model": MODEL, "prompt": ids, "max_tokens": 6, "use_beam_search": True,
                                 "logprobs": logprobs, "return_token_ids": True}).json()["choices"]
        assert [c["token_ids"] for c in got] == [s.tokens[len(ids):] for s in want] and got[0]["token_ids"][0] != eos


def test_a_beam_search_the_client_gives_up_on_stops(live, monkeypatch):
    """The client leaving cancels the search: its beams' requests in flight are aborted, no further
    step is submitted, and every block is free again."""
    engine, added = live.llm.engine, []
    add_request, step = engine.add_request, engine.step
    monkeypatch.setattr(engine, "add_request", lambda *a, **kw: (added.append(a[0]), add_request(*a, **kw))[1])
    # Slow steps: 100 steps of 3 beams take 5 s or more on any machine (unslowed, ~0.35 s on an idle one, so
    # the client's timeout could fall after the search, or in its last step, where nothing tells them apart).
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.05), step())[1])
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 100, "n": 3, "ignore_eos": True,
            "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):  # give up well before the search could end
        live.post(C, json=body, timeout=0.5)
    counts = [len(added)]
    while True:  # until no request is added for a second
        time.sleep(1.0)
        counts.append(len(added))
        if counts[-1] == counts[-2]:
            break
        assert len(counts) < 30, "the search went on"
    assert 0 < counts[-1] < 1 + 3 * 50  # one request a beam a step, cut short (~10 steps at 0.5 s)
    blocks = live.llm.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and not live.llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------- overload and shutdown
def test_queue_limit_answers_503_and_shutdown_is_clean(model_dirs):
    server = LiveServer(_llm(model_dirs, max_num_seqs=1), max_queued_requests=1)
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 30, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(5)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 503 in codes, codes  # one runs, one waits, the rest are refused
        refused = next(r for r in responses if r.status_code == 503).json()["error"]
        assert refused["code"] == "queue_full" and "max_queued_requests=1" in refused["message"]
        assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        # more sequences than the server ever holds (1 slot + 1 queued) is a 400, not "retry later"
        for extra, param in (({"n": 3, "temperature": 1.0}, "n"), ({"prompt": PROMPTS[:3]}, "prompt")):
            r = server.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

        # Shut down with a stream running and a request queued behind it (drain_timeout_s 0): the
        # engine is stopped before uvicorn closes connections, so the stream ends with an in-band
        # shutting_down error and [DONE], the queued request gets a 503, and none is cut.
        queued = {}
        engine, step = server.llm.engine, server.llm.engine.step
        engine.step = lambda: (time.sleep(0.05), step())[1]  # slow steps: the stream outlives the shutdown call
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={**body, "max_tokens": 110, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            waiter = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
                server.url + "/v1/completions", json=body, timeout=60)))
            waiter.start()
            time.sleep(0.3)
            server.server.should_exit = True
            rest = [line for line in lines if line]
        waiter.join(60)
        assert rest[-1] == "data: [DONE]" and "shutting_down" in rest[-2], rest[-2:]
        assert queued["r"].status_code == 503 and queued["r"].json()["error"]["code"] == "shutting_down"
        server.thread.join(60)
        assert not server.thread.is_alive()
        assert not server.app.state.engine_client.is_running
        assert not server.llm.engine.has_unfinished_requests()
    finally:
        server.stop()


def test_a_beam_search_is_let_in_once_counted_once_and_drained(model_dirs):
    """A beam search is held to the queue limit when it starts, not at every step: requests arriving
    while it runs may be refused, it is not (timing decides whether they are here; the rule itself
    is tested on the async engine's queue in tests/engine/test_priority.py). It counts as one request of n sequences in the metrics,
    its choices' tokens as its output. A graceful shutdown waits for it (drain_timeout_s) as for any request."""
    server = LiveServer(_llm(model_dirs, max_num_seqs=2), max_queued_requests=1, drain_timeout_s=60)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 30, "n": 2, "ignore_eos": True,
            "use_beam_search": True}
    done = {}

    def search(key: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: done.setdefault(key, server.post(C, json=body)))
        thread.start()
        return thread

    def finished() -> float:
        return sum(v for (name, _), v in server.metrics().items() if name == "tandem_request_success_total")

    try:
        before = finished()
        reply = server.post(C, json=body).json()
        assert [len(c["text"]) > 0 for c in reply["choices"]] == [True, True]
        assert finished() == before + 2  # as a request of n = 2 counts: one a sequence, not one a step's request
        assert server.metrics()[("tandem_generation_tokens_total", ())] >= reply["usage"]["completion_tokens"]

        engine, step = server.llm.engine, server.llm.engine.step
        engine.step = lambda: (time.sleep(0.01), step())[1]  # the search outlives the traffic's first wave
        thread = search("busy")
        time.sleep(0.3)
        others = []

        def traffic():
            while thread.is_alive():
                others.append(server.post(C, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8}).status_code)

        hammers = [threading.Thread(target=traffic) for _ in range(2)]
        for h in hammers:
            h.start()
        for t in (thread, *hammers):
            t.join(120)
        assert done["busy"].status_code == 200, done["busy"].text
        assert len(done["busy"].json()["choices"]) == 2 and 200 in others  # (test_priority has the rule itself)

        thread = search("drained")
        time.sleep(0.3)
        server.server.should_exit = True  # a graceful shutdown while the search runs
        thread.join(120)
        assert done["drained"].status_code == 200, done["drained"].text
        assert done["drained"].json()["choices"] == reply["choices"]
        server.thread.join(60)
        assert not server.thread.is_alive() and not server.llm.engine.has_unfinished_requests()
    finally:
        server.stop()


def test_a_streams_text_grows_in_a_buffer():
    """A stream adds the engine's text deltas into a buffer, not a str copied whole every step: the
    text reads back exactly (line breaks and non-ASCII as they came), a reader can take only the new
    part, and the renderer streams the same deltas as it would from a plain cumulative output."""
    import dataclasses

    from tandem.outputs import CompletionOutput, RequestOutput
    from tandem.server.async_engine import GrowingCompletion, RequestStream

    pieces = [("a\r\n", "b"), ("é€", ""), ("", "\r"), ("😀x\r", "yz")]

    async def run():
        stream = RequestStream("r", asyncio.get_running_loop(), n=2)
        seen = []
        for j, (first, second) in enumerate(pieces):
            seqs = [CompletionOutput(0, first, [j], None, None), CompletionOutput(1, second, [j], None, None)]
            stream._deliver(RequestOutput("r", None, [1], seqs, finished=False))
            out = await stream.next_output()
            seen.append([(s.buffer.length, s.buffer.between(1, 3)) for s in out.outputs])
        return out, seen

    out, seen = asyncio.run(run())
    texts = ["".join(p[i] for p in pieces) for i in (0, 1)]
    for seq, text in zip(out.outputs, texts):
        assert isinstance(seq, GrowingCompletion) and seq.text == text and seq.buffer.length == len(text)
        assert seq.buffer.between(2, 6) == text[2:6] and seq.buffer.between(5, 3) == ""
        assert dataclasses.replace(seq, text="new").text == "new"  # a copy as a plain output
    ends = [[len("".join(p[i] for p in pieces[: j + 1])) for i in (0, 1)] for j in range(len(pieces))]
    assert [[n for n, _ in step] for step in seen] == ends


def test_a_steps_outputs_reach_their_loop_in_one_wake_up():
    """The engine thread hands a step's outputs to each handler loop in one call_soon_threadsafe (one
    self-pipe write), in order; a closed loop's streams come back (their requests are aborted); an
    output a stream cannot add up ends that stream with the error, not a hang, and the others go on."""
    from tandem.outputs import CompletionOutput, RequestOutput
    from tandem.server.async_engine import RequestStream, put_all

    def output(rid, index, text):
        return RequestOutput(rid, None, [1], [CompletionOutput(index, text, [7], None, None)], finished=False)

    async def run():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        streams = [RequestStream(f"r{i}", loop) for i in range(3)]
        closed = asyncio.new_event_loop()
        closed.close()
        lost = RequestStream("lost", closed)
        pairs = [(streams[0], output("r0", 0, "a")), (streams[1], output("r1", 5, "x")),  # index 5: n is 1
                 (lost, output("lost", 0, "z")), (streams[2], output("r2", 0, "c")), (streams[0], output("r0", 0, "b"))]
        gone = put_all(pairs)
        assert [s.request_id for s, _ in gone] == ["lost"]
        assert len(calls) == 1  # one wake-up for the four items of this loop
        first = await streams[0].next_output()
        assert first.outputs[0].text == "ab"  # both, in order
        assert (await streams[2].next_output()).outputs[0].text == "c"
        with pytest.raises(IndexError):
            await streams[1].next_output()

    asyncio.run(run())


def test_one_prompts_error_cancels_the_other_prompts_waits():
    """A non-streamed request of several prompts answers the first error; the waits for its other prompts
    (whose requests are released then, their streams never woken) are cancelled, not left pending."""
    import asyncio

    from tandem.server.api import OpenAIServer
    from tandem.server.async_engine import ServerOverloaded

    cancelled = []

    class Stream:
        def __init__(self, fails: bool):
            self.fails = fails

        async def final(self):
            await asyncio.sleep(0)
            if self.fails:
                raise ServerOverloaded("shed")
            try:
                await asyncio.Event().wait()  # a released stream: nothing ever comes
            except asyncio.CancelledError:
                cancelled.append(self)
                raise

    class Connected:
        async def receive(self):
            await asyncio.Event().wait()

    async def run():
        waiting = Stream(False)
        with pytest.raises(ServerOverloaded):
            await OpenAIServer._finals(None, Connected(), [waiting, Stream(True)])
        await asyncio.sleep(0)
        assert cancelled == [waiting]  # (inside the loop: asyncio.run cancels what is left once it ends)

    asyncio.run(run())


def test_vllm_request_defaults_that_ask_nothing_are_taken(live):
    """What vLLM takes at values that ask nothing a reply lacks: prompt_logprobs 0 in a chat stream (vLLM refuses
    only > 0 there), tools [] with tool_choice "auto" (plain text), best_of equal to n."""
    hi = [{"role": "user", "content": "hi"}]
    for body in ({"prompt_logprobs": 0, "stream": True}, {"tools": [], "tool_choice": "auto"}, {"best_of": 1}):
        r = live.post(CH, json={"model": MODEL, "messages": hi, "max_tokens": 2, **body})
        assert r.status_code == 200, (body, r.text)

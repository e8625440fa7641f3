"""`tandem generate` end to end on a tiny local pair: streaming, the summary line, --compare; and the CLI's
errors for bad flags (generate and serve), each naming the flag."""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess

import pytest
import torch

from tandem.cli import main
from tests.helpers import make_hf_model


@pytest.mark.parametrize("flags", [[], ["--adaptive"], ["--draft-quantization", "fp8"], ["-tp", "2"], ["--kv-cache-dtype", "fp8"],
                                   ["--rejection-sample-method", "block", "--temperature", "0.8", "--seed", "3"],
                                   ["-q", "fp8"]])
def test_generate_compare_fp32(tmp_path, capsys, monkeypatch, flags):
    import tandem.models.loader as loader

    quantized = []
    quantize = loader.quantize_linears_
    monkeypatch.setattr(loader, "quantize_linears_", lambda model, method, lm_head, **kw:
                        quantized.append((method, lm_head)) or quantize(model, method, lm_head, **kw))
    adaptive = "--adaptive" in flags
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    rc = main(["generate", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "3", *flags,
               "--dtype", "float32", "--max-tokens", "12", "--ignore-eos", "--compare", "The quick brown fox"])
    assert rc == 0
    if "--draft-quantization" in flags:
        assert quantized == [("fp8", True)]  # the draft alone, its LM head too
    elif "-q" in flags:
        assert quantized == [("fp8", False)] * 2  # the target (LM head kept), in the spec and the --compare engines
    else:
        assert quantized == []
    out, err = capsys.readouterr()
    assert out.strip()  # the streamed completion
    assert "12 tokens in" in err
    if adaptive:  # drafting or not is the engine's call, from step costs timed at start-up (load-dependent)
        assert "k=0..3, acceptance rate" in err or "k=0..3, no drafts" in err, err
    else:
        assert "k=3, acceptance rate" in err and "mean acceptance length" in err
    if "--temperature" in flags:  # sampled: the same distribution, not the same draw
        assert "speedup" in err and "identical output:" in err
    else:
        assert "speedup" in err and "identical output: yes" in err  # fp32 greedy: token for token


def test_generate_batch_invariant(tmp_path, capsys):
    """`tandem generate --batch-invariant` in bf16: speculative output identical to target-only's; in fp32 one
    clear error naming the fix."""
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    argv = ["generate", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "3", "--batch-invariant",
            "--max-tokens", "12", "--ignore-eos", "--compare"]
    assert main([*argv, "--dtype", "bfloat16", "The quick brown fox"]) == 0
    assert "identical output: yes" in capsys.readouterr().err
    assert main([*argv, "--dtype", "float32", "The quick brown fox"]) == 2
    assert "batch_invariant=True needs dtype bfloat16 or float16" in capsys.readouterr().err


def test_token_map_then_a_pruned_draft(tmp_path, capsys):
    """`tandem token-map` ranks the ids of a text's tokens; `generate --draft-token-map` (cut by
    --draft-vocab-size) drafts from them alone and gives the target-only tokens."""
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    (tmp_path / "corpus.txt").write_text("the fox and the dog. the fox ran." * 3)
    out = tmp_path / "map.json"
    capsys.readouterr()
    assert main(["token-map", "--model", str(tmp_path / "t"), str(tmp_path / "corpus.txt"), "-o", str(out)]) == 0
    ids = json.loads(out.read_text())
    assert len(ids) == len(set(ids)) > 5 and f"{len(ids)} token ids by frequency" in capsys.readouterr().out
    rc = main(["generate", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "3",
               "--draft-token-map", str(out), "--draft-vocab-size", "4", "--dtype", "float32", "--max-tokens", "12",
               "--ignore-eos", "--compare", "The quick brown fox"])
    assert rc == 0
    assert "identical output: yes" in capsys.readouterr().err
    assert main(["token-map", "--model", str(tmp_path / "t"), str(tmp_path / "corpus.txt"), "-o",
                 str(tmp_path / "map.pt")]) == 2
    assert "give a name ending in .json" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert main(["token-map", "--model", str(tmp_path / "t"), str(tmp_path / "empty.txt"), "-o", str(out)]) == 2
    assert "hold no text to count tokens in" in capsys.readouterr().err
    assert main(["token-map", "--model", str(tmp_path / "t"), str(tmp_path / "corpus.txt"), "-o",
                 str(tmp_path / "no" / "such" / "map.json")]) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_watermarked_generation_and_detection(tmp_path, capsys, monkeypatch):
    """`generate --watermark-config` draws with the key (the draft does not change the tokens);
    `detect` scores the text as re-encoded by the model's tokenizer. (A random model's byte
    tokens do not survive decoding and re-encoding, so the verdict on real text is tested with the
    real models: tests/models/test_real_models.py.)"""
    from tandem import LLM
    from tandem.detect import detect_watermark

    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    key = '{"key": 31337}'
    common = ["--model", str(tmp_path / "t"), "--dtype", "float32", "--max-tokens", "64", "--ignore-eos",
              "--temperature", "1.0", "--watermark-config", key, "--quiet", "Once upon a time"]
    assert main(["generate", *common, "--draft", str(tmp_path / "d"), "-k", "3"]) == 0
    spec_text = capsys.readouterr().out
    assert main(["generate", *common, "--no-draft"]) == 0
    text = capsys.readouterr().out
    assert text == spec_text and text.strip()
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(text))
    assert main(["detect", "--model", str(tmp_path / "t"), "--watermark-config", key, "-"]) == 0
    out = capsys.readouterr().out
    ids = LLM(str(tmp_path / "t"), dtype="float32").get_tokenizer()(text, add_special_tokens=False).input_ids
    found = detect_watermark(ids, json.loads(key))
    verdict = "yes" if found.watermarked else "no"
    assert out.startswith(f"watermarked: {verdict} (p-value {found.p_value:.3g} over {found.num_tokens} scored "
                          f"tokens of {len(ids)}")
    # With the prompt, the first tokens have their contexts too, and are scored.
    tok = LLM(str(tmp_path / "t"), dtype="float32").get_tokenizer()
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(text))
    assert main(["detect", "--model", str(tmp_path / "t"), "--watermark-config", key, "--prompt", "Once upon a time",
                 "-"]) == 0
    out = capsys.readouterr().out
    prompted = detect_watermark(ids, json.loads(key), tok("Once upon a time").input_ids)
    assert prompted.num_tokens > found.num_tokens
    assert f"over {prompted.num_tokens} scored tokens of {len(ids)}" in out
    assert main(["detect", "--model", str(tmp_path / "t"), "--watermark-config", key, "--chat", "x"]) == 2
    assert "pass the prompt too" in capsys.readouterr().err
    # a text too short to score gets no verdict (it said "no" over 0 scored tokens)
    assert main(["detect", "--model", str(tmp_path / "t"), "--watermark-config", key, ""]) == 0
    assert capsys.readouterr().out.startswith("watermarked: unknown (none of the text's 0 tokens could be scored")


def test_generate_with_structured_outputs(tmp_path, capsys):
    """`generate --structured-outputs` constrains the completion, with or without the draft."""
    import re

    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    common = ["--model", str(tmp_path / "t"), "--dtype", "float32", "--max-tokens", "32", "--quiet",
              "--structured-outputs", '{"regex": "(yes|no), [0-9]{3}"}', "Answer:"]
    assert main(["generate", *common, "--no-draft"]) == 0
    text = capsys.readouterr().out.strip()
    assert re.fullmatch("(yes|no), [0-9]{3}", text), text
    assert main(["generate", *common, "--draft", str(tmp_path / "d"), "-k", "3"]) == 0
    assert capsys.readouterr().out.strip() == text


def test_generate_bad_model_is_one_clear_error(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing"), "--no-draft", "hello"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_an_unwritable_model_cache_is_one_clear_error(tmp_path, capsys, monkeypatch):
    """A GGUF converted into a cache that cannot be written ($TANDEM_CACHE a file here; a read-only
    HOME or a full disk alike): the cache's own error and its fix, no traceback."""
    from tests.tiny_gguf import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", arch="llama")
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "not-a-dir"))
    assert main(["generate", "--model", str(tmp_path / "m.gguf"), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "\nerror: cannot write to the model cache" in "\n" + err.split("\r")[-1].lstrip()  # (after a progress bar)
    assert "TANDEM_CACHE" in err and "Traceback" not in err


def test_a_folder_of_gguf_files_asks_for_the_file(tmp_path, capsys):
    """Many GGUF repositories ship a config.json beside the .gguf files: such a folder as --model
    is answered with the file to pass, not with random weights."""
    make_hf_model(tmp_path / "hf", "llama")
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (folder / "model-Q8_0.gguf").write_bytes(b"")
    assert main(["generate", "--model", str(folder), "--no-draft", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "pass the .gguf file itself" in err and "model-Q8_0.gguf" in err


def test_a_cuda_device_past_the_visible_ones_is_refused(monkeypatch):
    from tandem.config import resolve_device
    from tandem.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"device='cuda:2' but 2 CUDA device\(s\) are visible"):
        resolve_device("cuda:2")


# ---------------------------------------------------------------- bad flags: one clear error, no model loaded
# A missing --model path makes a check that came too late show up as "does not exist" instead.
def _argparse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _assert_names_flag(tmp_path, capsys, command: str, argv: list[str], flag: str, tail: list[str]) -> None:
    """`tandem command argv tail` fails while parsing, naming flag, without a traceback."""
    if "--model" not in argv:
        argv = ["--model", str(tmp_path / "missing")] + argv
    err = _argparse_error(capsys, [command, *argv, *tail])
    assert f"argument {flag}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, flag", [
    (["--model", ""], "--model"),
    (["--model", "  "], "--model"),
    (["--draft", ""], "--draft"),
    (["-k", "0"], "--num-speculative-tokens"),
    (["-k", "-2"], "--num-speculative-tokens"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--watermark-config", "{\"key\": -1}"], "--watermark-config"),
    (["--watermark-config", "key=1"], "--watermark-config"),
    (["--structured-outputs", "[1]"], "--structured-outputs"),
    (["--structured-outputs", '{"regexp": "a"}'], "--structured-outputs"),
    (["--structured-outputs", '{"regex": "a", "choice": ["a"]}'], "--structured-outputs"),
    (["--speculative-config", "{"], "--speculative-config"),
    (["--speculative-config", '["model"]'], "--speculative-config"),
])
def test_generate_bad_flag_value_names_the_flag(tmp_path, capsys, argv, flag):
    _assert_names_flag(tmp_path, capsys, "generate", argv, flag, ["hello"])


@pytest.mark.parametrize("value", ["0", "1", "1.5"])
def test_detect_p_value_threshold_out_of_range_names_the_flag(tmp_path, capsys, value):
    _assert_names_flag(tmp_path, capsys, "detect", ["--watermark-config", '{"key": 1}', "--p-value-threshold", value],
                       "--p-value-threshold", ["text"])


@pytest.mark.parametrize("extra, flag", [
    (["--draft", "D", "--no-draft"], "--draft conflicts with --no-draft"),
    (["-k", "2", "--no-draft"], "--num-speculative-tokens (-k) conflicts with --no-draft"),
    (["--draft-sample-method", "probabilistic", "--no-draft"], "--draft-sample-method conflicts with --no-draft"),
    # a --model of one's own runs without a draft unless --draft names one: -k would be ignored
    (["-k", "2"], "--num-speculative-tokens (-k) needs a draft model"),
    (["--draft-sample-method", "greedy"], "--draft-sample-method needs a draft model"),
    (["--adaptive", "--no-draft"], "--adaptive conflicts with --no-draft"),
    (["--adaptive"], "--adaptive needs a draft model"),
    (["--draft-quantization", "fp8"], "--draft-quantization needs a draft model"),
    (["--draft-quantization", "fp8", "--no-draft"], "--draft-quantization conflicts with --no-draft"),
    (["--draft-vocab-size", "100"], "--draft-vocab-size needs a draft model"),
    (["--rejection-sample-method", "block"], "--rejection-sample-method needs a draft model"),
    (["--draft-token-map", "m.json", "--no-draft"], "--draft-token-map conflicts with --no-draft"),
    # --compare times the draft against the target alone: with no draft it compared the target with itself
    (["--compare", "--no-draft"], "--compare conflicts with --no-draft"),
    (["--compare"], "--compare needs a draft model"),
    (["--speculative-config", '{"model": "D", "num_speculative_tokens": 2}', "--draft", "D"],
     "--draft conflicts with --speculative-config"),
    (["--speculative-config", '{"model": "D", "num_speculative_tokens": 2}', "-k", "2"],
     "--num-speculative-tokens (-k) conflicts with --speculative-config"),
    (["--speculative-config", '{"model": "D", "num_speculative_tokens": 2}', "--no-draft"],
     "--speculative-config conflicts with --no-draft"),
])
def test_generate_draft_flag_conflicts(tmp_path, capsys, extra, flag):
    rc = main(["generate", "--model", str(tmp_path / "missing"), *extra, "hello"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}") and "does not exist" not in err


@pytest.mark.parametrize("extra, says", [
    (["--max-tokens", "0"], "error: --max-tokens=0 is invalid"),
    (["--min-tokens", "5", "--max-tokens", "3"], "error: --min-tokens=5 is invalid"),
    (["--top-p", "2"], "error: --top-p=2.0 is invalid"),
    (["--temperature", "-1"], "error: --temperature=-1.0 is invalid"),
])
def test_generate_sampling_flags_are_named(tmp_path, capsys, extra, says):
    """A bad sampling flag is refused before the model loads, by its flag (not SamplingParams' field)."""
    rc = main(["generate", "--model", str(tmp_path / "missing"), *extra, "hello"])
    assert rc == 2
    assert capsys.readouterr().err.startswith(says)


def test_generate_chat_without_template(tmp_path, capsys):
    model = make_hf_model(tmp_path / "t", "qwen2")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # drop the checkpoint writer's progress bar
    rc = main(["generate", "--model", str(model), "--dtype", "float32", "--max-tokens", "1", "--chat", "hi"])
    assert rc == 2
    assert capsys.readouterr().err == "error: this model's tokenizer has no chat template; drop --chat\n"


@pytest.mark.parametrize("argv, flag", [
    (["--model", ""], "--model"),
    (["--draft", ""], "--draft"),
    (["--tokenizer", ""], "--tokenizer"),
    (["--served-model-name", ""], "--served-model-name"),
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--port", "x"], "--port"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--watermark-config", "{\"key\": 1, \"context_width\": 99}"], "--watermark-config"),
    (["--block-size", "0"], "--block-size"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout"),
    (["--seed", "-1"], "--seed"),
    (["-k", "0"], "--num-speculative-tokens"),
    (["--reasoning-parser", "r1"], "--reasoning-parser"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "--structured-outputs-config"),
    (["--structured-outputs-config", "{"], "--structured-outputs-config"),
    (["--override-generation-config", '{"do_sample": true}'], "--override-generation-config"),
    (["--override-generation-config", "[1]"], "--override-generation-config"),
    (["--override-generation-config", '{"temperature": "hot"}'], "--override-generation-config"),  # was after loading
    (["--chat-template-content-format", "xml"], "--chat-template-content-format"),
    (["--tool-call-parser", "llama5_json"], "--tool-call-parser"),
    (["--draft-vocab-size", "0"], "--draft-vocab-size"),
    (["--per-request-spec-decode-metrics", "full"], "--per-request-spec-decode-metrics"),
    (["--speculative-config", "model=D"], "--speculative-config"),
    (["--max-model-len", "1.5K"], "--max-model-len"),  # binary units take whole numbers (vLLM's rule)
    (["--kv-cache-memory-bytes", "2X"], "--kv-cache-memory-bytes"),
])
def test_serve_bad_flag_value_names_the_flag(tmp_path, capsys, argv, flag):
    _assert_names_flag(tmp_path, capsys, "serve", argv, flag, [])


@pytest.mark.parametrize("extra, flag", [
    (["-k", "2"], "--num-speculative-tokens (-k)"),
    (["--draft-sample-method", "probabilistic"], "--draft-sample-method"),
    (["--adaptive"], "--adaptive"),
    (["--draft-quantization", "fp8"], "--draft-quantization"),
    (["--draft-vocab-size", "64"], "--draft-vocab-size"),
    (["--draft-token-map", "m.json"], "--draft-token-map"),
    (["--rejection-sample-method", "block"], "--rejection-sample-method"),
    (["--per-request-spec-decode-metrics", "summary"], "--per-request-spec-decode-metrics"),
])
def test_serve_draft_flag_without_draft(tmp_path, capsys, extra, flag):
    rc = main(["serve", "--model", str(tmp_path / "missing"), *extra])
    assert rc == 2
    assert capsys.readouterr().err.startswith(f"error: {flag} needs a draft model; add --draft PATH")


@pytest.mark.parametrize("extra, says", [
    (["--enable-auto-tool-choice"], "error: --enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "hermes"], "error: --tool-call-parser is used only by tool_choice \"auto\""),
    (["--allowed-methods", "GET"], "error: --allowed-methods applies to CORS, which --allowed-origins turns on"),
    (["--allow-credentials"], "error: --allow-credentials applies to CORS"),
    (["--allowed-origins", "*", "--allow-credentials"], "error: --allow-credentials with --allowed-origins '*'"),
    (["--ssl-keyfile", "k.pem"], "error: HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "error: --ssl-keyfile: no file 'k.pem'"),
    (["--ssl-ca-certs", "ca.pem"], "error: --ssl-ca-certs applies to HTTPS, which --ssl-keyfile and --ssl-certfile"),
    (["--ssl-cert-reqs", "2"], "error: --ssl-cert-reqs applies to HTTPS"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "1"],
     "error: --ssl-cert-reqs 1 checks client certificates against CA certificates; give them with --ssl-ca-certs"),
    (["--allowed-origins", '["*"]', "--allow-credentials"], "error: --allow-credentials with --allowed-origins '*'"),
])
def test_serve_tool_flags_come_together(tmp_path, capsys, extra, says):
    rc = main(["serve", "--model", str(tmp_path / "missing"), *extra])
    assert rc == 2
    assert capsys.readouterr().err.startswith(says)


@pytest.mark.parametrize("flag", ["--speculative-config", "--hf-overrides", "--structured-outputs"])
def test_json_flags_nested_too_deeply_are_an_error(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path / "missing"), flag, "[" * 100000, "hi"])
    assert e.value.code == 2 and "nested too deeply" in capsys.readouterr().err


def test_serve_refuses_tls_files_that_are_not_pem_before_loading(tmp_path, capsys):
    """A key or certificate that exists but is not PEM was ssl.SSLError's traceback once the model had loaded."""
    for name in ("k.pem", "c.pem", "ca.pem"):
        (tmp_path / name).write_text("not PEM\n")
    k, c, ca = (str(tmp_path / n) for n in ("k.pem", "c.pem", "ca.pem"))
    assert main(["serve", "--model", str(tmp_path / "missing"), "--ssl-keyfile", k, "--ssl-certfile", c]) == 2
    assert capsys.readouterr().err.startswith(f"error: --ssl-certfile {c!r} and --ssl-keyfile {k!r} are not a PEM "
                                              "certificate and its private key")
    if shutil.which("openssl") is None:
        return
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", k, "-out", c, "-days", "1",
                    "-subj", "/CN=tandem"], check=True, capture_output=True)
    argv = ["serve", "--model", str(tmp_path / "missing"), "--ssl-keyfile", k, "--ssl-certfile", c]
    assert main(argv + ["--ssl-ca-certs", ca, "--ssl-cert-reqs", "2"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --ssl-ca-certs {ca!r} holds no PEM CA certificate")
    encrypted = str(tmp_path / "encrypted.pem")  # left to uvicorn, which asks for its password: no prompt here
    subprocess.run(["openssl", "rsa", "-in", k, "-aes128", "-passout", "pass:pw", "-out", encrypted], check=True,
                   capture_output=True)
    for key in (k, encrypted):
        main(["serve", "--model", str(tmp_path / "missing"), "--ssl-keyfile", key, "--ssl-certfile", c])
        assert "ssl" not in capsys.readouterr().err  # past the TLS check: the missing model is what fails


SPEC = '{"model": "D", "num_speculative_tokens": 2}'


@pytest.mark.parametrize("argv, says", [
    ([], "error: no model to serve; give its path or name: tandem serve MODEL"),
    (["A", "--model", "B"], "error: the model is given twice, as 'A' and --model 'B'; give it once"),
    (["M", "--speculative-config", SPEC, "--draft", "D"], "error: --draft conflicts with --speculative-config"),
    (["M", "--speculative-config", SPEC, "-k", "2"],
     "error: --num-speculative-tokens (-k) conflicts with --speculative-config"),
])
def test_serve_model_and_draft_given_once(capsys, argv, says):
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.startswith(says)


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading(tmp_path, capsys):
    """--host that names no address, or a --port another socket holds: refused by flag before the
    model loads (uvicorn would say so only after loading it, naming neither)."""
    import socket

    assert main(["serve", str(tmp_path / "never-loaded"), "--host", "999.1.1.1"]) == 2
    assert capsys.readouterr().err.startswith("error: --host '999.1.1.1' is not an address of this machine")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", str(tmp_path / "never-loaded"), "--port", str(port)]) == 2
        assert capsys.readouterr().err.startswith(f"error: cannot listen on --host 127.0.0.1 --port {port}: ")


def test_generate_with_vllms_speculative_config(tmp_path, capsys):
    """--speculative-config takes vLLM's JSON object: its keys reach the engine (k = 2 here), and a
    bad key is named as LLM names it."""
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    spec = {"model": str(tmp_path / "d"), "num_speculative_tokens": 2, "draft_sample_method": "greedy"}
    argv = ["generate", "--model", str(tmp_path / "t"), "--dtype", "float32", "--max-tokens", "12", "--ignore-eos"]
    assert main([*argv, "--speculative-config", json.dumps(spec), "--compare", "The quick brown fox"]) == 0
    err = capsys.readouterr().err
    assert "k=2, acceptance rate" in err and "identical output: yes" in err
    assert main([*argv, "--speculative-config", json.dumps({**spec, "bogus": 1}), "The quick brown fox"]) == 2
    assert "error: speculative_config has unknown keys ['bogus']" in capsys.readouterr().err


def test_generate_with_ngram_and_suffix_lookup(tmp_path, capsys):
    """--draft ngram (vLLM's lookup defaults) and --speculative-config with method "ngram": no draft
    model, the target's own tokens; a draft-model flag beside it is named. The same for suffix."""
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    argv = ["generate", "--model", str(tmp_path / "t"), "--dtype", "float32", "--max-tokens", "16", "--ignore-eos"]
    prompt = "The quick brown fox. The quick brown fox. The quick brown fox."
    assert main([*argv, "--draft", "ngram", "-k", "3", "--compare", prompt]) == 0
    assert "identical output: yes" in capsys.readouterr().err
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert main([*argv, "--speculative-config", json.dumps(spec), "--compare", prompt]) == 0
    assert "identical output: yes" in capsys.readouterr().err
    assert main([*argv, "--draft", "ngram", "--draft-quantization", "fp8", prompt]) == 2
    assert "error: --draft-quantization='fp8' configures a draft model" in capsys.readouterr().err
    # suffix decoding: --draft suffix, or its keys through --speculative-config
    assert main([*argv, "--draft", "suffix", "-k", "4", "--compare", prompt]) == 0
    assert "identical output: yes" in capsys.readouterr().err
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}
    assert main([*argv, "--speculative-config", json.dumps(spec), "--compare", prompt]) == 0
    assert "identical output: yes" in capsys.readouterr().err
    # --load-format reaches a draft model, never a lookup (which refuses draft_load_format)
    for lookup in (["--draft", "ngram"], ["--draft", "suffix"], ["--speculative-config", json.dumps(spec)]):
        assert main([*argv, "--load-format", "dummy", *lookup, prompt]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*argv, "--speculative-config", json.dumps({**spec, "prompt_lookup_max": 3}), prompt]) == 2
    assert "speculative_config.prompt_lookup_max sets n-gram lookup" in capsys.readouterr().err


def test_serve_builds_the_engine_and_app_its_flags_ask_for(tmp_path, monkeypatch):
    """`tandem serve MODEL --speculative-config JSON` with the per-request metrics flags: the engine
    gets the JSON's draft settings and the app reports (and stores) what the flags ask (uvicorn not started)."""
    from starlette.middleware.cors import CORSMiddleware

    from tandem.server.api import DrainingServer, RequireApiKey

    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    apps = []
    monkeypatch.setattr(DrainingServer, "run", lambda self: apps.append(self._app))
    configs = []

    def init(self, config, app) -> None:
        self._app = app
        configs.append(config)

    monkeypatch.setattr(DrainingServer, "__init__", init)
    spec = {"model": str(tmp_path / "d"), "num_speculative_tokens": 2, "rejection_sample_method": "block"}
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(["serve", str(tmp_path / "t"), "--dtype", "float32", "--max-model-len", "64",
                 "--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed",
                 "--enable-per-request-metrics", "--responses-store-size", "7", "--scheduling-policy",
                 "priority", "--enforce-eager", "--api-key", "sk-1", "--api-key", "sk-2", "--kv-cache-dtype", "fp8",
                 "--quantization", "fp8",
                 "--allowed-origins", "https://a.example", "--allowed-origins", '["https://b.example"]',
                 "--allowed-methods", "post", "--disable-fastapi-docs",
                 "--enable-prompt-tokens-details", "--root-path", "/tandem", "--return-tokens-as-token-ids",
                 "--chat-template", str(tmp_path / "t.jinja"), "--disable-log-stats"]) == 0
    (app,) = apps
    assert app.state.engine_client.engine.log_interval_s == float("inf")  # --disable-log-stats
    assert logging.getLogger("tandem").getEffectiveLevel() == logging.INFO  # a server logs at INFO, as vLLM's
    assert app.state.server.chat_template == (tmp_path / "t.jinja").read_text()
    (auth,) = [m for m in app.user_middleware if m.cls is RequireApiKey]
    assert auth.kwargs["keys"] == ["sk-1", "sk-2"]
    assert app.state.engine_client.engine.cfg.enforce_eager is True
    assert app.state.engine_client.engine.runner.kv.k[0].dtype == torch.float8_e4m3fn
    assert app.state.engine_client.engine.cfg.model.quantization == "fp8"
    (cors,) = [m for m in app.user_middleware if m.cls is CORSMiddleware]
    assert cors.kwargs == dict(allow_origins=["https://a.example", "https://b.example"], allow_methods=["POST"],
                               allow_headers=["*"], allow_credentials=False)
    assert app.docs_url is None and app.openapi_url is None and app.state.server.prompt_tokens_details
    assert app.state.server.tokens_as_ids
    assert app.state.root_path == "/tandem" and configs[0].ssl_keyfile is None
    engine = app.state.engine_client.engine
    assert engine.cfg.sched.scheduling_policy == "priority" and engine.scheduler.by_priority
    assert engine.cfg.spec.k == 2 and engine.cfg.spec.rejection_sample_method == "block"
    assert engine.cfg.per_request_spec_decode_metrics == "detailed" and engine.scheduler.record_spec_steps
    report = app.state.server.report
    assert report.timing and report.spec_decode == "detailed" and report.num_spec_tokens == 2
    assert app.state.server.responses_store.size == 7


def test_serve_api_key_from_the_environment_and_inline_chat_templates(tmp_path, monkeypatch, capsys):
    """TANDEM_API_KEY stands in for --api-key; --chat-template takes the template's text too (its
    backslash escapes read as vLLM reads them), and a value that is neither is named before the model loads."""
    from tandem.server import add_serve_args, check_serve_args

    parser = add_serve_args(argparse.ArgumentParser())
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    args = parser.parse_args(["M", "--chat-template", "{{ messages[0]['content'] }}\\n"])
    check_serve_args(args)
    assert args.api_key == ["sk-env"] and args.chat_template == "{{ messages[0]['content'] }}\n"
    args = parser.parse_args(["M", "--api-key", "sk-flag"])
    check_serve_args(args)
    assert args.api_key == ["sk-flag"]
    assert main(["serve", "M", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --chat-template: '{tmp_path / 'missing.jinja'}' is neither "
                                              "a file nor a template's text")
    assert main(["serve", "M", "--chat-template", "{{ 'C:\\x' }}"]) == 2  # a broken escape, not a traceback
    assert capsys.readouterr().err.startswith("error: --chat-template: the template's text has a broken backslash")
    args = parser.parse_args(["M", "--chat-template", "{{ '\\u2211 ∑ é' }}"])
    check_serve_args(args)
    assert args.chat_template == "{{ '∑ ∑ é' }}"


def test_serve_takes_vllms_command_line_forms(monkeypatch):
    """vLLM's spellings: several names or keys after one flag, sizes with units, --[no-]enable-prefix-caching,
    --no-enforce-eager, --response-role, --[no-]enable-log-requests and the older --disable-log-requests;
    VLLM_API_KEY when TANDEM_API_KEY is unset."""
    from tandem.server import add_serve_args, check_serve_args

    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["M", "--served-model-name", "a", "b", "--served-model-name", "c", "--api-key", "k1",
                              "k2", "--max-model-len", "32k", "--max-num-batched-tokens", "8K",
                              "--kv-cache-memory-bytes", "1.5g", "--no-enable-prefix-caching", "--no-enforce-eager",
                              "--response-role", "bot", "--disable-log-requests"])
    assert args.model_tag == "M" and args.served_model_name == ["a", "b", "c"] and args.api_key == ["k1", "k2"]
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (32000, 8192, 1500000000)
    assert not args.enable_prefix_caching and not args.enforce_eager and args.response_role == "bot"
    assert not args.enable_log_requests and parser.parse_args(["M", "--enable-log-requests"]).enable_log_requests
    assert parser.parse_args(["M", "--no-prefix-caching"]).enable_prefix_caching is False
    defaults = parser.parse_args(["M"])
    assert defaults.enable_prefix_caching and defaults.response_role == "assistant"
    assert parser.parse_args(["M", "--max-model-len", "2K"]).max_model_len == 2048
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    check_serve_args(defaults)
    assert defaults.api_key == ["sk-vllm"]


def test_serve_response_role_and_request_log(tmp_path, caplog):
    """--response-role names the role of chat replies (streamed and not) under add_generation_prompt;
    --enable-log-requests logs each request received, its prompt and ids cut to --max-log-len."""
    import logging

    from fastapi.testclient import TestClient

    from tandem import LLM
    from tandem.server.api import build_app

    llm = LLM(str(make_hf_model(tmp_path / "t", "qwen2")), dtype="float32", max_model_len=64)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    caplog.set_level(logging.INFO, logger="tandem.server.requests")
    with TestClient(build_app(llm, "m", response_role="bot", log_requests=True, max_log_len=4)) as client:
        assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
        client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 1})
        logged = [r.getMessage() for r in caplog.records if r.name == "tandem.server.requests"]
        assert len(logged) == 2 and all(m.startswith("Received request ") for m in logged)
        assert "prompt_token_ids: [5, 6, 7, 8]" in logged[1] and "max_tokens=1" in logged[1]
        first = next(line for line in client.post("/v1/chat/completions", json={**body, "stream": True}).iter_lines()
                     if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "bot"


def test_engine_errors_name_the_flag_that_set_the_value(tmp_path, capsys):
    """An error the engine raises about a value a flag set names that flag, not the engine's field."""
    model = make_hf_model(tmp_path / "t", "qwen2")
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--draft", str(tmp_path / "missing"), "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: --draft: ")
    assert main(["generate", "--model", str(model), "--no-draft", "--max-model-len", "100000", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-model-len=100000 ") and "use --max-model-len<=512" in err
    assert main(["generate", "--model", str(model), "--no-draft", "--structured-outputs", '{"regex": "(("}', "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: --structured-outputs regex ")
    spec = json.dumps({"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})
    assert main(["generate", "--model", str(model), "--speculative-config", spec, "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: speculative_config.model")  # the user wrote that key
    # a field compared, or named alone ("raise num_gpu_blocks_override"): the flag too; a field that is an
    # English word stays a word
    from tandem.cli import build_parser, in_flag_terms

    args = build_parser().parse_args(["serve", "m"])
    said = in_flag_terms('speculative_config.num_speculative_tokens_per_batch_size="auto" is not supported with '
                         "tensor_parallel_size > 1; raise num_gpu_blocks_override on the device", args)
    assert said == ('--adaptive="auto" is not supported with --tensor-parallel-size > 1; raise '
                    "--num-gpu-blocks-override on the device")
    said = in_flag_terms("--draft: ...; or set speculative_config.draft_tensor_parallel_size=1 (the whole draft)", args)
    assert said == '--draft: ...; or set --speculative-config with "draft_tensor_parallel_size": 1 (the whole draft)'
    known = "speculative_config has unknown keys ['bogus']; known keys: ['enforce_eager', 'max_model_len', \"method\"]"
    assert in_flag_terms(known, args) == known  # keys as the user writes them, not flags
    said = in_flag_terms("generation_config.json or override_generation_config sets ...; or pass "
                         "generation_config='vllm'", args)
    assert said == "generation_config.json or --override-generation-config sets ...; or pass --generation-config='vllm'"



def test_generate_into_a_closed_pipe_or_interrupted_ends_quietly(tmp_path, monkeypatch):
    """`tandem generate ... | head` and Ctrl-C end without a traceback (exit 0 and 130)."""
    import subprocess
    import sys

    import tandem.cli as cli

    model = str(make_hf_model(tmp_path / "t", "qwen2"))
    argv = ["generate", "--model", model, "--no-draft", "--dtype", "float32", "--ignore-eos", "--max-tokens", "400",
            "hi"]
    proc = subprocess.Popen([sys.executable, "-m", "tandem", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # as `head -c 1` does
    assert proc.wait(timeout=300) == 0
    assert b"Traceback" not in proc.stderr.read()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_stream", interrupted)
    assert main(argv) == 130


def test_async_engine_bad_queue_limit_is_a_config_error():
    from tandem.errors import ConfigError
    from tandem.server.async_engine import AsyncEngine

    for bad in (-1, True, 2.5):
        with pytest.raises(ConfigError, match="max_queued_requests"):
            AsyncEngine(None, max_queued_requests=bad)


def test_serve_override_generation_config_reaches_the_llm():
    """--override-generation-config (vLLM's) parses to the dict LLM(override_generation_config=...) takes."""
    import argparse

    from tandem.server import add_serve_args

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--model", "m", "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}'])
    assert args.override_generation_config == {"temperature": 0.5, "max_new_tokens": 64}
    assert add_serve_args(argparse.ArgumentParser()).parse_args(["--model", "m"]).override_generation_config is None


def test_serve_passes_the_engine_flags_llm_takes(monkeypatch):
    """vLLM's engine flags that LLM() takes (most asking for nothing here: --trust-remote-code,
    --enable-chunked-prefill, --swap-space, -pp 1, ...) and tandem's --cpu-matmul, --max-cudagraph-tokens and
    --[no-]async-scheduling reach LLM() as its arguments, which checks them as it checks the offline API's."""
    import tandem.engine.llm as llm_module

    seen = {}

    class Built(Exception):
        pass

    def capture(self, model, **kw):
        seen.update(kw)
        raise Built

    monkeypatch.setattr(llm_module.LLM, "__init__", capture)
    with pytest.raises(Built):
        main(["serve", "M", "--trust-remote-code", "--enable-chunked-prefill", "--swap-space", "4", "-pp", "1",
              "--distributed-executor-backend", "mp", "--tokenizer-mode", "hf", "--disable-custom-all-reduce",
              "--cpu-matmul", "torch", "--max-cudagraph-tokens", "0", "--no-async-scheduling"])
    assert {k: seen[k] for k in ("trust_remote_code", "enable_chunked_prefill", "swap_space", "pipeline_parallel_size",
                                 "distributed_executor_backend", "tokenizer_mode", "disable_custom_all_reduce",
                                 "cpu_matmul", "max_cudagraph_tokens", "async_scheduling")} == dict(
        trust_remote_code=True, enable_chunked_prefill=True, swap_space=4.0, pipeline_parallel_size=1,
        distributed_executor_backend="mp", tokenizer_mode="hf", disable_custom_all_reduce=True, cpu_matmul="torch",
        max_cudagraph_tokens=0, async_scheduling=False)
    seen.clear()
    with pytest.raises(Built):
        main(["serve", "M"])
    assert (seen["async_scheduling"], seen["cpu_matmul"], seen["max_cudagraph_tokens"], seen["tokenizer_mode"],
            seen["trust_remote_code"], seen["enable_chunked_prefill"]) == (None, "auto", 512, "auto", False, None)

"""Smoke tests of the benchmarks' quick modes (cpu_throughput, priority, ngram, suffix_rules, host_step,
prefix_sharing): they run end to end and write sane JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_throughput_quick(tmp_path):
    out = tmp_path / "cpu_throughput.json"
    proc = subprocess.run(
        [sys.executable, "bench/cpu_throughput.py", "--quick", "--dtype", "float32", "--batch-sizes", "1,3",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tandem/HF" in proc.stdout  # the table is printed last

    report = json.loads(out.read_text())
    assert {"benchmark", "env", "config", "load_s", "results"} <= set(report)
    env = report["env"]
    for key in ("torch", "torch_threads", "cpu", "date", "git_commit"):
        assert key in env
    assert env["torch_threads"] >= 1
    cfg = report["config"]
    assert cfg["quick"] and cfg["dtype"] == "float32" and cfg["new_tokens"] == 16
    assert cfg["batch_sizes"] == [1, 3]

    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["generated_tokens_per_run"] == r["batch_size"] * 16
        for engine in ("tandem", "hf"):
            e = r[engine]
            assert len(e["times_s"]) == cfg["repeats"] == 1
            for key in ("median_s", "tokens_per_s", "ttft_s", "decode_tokens_per_s"):
                assert e[key] > 0, (engine, key, e[key])
        assert r["ratio_tandem_over_hf"] > 0
        m = r["greedy_match"]
        assert m["sequences"] == 2 * r["batch_size"]  # warm-up + 1 timed run
        # fp32 on the same weights: greedy tokens agree exactly.
        assert m["identical_fraction"] == 1.0, m


def test_priority_bench_quick(tmp_path):
    """bench/priority.py on a small load: both policies give the same tokens, and under priority
    an urgent request starts at the step after it arrives."""
    out = tmp_path / "priority.json"
    proc = subprocess.run(
        [sys.executable, "bench/priority.py", "--dtype", "float32", "--backlog", "6", "--backlog-tokens", "16",
         "--urgent", "2", "--urgent-tokens", "4", "--every", "6", "--prompt-len", "16", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "same tokens" in proc.stdout
    fcfs, priority = json.loads(out.read_text())["results"]
    assert (fcfs["policy"], priority["policy"]) == ("fcfs", "priority")
    assert priority["urgent_wait_steps"] == [1, 1] and min(fcfs["urgent_wait_steps"]) > 1
    assert fcfs["preemptions"] == 0 < priority["preemptions"]


def test_ngram_bench_quick(tmp_path):
    """bench/ngram.py --quick on the CPU: the lookup timings and the engine rows (target-only and the
    lookups on tiny shapes) come out, and a repeating output has every draft accepted."""
    out = tmp_path / "ngram.json"
    proc = subprocess.run([sys.executable, "bench/ngram.py", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tokens/step" in proc.stdout  # the table is printed last
    report = json.loads(out.read_text())
    assert report["lookup"] and all(r["torch_us"] > 0 and r["suffix_us"] > 0 for r in report["lookup"])
    configs = {r["config"] for r in report["engine"]}
    assert {"target-only", "target-only, not planned ahead", "ngram 2:5 k=2", "suffix k=2"} <= configs
    for r in report["engine"]:
        assert r["tokens_per_step"] >= 1 and r["tok_s"] > 0
        if r["text"] == "repeating" and r["config"].startswith(("ngram", "suffix")):
            assert 0 < r["accepted"] == r["drafted"]


def test_suffix_rules_bench_on_given_outputs(tmp_path):
    """bench/suffix_rules.py on outputs given in a file (no model): both rules' rows for every
    workload; the second pass over the same requests, every answer seen before, needs fewer steps."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from bench.suffix_rules import arctic_speculate

    context = [1, 2, 3, 7, 8, 9, 5, 1, 2, 3]  # "1 2 3" seen once before (and at the end): 7 8 9 at 1/2 each
    assert arctic_speculate(np.array(context), context, 8, 24, 1.0, 0.1) == ([7, 8, 9], 1.5)
    g = np.random.default_rng(0)
    data = [["code", g.integers(0, 50, 8).tolist(), g.integers(0, 50, 40).tolist()] for _ in range(3)]
    outputs, out = tmp_path / "outputs.json", tmp_path / "rules.json"
    outputs.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "bench/suffix_rules.py", "--outputs", str(outputs), "--ks", "3",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(r["rule"], r["workload"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(rule, w) for rule in ("tandem", "arctic") for w in ("own", "pass 1", "pass 2")}
    for rule in ("tandem", "arctic"):
        assert rows[rule, "pass 2"]["steps"] < rows[rule, "pass 1"]["steps"] <= rows[rule, "own"]["tokens"]


def test_host_step_bench_quick(tmp_path):
    """bench/host_step.py on a small batch: both heap modes measured, every phase timed, and the
    frozen heap's full collections short."""
    out = tmp_path / "host_step.json"
    proc = subprocess.run([sys.executable, "bench/host_step.py", "--device", "cpu", "--batch-sizes", "8",
                           "--warmup", "2", "--blocks", "2", "--block-steps", "5", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "host time per engine step" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["heap"]) for r in rows] == [(8, "frozen"), (8, "thawed")]
    for r in rows:
        assert r["steps"] == 10 and 0 < r["step_p50_ms"] <= r["step_max_ms"]
        for phase in ("schedule_ahead", "build_batch", "launch", "update", "_emit", "_outputs"):
            assert r["us_per_request"][phase] > 0, (r["heap"], phase)


def test_prefix_sharing_bench_on_a_tiny_pair(tmp_path):
    """bench/prefix_sharing.py on a tiny pair: with sharing the later prompts hit the preamble,
    without it none does, and the tokens are the same."""
    from tests.helpers import make_spec_models

    models = make_spec_models(tmp_path)
    out = tmp_path / "prefix_sharing.json"
    proc = subprocess.run(
        [sys.executable, "bench/prefix_sharing.py", "--model", str(models["target"]), "--draft", str(models["near"]),
         "--dtype", "float32", "--prompts", "3", "--shared-examples", "4", "--tokens", "4", "--repeats", "1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "same tokens: True" in proc.stdout
    report = json.loads(out.read_text())
    shared, alone = report["results"]
    assert shared["cached_tokens"][0] == 0 and min(shared["cached_tokens"][1:]) >= 32
    assert alone["cached_tokens"] == [0, 0, 0]


def test_gpu_bench_peer_ratios():
    """The GPU bench's table of batch-1 runs against transformers (its GPU sections need CUDA;
    this is the arithmetic on their results)."""
    from bench.gpu_bench import peer_ratios

    results = {"hf": [{"engine": "hf_generate", "tok_s": 40.0, "cold_tok_s": 20.0},
                      {"engine": "hf_assisted", "tok_s": 20.0, "cold_tok_s": 8.0}],
               "target_only": [{"model": "t", "batch": 1, "tok_s": 250.0, "kv_cache_dtype": "auto"},
                               {"model": "t", "batch": 1, "tok_s": 260.0, "kv_cache_dtype": "fp8"},
                               {"model": "t", "batch": 8, "tok_s": 1700.0}, {"model": "d", "batch": 1, "tok_s": 900.0}],
               "synthetic": [{"target": "t", "batch": 1, "k": 4, "profile": "uniform-0.8", "draft_quantization": "fp8",
                              "tok_s": 460.0},
                             {"target": "t", "batch": 1, "k": 4, "profile": "uniform-0.8", "draft_quantization": None,
                              "draft_vocab_size": 32768, "tok_s": 430.0},
                             {"target": "t", "batch": 8, "k": 4, "profile": "uniform-0.8", "draft_quantization": None,
                              "tok_s": 3000.0}],
               "eps_pair": [{"eps": 0.02, "tok_s": 480.0}]}
    got = [(r["run"], r["over_warm"], r["over_cold"]) for r in peer_ratios(results, "t")]
    assert got == [("target-only", 6.25, 12.5), ("target-only, fp8 kv cache", 6.5, 13.0),
                   ("k=4 uniform-0.8 fp8 draft", 11.5, 23.0), ("k=4 uniform-0.8 head 32768", 10.75, 21.5),
                   ("eps pair 0.02 (k=4, greedy)", 12.0, 24.0)]
    assert peer_ratios({**results, "hf": results["hf"][1:]}, "t") == []

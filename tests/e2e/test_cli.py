"""`tandem generate` end to end on a tiny local pair: streaming, the summary line, --compare."""
from __future__ import annotations

from tandem.cli import main
from tests.helpers import make_hf_model


def test_generate_compare_fp32(tmp_path, capsys):
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=1)
    rc = main(["generate", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "3",
               "--dtype", "float32", "--max-tokens", "12", "--ignore-eos", "--compare", "The quick brown fox"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.strip()  # the streamed completion
    assert "12 tokens in" in err and "k=3, acceptance rate" in err and "mean acceptance length" in err
    assert "speedup" in err and "identical output: yes" in err  # fp32 greedy: token for token


def test_generate_bad_model_is_one_clear_error(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing"), "--no-draft", "hello"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("error: ")

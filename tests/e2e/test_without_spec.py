"""The engine without tandem/spec (docs/architecture.md: everything speculative lives there, so the engine
runs with it deleted): `tandem generate --no-draft`, `tandem serve` up to the app, and the offline API, in a
process where importing tandem.spec fails; and the CLI's parser is built without torch (`tandem --help`)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

from tests.helpers import make_hf_model

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A finder ahead of every other (the editable install's too) that refuses tandem.spec, as if deleted.
NO_SPEC = """
import sys
class NoSpec:
    def find_spec(self, name, path=None, target=None):
        if name == "tandem.spec" or name.startswith("tandem.spec."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoSpec())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_SPEC + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_finder_stands_in_for_a_deleted_spec_package():
    proc = _run("import tandem.spec.config")
    assert proc.returncode != 0 and "No module named 'tandem.spec" in proc.stderr


def test_generate_and_the_offline_api_run_without_spec(tmp_path):
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    code = f"""
from tandem.cli import main
assert main(["generate", "--model", {str(tmp_path / "t")!r}, "--no-draft", "--dtype", "float32",
             "--max-tokens", "4", "--ignore-eos", "--quiet", "hello"]) == 0
from tandem import LLM, SamplingParams
llm = LLM({str(tmp_path / "t")!r}, dtype="float32")
out = llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 4
assert "tandem.spec" not in sys.modules
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_serve_builds_its_app_without_spec(tmp_path):
    make_hf_model(tmp_path / "t", "qwen2", seed=1)
    code = f"""
import tandem.server.api as api
class Built(Exception):
    pass
def stop(self):
    raise Built  # the app and the engine are built; serving would start here
api.DrainingServer.run = stop
from tandem.cli import main
try:
    main(["serve", "--model", {str(tmp_path / "t")!r}, "--dtype", "float32", "--port", "1"])
except Built:
    pass
else:
    raise AssertionError("serve returned before building its app")
assert "tandem.spec" not in sys.modules
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_cli_parser_is_built_without_torch():
    code = "import tandem.cli as c; c.build_parser(); assert 'torch' not in sys.modules, 'torch was imported'"
    proc = subprocess.run([sys.executable, "-c", "import sys; " + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr

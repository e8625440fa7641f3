"""The block-table attention path (used on CUDA) equals the grouped CPU reference."""
import torch

from tandem import LLM, SamplingParams
from tandem.layers.backend import AttnBackend
from tests.helpers import make_hf_model


def test_table_metadata_path_matches_reference(tmp_path):
    path = make_hf_model(tmp_path / "m", "qwen2", init_std=0.3)
    draft = make_hf_model(tmp_path / "d", "qwen2", num_layers=1, seed=4)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, 300, (n,), generator=g).tolist()} for n in (5, 17, 40, 3)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=1)] * 2
    outs = []
    for use_table in (False, True):
        llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=24,
                  speculative_config=dict(model=str(draft), num_speculative_tokens=3))
        backend = AttnBackend(8, torch.device("cpu"), use_table=use_table, use_triton=False)
        llm.engine.runner.attn_backend = backend
        llm.engine.runner.speculator.attn_backend = backend
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]

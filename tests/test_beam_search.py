"""Beam search (features/beam_search.py) against transformers' generate(num_beams=K), and with
shared blocks against the same beams each holding its own."""

import math

import pytest
import torch
from conftest import forward_modes, tiny_hf_model

from block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from features.beam_search import BeamSampler, beam_search
from features.sharing.block_manager import SharingBlockManager
from plumbing.inputs import load_model
from llama3_paged import Llama

MAX_SEQ_LEN = 128
PROMPT_LENGTHS = [5, 17, 30, 2]


def our_beams(model, prompts, width, new_tokens, stop_ids, sharing=True, block_size=4):
    n = len(prompts) * width
    num_blocks = n * math.ceil(MAX_SEQ_LEN / block_size)
    cache = EngineKVCache(model.args, num_blocks, block_size, torch.float32, "cpu", TorchAttentionAfterPrefix())
    max_blocks = math.ceil(MAX_SEQ_LEN / block_size)
    manager = (SharingBlockManager(cache, n, max_blocks, prefix_caching=False) if sharing
               else BlockManager(num_blocks, block_size, n, max_blocks))
    sampler = BeamSampler(width)
    engine = ModelRunner(model, cache, manager, sampler)
    result = beam_search(engine, prompts, width, [new_tokens] * len(prompts), stop_ids,
                         progress=False, shares=sharing)
    assert manager.num_free_blocks == num_blocks and not manager.owned_blocks, "a block leaked"
    return result


def transformers_beams(hf, prompt, width, new_tokens, stop_id):
    out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                      do_sample=False, max_new_tokens=new_tokens, length_penalty=0.0,
                      early_stopping=False, eos_token_id=stop_id, pad_token_id=stop_id,
                      output_scores=True, return_dict_in_generate=True)
    beams = []
    for sequence in out.sequences[:, len(prompt):].tolist():
        while sequence and sequence[-1] == stop_id:  # the stop token and the padding after it
            sequence.pop()
        beams.append(sequence)
    return beams, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = tiny_hf_model(rope_scaling=False, tied=False, seed=3)
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, load_model(Llama, path, "cpu", torch.float32, max_positions=MAX_SEQ_LEN)


@pytest.mark.parametrize("width", [2, 4])
def test_beams_and_scores_equal_transformers(models, width):
    hf, model = models
    g = torch.Generator().manual_seed(width)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    prompts.append(prompts[1])  # shared with the sharing manager: its last token computed apart
    # A stop token the model likes: the third token of the first prompt's greedy answer. Some
    # beams end on it, others run to the length limit.
    greedy = hf.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=3)
    stop_id = int(greedy[0, -1])
    ours = our_beams(model, prompts, width, 12, {stop_id})
    ended_early = 0
    for prompt, search in zip(prompts, ours.prompts):
        beams, scores = transformers_beams(hf, prompt, width, 12, stop_id)
        assert [tokens for _, tokens in search.finished] == beams
        assert [score for score, _ in search.finished] == pytest.approx(scores, abs=1e-4)
        ended_early += sum(len(b) < 12 for b in beams)
    assert ended_early > 0, "no beam met the stop token: the test would not test it"


def test_shared_blocks_give_the_beams_of_unshared_ones_in_less_memory(models):
    _, model = models
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in [23, 9, 40]]
    shared = our_beams(model, prompts, 4, 20, set())
    unshared = our_beams(model, prompts, 4, 20, set(), sharing=False)
    assert [s.finished for s in shared.prompts] == [s.finished for s in unshared.prompts]
    # What sharing says the beams would hold unshared is what they held in the unshared run.
    assert shared.fullest_unshared_slots == unshared.fullest_reserved_slots
    assert shared.fullest_reserved_slots < 0.6 * unshared.fullest_reserved_slots
    assert shared.num_copied_blocks > 0  # children wrote into a part-full shared block


# slow: 15 s of script runs; test_beam_search above checks the same search in-process
@pytest.mark.slow
def test_the_script_reports_the_memory_sharing_saved_and_refuses_what_it_cannot_do(tmp_path):
    import json
    import subprocess
    import sys
    from conftest import ROOT
    run = lambda *flags: subprocess.run(
        [sys.executable, str(ROOT / "llama3_paged.py"), "3", "--random-weights", "--model", "tiny",
         "--device", "cpu", "--block-size", "16", "--beam-width", "3", "--max-new-tokens", "64",
         *flags],
        capture_output=True, text=True, timeout=300)
    shared, unshared = run("--json", tmp_path / "s.json"), run("--no-sharing", "--json",
                                                                  tmp_path / "u.json")
    assert shared.returncode == 0 == unshared.returncode, shared.stderr + unshared.stderr
    assert "saved" in shared.stdout and "(--no-sharing)" in unshared.stdout
    s, u = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "su")
    assert s["beams"] == u["beams"] and all(len(beams) == 3 for beams in s["beams"])
    assert s["memory"]["fullest_unshared_bytes"] == u["memory"]["fullest_reserved_bytes"]
    assert s["memory"]["fullest_reserved_bytes"] < u["memory"]["fullest_reserved_bytes"]
    refused = run("--continuous")
    assert refused.returncode == 2 and "does not combine" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_beam_search_runs_the_model_in_inference_mode(models, monkeypatch):
    """As Engine.generate and the CUDA graphs' capture: in another mode, compiled layers would
    compile again for it."""
    _, model = models
    modes = forward_modes(model, monkeypatch)
    our_beams(model, [[1, 2, 3]], 2, 3, stop_ids=set())
    assert modes and all(modes)

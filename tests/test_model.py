"""Our Llama against transformers' LlamaForCausalLM on the same tiny random weights."""

import pytest
import torch
from conftest import hf_to_meta, tiny_hf_model

from llama3_paged import TorchAttention
from plumbing.inputs import load_model, rope_rotations
from llama3_paged import Llama
from llama3_paged import KVCache, PrefillBatch

PROMPT_LENGTHS = [5, 17, 40, 1]


def our_logits(model, prompts):
    """Logits at every position of each prompt, all prompts packed into one prefill."""
    lengths = [len(p) for p in prompts]
    total = sum(lengths)
    cache = KVCache(model.args, num_blocks=1, block_size=total, dtype=model.output.weight.dtype, device="cpu",
                    attention=TorchAttention())
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    batch = PrefillBatch(slot_mapping=torch.arange(total), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                         cu_seqlens_host=cu, max_seqlen=max(lengths))
    tokens = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        logits = model(tokens, positions, cache, batch)  # [total, vocab]
    return logits.split(lengths)


def reference_logits(hf, prompts):
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts]


def assert_close(ours, theirs):
    for a, b in zip(ours, theirs):
        rel = (a - b).norm() / b.norm()
        assert rel < 1e-4, f"relative error {rel:.2e}"


@pytest.mark.parametrize("rope_scaling", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_from_hugging_face_layout(tmp_path, rope_scaling, tied):
    hf = tiny_hf_model(rope_scaling, tied)
    hf.save_pretrained(tmp_path)
    model = load_model(Llama, tmp_path, "cpu", torch.float32, max_positions=128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    assert_close(our_logits(model, prompts), reference_logits(hf, prompts))


@pytest.mark.parametrize("rope_scaling", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_from_meta_layout(tmp_path, rope_scaling, tied):
    hf = tiny_hf_model(rope_scaling, tied, original_context=8192)  # Meta's code fixes 8192
    model = load_model(Llama, hf_to_meta(hf, tmp_path), "cpu", torch.float32, max_positions=128)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    assert_close(our_logits(model, prompts), reference_logits(hf, prompts))


def test_rope_scaling_changes_the_model(tmp_path):
    """The scaled-RoPE tests above can fail: with scaling off, the logits differ."""
    hf = tiny_hf_model(rope_scaling=True, tied=False)
    hf.save_pretrained(tmp_path)
    model = load_model(Llama, tmp_path, "cpu", torch.float32, max_positions=128)
    prompts = [list(range(100, 140))]
    unscaled = model.args.__class__(**{**model.args.__dict__, "rope_scaling": None})
    model.args = unscaled
    model.rope_rotations = rope_rotations(model.args, 128)
    rel = (our_logits(model, prompts)[0] - reference_logits(hf, prompts)[0]).norm()
    assert rel / reference_logits(hf, prompts)[0].norm() > 1e-3

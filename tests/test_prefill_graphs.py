"""Short prefill passes as CUDA graphs (features/prefill_graphs.py): the padding changes nothing
(on the CPU, with the reference attention reading the padded bounds), and the graphs give the
eager pass's logits and K/V (on the GPU)."""

import functools
import math

import numpy as np
import pytest
import torch

from block_manager import BlockManager
from engine.attention_metadata import AttentionMetadata, Phase
from engine.kv_cache import EngineKVCache
from engine.model_runner import ModelForward, ModelRunner
from features.prefill_graphs import BUCKETS, LARGEST, LAYOUT, MAX_PROMPTS, padded_pass
from llama3_paged import Llama, Request, TorchAttention
from plumbing.cli import importable
from plumbing.inputs import PRESETS, random_model
from conftest import engine_model, random_ids

MAX_SEQ_LEN = 2048
BLOCK_SIZE = 16
CASES = [[5], [16], [100, 37, 300], [64] * MAX_PROMPTS, [LARGEST], [600, 424], [1, 1, 1]]
# On the CPU: the smallest bucket, a general pass, the most prompts, a pass that fills its bucket
CPU_CASES = [[5], [100, 37, 300], [64] * MAX_PROMPTS, [600, 424]]


def prompts_of(lengths, seed=0):
    return random_ids(lengths, seed)


def engine_with_blocks(model, cache_class, attention, prompts, block_size, device,
                       compiled=False):
    """An engine whose pool holds blocks for `prompts` (rows 0..B-1), none computed yet."""
    num_blocks = sum(math.ceil(len(p) / block_size) for p in prompts) + 4
    cache = cache_class(model.args, num_blocks, block_size, model.output.weight.dtype, device,
                        attention)
    manager = BlockManager(num_blocks, block_size, len(prompts), math.ceil(MAX_SEQ_LEN / block_size),
                           device)
    for row, prompt in enumerate(prompts):
        manager.allocate(Request(row, prompt, 1))
    return ModelRunner(ModelForward(model, compiled), cache, manager)


@pytest.mark.parametrize("lengths", CPU_CASES)
def test_a_padded_pass_gives_the_pass_logits_and_kv(lengths):
    # The graph's pass, run eagerly: tokens padded to the bucket, a padding prompt writing to the
    # spare slot, empty prompts after it, logits read at each prompt's last token. float64, so
    # that padding could change nothing but the rounding.
    model = engine_model(2, torch.float64, MAX_SEQ_LEN)
    prompts = prompts_of(lengths)
    engine = engine_with_blocks(model, functools.partial(EngineKVCache, spare_slot=True),
                                TorchAttention(), prompts, BLOCK_SIZE, "cpu")
    rows = np.arange(len(prompts))
    expected = engine.prefill_logits(rows, prompts)  # [B, vocab]
    expected_k, expected_v = engine.cache.k.clone(), engine.cache.v.clone()
    engine.cache.k.zero_()
    engine.cache.v.zero_()

    total = sum(lengths)
    bucket = BUCKETS[np.searchsorted(BUCKETS, total)]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.arange(total) - np.repeat(cu[:-1], lengths)
    slots = engine.manager.slots(np.repeat(rows, lengths), positions)
    inputs = torch.from_numpy(padded_pass(np.concatenate(prompts), positions, slots,
                                          np.array(lengths), bucket, engine.cache.spare_slot))
    per_token, cu_seqlens, last_token_at = inputs.split(LAYOUT)
    tokens, positions_in, slots_in = per_token.view(3, LARGEST)[:, :bucket]
    assert cu_seqlens[-1] == bucket and len(cu_seqlens) == MAX_PROMPTS + 2
    batch = AttentionMetadata(Phase.PREFILL, slots_in, cu_seqlens.int(), cu_seqlens.tolist(),
                              max_seqlen=bucket)
    padded = model(tokens, positions_in, engine.cache, batch, logits_at=last_token_at)

    assert padded.shape[0] == MAX_PROMPTS
    torch.testing.assert_close(padded[:len(prompts)], expected, rtol=1e-9, atol=1e-9)
    spare = engine.cache.spare_slot
    torch.testing.assert_close(engine.cache.k[:, :spare], expected_k[:, :spare], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(engine.cache.v[:, :spare], expected_v[:, :spare], rtol=1e-9, atol=1e-9)


def test_only_a_prefill_that_reads_its_bounds_on_the_gpu_is_recorded_as_graphs():
    # flash-attn's varlen prefill (the Triton decode's too) reads cu_seqlens on the GPU; the
    # PyTorch reference, the Triton prefill and a cascade read them on the host, or were never
    # recorded. The lesson's class is the truth: prefill graphs were flash-attn's alone.
    from engine.kv_cache import FlashAttentionAfterPrefix, TorchAttentionAfterPrefix
    from features.cascade.attention import CascadeAttention
    from features.prefill_graphs import supports_prefill_graphs
    from llama3_paged import FlashAttention
    backends = [FlashAttentionAfterPrefix, TorchAttentionAfterPrefix, CascadeAttention]
    if importable("triton"):
        from features.triton_attention import TritonAttention, TritonDecode
        backends += [TritonAttention, TritonDecode]
    for backend in backends:  # classes: flash-attn's import with an instance, on CUDA machines
        assert backend.prefill_in_graphs == issubclass(backend, FlashAttention), backend
    cache = EngineKVCache(PRESETS["tiny"], 2, 16, torch.float32, "cpu",
                          TorchAttentionAfterPrefix())
    assert not supports_prefill_graphs(cache)


needs_flash = pytest.mark.skipif(not (torch.cuda.is_available() and importable("flash_attn")),
                                 reason="needs CUDA and flash-attn")


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("float8", [False, True])
def test_prefill_graphs_give_the_eager_passes_logits_and_kv(float8, compiled):
    # bf16 (flash-attn has no float32): the graphs' matmuls see padded shapes, so they may
    # round differently; each pass is held to the pass launched from Python within bf16.
    from engine.kv_cache import FlashAttentionAfterPrefix
    from features.prefill_graphs import GraphPrefill
    model = random_model(Llama, "1b", "cuda", torch.bfloat16, MAX_SEQ_LEN, seed=3)
    cache_class = functools.partial(EngineKVCache, spare_slot=True)
    attention = FlashAttentionAfterPrefix()
    if float8:
        from features.fp8.cache import FP8KVCache
        from features.triton_attention import TritonDecode
        cache_class, attention = FP8KVCache, TritonDecode()
    all_prompts = [prompts_of(lengths, seed=i) for i, lengths in enumerate(CASES)]
    engine = engine_with_blocks(model, cache_class, attention, sum(all_prompts, []), 256, "cuda",
                                compiled)
    graphs = GraphPrefill(engine)

    def eager_logits(rows, prompts):  # launched from Python, compiled as the graphs record it
        with engine.model.at_any_length():
            return engine.prefill_logits(rows, prompts)

    first_row = 0
    for prompts in all_prompts:  # an FP8 cache's scales are set by the first eager pass
        rows = np.arange(first_row, first_row + len(prompts))
        first_row += len(prompts)
        positions = np.concatenate([np.arange(len(p)) for p in prompts])
        slots = torch.from_numpy(engine.manager.slots(np.repeat(rows, list(map(len, prompts))),
                                                      positions)).cuda()
        expected = eager_logits(rows, prompts).float()
        expected_kv = [engine.cache.k[:, slots].clone(), engine.cache.v[:, slots].clone()]
        assert graphs.replays(prompts)
        logits = graphs.logits(rows, prompts).float()
        kv = [engine.cache.k[:, slots], engine.cache.v[:, slots]]
        assert logits.shape == expected.shape
        assert ((logits - expected).norm() / expected.norm()).item() < 2e-2
        for got, want in zip(kv, expected_kv):  # float8 codes move by a step where bf16 rounds apart
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < (
                5e-2 if float8 else 1e-2)


@pytest.mark.gpu
@needs_flash
def test_the_served_engine_gives_the_same_tokens_through_each_cache_with_prefill_graphs():
    # The API's engine on its default GPU path (compiled layers, decode and prefill graphs): the
    # naive, paged and virtual caches give one another's tokens, as the scripts' N = 49 runs do;
    # requests added one step apart, so that each prefill is a pass of its own through a graph.
    import gc
    from engine.llm import SamplingParams
    from engine.llm_engine import LLMEngine
    from features.prefill_graphs import GraphPrefill
    prompts = prompts_of([30, 200, 5, 700, 64, 1])

    def served_tokens(cache) -> dict:
        engine = LLMEngine(cache, len(prompts), model="tiny", random_weights=True, kv_budget_gb=0.5,
                           max_seq_len=1024)
        assert isinstance(engine.runner.prefill_graphs, GraphPrefill)
        finished = {}
        for prompt in prompts + [None] * 100:  # then steps until every request is done
            if prompt is not None:
                engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))
            finished.update({s.request_id: list(s.request.output_tokens)
                             for s in engine.step() if s.finish_reason is not None})
        assert not engine.has_unfinished()
        return finished

    tokens = {}
    for cache in ("naive", "paged", "virtual"):
        tokens[cache] = served_tokens(cache)
        gc.collect()  # the engine's pool, before the next one sizes its own
        torch.cuda.empty_cache()
    assert len(tokens["paged"]) == len(prompts)
    assert tokens["naive"] == tokens["paged"] == tokens["virtual"]

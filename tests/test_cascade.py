"""Cascade attention (features/cascade/attention.py): attention over a shared prefix and a request's
own blocks, merged by their log-sum-exps, equals attention over all its keys; a run with it gives
the tokens of a run without it."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.request import EngineRequest

from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.model_runner import greedy
from llama3_paged import DecodeBatch
from features.cascade.attention import CascadeAttention
from engine.scheduler import Scheduler
from features.sharing.block_manager import SharingBlockManager
from plumbing.cli import importable
from test_sharing import random_prompts
from conftest import engine_model

MAX_SEQ_LEN = 160


def shared_prefix_batch(prefix_blocks, own_lengths, block_size, device, dtype, seed=0):
    """A pool of random K/V and a decode batch whose rows list the same first prefix_blocks
    blocks, then blocks of their own (scattered over the pool)."""
    g = torch.Generator().manual_seed(seed)
    n_heads, n_kv_heads, d = 8, 2, 64
    own_blocks = [math.ceil(n / block_size) for n in own_lengths]
    num_blocks = prefix_blocks + sum(own_blocks) + 3
    pool = [torch.randn(num_blocks, block_size, n_kv_heads, d, generator=g).to(device, dtype)
            for _ in range(2)]
    order = torch.randperm(num_blocks, generator=g).tolist()
    prefix, rest = order[:prefix_blocks], order[prefix_blocks:]
    width = prefix_blocks + max(own_blocks)
    table = torch.zeros(len(own_lengths), width, dtype=torch.int32)
    for r, n in enumerate(own_blocks):
        table[r, :prefix_blocks + n] = torch.tensor(prefix + rest[:n])
        rest = rest[n:]
    seqlens = torch.tensor(own_lengths, dtype=torch.int32) + prefix_blocks * block_size
    batch = DecodeBatch(slot_mapping=torch.zeros(len(own_lengths), dtype=torch.long, device=device),
                        block_table=table.to(device), cache_seqlens=seqlens.to(device),
                        max_cache_seqlen=int(seqlens.max()))
    q = torch.randn(len(own_lengths), n_heads, d, generator=g).to(device, dtype)
    return q, pool, batch, table[0, :prefix_blocks]


def test_the_cascade_equals_attention_over_all_the_keys():
    prefix_blocks, block_size = 3, 4
    q, (k, v), batch, prefix = shared_prefix_batch(prefix_blocks, [1, 5, 8, 13, 2], block_size,
                                                   "cpu", torch.float32)
    cascade = CascadeAttention(TorchAttentionAfterPrefix(), prefix_blocks, block_size, "cpu", min_batch=1)
    cascade.prefix_table[0] = prefix
    expected = TorchAttentionAfterPrefix().decode(q, k, v, batch)
    torch.testing.assert_close(cascade.decode(q, k, v, batch), expected, atol=1e-5, rtol=1e-5)
    cascade.prefix_table[0, 0] = batch.block_table[0, prefix_blocks]  # a wrong block: it can fail
    assert not torch.allclose(cascade.decode(q, k, v, batch), expected, atol=1e-3)


def test_a_step_whose_rows_do_not_share_the_prefix_runs_without_the_cascade():
    calls = []
    cascade = CascadeAttention(TorchAttentionAfterPrefix(), 2, 4, "cpu", min_batch=1,
                               table=np.array([[7, 3, 9], [7, 3, 4], [7, 5, 1]]))
    record = lambda name: SimpleNamespace(
        step=lambda *a: calls.append((name, cascade.active)), replays=lambda rows: True)
    runner = SimpleNamespace(cascade=cascade, graphs=record("graphs"), eager=record("eager"))
    decode_rows = lambda rows: ModelRunner.decode_rows(runner, None, None, rows, None)
    decode_rows(np.array([0, 1]))  # rows 0 and 1 share blocks 7, 3
    assert calls == [("graphs", True)] and cascade.prefix_table.tolist() == [[7, 3]]
    decode_rows(np.array([0, 2]))  # row 2 holds 7, 5: no cascade
    assert calls[-1] == ("eager", False) and cascade.active


def run(model, prompts, budgets, block_size, cascade_on: bool):
    cache = EngineKVCache(model.args, 128, block_size, torch.float32, "cpu", TorchAttentionAfterPrefix())
    manager = SharingBlockManager(cache, len(prompts), math.ceil(MAX_SEQ_LEN / block_size),
                                  prefix_caching=True)
    cascade = None
    if cascade_on:
        system_blocks = 21 // block_size
        cascade = CascadeAttention(cache.attention_backend, system_blocks, block_size, "cpu",
                                   min_batch=2, table=manager.table)
        cache.attend_with(cascade)
    requests = [EngineRequest(r, p, b) for r, (p, b) in enumerate(zip(prompts, budgets))]
    scheduler = Scheduler(manager, requests, continuous=True, max_running=4, token_budget=64,
                          shares_blocks=True)
    runner = ModelRunner(model, cache, manager, greedy, cascade=cascade)
    return EngineCore(runner, scheduler).generate(progress=False), cascade


@pytest.mark.parametrize("block_size", [4, 8])  # 8: the same path as 4 over fewer, longer blocks
def test_a_run_with_the_cascade_gives_the_tokens_of_a_run_without_it(block_size):
    model = engine_model(31, torch.float32, MAX_SEQ_LEN)
    system = random_prompts([21], seed=3)[0]  # 5 full blocks of 4, or 2 of 8, then a part
    prompts = random_prompts([5, 12, 1, 30, 8, 17, 9], seed=4, prefix=system)
    budgets = [9, 4, 12, 7, 10, 5, 8]
    without, _ = run(model, prompts, budgets, block_size, cascade_on=False)
    with_cascade, cascade = run(model, prompts, budgets, block_size, cascade_on=True)
    assert with_cascade.output_tokens == without.output_tokens
    assert cascade.num_sharing_steps >= cascade.num_steps - 2, "the cascade ran in most steps"


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importable("flash_attn")),
                    reason="needs a GPU and flash-attn")
@pytest.mark.parametrize("own_lengths", [[1, 300, 40, 700, 257, 1, 1, 1],  # padding-like rows
                                         list(range(1, 2000, 37))])
def test_the_flash_cascade_equals_flash_attention_over_all_the_keys(own_lengths):
    from engine.kv_cache import FlashAttentionAfterPrefix as FlashAttention  # the run's
    prefix_blocks, block_size = 4, 256
    q, (k, v), batch, prefix = shared_prefix_batch(prefix_blocks, own_lengths, block_size,
                                                   "cuda", torch.bfloat16)
    cascade = CascadeAttention(FlashAttention(), prefix_blocks, block_size, "cuda", min_batch=1)
    cascade.prefix_table[0] = prefix
    expected = TorchAttentionAfterPrefix().decode(q.double(), k.double(), v.double(), batch)  # float64
    got = cascade.decode(q, k, v, batch).double()
    plain = FlashAttention().decode(q, k, v, batch).double()
    error, plain_error = (got - expected).abs().max(), (plain - expected).abs().max()
    assert error <= 2 * plain_error + 1e-3, (error, plain_error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton)")
@pytest.mark.parametrize("n_heads", [32, 24])  # 24: heads padded to a power of two
def test_the_fused_merge_equals_the_merge_in_float64(n_heads):
    from features.cascade.merge import fused_merge
    g = torch.Generator().manual_seed(5)
    batch, d = 300, 128
    outs = [torch.randn(batch, n_heads, d, generator=g).cuda().bfloat16() for _ in range(2)]
    lses = [torch.randn(batch, n_heads, generator=g).cuda() * 5 for _ in range(2)]
    lses[0][:4] += 200.0  # one part's weight ~1 or ~0, where a plain exp(lse) would overflow
    lses[1][4:8] += 200.0
    lse_shared_transposed = lses[0].T.contiguous().T  # flash's shared lse is a transposed view
    (o1, o2), (l1, l2) = [o.double() for o in outs], [lse.double() for lse in lses]
    top = torch.maximum(l1, l2)  # the softmax merge written out, in float64
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    expected = (o1 * w1 + o2 * w2) / (w1 + w2)
    got = fused_merge(outs[0], lse_shared_transposed, outs[1], lses[1]).double()
    # Both round once, to bfloat16, from float32 sums of the same terms.
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got[:4], outs[0][:4].double())
    torch.testing.assert_close(got[4:8], outs[1][4:8].double())

"""bench.py's arithmetic against PyTorch's own FLOP counter."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.attention import TorchAttention
from tools.bench import prefill_flops, weight_bytes_read_per_step
from engine.checkpoints import random_model
from engine.kv_cache import KVCache, PrefillBatch


def test_prefill_flops_match_pytorchs_count():
    # One-token prompts: causal attention is then the full attention that the counter counts.
    model = random_model("tiny", "cpu", torch.float32, 64, seed=0)
    n = 5
    cache = KVCache(model.args, 1, n, torch.float32, "cpu", TorchAttention())
    bounds = list(range(n + 1))
    batch = PrefillBatch(torch.arange(n), torch.tensor(bounds, dtype=torch.int32), bounds, 1)
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.arange(n), torch.zeros(n, dtype=torch.long), cache, batch,
              logits_at=torch.arange(n))
    assert prefill_flops(model.args, [1] * n) == counter.get_total_flops()


def test_decode_reads_every_weight_but_the_embedding_table():
    untied = random_model("tiny", "cpu", torch.float32, 64, seed=0)
    params = sum(p.numel() for p in untied.parameters())
    embedding = untied.args.vocab_size * untied.args.dim
    assert weight_bytes_read_per_step(untied) == 4 * (params - embedding)

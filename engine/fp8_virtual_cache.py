"""The virtual cache in float8 (llama3_virtual.py --kv-cache-dtype fp8): vAttention's rows,
each token's K and V in 8 bits (features/fp8/cache.py says how and why). Where two features
combine, the engine, which picks the cache (engine/llm_engine.py), joins them: a feature imports
no other feature.

Half the bytes per token also doubles the tokens a 2 MB page holds: for Llama 3 8B, 32 tokens of
every layer (per-token layout) or 2,048 tokens of one layer's K (per-layer), so the page manager
grows a request half as often.

More in docs/engine-notes.md.
"""

import torch

from engine.attention_metadata import AttentionMetadata, Phase
from engine.kv_cache import left_out_of_compiled_layers
from engine.seams import plug

FP8 = plug("FP8 K/V", "FP8")


class FP8VirtualKVCache(plug("FP8 K/V", "Float8Writes"),
                        plug("virtual memory", "EngineVirtualKVCache")):
    """Rows of float8 K and V, with a scale for each per layer."""

    def __init__(self, args, max_requests: int, max_seq_len: int, dtype, device, attention,
                 layout: str, group=None):
        super().__init__(args, max_requests, max_seq_len, FP8, device, attention, layout)
        self.init_scales(args.n_layers, device, group)

    @left_out_of_compiled_layers
    def attention(self, layer: int, q, k, v, batch: AttentionMetadata) -> torch.Tensor:
        """Store this batch's k, v (`[T, n_kv_heads, head_dim]`) in float8, then attend."""
        slots = self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)  # [rows * row_tokens, ...]
        self.write_float8(layer, k, v, batch, *slots)
        if batch.phase is Phase.PREFILL:
            return self.attention_backend.prefill(q, k, v, batch)
        rows = self.rows_of(batch)[:, None]  # [B, 1]: each request's whole row, one block
        return self.attention_backend.paged_decode(  # TritonDecode's (engine/loader.py)
            q, self.k[layer], self.v[layer], rows, batch.cache_seqlens,
            kv_scales=self.scales[layer])

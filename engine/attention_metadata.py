"""What one pass's attention reads, built once a step by the model runner (nano-vllm's `Context`,
vLLM's `AttentionMetadata`). One type for every pass: its phase says which fields are set, and a
cache asks the phase where it would otherwise tell batch classes apart. The fields keep the
names of the lesson's `PrefillBatch` and `DecodeBatch`, so the lesson's attention backends read
it as they read the lesson's batches.
"""

import enum
from dataclasses import dataclass

import torch


class Phase(enum.Enum):
    PREFILL = "prompts with nothing cached before them: each attends to its own new tokens"
    AFTER_PREFIX = "new tokens after cached ones: each reads its every token through its blocks"
    DECODE = "one new token a request, over its cached tokens"


@dataclass
class AttentionMetadata:
    phase: Phase
    slot_mapping: torch.Tensor | None  # [T] int64: the slot each new token's K/V is written to
    # Both prefills: the new tokens packed, request r's at cu_seqlens[r]:cu_seqlens[r + 1]
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32
    cu_seqlens_host: list[int] | None = None
    max_seqlen: int = 0
    # After a prefix, and decode: each request's blocks
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32
    # After a prefix: request r's tokens, cached and new, at cu_seqlens_k[r]:cu_seqlens_k[r + 1]
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32
    cu_seqlens_k_host: list[int] | None = None
    max_seqlen_k: int = 0
    # Decode: the tokens cached per request, the new one included
    cache_seqlens: torch.Tensor | None = None  # [B] int32
    max_cache_seqlen: int = 0

    @property
    def prefills(self) -> bool:
        return self.phase is not Phase.DECODE

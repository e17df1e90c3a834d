"""Preemption by swapping (engine/swap.py): the tokens of a run without preemption, with no
token recomputed, and recompute where host memory runs short."""

import math

import pytest
import torch

from block_manager import BlockManager
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from engine.kv_cache import EngineKVCache, TorchAttentionAfterPrefix
from engine.request import EngineRequest
from engine.model_runner import greedy
from engine.scheduler import Scheduler
from engine.swap import HostBlocks
from plumbing.inputs import random_model
from llama3_paged import Llama
from test_scheduler import MAX_SEQ_LEN, random_prompts
from conftest import assert_one_paragraph, engine_model, run_main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_blocks_copy_in_queue_order_a_step_that_returns_one_request_and_swaps_another(dtype):
    """One flush: A's K/V come back from host blocks that B's are then copied into. A's must
    arrive in its new blocks before B's overwrite the host blocks; B's are copied out intact,
    bit for bit in either dtype."""
    model_args = random_model(Llama, "tiny", "cpu", dtype, max_positions=64).args
    cache = EngineKVCache(model_args, num_blocks=6, block_size=4, dtype=dtype, device="cpu",
                          attention=TorchAttentionAfterPrefix())
    cache.k.normal_(), cache.v.normal_()
    host = HostBlocks(cache, num_blocks=2)
    a_k, b_k = cache.k[:, :8].clone(), cache.k[:, 8:16].clone()  # blocks 0-1 and 2-3
    a_host = host.copy_out([0, 1])
    host.flush()  # A swapped out
    host.copy_in(a_host, [4, 5])  # a later step: A back into blocks 4-5 ...
    b_host = host.copy_out([2, 3])  # ... and B out, into the host blocks A just gave back
    host.flush()
    assert b_host == a_host
    assert torch.equal(cache.k[:, 16:24], a_k)
    cache.k[:, 8:16] = 0
    host.copy_in(b_host, [2, 3])
    host.flush()
    assert torch.equal(cache.k[:, 8:16], b_k)


# Short prompts that grow by 40 tokens each; a pool of 64 blocks of 16 holds them all at once, and
# TIGHT_POOL blocks only the longest and a little more.
PROMPTS, BUDGETS, BLOCK_SIZE = random_prompts([5, 12, 3, 9, 14, 7], seed=2), [40] * 6, 16
TIGHT_POOL = max(math.ceil((len(p) + b - 1) / BLOCK_SIZE) for p, b in zip(PROMPTS, BUDGETS)) + 2


def run_swapping(model, num_blocks, swap_blocks, mixed_budget=None):
    cache = EngineKVCache(model.args, num_blocks, BLOCK_SIZE, model.output.weight.dtype, "cpu",
                          TorchAttentionAfterPrefix())
    manager = BlockManager(num_blocks, BLOCK_SIZE, len(PROMPTS),
                           math.ceil(MAX_SEQ_LEN / BLOCK_SIZE))
    requests = [EngineRequest(r, p, b) for r, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    scheduler = Scheduler(manager, requests, continuous=True, token_budget=mixed_budget or 8192,
                          mixed=mixed_budget is not None, host=HostBlocks(cache, swap_blocks))
    runner = ModelRunner(model, cache, manager, greedy)
    result = EngineCore(runner, scheduler).generate(progress=False)
    assert manager.num_free_blocks == num_blocks and not manager.owned_blocks
    assert sorted(scheduler.host.free) == list(range(swap_blocks)), "every host block back"
    return result, scheduler


@pytest.fixture(scope="module")
def model():
    # In float32: in bf16 a CPU's matmul kernels may round a row differently beside other rows
    # (oneDNN's AMX and AVX2 kernels do, its AVX-512 ones did not), and a run that swaps batches
    # its rows otherwise. The bf16 bytes are held above; bf16 tokens on the GPU (tests/test_gpu.py).
    return engine_model(11, torch.float32, MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def ample(model):
    """The run without preemption, every test's truth."""
    result, scheduler = run_swapping(model, 64, swap_blocks=1)
    assert scheduler.num_preemptions == 0
    return result.output_tokens


def test_swapped_requests_give_the_tokens_of_a_run_without_preemption(model, ample):
    swapped, scheduler = run_swapping(model, TIGHT_POOL, swap_blocks=64)
    assert scheduler.num_swapped > 0 and scheduler.num_swapped == scheduler.num_preemptions
    assert scheduler.num_recomputed_tokens == 0
    assert swapped.output_tokens == ample


def test_swapping_in_mixed_steps_gives_the_tokens_of_a_run_without_preemption(model, ample):
    # Steps of at most 8 tokens: prompts are chunked over several steps beside decode rows. A
    # victim that is decoding is swapped; one halfway through its prompt is recomputed.
    mixed, scheduler = run_swapping(model, TIGHT_POOL, swap_blocks=64, mixed_budget=8)
    assert scheduler.num_swapped > 0
    assert mixed.output_tokens == ample


def test_a_victim_that_finds_no_room_in_host_memory_is_recomputed(model, ample):
    tight, scheduler = run_swapping(model, TIGHT_POOL, swap_blocks=1)
    assert scheduler.num_preemptions > scheduler.num_swapped  # some did not fit in one block
    assert scheduler.num_recomputed_tokens > 0
    assert tight.output_tokens == ample


@pytest.mark.parametrize("flags, says", [
    (["--preemption", "swap"], "a static batch never preempts"),
    (["--continuous", "--preemption", "swap", "--samples", "2"], "does not combine with shared"),
    (["--continuous", "--preemption", "swap", "--swap-space", "1e-9"], "holds no block"),
])
def test_swapping_where_it_cannot_run_ends_in_one_paragraph(flags, says, capsys):
    from engine.run import command_line  # the script's run, in this process
    code, _, err = run_main(lambda argv: command_line("llama3_paged.py", argv), [
        "2", "--random-weights", "--model", "tiny", "--device", "cpu", *flags], capsys)
    assert_one_paragraph(code, err, 2, says)


def test_an_aborted_request_waiting_in_host_memory_gives_its_host_blocks_back():
    # The served engine, swapping in a pool too small for its 4 rows: a request aborted while
    # its K/V wait in host memory frees its host blocks (before, they stayed taken for good, and
    # later victims were recomputed for want of room), and the others run to their end.
    from engine.llm import SamplingParams
    from engine.llm_engine import LLMEngine
    engine = LLMEngine("paged", 4, model="tiny", random_weights=True, device="cpu", block_size=4,
                       num_blocks=12, preemption="swap", swap_space=0.01, no_sharing=True,
                       max_seq_len=64)
    host, scheduler = engine.scheduler.host, engine.scheduler
    all_host_blocks = len(host.free)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = [engine.add_request(list(range(1, 6 + r)), params) for r in range(4)]
    while not scheduler.swapped:
        engine.step()
    victim = next(iter(scheduler.swapped))
    aborted = engine.sequences[victim.row].request_id
    engine.abort(aborted)
    assert not scheduler.swapped and len(host.free) == all_host_blocks
    finished = set()
    while engine.has_unfinished():
        finished |= {s.request_id for s in engine.step() if s.finish_reason == "length"}
    assert finished == set(ids) - {aborted} and len(host.free) == all_host_blocks
    assert engine.manager.num_used_blocks == 0 and len(engine.free_rows) == 4

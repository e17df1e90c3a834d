"""Tiny Llama checkpoints written by transformers, in both layouts, for tests that need real files."""

import dataclasses
import json
import os
import sys
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of two workers (pytest.ini's -n auto): a core
    os.environ["OMP_NUM_THREADS"] = "1"    # each, for its tests and the scripts they start

import torch
import torch._dynamo

# Past its recompile limit dynamo runs a function eagerly with one warning; a test process builds
# many engines, and a test of compiled layers would then pass on eager code. Here it raises.
torch._dynamo.config.fail_on_recompile_limit_hit = True

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent


def pytest_xdist_auto_num_workers(config) -> int:
    """pytest.ini's `-n auto`: on a machine without CUDA, a worker per core, two at most (the
    CI's two cores: one process of small models and script runs leaves the other idle); with a
    GPU, one process (the GPU tests share its memory, and time it)."""
    return 0 if torch.cuda.is_available() else min(2, os.cpu_count() or 1)


ENGINE_VOCAB = 2048  # the engine's tests feed random token ids, no text: the tiny preset's shapes
# with a small output head, whose 128,256 rows are 96% of a tiny step's arithmetic (a run of ten
# requests: 2.0 s with them, 0.18 s without, on 2 cores)


def engine_model(seed: int, dtype=torch.float32, max_positions: int = 256):
    """A random tiny Llama with ENGINE_VOCAB tokens, for tests of the scheduler, caches and loop."""
    from llama3_paged import Llama
    from plumbing.inputs import PRESETS, random_model
    shapes = dataclasses.replace(PRESETS["tiny"], vocab_size=ENGINE_VOCAB)
    return random_model(Llama, shapes, "cpu", dtype, max_positions, seed=seed)


def random_ids(lengths, seed: int, prefix=()) -> list[list[int]]:
    """Prompts of these lengths, random token ids below ENGINE_VOCAB, each after `prefix`."""
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, ENGINE_VOCAB, (n,), generator=g).tolist()
            for n in lengths]


def tokens(n: int, first: int = 0) -> list[int]:
    """n distinct token ids, for the block manager's tests: only prefix caching reads them."""
    return list(range(first, first + n))


def tiny_hf_model(rope_scaling: bool, tied: bool, seed: int = 0, original_context: int = 64,
                  vocab_size: int = 512):
    """A random transformers LlamaForCausalLM, small but with every feature of the real thing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if rope_scaling:  # Llama 3.1's; a short original context makes all three bands matter
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": original_context}
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters=rope,
        max_position_embeddings=1024, tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises norms to 1: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_to_meta(model, out_dir: Path) -> Path:
    """Write the transformers model in Meta's layout (params.json + consolidated.00.pth), undoing
    the q/k row permutation of transformers' convert_llama_weights_to_hf.py."""
    c = model.config
    sd = model.state_dict()
    def unpermute(w, heads):
        return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
    meta = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        meta["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        meta |= {
            f"layers.{i}.attention.wq.weight": unpermute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads),
            f"layers.{i}.attention.wk.weight": unpermute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads),
            f"layers.{i}.attention.wv.weight": sd[p + "self_attn.v_proj.weight"],
            f"layers.{i}.attention.wo.weight": sd[p + "self_attn.o_proj.weight"],
            f"layers.{i}.feed_forward.w1.weight": sd[p + "mlp.gate_proj.weight"],
            f"layers.{i}.feed_forward.w3.weight": sd[p + "mlp.up_proj.weight"],
            f"layers.{i}.feed_forward.w2.weight": sd[p + "mlp.down_proj.weight"],
            f"layers.{i}.attention_norm.weight": sd[p + "input_layernorm.weight"],
            f"layers.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        }
    # Meta's rule for the FFN width: 2/3 of 4*dim (=341 for dim 128), rounded up to multiple_of.
    assert c.intermediate_size == 320
    params = {"dim": c.hidden_size, "n_layers": c.num_hidden_layers, "n_heads": c.num_attention_heads,
              "n_kv_heads": c.num_key_value_heads, "vocab_size": c.vocab_size, "multiple_of": 64,
              "ffn_dim_multiplier": 0.9, "norm_eps": c.rms_norm_eps, "rope_theta": 500000.0}
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":
        assert rope["original_max_position_embeddings"] == 8192, "Meta's layout fixes it at 8192"
        params |= {"use_scaled_rope": True, "rope_scaling_factor": rope["factor"]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "params.json").write_text(json.dumps(params))
    torch.save({k: v.clone() for k, v in meta.items()}, out_dir / "consolidated.00.pth")
    return out_dir


def generate(model, cache, manager, prompts, budgets, max_seq_len: int, stop_ids=(),
             continuous=False, max_running=None, chunk_tokens=64, sampler=None, graphs=False,
             max_batched_tokens=None, swap_blocks=0, overlap=False, longest_first=False,
             compiled=False):
    """Run prompts through the core engine as the scripts do (engine/llm_engine.py's generate):
    request r is prompts[r], allowed budgets[r] new tokens and no more than max_seq_len in all.
    `graphs`: decode through CUDA graphs (features/cuda_graphs.py); `max_batched_tokens`: with
    `continuous`, mixed steps; `swap_blocks`: with `continuous`,
    preemption by swapping to that many host blocks (engine/swap.py); `overlap`: each step
    scheduled before the last one's tokens are recorded; `longest_first`:
    each decode step's rows longest first (features/longest_first.py); `compiled`: the model's
    layers compiled (engine/model_runner.py's ModelForward; the cache made `compiled` too)."""
    from engine.engine_core import EngineCore
    from engine.model_runner import ModelForward, ModelRunner, SamplingDecoder, greedy
    from engine.request import EngineRequest
    from engine.scheduler import Scheduler
    from engine.swap import HostBlocks
    from features.sharing.block_manager import SharingBlockManager
    requests = [EngineRequest(r, p, min(b, max_seq_len - len(p)))
                for r, (p, b) in enumerate(zip(prompts, budgets))]
    host = HostBlocks(cache, swap_blocks) if continuous and swap_blocks else None
    scheduler = Scheduler(manager, requests, continuous, max_running,
                          max_batched_tokens or chunk_tokens,
                          mixed=bool(continuous and max_batched_tokens), host=host,
                          shares_blocks=isinstance(manager, SharingBlockManager))
    if hasattr(manager, "watch_queue"):  # as engine/build.py's make_scheduler does
        manager.watch_queue(scheduler.waiting)
    sampler = sampler or greedy
    forward, recorded = ModelForward(model, compiled), None
    if graphs:
        from features.cuda_graphs import GraphDecoder
        recorded = GraphDecoder(SamplingDecoder(forward, cache, manager.block_table, sampler),
                                max_running or len(requests))
    runner = ModelRunner(forward, cache, manager, sampler, recorded, overlap=overlap,
                         longest_first=longest_first, tokens_per_pass=chunk_tokens)
    return EngineCore(runner, scheduler, set(stop_ids)).generate(progress=False)


def request(row: int, n: int, first: int = 0):
    """A request of n distinct prompt tokens, for the block manager's tests."""
    from engine.request import EngineRequest
    return EngineRequest(row, tokens(n, first), max_new_tokens=1)


def forward_modes(model, monkeypatch) -> list[bool]:
    """Whether inference mode was on at each of the model's forward passes from now on: the
    mode CUDA graphs are captured and compiled layers compiled in, which a pass in another mode
    would compile again for."""
    modes, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: modes.append(
        torch.is_inference_mode_enabled()) or forward(*a, **k))
    return modes


def run_main(main, argv, capsys):
    """A program's main() as the command line runs it: (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_paragraph(code, err, expected_code, fragment):
    assert code == expected_code, err
    assert fragment and fragment in err, err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]  # argparse puts its usage lines first
    assert fragment in message or fragment in err.strip().split("\n\n")[-1]

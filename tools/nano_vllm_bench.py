"""tools/bench.py's workloads through nano-vllm, the small engine to compare against.

    git clone https://github.com/GeeeekExplorer/nano-vllm
    python tools/nano_vllm_bench.py nano-vllm                  # workload W
    python tools/nano_vllm_bench.py nano-vllm --workload W2    # W2: a stream of 2,000 requests

nano-vllm (MIT) runs one model class, Qwen3. A Qwen3 config with `attention_bias: true` (which
drops Qwen3's q and k norms), `head_dim` 128 and Llama-3-8B's other sizes has Llama 3 8B's shapes,
the same matmuls and K/V per token as this project's `--random-weights`. Its weight loader is
replaced by random weights and its tokenizer by a stub (the requests are token ids; its engine
asks the tokenizer for `eos_token_id`, and end-of-text is ignored). The requests are
tools/bench.py's: the same chat-formatted prompts and new tokens per request. nano-vllm runs with
its defaults (CUDA graphs, 512 sequences and 16,384 batched tokens at most per step) unless the
flags say otherwise; it cannot decode greedily, so it samples at temperature 1. It needs a CUDA
GPU with flash-attn and triton installed. The figure is output tokens over the wall time of one
`generate` call, after a warm-up call.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("nano_vllm_bench.py")  # before torch loads

from plumbing.cli import UserError, writable_file

from plumbing.inputs import PRESETS
from plumbing.cli import (HelpFormatter, first_paragraph, fraction, one_paragraph_errors,
                          positive_int, refuse_output_over_input, standard_json, write_atomically)
from plumbing.inputs import PROMPTS_FILE, load_prompts, load_tokenizer
from engine.loader import system_prompt
from tools.bench import WORKLOADS, workload_requests
from tools.shared import ClockSampler, clock_line


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=first_paragraph(__doc__), formatter_class=HelpFormatter)
    p.add_argument("nano_vllm", type=Path, metavar="NANO_VLLM",
                   help="nano-vllm's source: the folder that holds its nanovllm package")
    p.add_argument("--workload", choices=WORKLOADS, default="W", help="as tools/bench.py's")
    p.add_argument("--num-requests", type=positive_int, help="default: the workload's")
    p.add_argument("--new-tokens", type=positive_int,
                   help="new tokens per request, at most (default: the workload's; 1: prefill)")
    p.add_argument("--max-num-seqs", type=positive_int, default=512,
                   help="nano-vllm's most sequences per step")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=16384,
                   help="nano-vllm's most tokens per step")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="nano-vllm's: share of the GPU it may use")
    p.add_argument("--system-prompt-file", type=Path, metavar="PATH",
                   help="a system turn before every prompt, as tools/bench.py's")
    p.set_defaults(system_prompt=None)  # the file is the only way in, as engine/loader.py reads it
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write the figures here")
    p.add_argument("--profile", type=writable_file, metavar="PATH",
                   help="kernel time by class, to PATH (tools/kernel_profile.py)")
    a = p.parse_args(argv)
    for name, value in WORKLOADS[a.workload].items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    return a


def llama3_8b_as_qwen3(max_seq_len: int) -> dict:
    """A Hugging Face Qwen3 config with Llama 3 8B's shapes."""
    args = PRESETS["8b"]
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "max_position_embeddings": max_seq_len,
            "attention_bias": True, "tie_word_embeddings": False, "hidden_act": "silu",
            "dtype": "bfloat16", "torch_dtype": "bfloat16"}  # the key's newer and older names


class StubTokenizer:
    """What nano-vllm's engine asks of a tokenizer when it is given token ids."""
    eos_token_id = 128009  # <|eot_id|>; never stops a request, as end-of-text is ignored

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def decode(self, token_ids) -> str:
        return ""


def random_weights(model, path) -> None:
    """Stands in for nano-vllm's loader: every parameter from N(0, 0.02), none left empty."""
    import torch
    generator = torch.Generator(device="cuda").manual_seed(0)
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.02, generator=generator)


def run(a, prompts: list[list[int]], budgets: list[int]) -> dict:
    if not (a.nano_vllm / "nanovllm").is_dir():
        raise UserError(f"{a.nano_vllm} holds no nanovllm package: give the folder of nano-vllm's "
                        f"source (git clone https://github.com/GeeeekExplorer/nano-vllm).")
    import torch
    if not torch.cuda.is_available():
        raise UserError("needs a CUDA GPU: nano-vllm runs on CUDA only.")
    sys.path.insert(0, str(a.nano_vllm.resolve()))
    import nanovllm.engine.llm_engine as llm_engine
    import nanovllm.engine.model_runner as model_runner
    from nanovllm import LLM, SamplingParams
    model_runner.load_model, llm_engine.AutoTokenizer = random_weights, StubTokenizer
    with tempfile.TemporaryDirectory() as model_dir:
        config = llama3_8b_as_qwen3(a.max_seq_len)
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        llm = LLM(model_dir, max_model_len=a.max_seq_len, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens,
                  gpu_memory_utilization=a.gpu_memory_utilization)
        params = [SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=b) for b in budgets]
        llm.generate([[1] * len(p) for p in prompts[:8]], params[:8], use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        sampler, start = ClockSampler(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall, clocks = time.perf_counter() - start, sampler.stop()  # nano-vllm shuts down at exit
        if a.profile:  # after the timed run, on the workload's first requests, as bench.py's
            def generated(prompts, budgets):
                params = [SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=b)
                          for b in budgets]
                return sum(len(o["token_ids"]) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False))
            from tools.kernel_profile import profile_engine
            from tools.shared import write_profile
            write_profile(a.profile, "nano-vllm", a.workload,
                          profile_engine(generated, prompts, budgets))
    generated = sum(len(o["token_ids"]) for o in outputs)
    return {"workload": a.workload, "num_requests": len(prompts), "device": torch.cuda.get_device_name(),
            "num_prompt_tokens": sum(map(len, prompts)), "num_generated_tokens": generated,
            "wall_seconds": wall, "output_tokens_per_second": generated / wall, "clock": clocks,
            "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens}


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("nano_vllm_bench.py"):
        refuse_output_over_input(a.json, [PROMPTS_FILE, a.system_prompt_file], "--json")
        refuse_output_over_input(a.profile, [PROMPTS_FILE, a.system_prompt_file, a.json],
                                 "--profile")
        tokenizer = load_tokenizer(None, None)
        system = system_prompt(a)
        prompts, budgets = workload_requests(load_prompts(a.num_requests, tokenizer, system),
                                             tokenizer, a)
        result = run(a, prompts, budgets)
        if a.json:
            text = standard_json(result)
            write_atomically(a.json, lambda path: path.write_text(text))
        print(f"nano-vllm, workload {a.workload}: {result['num_requests']:,} requests, "
              f"{result['num_prompt_tokens']:,} prompt tokens, {result['num_generated_tokens']:,} "
              f"generated; {result['device']}")
        print(f"  wall  {result['wall_seconds']:.2f} s, {result['output_tokens_per_second']:,.0f} "
              f"output tokens/s")
        print(f"  clock {clock_line(result['clock'])}")


if __name__ == "__main__":
    main()

"""From a checked Config to a loaded run: the attention chosen, then tokenizer, prompts and model
loaded (plumbing/inputs.py), all before any KV memory."""

import dataclasses

import torch

import llama3_paged as lesson
from engine.config import Config
from engine.kv_cache import FlashAttentionAfterPrefix, TorchAttentionAfterPrefix
from engine.seams import plug
from plumbing import inputs
from plumbing.cli import (UserError, format_bytes, importable, read_text_input,
                          torchrun_process)
from plumbing.inputs import Run


def load(config: Config) -> Run:
    """The run `config` asks for: under torchrun this process's slice of the model (features/
    tensor_parallel.py), the attention, compiled layers' default, then the model."""
    if config.cache == "virtual":  # from the flags, before minutes of loading the model
        import llama3_virtual  # only here: the other runs never touch CUDA's virtual memory
        llama3_virtual.require_cuda_and_flash_attn(config)
    share = group = None
    if torchrun_process() is not None:  # torchrun's processes split the model
        config = plug("tensor parallelism", "start")(config)
        share, group = plug("tensor parallelism", "SHARE"), plug("tensor parallelism", "group")()
    attention = choose_attention(config.attn, config.device, decode_kernel(config), config.dtype)
    if config.compile is None:
        config = dataclasses.replace(config, compile=compiles_by_default(config, attention))
    sequences = config.samples * config.beam_width
    run = inputs.load_run(config, lesson.Llama, attention, system_prompt(config), sequences, share,
                          group)
    if config.quantization == "fp8":
        use_fp8_weights(run)
    if config.kv_cache_dtype == "fp8":
        run = dataclasses.replace(run, kv_cache_dtype=plug("FP8 K/V", "FP8"))
    return run


# The decode kernel beside flash-attn's prefill, where measurement found one faster than
# flash-attn's own: whole workloads W, W2 and N timed with each in one call (docs/speed.md, "The
# decode kernel by default"). Key: (CUDA compute capability, --dtype, the weights' format). A GPU
# or format not here keeps flash-attn's kernel, the one llama3_paged.py's plain run reads with.
FASTER_DECODE_KERNEL = {
    ((9, 0), "bf16", "bf16"): "triton",  # Hopper
    ((9, 0), "bf16", "fp8"): "triton",  # Hopper, -q fp8
}


def decode_kernel(config: Config) -> str:
    """--decode-kernel, or for `auto` the table's kernel for this GPU, dtype and weights. With
    flash-attn's prefill, a float8 cache is always read by the Triton kernel: flash-attn 2
    reads no float8."""
    flash_prefill = (config.device.type == "cuda"
                     and attention_name(config.attn, config.device, config.dtype) == "flash")
    if not flash_prefill:  # choose_attention refuses "triton" here, and takes "flash" as none
        return "flash" if config.decode_kernel == "auto" else config.decode_kernel
    if config.kv_cache_dtype == "fp8":
        return "triton"
    if config.decode_kernel != "auto":
        return config.decode_kernel
    dtype = config.dtype or "bf16"  # CUDA's default (plumbing/inputs.py)
    gpu = torch.cuda.get_device_capability(config.device)
    return FASTER_DECODE_KERNEL.get((gpu, dtype, config.quantization or dtype), "flash")


def use_fp8_weights(run: Run) -> None:
    """--quantization fp8: the loaded model's projections in float8 (features/fp8/weights.py),
    before the KV budget is taken from what the GPU has left: the pool gets what they free."""
    before, after = plug("FP8 weights")(run.model, run.group)
    fixed = run.args.kv_budget_gb or run.device.type != "cuda"
    print(f"FP8 weights (--quantization fp8): the projections in float8, weights "
          f"{format_bytes(after)} where {str(run.dtype).removeprefix('torch.')} takes "
          f"{format_bytes(before)}: " + ("the KV budget is fixed (--kv-budget-gb, or the "
                                         "CPU's), so the pool stays as large." if fixed else
                                         f"{format_bytes(before - after)} more for the KV pool."))


def compiles_by_default(config: Config, attention) -> bool:
    """Compiled layers (engine/compiled_layers.py) where nothing stands in their way: CUDA, a
    GPU attention kernel, and not --eager. In bf16 they round otherwise than the eager kernels,
    so tokens can differ from an --eager run's; --no-compile keeps CUDA graphs without them."""
    return config.device.type == "cuda" and attention.name != "torch" and not config.eager


def system_prompt(config: Config) -> str | None:
    if config.system_prompt_file is None:
        return config.system_prompt
    try:
        return read_text_input(config.system_prompt_file, "--system-prompt-file")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Could not read --system-prompt-file {config.system_prompt_file}: "
                        f"{e}") from e


def attention_name(name: str, device: torch.device, dtype: str | None) -> str:
    """--attn with `auto` resolved: flash-attn on CUDA when it imports, else the Triton kernel on
    CUDA, else the PyTorch reference; for --dtype fp32 the reference, as both kernels read fp16
    and bf16 only."""
    if name != "auto":
        return name
    return ("torch" if device.type != "cuda" or dtype == "fp32" else
            "flash" if importable("flash_attn") else
            "triton" if importable("triton") else "torch")


def choose_attention(name: str, device: torch.device, decode_kernel: str = "flash",
                     dtype: str | None = None):
    """The backend --attn names (attention_name resolves `auto`). decode_kernel "triton"
    (llama3_paged.py) decodes through the Triton kernel beside flash-attn's prefill."""
    name = attention_name(name, device, dtype)
    if name != "torch" and dtype == "fp32":
        raise UserError(f"--attn {name} reads fp16 and bf16 only: with --dtype fp32 use --attn "
                        f"torch (the PyTorch reference), or --dtype bf16.")
    if decode_kernel == "triton" and name != "flash":
        raise UserError(f"--decode-kernel triton pairs the Triton decode kernel with flash-attn's "
                        f"prefill, and this run attends with --attn {name}: use --attn flash "
                        f"(with flash-attn installed), or drop --decode-kernel.")
    if name == "torch":
        return TorchAttentionAfterPrefix()
    if device.type != "cuda":
        raise UserError(f"--attn {name} needs a CUDA device; use --attn torch on the CPU.")
    if name == "triton":
        if not importable("triton"):
            raise UserError("--attn triton: Triton is not installed (it comes with PyTorch's CUDA "
                            "builds); use --attn torch.")
        return plug("Triton attention")()
    if not importable("flash_attn"):
        raise UserError("--attn flash: flash-attn is not installed. Install it after torch with "
                        "`pip install flash-attn --no-build-isolation`, or use --attn triton.")
    if decode_kernel == "triton":
        return plug("Triton attention", "TritonDecode")()
    return FlashAttentionAfterPrefix()

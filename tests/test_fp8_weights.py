"""FP8 weights (--quantization fp8, features/fp8/weights.py) on the CPU: the quantized numbers
against e4m3's rounding bound, the reference matmul against float64, the real SmolLM2 against its
16-bit self, and how the flag reaches the run."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, engine_model
from features.fp8.cache import FP8, FP8_MAX
from features.fp8.weights import Float8Linear, quantize_weights

PROJECTIONS = ("attention.wqkv", "attention.wo", "feed_forward.w_gate_up", "feed_forward.w_down")


def test_each_projection_dequantizes_within_e4m3s_rounding_bound():
    model = engine_model(seed=3)
    before = {f"{i}.{name}": layer.get_submodule(name).weight.clone()
              for i, layer in enumerate(model.layers) for name in PROJECTIONS}
    quantize_weights(model)
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            module, w = layer.get_submodule(name), before[f"{i}.{name}"]
            assert isinstance(module, Float8Linear) and module.weight.dtype == FP8
            scale = module.scale.t()  # [out, 1]: a scale per output channel
            # every row uses e4m3's whole range: its largest |w| lands on 448
            assert (module.weight.float().abs().amax(dim=1) == FP8_MAX).all()
            # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a
            # subnormal one (below 2^-6) by half their spacing of 2^-9, both in units of the scale
            error = (module.weight.float() * scale - w).abs()
            assert (error <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
            assert error.max() > 0  # float8, not a copy
    assert model.output.weight.dtype == torch.float32  # the head stays in the model's dtype


def test_the_reference_matmul_is_float64s_product_of_the_quantized_numbers():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False)
    fp8 = Float8Linear(linear)
    x = torch.randn(5, 64) * torch.logspace(-3, 2, 5)[:, None]  # rows of very different sizes
    # Per token, by hand in float64: a row's scale is its largest |x| over 448
    x_scale = x.double().abs().amax(dim=1, keepdim=True) / FP8_MAX
    x8 = (x.double() / x_scale).to(FP8).double() * x_scale
    w = fp8.weight.double() * fp8.scale.double().t()
    expected = x8 @ w.t()
    got = fp8(x)
    assert got.dtype == torch.float32 and got.shape == (5, 48)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max())
    # and it is not the unquantized product
    assert not torch.allclose(got, linear(x), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_fp8_weights_on_smollm2_agree_with_the_16_bit_model():
    # The real SmolLM2 (float32, CPU): the figure is printed; the bound only says it is the
    # same model (a per-column scale, a wrong row or a missing scale falls far below it).
    sys.path.insert(0, str(ROOT / "tools"))
    import fp8_accuracy
    r = fp8_accuracy.measure(fp8_accuracy.parse_arguments(
        ["--model", "smollm2", "--device", "cpu", "--what", "weights", "--num-prompts", "4",
         "--steps", "16"]))
    print(f"FP8 weights against float32, SmolLM2: top-1 agreement {r['top1_agreement']:.2%}, "
          f"mean |logit error| {r['mean_abs_logit_error']:.3f}")
    assert r["top1_agreement"] >= 0.8


def test_the_flag_quantizes_the_scripts_model_and_the_report_says_by_how_much(tmp_path):
    out = tmp_path / "run.json"
    run = subprocess.run(
        [sys.executable, "llama3_paged.py", "2", "--random-weights", "--model", "tiny",
         "--device", "cpu", "--max-new-tokens", "4", "-q", "fp8", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # tiny: 2 layers of dim 256 (q/k/v 512 rows, o 256, gate/up 1,024, down 256), a float32
    # embedding and head of 128,256 x 256, and norms; float8 projections take 1 byte each, and
    # a float32 scale per output channel
    projections = 2 * (256 * 512 + 256 * 256 + 256 * 1024 + 512 * 256)
    channels = 2 * (512 + 256 + 1024 + 256)
    rest = 2 * 128_256 * 256 + 256 * (2 * 2 + 1)
    weights = json.loads(out.read_text())["memory"]["weights_bytes"]
    assert weights == projections + 4 * channels + 4 * rest
    assert f"where float32 takes {(4 * (projections + rest)) / 1e6:,.2f} MB" in run.stdout
    assert f"weights {weights / 1e6:,.2f} MB (float8 projections, float32)" in run.stdout


def test_fp8_weights_in_fp16_on_cuda_are_refused_in_one_paragraph():
    import dataclasses
    from engine.config import parse_script_arguments
    from plumbing.cli import UserError
    config = parse_script_arguments("paged", ["2", "--random-weights", "--device", "cpu",
                                              "--quantization", "fp8", "--dtype", "fp16"])
    with pytest.raises(UserError, match="--quantization fp8 multiplies float8"):
        dataclasses.replace(config, device=torch.device("cuda"))  # checked again, as on a GPU


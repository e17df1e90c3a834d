"""Bad checkpoints end in a message and exit code 2; a pickle that carries code is never run."""

import json
import pytest
import torch

from plumbing.inputs import load_model, random_model
from llama3_paged import Llama
from plumbing.cli import UserError


def test_missing_checkpoint_names_the_files_and_the_download(tmp_path):
    with pytest.raises(UserError) as e:
        load_model(Llama, tmp_path, "cpu", torch.float32, 16)
    assert "params.json" in str(e.value) and "consolidated.00.pth" in str(e.value)
    assert "huggingface-cli download meta-llama/Meta-Llama-3-8B-Instruct" in str(e.value)
    assert e.value.exit_code == 2


def test_params_without_weights_is_reported(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64}))
    with pytest.raises(UserError, match="no consolidated.00.pth"):
        load_model(Llama, tmp_path, "cpu", torch.float32, 16)


class RunsCode:
    def __reduce__(self):
        return (open, (str(self.marker), "w"))

    def __init__(self, marker):
        self.marker = marker


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pickle_ran_code"
    (tmp_path / "params.json").write_text(json.dumps(
        {"dim": 64, "n_layers": 1, "n_heads": 1, "vocab_size": 8, "multiple_of": 8, "norm_eps": 1e-5}))
    torch.save({"tok_embeddings.weight": RunsCode(marker)}, tmp_path / "consolidated.00.pth")
    with pytest.raises(UserError, match="Refused"):
        load_model(Llama, tmp_path, "cpu", torch.float32, 16)
    assert not marker.exists()


def test_random_weights_stay_finite_in_bf16_through_every_layer():
    from test_model import our_logits
    model = random_model(Llama, "tiny", "cpu", torch.bfloat16, max_positions=64)
    logits = our_logits(model, [list(range(1000, 1040))])[0]
    assert torch.isfinite(logits).all() and logits.float().std() > 0.1


def test_a_config_missing_fields_is_reported(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64}))
    torch.save({}, tmp_path / "consolidated.00.pth")
    with pytest.raises(UserError, match="malformed"):
        load_model(Llama, tmp_path, "cpu", torch.float32, 16)

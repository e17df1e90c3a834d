"""vLLM's offline examples in their own shape (basic.py, chat.py: a parser from EngineArgs, the
sampling flags beside it, `LLM(**args)`, the default sampling parameters changed in place, one
chat and a batch, a chat template from a file), with only the import and the model changed: run
as a program, each prints what the Python API gives in process."""

import subprocess
import sys

import pytest

from conftest import ROOT
from engine.llm import LLM, SamplingParams

CHAT = '''
from engine.llm import LLM, EngineArgs, FlexibleArgumentParser

def create_parser():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="tiny")
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    parser.add_argument("--chat-template-path", type=str)
    return parser

def main(args: dict):
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    top_p, top_k = args.pop("top_p"), args.pop("top_k")
    chat_template_path = args.pop("chat_template_path")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hello! How can I assist you today?"},
                    {"role": "user", "content": "Write an essay about higher education."}]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    outputs += llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
    if chat_template_path is not None:
        with open(chat_template_path) as f:
            chat_template = f.read()
        outputs += llm.chat([conversation], sampling_params, use_tqdm=False,
                            chat_template=chat_template)
    for output in outputs:
        print(f"Generated text: {output.outputs[0].text!r}")

if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
'''

BASIC = '''
from engine.llm import LLM, SamplingParams
prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=6)
llm = LLM(model="tiny", random_weights=True, device="cpu")
for output in llm.generate(prompts, sampling_params):
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
'''


def run(script: str, *argv: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if "Generated text" in line]


# slow: 12 s of two program runs; the basic example runs by default, and test_serve.py checks
# LLM.chat's tokens against the server's
@pytest.mark.slow
def test_vllms_chat_example_runs_with_the_import_and_the_model_changed(tmp_path):
    llm = LLM(model="tiny", random_weights=True, device="cpu", dtype="fp32")
    template = tmp_path / "template.jinja"  # the model's own, rendered by transformers
    template.write_text(llm.get_tokenizer().chat_template)
    printed = run(CHAT, "--random_weights", "--device", "cpu", "--dtype", "float32",
                  "--max-tokens", "6", "--temperature", "0",
                  "--chat-template-path", str(template))
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hello! How can I assist you today?"},
                    {"role": "user", "content": "Write an essay about higher education."}]
    [expected] = llm.chat(conversation, SamplingParams(max_tokens=6, temperature=0),
                          use_tqdm=False)
    assert expected.outputs[0].text  # six tokens of the tiny random model
    assert printed == [f"Generated text: {expected.outputs[0].text!r}"] * 5


def test_vllms_basic_example_runs_with_the_import_and_the_model_changed():
    printed = run(BASIC)
    llm = LLM(model="tiny", random_weights=True, device="cpu")
    outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                           SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=6))
    assert printed == [f"Prompt: {o.prompt!r}, Generated text: {o.outputs[0].text!r}"
                       for o in outputs]

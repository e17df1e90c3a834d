"""lm-evaluation-harness, the installed package, against serve.py: a multiple-choice task
(loglikelihood, `local-completions`, tokenizing through the server's /tokenize) and a generation
task (`local-chat-completions`), each written here, each held to an independent run: the offline
LLM on the tiny random model, and transformers on SmolLM2's GGUF (slow)."""

import json
import os

import httpx2 as httpx  # the HTTP client the openai package brings
import pytest
import torch

from engine.llm import LLM, SamplingParams
from test_serve import KEY, start_server
from test_smollm2 import transformers_smollm2  # noqa: F401, F811 (a fixture)

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "22"], "answer": 0},
    {"question": "Water freezes at 0 degrees", "choices": ["Celsius", "Fahrenheit"], "answer": 0}]
PROMPTS = ["Name a colour.", "Count to three."]
END_OF_TEXT = "<|im_end|>"  # SmolLM2's (its GGUF's eos_token_id, 2)
TEXTS = ["The quick brown fox jumps over the lazy dog. It was 1999, and <|im_end|> was no word.",
         "Paged attention keeps the KV cache in blocks: 16 tokens each, handed out as needed."]


def write_tasks(folder) -> None:
    """The tasks, as lm-eval's YAML and JSON-lines files: multiple choice (its choices plain, and
    each ending in end-of-text), a rolling log-likelihood over whole texts, and generation."""
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"q": p}) + "\n" for p in PROMPTS))
    common = "dataset_path: json\ntest_split: train\n"
    (folder / "choice.yaml").write_text(
        f"task: served_choice\n{common}dataset_kwargs:\n  data_files: {folder}/questions.jsonl\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (folder / "rolling.yaml").write_text(
        f"task: served_rolling\n{common}dataset_kwargs:\n  data_files: {folder}/texts.jsonl\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    # the same questions, each choice ending in end-of-text (SmolLM2's, one token as vLLM reads it)
    (folder / "ending.jsonl").write_text("".join(json.dumps(q | {"choices": [
        c + END_OF_TEXT for c in q["choices"]]}) + "\n" for q in QUESTIONS))
    (folder / "ending.yaml").write_text(
        (folder / "choice.yaml").read_text().replace("served_choice", "served_ending")
        .replace("questions.jsonl", "ending.jsonl"))
    (folder / "generate.yaml").write_text(
        f"task: served_generate\n{common}dataset_kwargs:\n  data_files: {folder}/prompts.jsonl\n"
        "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: ''\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 8\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


def evaluate(url: str, folder, model: str, task: str, chat: bool, backend: str = "remote",
             tokenizer=None) -> list[dict]:
    """lm-eval's samples of `task` against the server, with their responses. backend: how
    lm-eval tokenizes a completion task's text, through the server's /tokenize ("remote") or
    with transformers' tokenizer saved in the folder `tokenizer` ("huggingface")."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    write_tasks(folder)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    args = {"base_url": url + path, "model": model, "max_length": 1024, "num_concurrent": 1,
            "tokenizer_backend": "none" if chat else backend, "auth_token": KEY}
    if tokenizer is not None:
        args["tokenizer"] = str(tokenizer)
    os.environ["OPENAI_API_KEY"] = KEY
    results = lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions", model_args=args,
        tasks=[task], log_samples=True, apply_chat_template=chat,
        # these tasks alone: indexing lm-eval's thousands of its own took 15 s a call
        task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def continuation_tokens(tokenizer, context: str, continuation: str):
    """lm-eval's split of a (context, continuation) pair into token ids (its _encode_pair)."""
    whole, first = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return first, whole[len(first):]


@pytest.fixture(scope="module")
def tiny_server():
    process, url = start_server("--api-key", KEY, "--max-num-seqs", "8", "--dtype", "fp32")
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_lm_evals_multiple_choice_and_generation_get_the_offline_engines_answers(tiny_server,
                                                                                 tmp_path):
    offline = LLM(model="tiny", random_weights=True, device="cpu", dtype="fp32", block_size=16)
    tokenizer = offline.tokenizer
    samples = evaluate(tiny_server, tmp_path, "tiny", "served_choice", chat=False)
    assert len(samples) == len(QUESTIONS)
    # each choice: (context, continuation) as lm-eval asked, and its answer
    asked = [(pair, got) for s in samples for (got, _), pair in zip(
        [r[0] for r in s["resps"]], s["arguments"])]
    pairs = [continuation_tokens(tokenizer, *pair) for pair, _ in asked]
    truths = offline.generate([c + t for c, t in pairs], SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    for (_, got), (context, continuation), truth in zip(asked, pairs, truths):
        expected = sum(truth.prompt_logprobs[len(context) + i][t].logprob
                       for i, t in enumerate(continuation))
        assert got == pytest.approx(expected, abs=2e-3)
    generated = evaluate(tiny_server, tmp_path, "tiny", "served_generate", chat=True)
    answers = offline.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                           SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert [s["resps"][0][0] for s in generated] == [a.outputs[0].text for a in answers]


# slow: transformers' SmolLM2, read from the GGUF, loads in about 35 s on 2 cores
@pytest.mark.slow
def test_lm_evals_tasks_on_smollm2_get_transformers_answers(tmp_path, transformers_smollm2):
    model, theirs = transformers_smollm2
    ours = LLM(model="smollm2", device="cpu").tokenizer  # the file's, digits split
    # lm-eval's request, sent as it sends it: token-id prompts, echo, logprobs 1, max_tokens 1
    id_lists = [ours.encode(q["question"] + " " + q["choices"][0]) for q in QUESTIONS]
    process, url = start_server("--api-key", KEY, "--max-num-seqs", "8", "--dtype", "fp32",
                                engine=["--model", "smollm2", "--device", "cpu"])
    try:
        samples = evaluate(url, tmp_path, "smollm2", "served_choice", chat=False)
        generated = evaluate(url, tmp_path, "smollm2", "served_generate", chat=True)
        scored = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                            json={"model": "smollm2", "prompt": id_lists, "echo": True,
                                  "logprobs": 1, "max_tokens": 1, "temperature": 0},
                            timeout=120).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    for ids, choice in zip(id_lists, scored["choices"], strict=True):  # every prompt token
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        expected = [logprobs[i - 1, t].item() for i, t in enumerate(ids) if i]
        assert choice["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(expected,
                                                                                  abs=2e-3)
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        for (got, _), pair in zip([r[0] for r in sample["resps"]], sample["arguments"]):
            context, continuation = continuation_tokens(ours, *pair)
            with torch.no_grad():
                logits = model(torch.tensor([context + continuation])).logits[0]
            logprobs = torch.log_softmax(logits.double(), -1)
            expected = sum(logprobs[len(context) - 1 + i, t].item()
                           for i, t in enumerate(continuation))
            assert got == pytest.approx(expected, abs=2e-3)
    for sample, prompt in zip(generated, PROMPTS):
        ids = theirs.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=8,
                                 eos_token_id=ours.im_end, pad_token_id=ours.im_end)
        answer = out[0, ids.shape[1]:].tolist()
        answer = answer[:-1] if answer[-1] == ours.im_end else answer
        assert sample["resps"][0][0] == ours.decode(answer)


def transformers_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities of the next token after each of ids, in float64."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


# slow: SmolLM2 twice (the server's engine and transformers') and four lm-eval runs
@pytest.mark.slow
def test_lm_evals_scores_of_endings_and_whole_texts_are_transformers_with_either_tokenizer(
        tmp_path, transformers_smollm2):
    # lm-eval's `local-completions` tokenizing through the server (remote) and with transformers'
    # tokenizer (huggingface): each choice ending in end-of-text, and each text's rolling
    # log-likelihood from the prefix token, equal to transformers' float32 on the same GGUF
    model, theirs = transformers_smollm2
    theirs.save_pretrained(tmp_path / "tokenizer")
    process, url = start_server("--api-key", KEY, "--max-num-seqs", "8", "--dtype", "fp32",
                                engine=["--model", "smollm2", "--device", "cpu"])
    try:
        info = httpx.get(url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30).json()
        runs = {backend: {task: evaluate(url, tmp_path, "smollm2", task, chat=False,
                                         backend=backend, tokenizer=tokenizer)
                          for task in ("served_ending", "served_rolling")}
                for backend, tokenizer in (("remote", None),
                                           ("huggingface", tmp_path / "tokenizer"))}
    finally:
        process.terminate()
        process.wait(timeout=30)
    end = theirs.convert_tokens_to_ids(END_OF_TEXT)
    assert info["eos_token"] == END_OF_TEXT and theirs.encode(END_OF_TEXT) == [end]
    prefixes = {"remote": theirs.convert_tokens_to_ids(info["bos_token"] or info["eos_token"]),
                "huggingface": theirs.bos_token_id if theirs.bos_token_id is not None
                else theirs.eos_token_id}
    for backend, samples in runs.items():
        endings = [(got, pair) for s in samples["served_ending"]
                   for (got, _), pair in zip([r[0] for r in s["resps"]], s["arguments"])]
        assert len(endings) == sum(len(q["choices"]) for q in QUESTIONS)
        for got, pair in endings:
            context, continuation = continuation_tokens(theirs, *pair)
            assert continuation[-1] == end, (backend, pair)  # the one token, scored
            logprobs = transformers_logprobs(model, context + continuation)
            expected = sum(logprobs[len(context) - 1 + i, t].item()
                           for i, t in enumerate(continuation))
            assert got == pytest.approx(expected, abs=2e-3), (backend, pair)
        rolling = samples["served_rolling"]
        assert len(rolling) == len(TEXTS)
        for sample, text in zip(rolling, TEXTS):
            ids = [prefixes[backend]] + theirs.encode(text, add_special_tokens=False)
            logprobs = transformers_logprobs(model, ids)
            expected = sum(logprobs[i - 1, t].item() for i, t in enumerate(ids) if i)
            got = sample["resps"][0][0]
            got = got[0] if isinstance(got, (list, tuple)) else got
            assert got == pytest.approx(expected, abs=2e-3), (backend, text)

"""Log-probabilities (features/logprobs/logprobs.py) held to one float64 pass over each whole sequence:
the prompt's and the generated tokens', in one prefill or in chunks, after a preemption, with n
samples, and the same tokens as a run that asks for none."""

import pytest
import torch

from engine.llm import LLM, SamplingParams
from llama3_paged import KVCache, PrefillBatch, TorchAttention

MODEL = dict(model="tiny", random_weights=True, device="cpu", dtype="fp32", block_size=16)
PROMPTS = [list(range(100, 105)), list(range(2000, 2033)), [7, 7, 7, 9000, 12, 12, 5, 5, 5, 1]]


@pytest.fixture(scope="module")
def llm():
    return LLM(**MODEL, max_num_seqs=8)


def truth(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: the log-softmax after each token, in float64, from one causal pass."""
    n = len(ids)
    cache = KVCache(model.args, -(-n // 16), 16, torch.float32, "cpu", TorchAttention())
    batch = PrefillBatch(torch.arange(n), torch.tensor([0, n], dtype=torch.int32), [0, n], n)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(n), cache, batch)  # [n, vocab]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_scored_as_one_pass(model, output, prompt_k: int, k: int) -> None:
    prompt, sample = output.prompt_token_ids, output.outputs[0]
    ids = prompt + sample.token_ids
    expected = truth(model, ids)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    scored = list(zip(output.prompt_logprobs[1:], ids[1:len(prompt)])) + list(
        zip(sample.logprobs, sample.token_ids))
    for position, (got, token) in enumerate(scored):  # the logits at `position` score token
        row = expected[position]
        assert got[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert got[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(prompt_k if position < len(prompt) - 1 else k)
        ranked = sorted(((p.rank, i) for i, p in got.items() if p.rank <= len(top.indices)))
        assert [i for _, i in ranked] == top.indices.tolist()
        assert [got[i].logprob for _, i in ranked] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert sample.cumulative_logprob == pytest.approx(
        sum(expected[len(prompt) - 1 + j, t].item() for j, t in enumerate(sample.token_ids)),
        abs=1e-3)


def test_prompt_and_generated_logprobs_are_one_whole_pass_and_change_no_token(llm):
    asked = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3,
                           prompt_logprobs=2)
    outputs = llm.generate(PROMPTS, asked, use_tqdm=False)
    for output in outputs:
        assert_scored_as_one_pass(llm.llm_engine.run.model, output, prompt_k=2, k=3)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert plain[0].prompt_logprobs is None and plain[0].outputs[0].logprobs is None


def test_a_stop_token_stays_in_the_token_ids_scored_and_out_of_the_text(llm):
    # vLLM records the token that ends an answer ("recorded but not rendered"): lm-eval sums an
    # echoed continuation's scores through its last token, end-of-text included.
    free = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[2]
    asked = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_id], logprobs=2,
                           prompt_logprobs=1)
    output = llm.generate(PROMPTS[:1], asked, use_tqdm=False)[0]
    sample = output.outputs[0]
    assert sample.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert sample.finish_reason == "stop" and len(sample.logprobs) == len(sample.token_ids)
    assert sample.text == llm.tokenizer.decode(sample.token_ids[:-1])
    assert_scored_as_one_pass(llm.llm_engine.run.model, output, prompt_k=1, k=2)


def test_chunked_and_preempted_prompts_are_scored_as_one_pass():
    # Mixed steps of 16 tokens cut the 33-token prompt in three; a pool of 5 blocks of 16 holds
    # two of the requests, so the third waits, and growing ones are preempted and recomputed.
    llm = LLM(**MODEL | {"num_blocks": 5}, max_num_seqs=3, no_sharing=True, max_batched_tokens=16)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                   logprobs=1, prompt_logprobs=1), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert_scored_as_one_pass(llm.llm_engine.run.model, output, prompt_k=1, k=1)


def test_sampled_tokens_are_scored_before_temperature_and_each_sample_scores_the_prompt(llm):
    # vLLM's default: the model's log-probabilities, not those of the distribution sampled from
    output = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=6, temperature=1.5, top_k=50,
                                                       n=2, seed=3, logprobs=0,
                                                       prompt_logprobs=0), use_tqdm=False)[0]
    for sample in output.outputs:
        one = type(output)(output.request_id, None, output.prompt_token_ids, [sample],
                           output.prompt_logprobs)
        assert_scored_as_one_pass(llm.llm_engine.run.model, one, prompt_k=0, k=0)
        assert all(len(d) == 1 for d in sample.logprobs)  # logprobs=0: the token's own alone


def test_more_top_logprobs_than_max_logprobs_are_refused(llm):
    with pytest.raises(ValueError, match=r"at most 20 top tokens here \(--max-logprobs\)"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished()

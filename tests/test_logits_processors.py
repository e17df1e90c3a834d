"""vLLM's logits processors (engine/sampler.py's RowProcessing and min_p) held to a reference
that recomputes every step from scratch: one float64 causal pass over the whole sequence, the
penalties by transformers' processors and OpenAI's documented formula. Greedy, in one batch
and in 16-token mixed steps with preemption (so the counts survive recomputation), beside rows
that ask for nothing and so must not change."""

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor)

from engine.llm import LLM, SamplingParams
from llama3_paged import KVCache, PrefillBatch, TorchAttention

MODEL = dict(model="tiny", random_weights=True, device="cpu", dtype="fp32", block_size=16)
PROMPTS = [[7, 7, 7, 9000, 12, 12, 5, 5, 5, 1], list(range(2000, 2033)), list(range(100, 105))]
# The tiny random model's logits have a spread of about 1: the bias makes a few prompt tokens
# and one other the likeliest, so that the penalties have repeats to act on
BIAS = {7: 5.0, 12: 4.5, 2001: 5.0, 300: 4.0}
PENALIZED = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=BIAS,
                           repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """[vocab] float64: the logits after the last of ids, from one causal pass over them all."""
    n = len(ids)
    cache = KVCache(model.args, -(-n // 16), 16, torch.float32, "cpu", TorchAttention())
    batch = PrefillBatch(torch.arange(n), torch.tensor([0, n], dtype=torch.int32), [0, n], n)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), torch.arange(n), cache, batch)[-1]
    return logits.double().clone()  # out of inference mode: the test adds to it


def reference(model, prompt: list[int], params: SamplingParams, stop_ids=()) -> list[int]:
    """Greedy tokens with vLLM's order: bias, min_tokens, repetition, frequency, presence."""
    ids = list(prompt)
    for _ in range(params.max_tokens):
        logits = last_logits(model, ids)[None]  # [1, vocab]
        for token, bias in (params.logit_bias or {}).items():
            logits[0, token] += bias
        logits = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, list(stop_ids))(
            torch.tensor([ids]), logits)
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
            torch.tensor([ids]), logits)[0]
        for token, count in Counter(ids[len(prompt):]).items():  # OpenAI's formula
            logits[token] -= count * params.frequency_penalty + params.presence_penalty
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def llm():
    return LLM(**MODEL, max_num_seqs=8)


def test_bias_and_penalties_are_the_references_beside_rows_that_ask_for_nothing(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    together = llm.generate(PROMPTS + PROMPTS, [PENALIZED] * 3 + [plain] * 3, use_tqdm=False)
    model = llm.llm_engine.run.model
    for prompt, output in zip(PROMPTS, together[:3]):
        assert output.outputs[0].token_ids == reference(model, prompt, PENALIZED)
    assert [o.outputs[0].token_ids for o in together[3:]] == [
        o.outputs[0].token_ids for o in alone]
    # Again with the rows the way round: the plain requests now take rows penalized before
    swapped = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [PENALIZED] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in swapped] == [
        o.outputs[0].token_ids for o in alone + together[:3]]
    biased_only = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0,
                                                           ignore_eos=True, logit_bias=BIAS),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert biased_only != together[0].outputs[0].token_ids, "the penalties changed nothing"


def test_penalties_count_the_tokens_of_recomputed_and_chunked_requests():
    # A pool of 5 blocks of 16 holds two of the requests; growing ones are preempted and
    # recomputed in 16-token mixed steps, drawing tokens that are thrown away on the way.
    llm = LLM(**MODEL | {"num_blocks": 5}, max_num_seqs=3, no_sharing=True,
              max_batched_tokens=16)
    params = SamplingParams(**vars(PENALIZED) | {"max_tokens": 16})
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == reference(llm.llm_engine.run.model, prompt, params)


def test_min_tokens_holds_back_the_stop_tokens_and_then_lets_them_end(llm):
    # The stop token is the one the model picks first: without min_tokens it ends at once
    first = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    params = SamplingParams(max_tokens=10, temperature=0, min_tokens=4, stop_token_ids=[first],
                            logit_bias={first: 3.0})
    got = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    stop_ids = {first} | llm.tokenizer.stop_ids
    expected = reference(llm.llm_engine.run.model, PROMPTS[0], params, stop_ids)
    assert len(got.token_ids) >= 4 and first not in got.token_ids[:4]
    # the stop token ends the answer and is kept in its token ids, as vLLM keeps it
    assert got.token_ids == expected[:expected.index(first) + 1] and got.finish_reason == "stop"


def test_min_p_draws_only_tokens_within_it_of_the_likeliest(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, min_p=0.9, seed=5, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        ids = prompt + output.outputs[0].token_ids
        for at in range(len(prompt), len(ids)):
            logits = last_logits(llm.llm_engine.run.model, ids[:at])[None]
            kept = MinPLogitsWarper(0.9)(torch.tensor([ids[:at]]), logits)[0]
            assert kept[ids[at]] > -float("inf"), f"token {at} is below min_p"


def test_special_tokens_leave_the_text_unless_asked_to_stay(llm):
    special = 128010  # <|reserved_special_token_5|>: made the likeliest by the bias
    asked = dict(max_tokens=2, temperature=0, ignore_eos=True, logit_bias={special: 100.0})
    skipped, kept = (llm.generate(PROMPTS[:1], SamplingParams(**asked, skip_special_tokens=skip),
                                  use_tqdm=False)[0].outputs[0] for skip in (True, False))
    assert skipped.token_ids == kept.token_ids == [special, special]
    assert skipped.text == "" and kept.text == "<|reserved_special_token_5|>" * 2


def test_fields_out_of_range_are_refused_by_name():
    for fields in [{"presence_penalty": 3}, {"repetition_penalty": 0}, {"min_p": 1.5},
                   {"min_tokens": 20, "max_tokens": 10}, {"logit_bias": {5: 101}},
                   {"logit_bias": {-1: 1.0}}]:
        name = next(iter(fields))
        with pytest.raises(ValueError, match=f"SamplingParams {name} ="):
            SamplingParams(**fields)

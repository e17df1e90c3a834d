"""The API's engine with overlapped steps (on CUDA by default): requests that the host ends
between steps (stop strings, aborts) while the next step is in flight give the tokens of the
engine without overlap, and leave every row, block and stopped request behind them free."""

import pytest

from engine.llm import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from plumbing.inputs import PROMPTS_FILE, read_records

ENGINE = dict(model="tiny", random_weights=True, device="cpu", block_size=16, max_num_seqs=4)
PROMPTS = [r["conversations"][0]["value"][:100] for r in read_records(PROMPTS_FILE)[:7]]


def outputs(llm, params) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
            for o in llm.generate(PROMPTS, params)]


# slow: 11 s, two engines four times over; tests/test_overlap.py holds overlap to the plain loop
@pytest.mark.slow
def test_stop_strings_and_samples_give_the_same_outputs_overlapped_or_not():
    plain, overlapped = LLM(**ENGINE, overlap=False), LLM(**ENGINE, overlap=True)
    free = [o.outputs[0].text for o in plain.generate(PROMPTS, SamplingParams(max_tokens=20,
                                                                              temperature=0))]
    # Stop strings cut out of answers given without them: requests end on the host mid-run,
    # while more requests wait for their rows (7 prompts, 4 rows).
    stops = [text[8:11] for text in free[:4] if len(text) > 12]
    greedy = SamplingParams(max_tokens=20, temperature=0, stop=stops)
    expected = outputs(plain, greedy)
    assert outputs(overlapped, greedy) == expected
    assert any(reason == "stop" for o in expected for _, _, reason in o)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_k=5, seed=3, n=2)
    assert outputs(overlapped, sampled) == outputs(plain, sampled)
    engine = overlapped.llm_engine
    assert not engine.core.stopped, "every thrown-away token's request is forgotten"
    assert engine.manager.num_used_blocks == 0 and len(engine.free_rows) == 4


def test_an_abort_while_a_step_is_in_flight_frees_its_request_and_spares_the_others():
    def run(overlap: bool) -> tuple[dict, LLMEngine]:
        engine = LLMEngine("paged", 4, overlap=overlap, **{k: v for k, v in ENGINE.items()
                                                          if k != "max_num_seqs"})
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        ids = [engine.add_request(engine.tokenizer.encode(p), params) for p in PROMPTS[:4]]
        finished, steps = {}, 0
        while engine.has_unfinished():
            for s in engine.step():
                if s.finish_reason:
                    finished[s.request_id] = (list(s.request.output_tokens), s.finish_reason)
            steps += 1
            if steps == 4:  # mid-decode: on the overlapped engine, step 5 is in flight
                engine.abort(ids[1])
        return finished, engine
    (overlapped, engine), (plain, _) = run(True), run(False)
    assert overlapped == plain and "abort" not in {reason for _, reason in plain.values()}
    assert len(overlapped) == 3, "the aborted request is not reported as finished by a step"
    assert engine.manager.num_used_blocks == 0 and len(engine.free_rows) == 4
    assert not engine.core.stopped


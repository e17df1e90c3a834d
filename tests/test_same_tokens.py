"""tools/same_tokens.py: two greedy runs' --json compared; where a request parts, the gaps
between the two runs' tokens are set against how much the runs disagreed on the tokens they
shared."""

import pytest

from tools import same_tokens


def request(tokens: list[int], rows: list[tuple[float, list[list[float]]]]) -> dict:
    """A --json request record: its tokens, and at each its log-probability and the K likeliest
    [id, log-probability]."""
    return {"id": 0, "output_tokens": tokens,
            "logprobs": [{"logprob": lp, "rank": 1, "top": top} for lp, top in rows]}


def write(path, *requests) -> str:
    import json
    path.write_text(json.dumps({"requests": [r | {"id": i} for i, r in enumerate(requests)]}))
    return str(path)


# The shared token 5 is 0.050 apart in the two runs: the disagreement a gap is set against.
SHARED_A = request([5, 6], [(-1.00, [[5, -1.00], [9, -2.0]]), (-1.0, [[6, -1.0], [8, -3.0]])])
SHARED_B = request([5, 6], [(-1.05, [[5, -1.05], [9, -2.0]]), (-1.0, [[6, -1.0], [8, -3.0]])])


@pytest.mark.parametrize("a_leads_by, b_leads_by, exit_code, verdict", [
    (0.03, 0.02, 0, "1 at a near-tie"),  # each within the 0.05 the runs disagreed by
    (0.0, 0.08, 0, "1 at a near-tie"),  # one beyond it, their sum within twice it
    (0.06, 0.06, 1, "0 at a near-tie (the gaps' sum within twice the runs' largest disagreement "
                    "on a shared token, 0.050), 1 not"),
    (0.5, 0.02, 1, "0 at a near-tie"),
])
def test_a_request_parts_at_a_near_tie_only_within_the_runs_own_disagreement(
        tmp_path, capsys, a_leads_by, b_leads_by, exit_code, verdict):
    a = request([5, 6, 7], [(-1.0, [[5, -1.0], [9, -2.0]]),
                            (-1.0, [[6, -1.0], [4, -1.0 - a_leads_by]]),
                            (-1.0, [[7, -1.0], [3, -4.0]])])
    b = request([5, 4, 1], [(-1.01, [[5, -1.01], [9, -2.0]]),
                            (-1.0, [[4, -1.0], [6, -1.0 - b_leads_by]]),
                            (-1.0, [[1, -1.0], [2, -4.0]])])
    args = [write(tmp_path / "a.json", SHARED_A, a), write(tmp_path / "b.json", SHARED_B, b)]
    if exit_code:
        with pytest.raises(SystemExit) as e:
            same_tokens.main(args)
        assert e.value.code == exit_code
    else:
        same_tokens.main(args)
    out = capsys.readouterr().out
    assert "request 1: token 1 of 3: 6 against 4" in out
    assert f"1 of 2 requests gave the same tokens; of the 1 that part, {verdict}" in out


def test_the_disagreement_counts_every_token_both_runs_kept_not_only_the_one_chosen(
        tmp_path, capsys):
    # At the shared token the chosen 5 agrees, but 9, kept by both, is 0.2 apart: gaps of 0.1 and
    # 0.2 at the parting (0.3) are within twice that.
    shared_a = request([5, 6], [(-1.0, [[5, -1.0], [9, -2.0]]), (-1.0, [[6, -1.0], [8, -3.0]])])
    shared_b = request([5, 6], [(-1.0, [[5, -1.0], [9, -2.2]]), (-1.0, [[6, -1.0], [8, -3.0]])])
    a = request([5, 6], [(-1.0, [[5, -1.0], [9, -2.0]]), (-1.0, [[6, -1.0], [4, -1.1]])])
    b = request([5, 4], [(-1.0, [[5, -1.0], [9, -2.0]]), (-1.0, [[4, -1.0], [6, -1.2]])])
    same_tokens.main([write(tmp_path / "a.json", shared_a, a),
                      write(tmp_path / "b.json", shared_b, b)])
    assert "1 at a near-tie (the gaps' sum within twice the runs' largest disagreement on a " \
           "shared token, 0.200)" in capsys.readouterr().out


def test_a_token_beyond_the_k_kept_leaves_the_gap_unknown(tmp_path, capsys):
    a = request([5], [(-1.0, [[5, -1.0], [9, -1.0]])])  # a three-way tie: 4 was not kept
    b = request([4], [(-1.0, [[4, -1.0], [5, -1.0]])])
    with pytest.raises(SystemExit) as e:
        same_tokens.main([write(tmp_path / "a.json", a), write(tmp_path / "b.json", b)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "at least 0.000 and 0.000: unknown (beyond the K kept)" in out


def test_runs_of_different_commands_are_refused_in_one_paragraph(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        same_tokens.main([write(tmp_path / "a.json", SHARED_A),
                          write(tmp_path / "b.json", SHARED_A, SHARED_A)])
    assert e.value.code == 2 and "1 and 2 requests" in capsys.readouterr().err

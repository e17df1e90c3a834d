"""Whether two greedy runs gave the same tokens, and where they did not, how near a tie it was.

    python llama3_paged.py 49 --random-weights --decode-kernel flash --logprobs 20 --json a.json
    python llama3_paged.py 49 --random-weights --decode-kernel triton --logprobs 20 --json b.json
    python tools/same_tokens.py a.json b.json

Two kernels that round differently give slightly different logits, and where the two likeliest
tokens nearly tie, greedy decoding can take the other one; from that token on a request's text
differs. How much the two runs disagree is measured where they share the context: before each
request parts, both runs computed the same tokens, and the largest difference between their
log-probabilities of one token there (the token chosen, or any other both kept among the K
likeliest) is the kernels' disagreement. At the token where a request parts, each run's token led
the other run's by a gap in log-probability (the gap between their logits). The two gaps add up to
the runs' difference on the one token less their difference on the other
(a's lead + b's lead = (a - b on a's token) - (a - b on b's token)), so kernels that disagree by
at most D on any token part with gaps that sum to at most 2D: a near-tie when they do. A token
beyond the other run's --logprobs K likeliest leaves its gap unknown: rerun both with a larger
K. Exit 1 unless every request gave the same tokens or parted at a near-tie.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

import argparse

from plumbing.cli import HelpFormatter, UserError, first_paragraph, one_paragraph_errors
from tools.arguments import json_file


def first_difference(a: dict, b: dict) -> int | None:
    """The position of the first output token two runs' records of one request differ at."""
    for i, (x, y) in enumerate(zip(a["output_tokens"], b["output_tokens"])):
        if x != y:
            return i
    same_length = len(a["output_tokens"]) == len(b["output_tokens"])
    return None if same_length else min(len(a["output_tokens"]), len(b["output_tokens"]))


def disagreement(pairs: list[tuple[dict, dict, int]]) -> float:
    """The largest difference between the two runs' log-probabilities of one token, over every
    position they share (pairs: each request's two records, and how many tokens they share):
    the token both chose there, and every other token both kept among the K likeliest."""
    def differences(x: dict, y: dict):
        yield abs(x["logprob"] - y["logprob"])
        kept_by_y = dict(map(tuple, y["top"]))
        yield from (abs(logprob - kept_by_y[token]) for token, logprob in x["top"]
                    if token in kept_by_y)
    return max((d for a, b, parts in pairs
                for x, y in zip(a["logprobs"][:parts], b["logprobs"][:parts])
                for d in differences(x, y)), default=0.0)


def gap(record: dict, position: int, other_token: int) -> tuple[float, bool]:
    """How far this run's token led `other_token` in log-probability, and whether that is known:
    if `other_token` is beyond the K likeliest kept, the gap is at least the lead over the last."""
    row = record["logprobs"][position]
    for token, logprob in row["top"]:
        if token == other_token:
            return row["logprob"] - logprob, True
    return row["logprob"] - row["top"][-1][1], False


def compare(a: dict, b: dict) -> tuple[list[str], float, dict]:
    """One line per request that parts, the kernels' disagreement, and a count per verdict."""
    if len(a["requests"]) != len(b["requests"]):
        raise UserError(f"The runs hold {len(a['requests'])} and {len(b['requests'])} requests: "
                        f"compare two runs of the same command with another kernel.")
    pairs = [(ra, rb, first_difference(ra, rb)) for ra, rb in zip(a["requests"], b["requests"])]
    parted = [(ra, rb, i) for ra, rb, i in pairs if i is not None]
    if any("logprobs" not in r for ra, rb, i in pairs for r in (ra, rb)) and parted:
        raise UserError("The runs differ and hold no log-probabilities: run both with --logprobs "
                        "K to see how near a tie each difference was.")
    limit = disagreement([(ra, rb, len(ra["output_tokens"]) if i is None else i)
                          for ra, rb, i in pairs]) if parted else 0.0
    lines, counts = [], {"a near-tie": 0, "NOT a near-tie": 0, "unknown": 0}
    for ra, rb, i in parted:
        if i == min(len(ra["output_tokens"]), len(rb["output_tokens"])):
            counts["NOT a near-tie"] += 1
            lines.append(f"request {ra['id']}: the same tokens, but one run stopped sooner")
            continue
        ta, tb = ra["output_tokens"][i], rb["output_tokens"][i]
        gaps = gap(ra, i, tb), gap(rb, i, ta)
        verdict = ("NOT a near-tie" if sum(g for g, _ in gaps) > 2 * limit else
                   "a near-tie" if all(known for _, known in gaps) else "unknown")
        counts[verdict] += 1
        shown = [f"{g:.3f}" if known else f"at least {g:.3f}" for g, known in gaps]
        lines.append(f"request {ra['id']}: token {i:,} of {len(ra['output_tokens']):,}: {ta} "
                     f"against {tb}, each leading the other by {shown[0]} and {shown[1]}: "
                     f"{verdict}" + (" (beyond the K kept)" if verdict == "unknown" else ""))
    return lines, limit, counts


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog="same_tokens.py", description=first_paragraph(__doc__),
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=HelpFormatter)
    p.add_argument("first", type=json_file, help="one run's --json")
    p.add_argument("second", type=json_file, help="the other run's --json")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_arguments(argv)
    with one_paragraph_errors("same_tokens.py"):
        lines, limit, counts = compare(a.first, a.second)
        for line in lines:
            print(line)
        n = len(a.first["requests"])
        print(f"{n - len(lines)} of {n} requests gave the same tokens; of the {len(lines)} that "
              f"part, {counts['a near-tie']} at a near-tie (the gaps' sum within twice the runs' "
              f"largest disagreement on a shared token, {limit:.3f}), "
              f"{counts['NOT a near-tie']} not, "
              f"{counts['unknown']} unknown.")
    if counts["NOT a near-tie"] or counts["unknown"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

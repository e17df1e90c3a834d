"""What a served request carries beyond the lesson's: where it is in its life, and when.

The lesson's static batch admits every request at once and never sends one back, so its
Request is a prompt, a budget and the tokens so far. Served requests need more: continuous
batching sends a running request back to the queue when blocks run out (its Status), arrivals
spread requests over time, and the latency report measures from when each arrived to when each
of its tokens reached the host (features/arrivals.py); the report counts the queue's waits.
"""

from dataclasses import dataclass, field
from enum import Enum

from llama3_paged import Request, append_tokens


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class ServedRequest(Request):
    status: Status = Status.WAITING
    arrival_time: float = 0.0  # seconds from the start: when it asked to run
    admitted_at: float | None = None  # when it first got blocks
    token_times: list[float] = field(default_factory=list)  # when each new token reached the host
    # Log-probabilities, where asked (features/logprobs/): a row for each output token, and
    # for each prompt token but the first, by its index. A request that scores its prompt
    # computes all of it: it reads no cached prefix and forks from no other request.
    logprobs: list = field(default_factory=list)
    prompt_logprobs: dict = field(default_factory=dict)
    reads_cached_prefix: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)


def append_tokens_at(requests: list[ServedRequest], new_tokens, stop_ids, now: float) -> list:
    """The lesson's append_tokens, noting when each appended token reached the host (`now`)."""
    before = [len(r.output_tokens) for r in requests]
    done = append_tokens(requests, new_tokens, stop_ids)
    for request, count in zip(requests, before):
        if len(request.output_tokens) > count:
            request.token_times.append(now)
    return done

"""The engine's request: a prompt, a budget and the tokens so far, and where it is in its life.

The lesson's static batch admits every request at once and never sends one back, so its
Request is a prompt, a budget and the tokens so far. The engine's requests need more: continuous
batching sends a running request back to the queue when blocks run out (its Status), arrivals
spread requests over time, and the latency report measures from when each arrived to when each
of its tokens reached the host (features/arrivals.py). A type of the engine's own, not a
subclass of the lesson's: a change to the lesson's loop cannot change the engine's.
"""

from dataclasses import dataclass, field
from enum import Enum


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class EngineRequest:
    row: int  # its row of the block table while it runs
    prompt_tokens: list[int]
    max_new_tokens: int  # it stops after this many, or at a stop token
    output_tokens: list[int] = field(default_factory=list)
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
    def tokens(self) -> list[int]:
        """What the cache must hold for it to go on: its prompt and what it generated."""
        return self.prompt_tokens + self.output_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)


def append_tokens_at(requests: list[EngineRequest], new_tokens, stop_ids, now: float) -> list:
    """Append each request's new token, noting when it reached the host (`now`); return those
    done: a stop token of `stop_ids` (a script's run: not kept, as the lesson's loop does; a
    served engine passes none and judges stops itself) or their last allowed token."""
    done = []
    for request, token in zip(requests, new_tokens.tolist()):
        if token not in stop_ids:
            request.output_tokens.append(token)
            request.token_times.append(now)
        if token in stop_ids or len(request.output_tokens) >= request.max_new_tokens:
            done.append(request)
    return done

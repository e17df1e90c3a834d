"""Requests that arrive over time (--request-rate), and how long each waited for its tokens.

The PagedAttention paper serves requests that arrive as a Poisson process at a given rate, and
judges a system by its normalized latency: each request's end-to-end latency divided by its
output length, averaged. A Poisson process has independent, exponentially distributed gaps
between arrivals, of mean 1 / rate. engine/scheduler.py admits no request before its
arrival time; this file draws those times, and measures how long each request waited.

More in docs/engine-notes.md.
"""

import math

import numpy as np


def poisson_arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the start at which n requests arrive at `rate` per second: [n], sorted. An
    infinite rate: all at the start."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]  # the first at 0: no idle start


def latency_report(requests: list) -> dict:
    """Mean, median, p90 and p99 of each latency, in seconds, over the requests that produced a
    token (from Request.arrival_time and Request.token_times)."""
    done = [r for r in requests if r.token_times]
    first = [r.token_times[0] - r.arrival_time for r in done]
    between = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    end_to_end = [r.token_times[-1] - r.arrival_time for r in done]
    normalized = [e / len(r.token_times) for r, e in zip(done, end_to_end)]
    return {"time_to_first_token": summary(first), "time_between_tokens": summary(between),
            "end_to_end": summary(end_to_end), "normalized_seconds_per_token": summary(normalized)}


def summary(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99)}

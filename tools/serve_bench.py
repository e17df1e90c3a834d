"""Serving through HTTP, measured as vLLM's serving benchmark measures it: a load client for any
OpenAI-compatible server (serve.py, vLLM, nano-vllm's).

    python serve.py --random-weights &                           # random 8B weights, a GPU
    python tools/serve_bench.py --request-rate 8 --num-prompts 160 --json http8.json

Workload: the first --num-prompts prompts of sharegpt_filtered.json, chat-formatted with Llama 3's
tokenizer and sent as token ids to /v1/completions, each asking for its ShareGPT reply's length
(at most --max-tokens) with `ignore_eos`, greedy, streamed; arriving as a Poisson process at
--request-rate per second (features/arrivals.py's times, drawn with --seed). These are the
requests tools/latency_sweep.py serves in one process, so the two can be set side by side.
The openai package parses each streamed chunk in Python, and a client process busy with one
stream's chunk delays the others': at 64 requests/s on an H100, 8 processes added 2.9 ms to
HTTP's mean TTFT share against 14 (0.35 and 0.22 of a core for the busiest). --clients K sends
the same requests, at the same times, from K processes; by default one per 4 requests/s, as
many as the cores leave beside the server's two processes.

Reported, as vLLM's `bench serve` reports them: request throughput and output tokens/s over the
whole run; TTFT (send to first token), TPOT (the rest of the request's time over its other tokens)
and ITL (gaps between streamed chunks), each as mean, median and p99; and latency_sweep's
figure, the mean normalized latency (arrival to last token, over output tokens). Where the server
serves latency histograms on /metrics (serve.py, vLLM), their means over this run's requests
too: the server's own measure (serve.py's from a request's arrival at its engine's process, as
latency_sweep.py's from an arrival), so that the client's figures less serve.py's are HTTP's own,
measured on the same requests in the same run.
"""

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's root

from plumbing.interrupt import exit_quietly_on_ctrl_c
exit_quietly_on_ctrl_c("serve_bench.py")  # before the openai package loads

from plumbing.cli import (HelpFormatter, UserError, first_paragraph,
                          one_paragraph_errors, positive_int, request_rate, require_packages,
                          seed, write_json, writable_file)

BUSY_CLIENT = 0.3  # of a core: past it a client's own delays show (the docstring's 0.35)
RATE_PER_CLIENT = 4  # requests/s a client process sends by default (see the docstring)


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(prog="serve_bench.py", description=first_paragraph(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1")
    p.add_argument("--model", help="the served model's name (default: the server's first)")
    p.add_argument("--api-key", default="-", help="sent as Authorization: Bearer KEY")
    p.add_argument("--num-prompts", type=positive_int, default=200, help="requests to send")
    p.add_argument("--request-rate", type=request_rate, default=math.inf,
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-tokens", type=positive_int, default=2048,
                   help="most tokens a request asks for")
    p.add_argument("--seed", type=seed, default=0, help="of the arrival times")
    p.add_argument("--clients", type=clients, default="auto",
                   help="processes that send the requests, each every K-th; auto: one per "
                        f"{RATE_PER_CLIENT} requests/s, up to the cores less the server's two")
    p.add_argument("--http-client", choices=["httpx", "aiohttp"], default="httpx",
                   help="the openai package's transport: its default, or aiohttp (openai[aiohttp]), "
                        "which takes less of a core per streamed chunk")
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="the client processes' event loop, as uvicorn's --loop: auto takes uvloop "
                        "where it is installed")
    p.add_argument("--json", type=writable_file, metavar="PATH", help="write every figure here")
    a = p.parse_args(argv)
    if a.clients == "auto":
        a.clients = min(auto_clients(a.request_rate, os.cpu_count() or 1), a.num_prompts)
    if a.loop == "auto":
        from plumbing.cli import importable
        a.loop = "uvloop" if importable("uvloop") else "asyncio"
    return a


def clients(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive whole number, got "
                                         f"{text!r}") from None


def auto_clients(rate: float, cores: int) -> int:
    """One process per RATE_PER_CLIENT requests/s (every core for all at once), on the cores
    that the server's HTTP and engine processes leave, and at least one."""
    wanted = cores if math.isinf(rate) else math.ceil(rate / RATE_PER_CLIENT)
    return max(1, min(wanted, cores - 2))


def workload(a) -> tuple[list[list[int]], list[int], list[float]]:
    """Prompts as token ids, tokens to ask for, arrival times: latency_sweep.py's requests."""
    from features.arrivals import poisson_arrival_times
    from plumbing.inputs import load_prompts, load_tokenizer
    prompts = load_prompts(a.num_prompts, load_tokenizer(), asked_by="--num-prompts")
    budgets = [min(max(p.num_reply_tokens, 1), a.max_tokens) for p in prompts]
    arrivals = ([0.0] * len(prompts) if math.isinf(a.request_rate)
                else poisson_arrival_times(len(prompts), a.request_rate, a.seed).tolist())
    return [p.prompt_tokens for p in prompts], budgets, arrivals


async def one_request(client, model, prompt, max_tokens, arrival, start) -> dict:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    sent = time.perf_counter()
    chunks, tokens = [], 0
    # The token ids go in extra_body, which the openai package sends as they are: as `prompt` it
    # walks each id through its type transforms in Python first (4 ms for 500 ids on a 2-core
    # CPU), client time that would count as the server's. The request on the wire is the same.
    stream = await client.completions.create(
        model=model, prompt=[], max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"prompt": prompt, "ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            chunks.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return {"arrival": start + arrival, "sent": sent, "chunks": chunks, "done": done, "tokens": tokens}


async def run_load(a, prompts, budgets, arrivals, start: float) -> list[dict]:
    import openai
    transport = {"http_client": openai.DefaultAioHttpClient()} if a.http_client == "aiohttp" else {}
    client = openai.AsyncOpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0,
                                timeout=3600, **transport)
    model = a.model or (await client.models.list()).data[0].id
    return await asyncio.gather(*[one_request(client, model, p, b, t, start)
                                  for p, b, t in zip(prompts, budgets, arrivals)])


def run_share(a, prompts, budgets, arrivals, start: float, k: int) -> tuple[list[dict], float] | str:
    """Client process k's requests: every --clients-th from the k-th, at their own arrival
    times after the shared `start` (perf_counter is the system's monotonic clock on Linux, the
    same in every process), and the CPU seconds it spent. Returns the error's text instead of
    raising it across processes."""
    import openai
    share, cpu_start = slice(k, None, a.clients), time.process_time()
    try:
        loop_factory = None
        if a.loop == "uvloop":
            import uvloop
            loop_factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            results = runner.run(run_load(a, prompts[share], budgets[share], arrivals[share], start))
        return results, time.process_time() - cpu_start
    except openai.APIConnectionError as e:
        return (f"No server answers at {a.base_url} ({e}). Start one: python serve.py "
                f"--random-weights")
    except openai.APIStatusError as e:
        return f"The server refused a request: {e}"


def server_latency_sums(base_url: str) -> dict | None:
    """The server's own time-to-first-token and end-to-end histograms' sums and counts, from
    its /metrics (serve.py's llama3:..., vLLM's vllm:...); None where it has no /metrics."""
    import urllib.request
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    found = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split()[0].rsplit(":", 1)[-1]  # no prefix, no labels
        if name in ("time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
                    "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count"):
            found[name] = found.get(name, 0.0) + float(line.split()[-1])
    return found


def server_means(before: dict | None, after: dict | None) -> dict | None:
    """Mean seconds to first token and to last, as the server measured this run's requests."""
    if before is None or after is None or len(after) < 4:
        return None
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    means = {}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        count = delta[f"{name}_count"]
        means[name] = delta[f"{name}_sum"] / count if count else None
    return means


def send_load(a, prompts, budgets, arrivals) -> tuple[list[dict], float, float]:
    """Every request's timings, the run's wall time, and the CPU seconds of the busiest client
    process, from --clients processes."""
    start = time.perf_counter() + (0 if a.clients == 1 else 2.0)  # the processes' start-up
    if a.clients == 1:
        shares = [run_share(a, prompts, budgets, arrivals, start, 0)]
    else:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(a.clients) as pool:
            shares = pool.starmap(run_share, [(a, prompts, budgets, arrivals, start, k)
                                              for k in range(a.clients)])
    for share in shares:
        if isinstance(share, str):
            raise UserError(share)
    results = sorted((r for share, _ in shares for r in share), key=lambda r: r["arrival"])
    return results, max(r["done"] for r in results) - start, max(cpu for _, cpu in shares)


def summary(values: list[float]) -> dict:
    ordered = sorted(values) or [0.0]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]}


def report(results: list[dict], wall: float) -> dict:
    ttft = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    tpot = [(r["done"] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    output = sum(r["tokens"] for r in results)
    return {
        "requests": len(results), "wall_seconds": wall, "output_tokens": output,
        "request_throughput": len(results) / wall, "output_tokens_per_second": output / wall,
        "ttft_seconds": summary(ttft), "tpot_seconds": summary(tpot), "itl_seconds": summary(itl),
        "mean_normalized_latency": statistics.fmean(
            (r["done"] - r["arrival"]) / max(r["tokens"], 1) for r in results),
    }


def print_report(r: dict) -> None:
    ms = lambda s: f"mean {s['mean'] * 1e3:.1f}, median {s['median'] * 1e3:.1f}, p99 {s['p99'] * 1e3:.1f} ms"
    print(f"{r['requests']:,} requests in {r['wall_seconds']:.1f} s from {r['clients']} client "
          f"process{'es' if r['clients'] > 1 else ''}: {r['request_throughput']:.2f} requests/s, "
          f"{r['output_tokens_per_second']:,.0f} output tokens/s")
    print(f"  TTFT  {ms(r['ttft_seconds'])}\n  TPOT  {ms(r['tpot_seconds'])}\n  ITL   {ms(r['itl_seconds'])}")
    print(f"  mean normalized latency {r['mean_normalized_latency']:.4f} s/token")
    server = r.get("server_mean_seconds")
    if server and server["time_to_first_token_seconds"] is not None:
        inside, client = server["time_to_first_token_seconds"], r["ttft_seconds"]["mean"]
        print(f"  in the engine (the server's /metrics, from a request's arrival at the engine's "
              f"process): mean TTFT {inside * 1e3:.1f} ms, mean end-to-end "
              f"{server['e2e_request_latency_seconds'] * 1e3:.1f} ms; HTTP's own share of the "
              f"client's mean TTFT: {(client - inside) * 1e3:.1f} ms (the client's send, the "
              f"server's handler, the pipes both ways)")
    if r["busiest_client_cpu_share"] > BUSY_CLIENT:
        print(f"  The busiest client process used {r['busiest_client_cpu_share']:.0%} of a core: "
              f"its own delays count in these times. More --clients spread the load.")


def main(argv=None) -> None:
    with one_paragraph_errors("serve_bench.py"):
        a = parse_arguments(argv)
        require_packages(["openai"] + (["aiohttp"] if a.http_client == "aiohttp" else [])
                         + (["uvloop"] if a.loop == "uvloop" else []), "the client it measures with")
        prompts, budgets, arrivals = workload(a)
        before = server_latency_sums(a.base_url)
        results, wall, client_cpu = send_load(a, prompts, budgets, arrivals)
        record = report(results, wall) | {"clients": a.clients, "http_client": a.http_client,
                                          "loop": a.loop,
                                          "busiest_client_cpu_share": client_cpu / wall}
        record["server_mean_seconds"] = server_means(before, server_latency_sums(a.base_url))
        if a.json:
            write_json(a, record)
        print_report(record)


if __name__ == "__main__":
    main()

"""serve.py as a process: its port, its engine's process, its stop, and what it logs. Servers
of their own, started and stopped by each test (tests/test_serve.py holds the answers to the
offline engine's over one shared server); a file of its own, so that the suite's two workers
share these slow starts."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx  # the HTTP client the openai package brings
import pytest
from conftest import ROOT

from engine.llm import LLM, SamplingParams
from test_serve import (ENGINE, GREEDY, PROMPTS, alive, engine_pid, free_port, start_server,
                        wait_until)


@pytest.fixture(scope="module")
def offline():
    return LLM(model="tiny", random_weights=True, device="cpu", block_size=16, max_num_seqs=40)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
# slow: 8 s, a server started to be killed; the SIGTERM and dying-engine tests end servers too
@pytest.mark.slow
def test_a_killed_server_takes_its_engine_process_with_it():
    """SIGKILL leaves no time to clean up: the engine ends on its own when the pipe closes, and
    does not hold the GPU's memory as an orphan."""
    process, url = start_server()
    engine = engine_pid(process)
    process.kill()
    process.wait(timeout=30)
    assert wait_until(lambda: not alive(engine)), "the engine outlived its server"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_engine_that_dies_makes_the_server_say_so():
    """/health answers 503 and a request an OpenAI error with status 500, not a hang."""
    process, url = start_server()
    try:
        os.kill(engine_pid(process), signal.SIGKILL)
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503)
        response = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert response.status_code == 500 and "engine" in response.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_port_in_use_is_said_in_one_paragraph_before_the_engine_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run([sys.executable, str(ROOT / "serve.py"), *ENGINE, "--port",
                               str(taken.getsockname()[1])], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "another program holds it" in done.stderr and "Traceback" not in done.stderr
    assert "KV pool" not in done.stdout  # said before the engine loaded


def test_of_two_servers_started_together_on_one_port_the_second_exits_at_once():
    # Both used to bind (SO_REUSEADDR lets two sockets that do not listen share a port) and both
    # said "Serving"; only the first listened, and the second never served nor exited.
    port = free_port()
    command = [sys.executable, str(ROOT / "serve.py"), *ENGINE, "--port", str(port)]
    both = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    try:
        assert wait_until(lambda: any(p.poll() is not None for p in both), 60), "neither exited"
        [second] = [p for p in both if p.poll() is not None]  # the other one serves
        out, err = second.communicate()
        assert second.returncode == 2 and "another program holds it" in err, out + err
        assert "Serving" not in out
        # The first serves: a client that connected while it loaded waits, then is answered
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=120).status_code == 200
    finally:
        for process in both:
            process.kill()
            process.wait(timeout=30)


def test_sigterm_drains_what_runs_refuses_what_comes_and_exits_0():
    # As uvicorn drains: a service manager's stop (SIGTERM, sent to every process of the service:
    # the engine's process leaves the stopping to the server) lets the answer in flight finish,
    # takes no new connection, says so, and ends with exit 0 (it was 143, the answer cut).
    import signal
    process, url = start_server()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line)
            process.send_signal(signal.SIGTERM)
            refused = False
            for _ in range(50):  # the listening socket closes at once
                try:
                    httpx.get(url + "/health", timeout=1)
                except httpx.TransportError:
                    refused = True
                    break
                time.sleep(0.1)
            rest = [line for line in lines if line]
        assert refused, "a new connection was taken while draining"
        chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
        output = process.stdout.read()
        assert "SIGTERM: no new requests" in output and "Traceback" not in output
    finally:
        process.kill()
        process.wait()


def test_ctrl_c_ends_each_stream_still_open_with_abort_and_done_and_exits_130(offline):
    # They used to end without [DONE], a finish_reason or an error: a client could not tell
    # the answer was cut. Now, the drain's time up, each ends as vLLM ends an aborted request
    # (SIGTERM runs the same path, and exits 0: test_sigterm_drains_what_runs_...). The same
    # server takes a request with a field of no request model, as vLLM does: served without it,
    # named in one log line; OpenAI's `store` and its kin mean nothing here.
    process, url = start_server("--timeout-graceful-shutdown", "2")
    unknown = {"prompt": PROMPTS[0], **GREEDY, "no_such_field": 1, "store": True,
               "metadata": {"a": "b"}, "service_tier": "auto"}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True,
            "stream": True, "n": 2}
    try:
        served = httpx.post(url + "/v1/completions", json=unknown, timeout=60)
        assert served.status_code == 200, served.text
        expected = offline.generate(PROMPTS[:1], SamplingParams(**GREEDY), use_tqdm=False)
        assert served.json()["choices"][0]["text"] == expected[0].outputs[0].text
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line)
            process.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
        ends = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]}
        assert ends == {0: "abort", 1: "abort"}
        assert process.wait(timeout=60) == 130
        output = process.stdout.read()
        assert "SIGINT: no new requests" in output and '"abort"' in output
        assert "Traceback" not in output
        logged = [line for line in output.splitlines() if "ignored" in line]
        assert logged == ["The following fields were present in the request but ignored: "
                          "['no_such_field']"]
    finally:
        process.kill()
        process.wait()

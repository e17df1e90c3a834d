"""serve.py through a real client (the openai package), held to the offline LLM.generate: the tiny
random model in float32 on the CPU, a server on 127.0.0.1 and a free port, stopped by the test."""

import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package brings
import pytest
from conftest import ROOT, forward_modes

from engine.llm import LLM, SamplingParams
from plumbing.inputs import PROMPTS_FILE, read_records

ENGINE = ["--model", "tiny", "--random-weights", "--device", "cpu", "--block-size", "16"]
KEY = "test-key"
PROMPTS = [r["conversations"][0]["value"][:200] for r in read_records(PROMPTS_FILE)[:32]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags, engine=ENGINE) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), *engine, "--port", str(port),
                               *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            raise AssertionError(server.stdout.read())
        time.sleep(0.1)
    server.kill()
    raise AssertionError("the server did not start in 60 s")


@pytest.fixture(scope="module")
def server():
    process, url = start_server("--api-key", KEY, "--max-num-seqs", "40")
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def offline():
    return LLM(model="tiny", random_weights=True, device="cpu", block_size=16, max_num_seqs=40)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {line.split("{")[0].split(":")[1]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith("llama3:")}


GREEDY = dict(max_tokens=12, temperature=0)


def test_completions_streamed_or_not_give_the_offline_text(client, offline):
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS[:4], SamplingParams(**GREEDY))]
    for prompt, text in zip(PROMPTS[:4], expected):
        whole = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 12
        stream = client.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
        assert "".join(chunk.choices[0].text for chunk in stream) == text


def test_fp8_weights_and_kv_serve_the_offline_engines_text():
    # --quantization fp8 and --kv-cache-dtype fp8 are the engine's flags: the served answers are
    # those of LLM(...) with the same two, streamed or not
    flags = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    process, url = start_server(engine=[*ENGINE, *flags])
    try:
        from openai import OpenAI
        client = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        offline = LLM(model="tiny", random_weights=True, device="cpu", block_size=16,
                      quantization="fp8", kv_cache_dtype="fp8")
        expected = [o.outputs[0].text for o in offline.generate(PROMPTS[:2],
                                                                SamplingParams(**GREEDY))]
        for prompt, text in zip(PROMPTS[:2], expected):
            assert client.completions.create(model="tiny", prompt=prompt,
                                             **GREEDY).choices[0].text == text
            stream = client.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
            assert "".join(chunk.choices[0].text for chunk in stream) == text
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_chat_completions_and_token_id_prompts_give_the_offline_text(client, offline):
    conversation = [{"role": "user", "content": PROMPTS[5]}]
    [expected] = offline.chat([conversation], SamplingParams(**GREEDY))
    whole = client.chat.completions.create(model="tiny", messages=conversation, **GREEDY)
    assert whole.choices[0].message.content == expected.outputs[0].text
    stream = client.chat.completions.create(model="tiny", messages=conversation, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    ids = client.completions.create(model="tiny", prompt=expected.prompt_token_ids, **GREEDY)
    assert ids.choices[0].text == expected.outputs[0].text


def test_add_special_tokens_false_leaves_the_begin_of_text_out_as_vllm(client, offline):
    prompt = offline.tokenizer.encode_prompt(PROMPTS[3])  # begin-of-text first
    [expected] = offline.generate([prompt[1:]], SamplingParams(**GREEDY), use_tqdm=False)
    served = client.completions.create(model="tiny", prompt=PROMPTS[3], **GREEDY,
                                       extra_body={"add_special_tokens": False})
    assert served.usage.prompt_tokens == len(prompt) - 1
    assert served.choices[0].text == expected.outputs[0].text


def test_continuous_usage_stats_gives_the_usage_so_far_in_every_chunk(client, offline):
    # vLLM's stream_options.continuous_usage_stats: each chunk's completion_tokens counts the
    # tokens sent so far; the last equals the offline answer's
    conversation = [{"role": "user", "content": PROMPTS[6]}]
    [expected] = offline.chat([conversation], SamplingParams(**GREEDY), use_tqdm=False)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=conversation, stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 12
    assert all(c.usage.prompt_tokens == len(expected.prompt_token_ids) for c in chunks)
    plain = list(client.chat.completions.create(model="tiny", messages=conversation, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
    assert all(c.usage is None for c in plain if c.choices)


def test_32_concurrent_streams_each_get_their_own_tokens(client, offline):
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(**GREEDY))]
    got = [None] * len(PROMPTS)

    def ask(i):
        stream = client.completions.create(model="tiny", prompt=PROMPTS[i], stream=True, **GREEDY)
        got[i] = "".join(chunk.choices[0].text for chunk in stream)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected


def test_seeded_samples_are_reproducible_and_n_gives_n_choices(client):
    params = dict(prompt=PROMPTS[0], max_tokens=8, temperature=0.9, top_p=0.9, seed=7, n=3)
    first = client.completions.create(model="tiny", **params)
    again = client.completions.create(model="tiny", **params)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1, "three samples, not one copied"


def test_n_samples_share_their_prompts_blocks_and_draw_the_unshared_samples_tokens():
    """The samples after the first fork: they take the prompt's blocks
    (features/sharing/block_manager.py). Top-k keeps each draw far from a boundary that rounding
    could move (random weights' full distributions are flat), so the tokens are those of the same
    samples without sharing."""
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=5, seed=11, n=4, ignore_eos=True)
    engine = dict(model="tiny", random_weights=True, device="cpu", block_size=16, max_num_seqs=8)
    shared, unshared = LLM(**engine), LLM(**engine, no_sharing=True)
    tokens = lambda llm: [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], params)]
    answers = tokens(shared)
    assert answers == tokens(unshared)
    assert shared.llm_engine.manager.num_shared > 0, "the forks took the prompt's blocks"
    assert len({tuple(t) for t in answers[0]}) > 1, "four samples, not one copied"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_warm_up_leaves_no_trace(kv_cache_dtype):
    """serve.py's engine runs a few requests before it serves (compiled layers compile on them,
    on a GPU): afterwards every row and block is free, the counters are zero, an FP8 cache's
    scales are unset, and answers are those of an engine that never warmed up."""
    from engine.llm_engine import LLMEngine
    params = SamplingParams(max_tokens=12, temperature=0)

    def answer(warm: bool) -> list:
        engine = LLMEngine("paged", 8, model="tiny", random_weights=True, device="cpu",
                           block_size=16, kv_cache_dtype=kv_cache_dtype)
        if warm:
            engine.warm_up()
            assert not engine.has_unfinished() and len(engine.free_rows) == 8
            assert engine.manager.num_used_blocks == 0 and engine.num_generated_tokens == 0
            assert kv_cache_dtype != "fp8" or not any(engine.cache.scaled)
        engine.add_request(engine.tokenizer.encode(PROMPTS[3]), params)
        finished = []
        while engine.has_unfinished():
            finished += [s.request.output_tokens for s in engine.step() if s.finish_reason]
        return finished
    assert answer(warm=True) == answer(warm=False)


def test_the_warm_up_fits_a_small_pool():
    # Its prompts take at most half the pool: a 32-token warm-up once ended an engine of 2 blocks
    # of 16 at start-up (ValueError: more KV blocks than the whole pool has).
    from engine.llm_engine import LLMEngine
    engine = LLMEngine("paged", 4, model="tiny", random_weights=True, device="cpu", block_size=16,
                       num_blocks=2)
    engine.warm_up()
    assert engine.manager.num_used_blocks == 0 and not engine.has_unfinished()
    engine = LLMEngine("paged", 4, model="tiny", random_weights=True, device="cpu", block_size=16,
                       num_blocks=8)
    engine.warm_up()  # room for it: it ran, and left nothing behind
    assert engine.num_generated_tokens == 0 and len(engine.free_rows) == 4


def test_the_engine_takes_a_max_seq_len_shorter_than_the_prompts_files_prompts():
    # The API's requests come through add_request: the scripts' prompts file is not read, and
    # its first prompt (44 tokens) once refused --max-seq-len 24 before anything was served.
    llm = LLM(model="tiny", random_weights=True, device="cpu", max_seq_len=24)
    answer = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(answer[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match=r"the context is 24 tokens \(--max-seq-len\)"):
        llm.generate([[5] * 24], SamplingParams(max_tokens=1))


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        m = metrics(server)  # one snapshot: vLLM's usage is the used blocks' share
        assert m["kv_blocks_used"] > 0 and m["kv_cache_usage_perc"] == pytest.approx(
            m["kv_blocks_used"] / (m["kv_blocks_used"] + m["kv_blocks_free"]))
    for _ in range(100):  # the engine frees them at its next step
        m = metrics(server)
        if m["kv_blocks_used"] == 0 and m["num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m["kv_blocks_used"] == 0 and m["kv_reserved_bytes"] == 0 and m["num_requests_running"] == 0


BAD = [
    ("{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"prompt": 42}), "'prompt'"),
    (json.dumps({"prompt": ""}), "'prompt'"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}), "'max_tokens'"),
    (json.dumps({"prompt": "hi", "max_tokens": "ten"}), "'max_tokens'"),
    (json.dumps({"prompt": "hi", "temperature": -1}), "'temperature'"),
    (json.dumps({"prompt": "hi", "n": 1000}), "'n'"),
    (json.dumps({"prompt": "hi", "stream": "yes"}), "'stream'"),
    (json.dumps({"prompt": [1, 2, 10**9]}), "vocabulary"),
    (json.dumps({"prompt": "word " * 9000}), "--max-seq-len"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # nested past Python's recursion limit
    (json.dumps({"prompt": "x" * 1_200_000}), "larger than"),
    (json.dumps({"prompt": "hi", "logprobs": 21}), "'logprobs' must be a whole number from 0 to 20"),
    (json.dumps({"prompt": "hi", "max_tokens": 2, "top_k": 10**20}), "'top_k'"),  # past a long
    (json.dumps({"prompt": "hi", "presence_penalty": 2.5}), "'presence_penalty' must be"),
    (json.dumps({"prompt": "hi", "logit_bias": {"x": -100}}), "'logit_bias' must be"),
    (json.dumps({"prompt": "hi", "logit_bias": {"999999999": 1}}), "logit_bias token id"),
    (json.dumps({"prompt": "hi", "logit_bias": {"\u0661\u0662": 1}}), "'logit_bias' must be"),
    (json.dumps({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}), "min_tokens"),
    (json.dumps({"prompt": "hi", "stop": ""}), "'stop'"),
    (json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}), "'stream_options'"),
    (json.dumps({"prompt": "hi", "max_tokens": 10**30}), "max_tokens is too large: 1,000,"),
    (json.dumps({"prompt": "hi", "stop": ["a", ""]}), "'stop'"),
    # JSON's escapes spell a lone UTF-16 surrogate, which is no text: refused wherever it is
    ('{"prompt": "\\ud800"}', "'prompt' holds a lone UTF-16 surrogate"),
    ('{"prompt": "hi", "user": "a\\udfffb"}', "'user' holds a lone UTF-16 surrogate"),
    ('{"prompt": "hi", "stop": ["x", "\\ud83d"]}', "'stop[1]' holds a lone UTF-16 surrogate"),
]


@pytest.mark.parametrize("body, says", BAD)
def test_each_bad_request_gets_a_400_and_the_server_serves_on(server, client, body, says):
    response = httpx.post(server + "/v1/completions", content=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == (413 if says == "larger than" else 400), response.text
    assert says in response.json()["error"]["message"]
    if says.startswith("'") and says.endswith("'"):  # a field's value: the error names it
        assert response.json()["error"]["param"] == says[1:-1]
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text


def test_a_lone_surrogate_in_any_field_of_any_endpoint_is_a_400_and_the_engine_serves_on(server,
                                                                                            client):
    # /tokenize's text reached the tokenizer, whose TypeError ended the engine's process
    for path, body, param in [
            ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
            ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
            ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "x"}, '
             '{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages"),
            ("/v1/completions", '{"prompt": "hi", "request_id": "\\ud800"}', "request_id")]:
        response = httpx.post(server + path, content=body, timeout=30, headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == param
        assert "lone UTF-16 surrogate" in response.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text


def test_health_answers_head_as_a_load_balancer_asks_it(server):
    assert httpx.head(server + "/health").status_code == 200


def test_a_bad_engine_flag_of_the_server_is_said_as_the_servers_before_loading():
    done = subprocess.run([sys.executable, str(ROOT / "serve.py"), "5", *ENGINE], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "serve.py: error: unrecognized arguments: 5" in done.stderr
    assert "llama3_paged.py" not in done.stderr


def test_the_apis_model_must_be_a_name_or_a_path():
    with pytest.raises(TypeError, match="LLM\\(model=...\\) is a preset's name"):
        LLM(model=None)


def test_tokenizer_info_carries_the_chat_template_that_renders_the_servers_chats(server):
    # lm-eval's --apply_chat_template with tokenizer_backend=remote renders chats with it
    import jinja2
    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(server + "/tokenizer_info", headers=headers).json()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    rendered = jinja2.Template(info["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=info["bos_token"])
    ids = httpx.post(server + "/tokenize", json={"messages": messages},
                     headers=headers).json()["tokens"]
    served = httpx.post(server + "/detokenize", json={"tokens": ids}, headers=headers).json()
    assert served["prompt"] == rendered


def test_empty_messages_get_a_400(server):
    response = httpx.post(server + "/v1/chat/completions", json={"messages": []},
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and "'messages'" in response.json()["error"]["message"]


def test_models_and_unknown_paths_answer_in_openais_shape(server, client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.created > 0
    assert client.models.list().data[0].created == card.created
    lower = httpx.get(server + "/v1/models", headers={"Authorization": f"bearer {KEY}"})
    assert lower.status_code == 200, "HTTP's auth scheme is case-insensitive"
    for method, path, status in [("GET", "/v1/models/gpt-4", 404), ("GET", "/v1/nothing", 404),
                                 ("GET", "/v1/completions", 405)]:
        response = httpx.request(method, server + path, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == status, (path, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, path


def test_vllms_shape_chat_ids_an_unknown_model_and_its_metric_names(server, client):
    # What a vLLM client or dashboard reads: chatcmpl- ids for chat (cmpl- for completions), 404
    # with vLLM's error body for a model this server does not serve, vLLM's metric names.
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2)
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert chat.id.startswith("chatcmpl-") and completion.id.startswith("cmpl-")
    for path, body in [("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "gpt-4", "messages": []})]:
        response = httpx.post(server + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 404 and response.json() == {"error": {
            "message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
            "param": "model", "code": 404}}
    text = httpx.get(server + "/metrics").text
    for name in ("num_requests_running", "kv_cache_usage_perc", "generation_tokens_total",
                 "time_to_first_token_seconds_count"):
        ours, theirs = (next(line.split()[-1] for line in text.splitlines()
                             if line.startswith(f"{prefix}:{name}{{")) for prefix in ("llama3", "vllm"))
        assert ours == theirs, name
    assert "vllm:kv_reserved_bytes" not in text  # a lesson figure vLLM has no equal of
    gaps = lambda: metrics(server)["inter_token_latency_seconds_count"]
    before = gaps()
    client.completions.create(model="tiny", prompt="hi", max_tokens=5, extra_body={"ignore_eos": True})
    assert gaps() == before + 4, "five tokens, four waits between them"
    assert httpx.get(server + "/version").json() == {"version": "0.70.0"}


def test_a_wrong_api_key_gets_401(server):
    from openai import AuthenticationError, OpenAI
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/health").status_code == 200  # health and metrics need no key


@pytest.mark.slow  # it waits past the clients' 5 s
def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    # serve.py's KEEP_ALIVE_SECONDS: the openai package's pool drops an idle connection after
    # 5 s, so the server must not close one first, or a request sent then meets its close.
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        connection.sendall(request)
        assert whole_response(connection).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        connection.sendall(request)  # on the same connection: still open
        assert whole_response(connection).startswith(b"HTTP/1.1 200")


def whole_response(connection) -> bytes:
    """One HTTP response read to its last byte: its head, then Content-Length bytes of body, which
    can come in a read of their own (one recv alone leaves them for the next response's read)."""
    def more() -> bytes:
        received = connection.recv(4096)
        assert received, "the server closed the connection"
        return received
    data = more()
    while b"\r\n\r\n" not in data:
        data += more()
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += more()
    return head + b"\r\n\r\n" + body


def test_a_full_server_answers_503_with_retry_after():
    process, url = start_server("--max-num-seqs", "2")
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as first, \
                httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as second:
            streams = [first.iter_lines(), second.iter_lines()]  # kept: a dropped one hangs up
            next(streams[0]), next(streams[1])
            third = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert third.status_code == 503 and third.headers["Retry-After"] == "1"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_stop_string_ends_the_text_just_before_it(client, offline):
    [free] = offline.generate(PROMPTS[7], SamplingParams(max_tokens=24, temperature=0))
    text = free.outputs[0].text
    stop = text[12:15]  # cut out of the answer given without a stop string
    whole = client.completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=24, temperature=0,
                                      stop=[stop])
    assert whole.choices[0].text == text[:text.index(stop)]
    assert whole.choices[0].finish_reason == "stop"


# slow: three clients, the path one takes, on connections of their own
@pytest.mark.parametrize("clients", ["1", pytest.param("3", marks=pytest.mark.slow)])
def test_serve_bench_replays_the_workload_through_http(server, tmp_path, clients):
    """From one process or several (each every third request), the same requests: the server
    counts the workload's prompt tokens, sent as ids."""
    from plumbing.inputs import load_prompts, load_tokenizer
    sent = sum(len(p.prompt_tokens) for p in load_prompts(6, load_tokenizer()))
    before = metrics(server)["prompt_tokens_total"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "serve_bench.py"), "--base-url",
                          server + "/v1", "--api-key", KEY, "--num-prompts", "6", "--request-rate",
                          "20", "--max-tokens", "5", "--json", str(tmp_path / "b.json"),
                          "--clients", clients],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["requests"] == 6 and record["output_tokens"] == 6 * 5  # every reply is longer
    assert record["clients"] == int(clients)
    assert metrics(server)["prompt_tokens_total"] - before == sent
    assert 0 < record["ttft_seconds"]["median"] <= record["ttft_seconds"]["p99"]
    assert "TTFT" in out.stdout
    # the server's own means, from its /metrics: inside the client's, which add the HTTP path
    assert 0 < record["busiest_client_cpu_share"] < 2  # CPU seconds over wall seconds
    inside = record["server_mean_seconds"]
    assert 0 < inside["time_to_first_token_seconds"] < record["ttft_seconds"]["mean"]
    assert inside["time_to_first_token_seconds"] < inside["e2e_request_latency_seconds"]


@pytest.mark.parametrize("rate, cores, expected", [(8, 16, 2), (9, 16, 3), (64, 16, 14),
                                                   (64, 2, 1), (math.inf, 16, 14), (1, 1, 1)])
def test_serve_bench_sends_from_a_process_per_4_requests_a_second_on_the_cores_left(rate, cores,
                                                                                  expected):
    from tools.serve_bench import auto_clients
    assert auto_clients(rate, cores) == expected


def engine_pid(server: subprocess.Popen) -> int:
    """The engine's process: serve.py's child that runs spawn_main (engine/engine_process.py;
    the other child is multiprocessing's resource tracker)."""
    from pathlib import Path
    children = [int(pid) for task in Path(f"/proc/{server.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    engines = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return state != "Z"  # a zombie has ended; only its exit code waits to be read


def wait_until(condition, seconds: float = 20) -> bool:
    for _ in range(int(seconds * 10)):
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_streamed_answer_never_shows_the_start_of_its_stop_string(client, offline):
    """A stop string that begins in one token's text and ends in the next: the first token's
    text must not be streamed before the second shows it is the stop string's start (vLLM holds
    back the last len(stop) - 1 characters while a request runs)."""
    [free] = offline.generate(PROMPTS[7], SamplingParams(max_tokens=24, temperature=0))
    tokens, tokenizer = free.outputs[0].token_ids, offline.tokenizer
    ends = [len(tokenizer.decode(tokens[:i + 1])) for i in range(len(tokens))]  # after token i
    text = free.outputs[0].text
    cut = next(e for e, after in zip(ends[3:], ends[4:])
               if after > e and text.index(text[e - 1:e + 1]) == e - 1)  # first such boundary
    stop = text[cut - 1:cut + 1]  # the last character of one token, the first of the next
    stream = client.completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=24,
                                       temperature=0, stop=[stop], stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == text[:cut - 1]


def histograms(url: str) -> dict:
    """/metrics' histograms: name -> {"buckets": [(le, count), ...], "sum": s, "count": n}."""
    found = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        name = line.partition("{")[0]
        if not line.startswith("llama3:") or not name.endswith(("_bucket", "_sum", "_count")):
            continue
        value = float(line.split()[-1])
        base, part = name.rsplit("_", 1)
        entry = found.setdefault(base.split(":")[1], {"buckets": []})
        if part == "bucket":
            entry["buckets"].append((line.split('le="')[1].split('"')[0], value))
        else:
            entry[part] = value
    return found


def test_metrics_time_each_request_to_its_first_and_last_token(server, client):
    """Prometheus histograms, as vLLM serves them: each finished request counted once in
    each, cumulative buckets, and no first token later than the last."""
    before = histograms(server)
    for prompt in PROMPTS[:3]:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    after = histograms(server)
    first, last = (after[name] for name in ("time_to_first_token_seconds",
                                            "e2e_request_latency_seconds"))
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[name]["count"] - before.get(name, {"count": 0})["count"] == 3
        counts = [count for _, count in after[name]["buckets"]]
        assert counts == sorted(counts) and after[name]["buckets"][-1] == ("+Inf", after[name]["count"])
    added = lambda h, name: h[name]["sum"] - before.get(name, {"sum": 0})["sum"]
    assert 0 < added(after, "time_to_first_token_seconds") < added(after, "e2e_request_latency_seconds")


def test_a_served_requests_latency_counts_from_its_arrival_at_the_engines_process(offline):
    """A request that waited in the engine's inbox for the engine's next turn (here half a
    second) counts that wait, as an in-process request counts its wait from its arrival: so
    that a client's time to first token less the server's is HTTP's alone."""
    import queue
    from engine.engine_process import take_commands
    engine, inbox, answers = offline.llm_engine, queue.Queue(), []
    command = ("add", "waited", {"ids": [1, 2, 3]}, {"max_tokens": 2, "temperature": 0})
    inbox.put((command, time.perf_counter() - 0.5))
    assert take_commands(engine, inbox, type("Results", (), {"send": answers.append}), block=False,
                         echoes=set())
    assert answers == [("added", "waited", [1, 2, 3], None, None)]
    request = next(s.request for s in engine.sequences.values() if s.request_id == "waited")
    assert 0.5 <= engine.scheduler.now() - request.arrival_time < 5
    engine.abort("waited")
    assert not engine.has_unfinished()


@pytest.mark.parametrize("fields, name", [
    ({"top_k": 10**20}, "top_k"), ({"temperature": "0.5"}, "temperature"), ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"), ({"seed": 1.5}, "seed"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"n": 0}, "n"), ({"top_p": float("nan")}, "top_p"), ({"max_tokens": "abc"}, "max_tokens"),
    ({"stop": ""}, "stop"),  # no stop string: refused as the server refuses it, not taken as none
])
def test_sampling_params_are_checked_as_made_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=f"SamplingParams {name} ="):
        SamplingParams(**fields)
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize("fields", [
    {"allowed_token_ids": [1, 2]}, {"bad_words": ["x"]},
    {"spaces_between_special_tokens": False}], ids=lambda fields: next(iter(fields)))
def test_vllms_sampling_fields_not_implemented_are_refused_by_name(fields):
    # vLLM's SamplingParams takes them; here they were a TypeError. At their defaults they ask
    # for nothing and pass; any other value is refused, not silently ignored.
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"SamplingParams {name} = .*not implemented"):
        SamplingParams(**fields)
    SamplingParams(**{name: getattr(SamplingParams(), name)})  # its default raises nothing


def test_max_tokens_past_the_context_is_refused_by_the_api_as_by_the_server():
    # One rule for both (vLLM's server's): the API once cut max_tokens=10**12 to the context
    # and ran minutes, while the server answered 400 naming an internal request number.
    llm = LLM(model="tiny", random_weights=True, device="cpu", max_seq_len=64)
    with pytest.raises(ValueError, match=r"max_tokens is too large: 1,000,000,000,000\. The "
                                         r"context is 64 tokens") as refused:
        llm.generate("hi", SamplingParams(max_tokens=10**12), use_tqdm=False)
    assert "request" not in str(refused.value) and not llm.llm_engine.has_unfinished()
    whole = llm.generate("hi", SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0]  # None: the context left, as vLLM's None
    assert len(whole.prompt_token_ids) + len(whole.outputs[0].token_ids) == 64


def test_the_context_is_fitted_to_the_pool_and_the_default_answer_fills_what_is_left(capsys):
    # vLLM sizes its context to the KV cache at start-up: here --max-seq-len 8,192 (the default)
    # over 8 blocks of 16. A request caches every token but its last, so the pool holds one
    # request of 8 x 16 + 1 tokens; a chat without max_tokens once got 400 for the default.
    llm = LLM(model="tiny", random_weights=True, device="cpu", block_size=16, num_blocks=8)
    assert "serving a context of 129 tokens" in capsys.readouterr().out
    answer = llm.generate("hi", SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(answer.prompt_token_ids) + len(answer.outputs[0].token_ids) == 8 * 16 + 1
    assert answer.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"context is 129 tokens \(what the KV pool holds"):
        llm.generate("hi", SamplingParams(max_tokens=200), use_tqdm=False)
    assert llm.llm_engine.manager.num_used_blocks == 0  # the whole pool was the answer's, and is back


def test_what_generate_cannot_read_is_refused_by_name(offline):
    for prompts in (None, 5):
        with pytest.raises(ValueError, match="prompts is a text"):
            offline.generate(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params is a SamplingParams"):
        offline.generate(["hi"], {"max_tokens": 2}, use_tqdm=False)
    done = offline.generate("hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(done[0].outputs[0].token_ids) == 2 and not offline.llm_engine.has_unfinished()


def test_a_request_the_engine_fails_at_fails_alone_and_leaves_no_trace(offline, monkeypatch):
    """One request must not stop the engine: whatever its content makes the engine raise as it
    is added (here the sampler, at its second sample), that request alone is answered as
    failed, its rows are free again, and the request after it runs."""
    import queue
    from engine.engine_process import take_commands
    engine, inbox, answers = offline.llm_engine, queue.Queue(), []
    free_rows, set_row = len(engine.free_rows), engine.sampler.set_row

    def fails_at_seed_13(row, params, sample, *rest):
        if params.seed == 13 and sample == 1:
            raise RuntimeError("a bug that this request's content reaches")
        set_row(row, params, sample, *rest)
    monkeypatch.setattr(engine.sampler, "set_row", fails_at_seed_13)
    for name, seed in [("failing", 13), ("next", 14)]:
        command = ("add", name, {"ids": [1, 2, 3]}, {"max_tokens": 2, "n": 2, "seed": seed})
        inbox.put((command, time.perf_counter()))
    take_commands(engine, inbox, type("Results", (), {"send": answers.append}), block=False,
                  echoes=set())
    assert answers[0][:4] == ("added", "failing", None, "failed") and "a bug" in answers[0][4]
    assert answers[1] == ("added", "next", [1, 2, 3], None, None)
    assert len(engine.free_rows) == free_rows - 2, "the failing request's rows came back"
    while engine.has_unfinished():
        engine.step()
    assert len(engine.free_rows) == free_rows


def test_the_served_engine_runs_the_model_in_inference_mode(offline, monkeypatch):
    """As the scripts' Engine.generate and the CUDA graphs' capture: in another mode, compiled
    layers would compile again for it."""
    modes = forward_modes(offline.llm_engine.run.model, monkeypatch)
    offline.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert modes and all(modes)

def test_one_sampling_params_per_prompt_gives_each_prompt_its_own_answer(offline):
    """LLM.generate(prompts, [params, ...]) as vLLM takes it: each prompt's output is the one it
    gets alone with its own parameters, though they run in one batch."""
    each = [SamplingParams(max_tokens=4, temperature=0),
            SamplingParams(max_tokens=9, temperature=0.8, top_k=5, seed=1, n=2),
            SamplingParams(max_tokens=6, temperature=0, stop=["e"])]
    answers = lambda results: [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
                               for o in results]
    together = answers(offline.generate(PROMPTS[:3], each))
    alone = [answers(offline.generate(p, params))[0] for p, params in zip(PROMPTS, each)]
    assert together == alone
    assert [len(o[0][0]) for o in alone[:2]] == [4, 9] and len(alone[1]) == 2
    with pytest.raises(ValueError, match="one for all, or one each"):
        offline.generate(PROMPTS[:3], each[:2])


@pytest.mark.parametrize("options, says", [
    ({"temperature": 0.7}, "(--temperature: its temperature)"),
    ({"system_prompt": "Be brief.", "samples": 2}, "--samples: its n"),
    ({"find_max_batch": True}, "--find-max-batch: a served engine"),
])
def test_a_flag_that_chooses_what_a_request_asks_is_refused_not_ignored(options, says):
    from plumbing.cli import UserError
    with pytest.raises(UserError) as refused:
        LLM(model="tiny", random_weights=True, device="cpu", **options)
    assert says in str(refused.value) and "Drop" in str(refused.value)


def test_serve_refuses_a_scripts_sampling_flag_in_one_paragraph_before_loading():
    done = subprocess.run([sys.executable, str(ROOT / "serve.py"), *ENGINE, "--port",
                           str(free_port()), "--temperature", "0.8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--temperature: a served engine" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("script, flags, package", [
    ("serve.py", [*ENGINE, "--port", "1"], "uvicorn"),
    ("tools/serve_bench.py", ["--base-url", "http://127.0.0.1:1/v1"], "openai"),
])
def test_a_missing_package_is_named_in_one_paragraph_before_anything_starts(script, flags, package):
    hide = f"import sys, runpy; sys.modules[{package!r}] = None; sys.argv = sys.argv[1:]; " \
           f"runpy.run_path(sys.argv[0], run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", hide, str(ROOT / script), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"lacks {package}" in done.stderr and f"pip install {package}" in done.stderr
    assert "Traceback" not in done.stderr and "KV pool" not in done.stdout  # nothing loaded


def test_generate_shows_a_bar_of_prompts_done_unless_told_not_to(offline, capsys):
    greedy = SamplingParams(max_tokens=4, temperature=0)
    with_bar = offline.generate(PROMPTS[:3], greedy)
    assert "Processed prompts" in capsys.readouterr().err  # vLLM's words, its total: 3
    without = offline.generate(PROMPTS[:3], greedy, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in with_bar] == [o.outputs[0].token_ids for o in without]


def test_a_model_name_cannot_break_the_metrics_text():
    # prometheus_client's own parser reads back the one model name, whatever it holds
    from prometheus_client.parser import text_string_to_metric_families
    from engine.metrics import ServerMetrics
    name = 'a"b\\c\nllama3:fake 1'
    metrics = ServerMetrics(name)
    metrics.update({"num_requests_running": 2, "prompt_tokens": 7,
                    "observed": {"time_to_first_token_seconds": [0.03, 0.5]}})
    families = {f.name: f for f in text_string_to_metric_families(
        metrics.exposition().decode())}
    assert "llama3:fake" not in families
    for prefix in ("llama3", "vllm"):
        [running] = families[f"{prefix}:num_requests_running"].samples
        assert running.labels == {"model_name": name} and running.value == 2
        [total] = families[f"{prefix}:prompt_tokens"].samples
        assert total.name == f"{prefix}:prompt_tokens_total" and total.value == 7
        buckets = {s.labels["le"]: s.value for s in
                   families[f"{prefix}:time_to_first_token_seconds"].samples
                   if s.name.endswith("_bucket")}
        assert buckets["0.02"] == 0 and buckets["0.04"] == 1 and buckets["+Inf"] == 2


def test_the_virtual_cache_without_cuda_is_refused_in_one_paragraph_before_loading():
    from plumbing.cli import UserError
    with pytest.raises(UserError, match="needs --device cuda, flash-attn"):
        LLM(model="tiny", cache="virtual", random_weights=True, device="cpu")
    done = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--model", "tiny",
                           "--random-weights", "--device", "cpu", "--port", str(free_port()),
                           "--cache", "virtual"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs --device cuda, flash-attn" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("options, says", [
    ({"blok_size": 16}, "blok_size= is no keyword of the engine"),
    ({"block_size": "big"}, "--block-size: expected a positive whole number"),
    ({"block_size": 0}, "--block-size: expected a positive whole number"),  # not the default
    ({"no_sharing": "yes"}, "--no-sharing: expected True or False"),
    ({"attn": "fast"}, "--attn: choose from auto, flash, triton, torch"),
    ({"num_requests": 3}, "num_requests= is no keyword"),  # the scripts' N: no flag
    ({"help": True}, "help= is no keyword"),
])
def test_a_bad_keyword_of_the_api_raises_with_the_flag_not_exits(options, says):
    from plumbing.cli import UserError
    with pytest.raises(UserError, match=says):  # not SystemExit: a notebook goes on
        LLM(model="tiny", random_weights=True, device="cpu", **options)


def test_get_tokenizer_is_transformers_tokenizer_of_the_engines_tokens_and_template(offline):
    # vLLM's LLM.get_tokenizer(): tok("Hello"), apply_chat_template, eos_token_id, len(), ...
    from transformers import PreTrainedTokenizerFast
    tokenizer, ours = offline.get_tokenizer(), offline.tokenizer
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and offline.get_tokenizer() is tokenizer
    for text in [*PROMPTS[:16], "a<|eot_id|>b", "  x\n\n1234 "]:
        assert tokenizer(text).input_ids == ours.encode_prompt(text), text
        assert tokenizer.decode(ours.encode_prompt(text)[1:]) == text  # after begin-of-text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                         tokenize=True)["input_ids"] == ours.chat(chat)
    assert tokenizer.eos_token_id in ours.stop_ids and len(tokenizer) == ours.n_vocab
    assert tokenizer.convert_ids_to_tokens(ours.encode(" world")) == ["Ġworld"]


def test_a_generate_that_raises_leaves_nothing_running_for_the_next(offline):
    """A bad prompt after good ones: the call raises, and its good ones do not linger in the
    engine to finish inside the next call (under its own request ids, offline-0, ...)."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = offline.generate(PROMPTS[3:4], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        offline.generate([PROMPTS[5], PROMPTS[6], [10**9]],
                         [SamplingParams(max_tokens=2), greedy, greedy], use_tqdm=False)
    assert not offline.llm_engine.has_unfinished()
    again = offline.generate(PROMPTS[3:4], greedy, use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_client_that_hangs_up_before_its_whole_answer_frees_its_blocks(server):
    """Not streamed: the server finds the hang-up while it waits for the answer, not when it
    would write it minutes later."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client gives up, closing its connection
        httpx.post(server + "/v1/completions", json=body, timeout=1.0,
                   headers={"Authorization": f"Bearer {KEY}"})
    for _ in range(50):  # the engine frees them at its next step
        m = metrics(server)
        if m["kv_blocks_used"] == 0 and m["num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m["kv_blocks_used"] == 0 and m["num_requests_running"] == 0


# slow: 8 s, a server of its own; test_the_context_is_fitted_to_the_pool_... checks the default
# answer's length in-process
@pytest.mark.slow
def test_without_max_tokens_a_chat_answer_may_fill_the_context_and_a_completion_takes_16():
    """vLLM's defaults: OpenAI's chat has no limit but the context; its legacy completions 16."""
    process, url = start_server("--max-seq-len", "64")
    try:
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}).json()
        completion = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "Hello", "ignore_eos": True}).json()
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert chat["usage"]["completion_tokens"] == 64 - chat["usage"]["prompt_tokens"]
    assert chat["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 16


def test_fields_that_ask_for_nothing_pass_as_vllms_benchmark_sends_them(client, offline):
    greedy = SamplingParams(max_tokens=8, temperature=0)
    answer = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                       temperature=0, logprobs=None, best_of=1,
                                       presence_penalty=0, frequency_penalty=0.0)
    assert answer.choices[0].text == offline.generate(PROMPTS[:1], greedy)[0].outputs[0].text


def test_an_empty_api_key_is_refused_not_taken_as_no_key(capsys):
    import serve  # `--api-key "$KEY"` with KEY unset would otherwise serve everyone
    with pytest.raises(SystemExit) as exited:
        serve.argument_parser().parse_known_args(["--api-key", ""])
    assert exited.value.code == 2 and "--api-key: empty" in capsys.readouterr().err


@pytest.mark.parametrize("host, open_to_others", [
    ("127.0.0.1", False), ("localhost", False), ("::1", False), ("127.0.1.1", False),
    ("0.0.0.0", True), ("::", True), ("192.168.1.20", True),
])
def test_a_server_beyond_this_machine_without_a_key_is_said(host, open_to_others):
    import serve
    assert serve.open_to_others(host) == open_to_others


# slow: a server of its own; the FP8 cache's tokens are tests/test_fp8.py's, the server's path
# the 16-bit one
@pytest.mark.slow
def test_an_fp8_server_says_its_bytes_per_token_and_gives_the_offline_fp8_text():
    # The first prefill sets each layer's scales, in the server as offline: the same prompt first.
    process, url = start_server("--kv-cache-dtype", "fp8_e4m3")
    try:
        said = next(line for line in process.stdout if "KV pool" in line)
        from openai import OpenAI
        served = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).completions.create(
            model="tiny", prompt=PROMPTS[5], max_tokens=12, temperature=0).choices[0].text
    finally:
        process.terminate()
        process.wait(timeout=30)
    offline = LLM(model="tiny", random_weights=True, device="cpu", block_size=16,
                  kv_cache_dtype="fp8")
    greedy = SamplingParams(max_tokens=12, temperature=0)
    assert served == offline.generate([PROMPTS[5]], greedy, use_tqdm=False)[0].outputs[0].text
    assert "x 512 bytes per token" in said  # tiny: 2 layers x K, V x 2 heads x 64, a byte each


def test_the_api_takes_vllms_prompt_and_conversation_shapes(offline):
    greedy = SamplingParams(**GREEDY)
    text = lambda outputs: [o.outputs[0].text for o in outputs]
    conversation = [{"role": "user", "content": PROMPTS[6]}]
    one = offline.chat(conversation, greedy, use_tqdm=False)  # one conversation, not a list
    assert text(one) == text(offline.chat([conversation], greedy, use_tqdm=False))
    ids = offline.tokenizer.encode_prompt(PROMPTS[7])
    plain = text(offline.generate([PROMPTS[7], ids], greedy, use_tqdm=False))
    assert plain[0] == plain[1]
    assert text(offline.generate([{"prompt": PROMPTS[7]}, {"prompt_token_ids": ids}], greedy,
                                 use_tqdm=False)) == plain
    assert text(offline.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)) == plain[:1]


@pytest.mark.parametrize("call, says", [
    (lambda llm: llm.chat([{"content": "hi"}]), "needs a 'role'"),
    (lambda llm: llm.chat("hi"), "non-empty list"),
    (lambda llm: llm.generate([[1.5, 2]]), "a prompt is a text"),
    (lambda llm: llm.generate([{"text": "hi"}]), "a prompt is a text"),
    (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=2.5)), "max_tokens = 2.5"),
    (lambda llm: llm.generate(["hi"], SamplingParams(n=True)), "n = True"),
    (lambda llm: llm.generate(["a\ud800"]),
     "prompts: the text holds a lone UTF-16 surrogate (U+D800 at character 1)"),
    (lambda llm: llm.chat([{"role": "user", "content": "\udfff"}]),
     "messages: the text holds a lone UTF-16 surrogate"),
])
def test_a_malformed_prompt_or_parameter_is_a_value_error_that_names_it(offline, call, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        call(offline)
    assert not offline.llm_engine.has_unfinished()


def test_content_as_text_parts_is_read_as_vllm_reads_it_and_other_parts_get_a_400(server, client,
                                                                                  offline):
    # OpenAI's clients may send a message's content as parts; vLLM joins text parts by newlines.
    parts = [{"type": "text", "text": PROMPTS[8]}, {"type": "text", "text": "Briefly."}]
    joined = [{"role": "user", "content": PROMPTS[8] + "\n" + "Briefly."}]
    served = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                     "content": parts}], **GREEDY)
    [expected] = offline.chat(joined, SamplingParams(**GREEDY), use_tqdm=False)
    assert served.choices[0].message.content == expected.outputs[0].text
    image = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]
    for content in (image, [], 7):
        response = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}]})
        assert response.status_code == 400 and "text parts" in response.json()["error"]["message"]


def test_metrics_count_a_requests_prompt_tokens_once_whatever_its_n(server, client):
    before = metrics(server)
    ids = list(range(1000, 1037))  # 37 prompt tokens, 2 samples sharing them
    client.completions.create(model="tiny", prompt=ids, n=2, max_tokens=3, temperature=1, seed=1)
    after = metrics(server)
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 37
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 6


def test_openapi_describes_each_request_body_as_the_server_checks_it(server, client):
    # A schema-driven tool reads /openapi.json: each bound it gives must be the server's. Every
    # ranged field's value just past its bound gets a 400 naming it; the bound itself, a 200.
    spec = httpx.get(server + "/openapi.json", timeout=30).json()
    for path, needs, answer in (("/v1/completions", "prompt", "CompletionResponse"),
                                ("/v1/chat/completions", "messages", "ChatCompletionResponse")):
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["required"] == [needs] and needs in schema["properties"]
        answered = spec["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        assert answered["schema"]["$ref"].endswith("/" + answer)  # engine/protocol.py's model
        assert "usage" in spec["components"]["schemas"][answer]["properties"]
    fields = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    headers = {"Authorization": f"Bearer {KEY}"}
    tried = 0
    for name in ("temperature", "top_p", "top_k", "n", "seed", "max_tokens"):
        # a field that may be null: its bounds are the other member's of the union
        bounds = next(b for b in fields[name].get("anyOf", [fields[name]]) if b["type"] != "null")
        for bound, past in (("minimum", -1), ("exclusiveMinimum", 0), ("maximum", +1)):
            if bound not in bounds or abs(bounds[bound]) >= 2**62:  # past a long: top_k's own test
                continue
            kind = int if "integer" in str(bounds["type"]) else float  # JSON may say -1.0
            edge = kind(bounds[bound] + (past if bound == "exclusiveMinimum" else 0))
            past_edge = kind(bounds[bound] + (0 if bound == "exclusiveMinimum" else past))
            body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
            if bound != "exclusiveMinimum":
                ok = httpx.post(server + "/v1/completions", json=body | {name: edge},
                                headers=headers, timeout=30)
                assert ok.status_code == 200, (name, edge, ok.text)
            refused = httpx.post(server + "/v1/completions", json=body | {name: past_edge},
                                 headers=headers, timeout=30)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == name, (
                name, past_edge, refused.text)
            tried += 1
    assert tried >= 8  # each field's every bound: temperature's two, top_p's two, n's two, ...


def test_tokenize_and_detokenize_answer_as_vllms_and_count_what_a_request_counts(server, client):
    # vLLM's /tokenize (a prompt, or a chat's messages) and /detokenize: the count /tokenize
    # gives is what a completion or chat request of the same prompt reports as prompt_tokens.
    headers = {"Authorization": f"Bearer {KEY}"}
    post = lambda path, body: httpx.post(server + path, json=body, headers=headers, timeout=30)
    text, messages = PROMPTS[0], [{"role": "user", "content": PROMPTS[1]}]
    tokenized = post("/tokenize", {"model": "tiny", "prompt": text}).json()
    chat = post("/tokenize", {"messages": messages}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 8192
    # return_token_strs: each token spelled as transformers spells it, its bytes in GPT-2's table
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    spelled = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert spelled["tokens"] == tokenized["tokens"] and tokenized["token_strs"] is None
    strs = spelled["token_strs"]
    assert len(strs) == spelled["count"] and strs[0] == "<|begin_of_text|>"
    assert b"".join(bytes(byte_of[c] for c in s) for s in strs[1:]) == text.encode()
    assert tokenized["count"] == client.completions.create(
        model="tiny", prompt=text, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens
    # Every token is text, the begin-of-text one too (vLLM decodes with the special tokens)
    assert post("/detokenize", {"tokens": tokenized["tokens"]}).json() == {
        "prompt": "<|begin_of_text|>" + text}
    assert post("/detokenize", {"tokens": tokenized["tokens"][1:]}).json() == {"prompt": text}
    for path, body, param in [("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": ""}, "prompt")]:
        refused = post(path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert post("/detokenize", {"tokens": [10**9]}).status_code == 400
    assert post("/tokenize", {"prompt": [5, 10**9]}).status_code == 400  # as /detokenize says
    # vLLM's rule: text that spells a control token is that token; add_special_tokens: the BOS
    assert post("/tokenize", {"prompt": "<|eot_id|>"}).json()["tokens"] == [128000, 128009]
    assert post("/tokenize", {"prompt": "<|eot_id|>", "add_special_tokens": False}).json()[
        "tokens"] == [128009]
    assert httpx.post(server + "/tokenize", json={"prompt": "hi"}).status_code == 401  # the key


def test_stop_token_ids_end_an_answer_and_a_stop_string_may_stay_in_it(server, offline):
    # The truth is the answer without them, cut: at the first of the stop ids (the token is in
    # the token ids and the usage, not in the text, as vLLM keeps end-of-text), after the stop
    # string when asked.
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    free = offline.generate(PROMPTS[:1], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[4]
    cut = offline.generate(PROMPTS[:1], SamplingParams(**greedy, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert cut.text == offline.tokenizer.decode(cut.token_ids[:-1])
    assert cut.finish_reason == "stop"
    stop = free.text[len(free.text) // 2:][:3]
    kept = offline.generate(PROMPTS[:1], SamplingParams(**greedy, stop=[stop],
                                                        include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[:free.text.index(stop) + len(stop)]
    served = httpx.post(server + "/v1/completions", timeout=30, headers={
        "Authorization": f"Bearer {KEY}"}, json={"prompt": PROMPTS[0], **greedy, "stop": [stop],
                                                "include_stop_str_in_output": True}).json()
    assert served["choices"][0]["text"] == kept.text
    served = httpx.post(server + "/v1/completions", timeout=30, headers={
        "Authorization": f"Bearer {KEY}"}, json={"prompt": PROMPTS[0], **greedy,
                                                "stop_token_ids": [stop_id]}).json()
    assert served["choices"][0]["text"] == cut.text and served["usage"]["completion_tokens"] == (
        len(cut.token_ids))


def test_penalties_bias_min_tokens_and_special_tokens_are_the_offline_engines(server, offline):
    # The logits processors' fields (tests/test_logits_processors.py holds them to a reference)
    asked = dict(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                 frequency_penalty=0.7, presence_penalty=0.4, min_tokens=2,
                 logit_bias={128010: 4.0, 1000: 3.0}, skip_special_tokens=False)
    for skip in (False, True):
        truth = offline.generate(PROMPTS[:1], SamplingParams(**asked | {
            "skip_special_tokens": skip}), use_tqdm=False)[0].outputs[0]
        served = httpx.post(server + "/v1/completions", timeout=30, headers={
            "Authorization": f"Bearer {KEY}"}, json={"prompt": PROMPTS[0], **asked, "logit_bias": {
                "128010": 4.0, "1000": 3.0}, "skip_special_tokens": skip}).json()
        assert served["choices"][0]["text"] == truth.text
    assert 128010 in truth.token_ids and "<|reserved" not in truth.text  # the bias showed one


# Every field of vLLM's request models (vllm/entrypoints/openai/protocol.py, CompletionRequest
# and ChatCompletionRequest), each with a value that asks for something. The server either does
# it (the fields it reads, each tested for its effect above) or answers 400 naming the field.
ASKS = {"best_of": 2, "suffix": "!", "use_beam_search": True, "length_penalty": 0.5,
        "spaces_between_special_tokens": False,
        "allowed_token_ids": [1, 2], "prompt_embeds": "AAAA",
        "response_format": {"type": "json_object"}, "guided_json": {"type": "object"},
        "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'",
        "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ", "priority": 1,
        "logits_processors": ["x.Y"], "return_tokens_as_token_ids": True,
        "cache_salt": "salt", "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
        "top_logprobs": 2, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required", "reasoning_effort": "low", "include_reasoning": False,
        "documents": [{"title": "a", "text": "b"}], "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
        "structural_tag": "{}",
        "bad_words": ["x"], "structured_outputs": {"choice": ["a"]}}
COMPLETION_ONLY = {"suffix", "prompt_embeds", "add_special_tokens"}
CHAT_ONLY = {"tools", "tool_choice", "reasoning_effort", "include_reasoning", "documents",
             "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
             "add_generation_prompt", "continue_final_message"}


@pytest.mark.parametrize("path, base, skip, chat", [
    ("/v1/completions", {"prompt": "hi"}, CHAT_ONLY, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, COMPLETION_ONLY,
     True)], ids=["completions", "chat"])
def test_every_vllm_field_works_or_is_refused_by_name(server, path, base, skip, chat):
    headers = {"Authorization": f"Bearer {KEY}"}
    post = lambda body: httpx.post(server + path, json=base | {"max_tokens": 2} | body,
                                   headers=headers, timeout=30)
    asks = {name: value for name, value in ASKS.items() if name not in skip}
    if chat:  # a chat's template places its own begin-of-text: vLLM's True would add another
        asks["add_special_tokens"] = True
    for name, value in asks.items():
        refused = post({name: value})
        assert refused.status_code == 400, (name, refused.text)
        assert refused.json()["error"]["param"] == name and f"'{name}'" in refused.text
    # The same fields at vLLM's defaults ask for nothing: one request with all of them is served.
    defaults = {"best_of": 1, "echo": False, "frequency_penalty": 0, "logprobs": None,
                "presence_penalty": 0, "use_beam_search": False, "length_penalty": 1.0,
                "stop_token_ids": [], "include_stop_str_in_output": False, "min_tokens": 0,
                "skip_special_tokens": True, "spaces_between_special_tokens": True,
                "priority": 0, "bad_words": [], "add_special_tokens": not chat,
                "tool_choice": "none", "include_reasoning": True, "add_generation_prompt": True,
                "continue_final_message": False, "user": "me"}
    served = post({name: value for name, value in defaults.items() if name not in skip})
    assert served.status_code == 200, served.text


# Log-probabilities (features/logprobs/logprobs.py), as lm-evaluation-harness asks for them: token-id
# prompts in a list, echo, logprobs 1, max_tokens 1, temperature 0. Held to the offline LLM's.
def test_a_batch_of_token_prompts_with_echo_gives_the_offline_prompt_logprobs(server, offline):
    prompts = [offline.tokenizer.encode_prompt(p)[:20] for p in PROMPTS[:3]]
    served = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1,
                              "max_tokens": 1, "temperature": 0}, timeout=60).json()
    truth = offline.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=1,
                                                     prompt_logprobs=1), use_tqdm=False)
    assert [c["index"] for c in served["choices"]] == [0, 1, 2]
    for choice, want, prompt in zip(served["choices"], truth, prompts):
        scored = choice["logprobs"]
        assert len(scored["token_logprobs"]) == len(prompt) + 1 and scored["token_logprobs"][0] is None
        expected = [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], prompt[1:])]
        expected.append(want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]].logprob)
        assert scored["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
        for logprob, top in zip(scored["token_logprobs"][1:], scored["top_logprobs"][1:]):
            assert logprob <= max(top.values()) + 1e-6 and 1 <= len(top) <= 2  # its own and top 1
        assert choice["text"].endswith(want.outputs[0].text)
    assert served["usage"]["prompt_tokens"] == sum(map(len, prompts))
    echoed = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": PROMPTS[0], "echo": True, "max_tokens": 3,
                              "temperature": 0}, timeout=60).json()["choices"][0]
    alone = offline.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0),
                             use_tqdm=False)[0].outputs[0]
    assert echoed["text"] == PROMPTS[0] + alone.text and echoed["logprobs"] is None


def test_an_echoed_answer_that_ends_at_its_one_stop_token_scores_that_token(server, offline):
    # lm-eval's loglikelihood: echo, logprobs, max_tokens 1, and it sums token_logprobs[ctxlen:-1].
    # When the one token drawn ends the answer (here a stop token id; end-of-text alike) it is
    # still the answer's token: in token_ids, the usage and the scored list, not in the text.
    prompt = offline.tokenizer.encode_prompt(PROMPTS[2])[:17]
    free = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=1),
                            use_tqdm=False)[0].outputs[0]
    [stop_id] = free.token_ids
    served = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1,
                              "max_tokens": 1, "temperature": 0, "stop_token_ids": [stop_id],
                              "return_token_ids": True}, timeout=60).json()
    choice = served["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [stop_id]
    assert served["usage"]["completion_tokens"] == 1
    scored = choice["logprobs"]["token_logprobs"]
    assert len(scored) == len(prompt) + 1
    assert scored[-1] == pytest.approx(free.logprobs[0][stop_id].logprob, abs=1e-5)
    assert choice["text"] == offline.tokenizer.decode(prompt)  # the prompt, nothing after


def test_chat_logprobs_and_a_streamed_completions_logprobs_are_the_offline_ones(server, client,
                                                                               offline):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    want = offline.chat(messages, params, use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in content)
    want = offline.generate(PROMPTS[2:3], params, use_tqdm=False)[0].outputs[0]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6,
                                       temperature=0, logprobs=3, stream=True)
    streamed = [lp for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([d[t].logprob for d, t in zip(want.logprobs, want.token_ids)],
                                     abs=1e-5)
    assert want.cumulative_logprob == pytest.approx(sum(streamed), abs=1e-4)


def test_what_logprobs_do_not_combine_with_is_a_400_naming_the_field(server):
    post = lambda path, body: httpx.post(server + path, json={"max_tokens": 2} | body, timeout=30,
                                         headers={"Authorization": f"Bearer {KEY}"})
    for path, body, name in [
            ("/v1/completions", {"prompt": ["a", "b"], "stream": True}, "prompt"),
            ("/v1/completions", {"prompt": "a", "echo": True, "stream": True}, "echo"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                      "top_logprobs": 2}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                      "echo": True}, "echo"),
            ("/v1/completions", {"prompt": ["a"] * 41}, "prompt")]:  # past --max-num-seqs 40
        refused = post(path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm(server, client, offline):
    ids = offline.tokenizer.encode_prompt(PROMPTS[3])
    served = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"truncate_prompt_tokens": 5})
    alone = offline.generate([ids[-5:]], SamplingParams(max_tokens=6, temperature=0),
                             use_tqdm=False)[0].outputs[0]
    assert served.usage.prompt_tokens == 5 and served.choices[0].text == alone.text
    cut = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0,
                                                 truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].text == alone.text
    whole = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0,
                                                   truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # -1: as much as the context takes, all of these


def test_a_clients_request_id_names_the_answer_as_vllms_and_may_come_twice(server, client):
    answers = [client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "hi"}], extra_body={"request_id": "mine"}) for _ in range(2)]
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                           extra_body={"request_id": "mine"})
    assert [a.id for a in answers] == ["chatcmpl-mine"] * 2 and completion.id == "cmpl-mine"


def test_a_chat_goes_on_with_its_last_message_as_the_offline_chat(server, client, offline):
    chat = [{"role": "user", "content": PROMPTS[4]}, {"role": "assistant", "content": "Well,"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    served = client.chat.completions.create(model="tiny", messages=chat, max_tokens=5,
                                            temperature=0, extra_body=flags)
    alone = offline.chat(chat, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False,
                         **flags)[0]
    assert served.choices[0].message.content == alone.outputs[0].text
    post = lambda path, body: httpx.post(server + path, json=body,
                                         headers={"Authorization": f"Bearer {KEY}"})
    closed = post("/tokenize", {"messages": chat, "add_generation_prompt": False}).json()["tokens"]
    opened = offline.tokenizer.chat(chat)  # Llama 3's template: ... <|eot_id|>, a header
    assert opened[:len(closed)] == closed and closed[-1] == offline.tokenizer.special[
        "<|eot_id|>"]
    assert alone.prompt_token_ids == closed[:-1]  # the last turn open: no <|eot_id|>
    both = post("/v1/chat/completions", {"messages": chat, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_return_token_ids_gives_the_offline_ids_whole_or_streamed(server, client, offline):
    ids = offline.tokenizer.encode_prompt(PROMPTS[5])
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = offline.generate([ids], greedy, use_tqdm=False)[0].outputs[0]
    served = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True}).model_dump()
    choice = served["choices"][0]
    assert choice["token_ids"] == alone.token_ids and choice["prompt_token_ids"] == ids
    messages = [{"role": "user", "content": PROMPTS[5]}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0, stream=True,
                                          extra_body={"return_token_ids": True})
    chunks = [c.model_dump() for c in chat]
    assert chunks[0]["prompt_token_ids"] == offline.tokenizer.chat(messages)
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert streamed == offline.chat(messages, greedy, use_tqdm=False)[0].outputs[0].token_ids
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=2).model_dump()
    assert "token_ids" not in plain["choices"][0] or plain["choices"][0]["token_ids"] is None

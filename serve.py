"""An OpenAI-compatible server over the paged engine: watch the block pool fill as requests come and go.

    python serve.py --model tiny --random-weights --device cpu      # http://127.0.0.1:8000
    curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16, "stream": true}'

More in docs/engine-notes.md.
"""

if __name__ == "__main__":  # first of all: Ctrl-C from here on ends in one line, exit 130
    from plumbing.interrupt import exit_quietly_on_ctrl_c
    exit_quietly_on_ctrl_c("serve.py")

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import secrets
import signal
import socket
import sys
import time

from engine import protocol
from engine.protocol import BadRequest, Reply, Sample, UnknownModel
from plumbing.cli import (ONE_PROCESS, HelpFormatter, UserError, first_paragraph, finite_float,
                          format_bytes, one_paragraph_errors, per_token, port, positive_int,
                          require_packages, torchrun_process)

LISTEN_BACKLOG = 2048  # connections the kernel queues before uvicorn accepts them (its default)
MAX_BODY_BYTES = 1_000_000  # a request body larger than this is refused before it is parsed
MAX_N = 16  # samples per request
VERSION = "0.70.0"  # /version: this server's protocol (vLLM's fields and shapes)
# An idle connection is closed by the client first: the openai package's pool (httpx) drops one
# after 5 s, uvicorn's default, so a request sent at 5 s could meet the server's close
# ("Server disconnected without sending a response", seen once in CI). nginx's default.
KEEP_ALIVE_SECONDS = 75
# On SIGTERM (a service manager's stop, `kill`): no new requests; those in flight get this long
DRAIN_SECONDS = 30
STREAM_END_MARGIN_SECONDS = 0.5  # before uvicorn cancels what runs: the streams' ends go out
STREAM_CUT = "cut"  # put on an open stream's updates when the server stops before it ends


# --- The HTTP application ------------------------------------------------------------------------

def build_app(engine, model_name: str, api_key: str | None):
    """engine: engine/engine_process.py's EngineClient, the server's end of the engine."""
    from fastapi import FastAPI, Request
    from fastapi.responses import (JSONResponse, PlainTextResponse, Response,
                                   StreamingResponse)
    from starlette.exceptions import HTTPException
    from prometheus_client import CONTENT_TYPE_LATEST
    from engine.engine_process import RequestFailed
    from engine.metrics import ServerMetrics

    max_num_seqs = engine.info["max_num_seqs"]
    request_models = protocol.request_models(min(MAX_N, max_num_seqs),
                                             engine.info["max_logprobs"], max_num_seqs)

    open_streams: set[asyncio.Queue] = set()  # the updates of every stream being sent
    server_metrics = ServerMetrics(model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        engine.attach(loop, server_metrics)

        def end_streams_in(seconds: float) -> None:
            """On a stop's signal: the streams still open that long after end with "abort"."""
            end = lambda: [updates.put_nowait(STREAM_CUT) for updates in open_streams]
            loop.call_soon_threadsafe(loop.call_later, seconds, end)
        app.state.end_streams_in = end_streams_in
        yield

    app = FastAPI(title="llama3 paged server", lifespan=lifespan)
    started = int(time.time())  # the model card's `created`

    def error(message: str, status: int = 400, param=None, kind="invalid_request_error",
              headers=None, code=None):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                       "code": code}}, status_code=status, headers=headers)

    def answer(e: BadRequest) -> JSONResponse:
        if isinstance(e, UnknownModel):
            return error(str(e), 404, e.param, "NotFoundError", code=404)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        kind = "server_error" if e.status == 500 else "invalid_request_error"
        return error(str(e), e.status, e.param, kind, headers=headers)

    def refused(request: Request):
        """401 without the API key, where one is set (a handler's first check: a middleware
        would end streamed responses early, as Starlette's BaseHTTPMiddleware does)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if api_key and not (scheme.lower() == "bearer"  # HTTP's schemes are case-insensitive
                            and secrets.compare_digest(given.encode(), api_key.encode())):
            return error("Invalid or missing API key (Authorization: Bearer ...).", 401,
                         kind="authentication_error")
        return None

    async def read_body(request: Request) -> dict:
        length = request.headers.get("content-length")
        too_large = BadRequest(f"The request body is larger than {MAX_BODY_BYTES:,} bytes.",
                               status=413)
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            raise too_large
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
        return protocol.json_body(raw, model_name)

    async def submit(prompt: dict, params: dict, answer_id: str) -> tuple[str, list, asyncio.Queue]:
        """One prompt to the engine, as a request of its own: (its id there, its prompt's
        token ids, the queue its updates come on). Its id there is the answer's and a random part
        (a client's request_id may come twice)."""
        request_id = f"{answer_id}-{secrets.token_hex(6)}"
        try:
            prompt_token_ids, updates = await engine.add(request_id, prompt, params)
        except OverflowError as e:
            raise BadRequest(f"The server is full ({e}); retry shortly.", status=503) from e
        except ValueError as e:
            raise BadRequest(str(e)) from e
        except RequestFailed as e:
            raise BadRequest(f"The engine failed at this request ({e}); it serves others.",
                             status=500) from e
        except RuntimeError as e:
            raise BadRequest(f"The engine stopped: {e}", status=500) from e
        return request_id, prompt_token_ids, updates

    async def whole_answers(updates: asyncio.Queue, n: int) -> list[Sample] | None:
        """Each sample's answer once all n have ended; None if the engine stopped first."""
        answers = [Sample() for _ in range(n)]
        while any(a.reason is None for a in answers):
            update = await updates.get()
            if update is None:
                return None
            answers[update[0]].take(update)
        return answers

    async def until_disconnected(request: Request) -> None:
        """Returns when the client hangs up. Its body has been read whole, so the next message
        the server has for this request is the disconnect (a streamed answer finds out instead
        when it next writes)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def serve(request: Request, chat: bool):
        if refused(request):
            return refused(request)
        submitted = []  # (request id, prompt tokens, updates), one per prompt
        try:
            endpoint = "chat" if chat else "completions"
            body = protocol.parse(request_models[endpoint], await read_body(request), endpoint)
            ignored = protocol.ignored_fields(body)
            if ignored:  # one line, as vLLM's warning
                print(f"The following fields were present in the request but ignored: "
                      f"{ignored}", file=sys.stderr, flush=True)
            prompts = ([protocol.chat_prompt(body)] if chat else protocol.completion_prompts(body))
            params = protocol.sampling_params(body, chat, None if chat else 16)
            stream, echo = bool(body.stream), not chat and bool(body.echo)
            options = body.stream_options.model_dump() if body.stream_options else {}
            # vLLM's request_id: the answer's id ends so
            given_id = body.request_id or secrets.token_hex(12)
            answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{given_id}"
            if body.stream_options is not None and not stream:  # as vLLM: for a stream
                raise BadRequest("'stream_options' is for a streamed answer: add \"stream\": "
                                 "true, or leave it out", "stream_options")
            if len(prompts) * params["n"] > max_num_seqs:
                raise BadRequest(f"{len(prompts)} prompts x n = {params['n']} sequences; this "
                                 f"server runs at most {max_num_seqs} at once (--max-num-seqs)",
                                 "prompt")
            for name, asked in [("prompt", len(prompts) > 1), ("echo", echo),
                                ("prompt_logprobs", params["prompt_logprobs"] is not None)]:
                if stream and asked:  # whole answers only, for now
                    raise BadRequest(f"'{name}' is answered whole: leave out \"stream\", or "
                                     f"send {'one prompt' if name == 'prompt' else 'no ' + name}",
                                     name)
            for prompt in prompts:
                submitted.append(await submit(prompt | {"echo": echo}, params, answer_id))
        except BadRequest as e:
            for request_id, _, _ in submitted:  # the batch's earlier prompts end with it
                engine.abort(request_id)
            return answer(e)
        n, request_id = params["n"], submitted[0][0]  # a stream's
        reply = Reply(chat, answer_id, model_name, n, params["logprobs"],
                      bool(body.return_token_ids), [ids for _, ids, _ in submitted])
        if not stream:
            answers = asyncio.ensure_future(asyncio.gather(
                *[whole_answers(updates, n) for _, _, updates in submitted]))
            hang_up = asyncio.ensure_future(until_disconnected(request))
            try:
                await asyncio.wait([answers, hang_up], return_when=asyncio.FIRST_COMPLETED)
            finally:  # the client went away (or the server stops): free its blocks and rows
                hang_up.cancel()
                hung_up = not answers.done()
                if hung_up:
                    answers.cancel()
                    for submitted_id, _, _ in submitted:
                        engine.abort(submitted_id)
            if hung_up:
                return Response(status_code=499)  # nginx's "client closed": no one reads it
            if None in answers.result():
                return error(f"The engine stopped: {engine.failed}", 500, kind="server_error")
            for submitted_id, _, _ in submitted:
                engine.forget(submitted_id)
            return JSONResponse(reply.whole(answers.result(), echo,  # as it is: FastAPI would
                                            [p.get("text") for p in prompts]))  # add unset fields
        updates = submitted[0][2]

        async def events():
            ended = [False] * n  # by sample
            # vLLM's continuous_usage_stats (with include_usage): the usage so far in every chunk
            so_far = (lambda: {"usage": reply.usage(reply.tokens)}) if options.get(
                "include_usage") and options.get("continuous_usage_stats") else dict
            open_streams.add(updates)
            try:
                if chat:
                    yield reply.opening(**so_far())
                while not all(ended):
                    waiting = [await updates.get()]
                    while not updates.empty():  # all that wait: when the loop falls behind the
                        waiting.append(updates.get_nowait())  # engine, one event per sample
                    if None in waiting:  # the engine stopped
                        yield "data: " + json.dumps({"error": {"message": "The engine stopped: "
                                                    f"{engine.failed}"}}) + "\n\n"
                        return
                    if STREAM_CUT in waiting:  # the server stops: the answer ends here, said so
                        yield "".join(reply.cut(i) for i in range(n) if not ended[i])
                        break
                    moved = {}  # index -> the sample's part of this event
                    for update in waiting:
                        moved.setdefault(update[0], Sample()).take(update)
                    for index, a in moved.items():
                        ended[index] = a.reason is not None
                    yield "".join(reply.event([reply.moved(index, a)], **so_far())
                                  for index, a in moved.items())  # one event per sample moved
                if options.get("include_usage"):
                    yield reply.event([], usage=reply.usage(reply.tokens))
                yield "data: [DONE]\n\n"
            finally:
                open_streams.discard(updates)
                if not all(ended):  # the client went away, or the server stops: free its blocks
                    engine.abort(request_id)
                else:
                    engine.forget(request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", response_model=protocol.CompletionResponse,
              openapi_extra=protocol.openapi_body(request_models["completions"], "completions"))
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", response_model=protocol.ChatCompletionResponse,
              openapi_extra=protocol.openapi_body(request_models["chat"], "chat"))
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.exception_handler(HTTPException)
    async def in_openais_shape(request: Request, e: HTTPException):
        """404 and 405 as every other error: OpenAI's {"error": {...}}, not FastAPI's {"detail"}."""
        return error(f"{e.detail}: {request.method} {request.url.path}", e.status_code)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started,
                "owned_by": "llama3-paged", "max_model_len": engine.info["max_seq_len"]}

    @app.get("/v1/models")
    async def models(request: Request):
        if refused(request):
            return refused(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def model(request: Request, model: str):
        if refused(request):
            return refused(request)
        if model != model_name:
            return answer(UnknownModel(model))
        return model_card()

    async def tokenizer_call(request: Request, kind: str, read, shape) -> JSONResponse | dict:
        """vLLM's /tokenize and /detokenize: `read(body)` is what the engine's tokenizer takes,
        `shape(its answer)` the response body."""
        if refused(request):
            return refused(request)
        try:
            return shape(await engine.ask(kind, read(await read_body(request))))
        except BadRequest as e:
            return answer(e)
        except ValueError as e:
            return error(str(e), 400)

    @app.post("/tokenize", openapi_extra=protocol.openapi_body(request_models["tokenize"]))
    async def tokenize(request: Request):
        def prompt(body):  # add_special_tokens: vLLM's, a text's begin-of-text (default true)
            body = protocol.parse(request_models["tokenize"], body)
            strs = bool(body.return_token_strs)
            if body.messages is not None:
                return protocol.chat_prompt(body) | {"token_strs": strs}
            if body.prompt is None:
                raise BadRequest("'prompt' or 'messages' must be given", "prompt")
            return protocol.completion_prompts(body)[0] | {"token_strs": strs}
        return await tokenizer_call(request, "tokenize", prompt, lambda answer: {
            "count": len(answer[0]), "max_model_len": engine.info["max_seq_len"],
            "tokens": answer[0], "token_strs": answer[1]})

    @app.post("/detokenize", openapi_extra=protocol.openapi_body(request_models["detokenize"]))
    async def detokenize(request: Request):
        def ids(body):
            return protocol.parse(request_models["detokenize"], body).tokens
        return await tokenizer_call(request, "detokenize", ids, lambda text: {"prompt": text})

    @app.get("/version")
    async def version():
        """vLLM's: the server's version, which clients log beside their results."""
        return {"version": VERSION}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's: the tokenizer's special tokens and length, for clients that tokenize here."""
        return refused(request) or engine.info["tokenizer"]

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: a load balancer's probe
    async def health():
        alive = engine.alive
        return PlainTextResponse("ok" if alive else "engine stopped",
                                 status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


MAX_DRAIN_SECONDS = 3600


def drain_seconds(text: str) -> float:
    """--timeout-graceful-shutdown (uvicorn's name): 0 ends every open stream at once."""
    value = finite_float(text)
    if not 0 <= value <= MAX_DRAIN_SECONDS:
        raise argparse.ArgumentTypeError(f"expected 0 to {MAX_DRAIN_SECONDS:,} seconds, got {text}")
    return value


def api_key(text: str) -> str:
    """An empty key (`--api-key "$KEY"` with KEY unset) would serve everyone: refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; give the key, or leave the flag out to serve "
                                         "without one")
    return text


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.py", description=first_paragraph(__doc__),
                                formatter_class=HelpFormatter,
                                epilog="Any other flag is the scripts' (llama3_paged.py --help) "
                                       "that build the engine: --model, --random-weights, "
                                       "--block-size, --device, ... Those that choose what a run "
                                       "asks (--temperature, --samples, --system-prompt, ...) "
                                       "are each request's here, and refused.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every network)")
    p.add_argument("--port", type=port, default=8000, help="TCP port")
    p.add_argument("--api-key", type=api_key,
                   help="require Authorization: Bearer KEY on /v1 requests")
    p.add_argument("--cache", choices=["paged", "naive", "virtual"], default="paged",
                   help="which KV cache: the three scripts'")
    p.add_argument("--max-num-seqs", type=positive_int, default=256,
                   help="sequences queued or running at once; more get 503")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model)")
    p.add_argument("--timeout-graceful-shutdown", type=drain_seconds, default=DRAIN_SECONDS,
                   metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, seconds for answers in flight to finish")
    return p


def open_to_others(host: str) -> bool:
    """Whether --host reaches beyond this machine (not 127.x.x.x, ::1 or localhost)."""
    return not (host == "localhost" or host.startswith("127.") or host == "::1")


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's address, taken and listened on before the engine loads (minutes for 8B):
    another server on the port ends this one at once, in one paragraph, and a second started
    beside this one finds the port held (bound alone, two sockets with SO_REUSEADDR may share a
    port until one listens). A client that connects while the engine loads waits in the
    kernel's queue and is answered once uvicorn runs."""
    # As uvicorn binds its own: IPv6 where the host has a colon, else IPv4 (localhost: 127.0.0.1)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except socket.gaierror as e:
        sock.close()
        raise UserError(f"--host {host}: {e.strerror}. Give an address (127.0.0.1, 0.0.0.0) or a "
                        f"name this machine resolves.") from e
    except OSError as e:
        sock.close()
        what_to_do = {errno.EADDRINUSE: "another program holds it: choose another --port, or "
                                        "stop it",
                      errno.EACCES: "ports under 1024 need root: choose a higher --port"}
        raise UserError(f"Cannot serve on {host}:{port}: {e.strerror or e}; "
                        f"{what_to_do.get(e.errno, 'choose another --host or --port')}.") from e
    return sock


def main(argv=None) -> None:
    with one_paragraph_errors("serve.py", reports=False):  # a service may run without stdout
        args, engine_argv = argument_parser().parse_known_args(argv)
        from engine.config import parser_with_features
        engine_flags = parser_with_features(args.cache, served=True)
        engine_flags.prog = "serve.py"  # the rest are the engine's flags: checked now, as ours
        engine_flags.parse_args(engine_argv)
        if torchrun_process() is not None:  # said before two processes contend for the port
            raise UserError(ONE_PROCESS)
        require_packages(["fastapi", "uvicorn", "prometheus_client"], "the HTTP server")
        address = bound_socket(args.host, args.port)  # a port in use is said now, not after loading
        if open_to_others(args.host) and not args.api_key:
            print(f"Serving on {args.host}, beyond this machine, without --api-key: anyone who can "
                  f"reach it can send it requests.", file=sys.stderr, flush=True)
        from engine.engine_process import EngineClient
        engine = EngineClient(args.cache, args.max_num_seqs, engine_argv)
        name, info = args.served_model_name or engine.info["model"], engine.info
        url_host = f"[{args.host}]" if ":" in args.host else args.host  # IPv6 in brackets
        print(f"KV pool: {info['num_blocks']:,} blocks x {info['block_size']:,} tokens x "
              f"{per_token(info['kv_bytes_per_token'])} per token = "
              f"{format_bytes(info['pool_bytes'])} ({args.cache}); up to {args.max_num_seqs:,} "
              f"sequences. Serving '{name}' on http://{url_host}:{args.port}", flush=True)
        import uvicorn

        drain = args.timeout_graceful_shutdown

        class DrainingServer(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if not self.should_exit:
                    print(f"{signal.Signals(sig).name}: no new requests; those in flight get up "
                          f"to {drain:g} s to finish, then each stream still open ends with "
                          f"finish_reason \"abort\" and the server stops.", file=sys.stderr,
                          flush=True)
                    app.state.end_streams_in(max(drain - STREAM_END_MARGIN_SECONDS, 0))
                super().handle_exit(sig, frame)

        class WithoutCutTracebacks(logging.Filter):  # a request cut at the bound: said above
            def filter(self, record) -> bool:
                return not (record.exc_info and isinstance(record.exc_info[1],
                                                           asyncio.CancelledError))

        logging.getLogger("uvicorn.error").addFilter(WithoutCutTracebacks())
        app = build_app(engine, name, args.api_key)
        server = DrainingServer(uvicorn.Config(app, log_level="warning",
                                               timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                               timeout_graceful_shutdown=drain))
        # uvicorn raises the signal again once it has drained: then it ends this well, exit 0
        signal.signal(signal.SIGTERM, lambda sig, frame: None)
        server.run(sockets=[address])
        engine.close()
        print("Stopped.", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

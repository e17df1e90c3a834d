"""The served engine in a process of its own, as vLLM's engine core runs: serve.py's HTTP handlers
and the engine's loop no longer take turns on one interpreter lock.

Why a process and not a thread: Python runs one thread at a time. With the engine on a thread
of the server, every step waited while the event loop parsed requests and wrote server-sent
events, and the event loop waited while the engine launched kernels. Here each has a core of its
own (docs/serving-under-load.md measures the two).

More in docs/engine-notes.md.
"""

import asyncio
import multiprocessing
import os
import queue
import secrets
import signal
import threading
import time
import traceback

from plumbing.cli import UserError

START_TIMEOUT_S = 1800  # loading 8B from a slow disk and compiling: minutes, not hours


class RequestFailed(Exception):
    """The engine failed at one request (a bug its content reached) and serves the others."""


# --- The engine's side ---------------------------------------------------------------------------

def engine_main(cache: str, max_num_seqs: int, argv: list[str], commands, results) -> None:
    """The engine process's body: build the engine, say ready, then step while there is work."""
    # Ctrl-C, and SIGTERM (which a service manager sends every process of the service), are the
    # server's: it drains its requests, then closes the pipe, which ends this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = queue.Queue()  # drained from now on, so that a server gone while we load ends us
    threading.Thread(target=drain, args=(commands, inbox), daemon=True).start()
    from engine import protocol
    from engine.llm_engine import LLMEngine
    from plumbing.cli import one_paragraph_errors
    try:
        with one_paragraph_errors("serve.py"):  # a bad flag or a missing file: one paragraph
            engine = LLMEngine(cache, max_num_seqs, argv=argv, progress=True)
    except SystemExit as e:
        results.send(("exit", e.code))
        return
    m = engine.manager
    results.send(("ready", {"model": engine.run.args.model, "num_blocks": m.num_blocks,
                            "block_size": m.block_size, "pool_bytes": engine.cache.nbytes,
                            "kv_bytes_per_token": engine.kv_bytes_per_token,
                            "max_seq_len": engine.max_seq_len, "max_num_seqs": max_num_seqs,
                            "max_logprobs": engine.run.args.max_logprobs,
                            "tokenizer": protocol.tokenizer_info(engine.tokenizer,
                                                                 engine.max_seq_len)}))
    try:
        serve(engine, inbox, results)
    except Exception as e:  # a bug or a device failure: say so once; the server ends requests
        traceback.print_exc()
        results.send(("failed", f"{type(e).__name__}: {e}"))


def drain(commands, inbox: queue.Queue) -> None:
    """The server's messages into the engine's queue, as they come, each with the time it came:
    a request's latencies count from there, as an in-process request's count from its arrival,
    the wait for the engine's next turn included. The pipe closes when the server's process
    ends, however it ends: then this one ends too."""
    while True:
        try:
            inbox.put((commands.recv(), time.perf_counter()))
        except (EOFError, OSError):
            os._exit(0)


def serve(engine, inbox: queue.Queue, results) -> None:
    from engine.metrics import EngineFigures
    sent_chars = {}  # (request id, sample) -> characters of its text sent: only new text travels
    sent_tokens = {}  # (request id, sample) -> tokens whose ids and log-probabilities were sent
    echoes = set()  # request ids whose first updates carry the prompt's text
    figures = EngineFigures()
    results.send(("step", [], figures.take(engine)))  # /metrics serves every figure from the start
    while True:
        took = take_commands(engine, inbox, results, block=not engine.has_unfinished(),
                             echoes=echoes)
        updates = []
        for s in engine.step():
            key, request = (s.request_id, s.index), s.request
            text = s.sendable_text
            sent = sent_tokens.get(key, 0)
            logprobs = engine.logprobs_of(s, sent)
            sent_tokens[key] = len(request.output_tokens)
            prompt = None
            if key not in sent_chars and (s.request_id in echoes
                                          or s.params.prompt_logprobs is not None):
                first = (request.prompt_tokens[0],  # nothing scores the first token
                         engine.tokenizer.decode(request.prompt_tokens[:1]), None, None)
                prompt = {"text": engine.tokenizer.decode(request.prompt_tokens),
                          "logprobs": on_the_wire(engine.prompt_logprobs_of(s), first)}
            updates.append((*key, text[sent_chars.get(key, 0):], len(request.output_tokens),
                            s.finish_reason, on_the_wire(logprobs), prompt,
                            request.output_tokens[sent:]))
            figures.observe(key, request, s.finish_reason is not None)
            sent_chars[key] = len(text)
            if s.finish_reason is not None:
                del sent_chars[key], sent_tokens[key]
                echoes.discard(s.request_id)
        if updates or took:  # one message a step, not one a request
            results.send(("step", updates, figures.take(engine)))


def on_the_wire(logprobs: list | None, first: tuple | None = None) -> list | None:
    """LLMEngine's log-probabilities as the server reads them: for each token a list of (id,
    text, log-probability, rank), the token's own first, then the top k (vLLM's order). A
    prompt's first token, which nothing scores, is [`first`]."""
    if logprobs is None:
        return None
    return [[(i, p.decoded_token, p.logprob, p.rank) for i, p in token.items()]
            if token is not None else [first] for token in logprobs]


def take_commands(engine, inbox: queue.Queue, results, block: bool, echoes: set) -> bool:
    """Add and abort what the server asked for since the last step; wait for work when idle.
    echoes: the ids of requests whose first updates carry their prompt's text (`echo`)."""
    from engine.llm_engine import QueueFull
    from engine.sampler import SamplingParams
    took = False
    while True:
        try:
            command, received = inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return took
        took, block = True, False
        if command[0] == "abort":
            engine.abort(command[1])
            continue
        if command[0] in ("tokenize", "detokenize"):  # serve.py's /tokenize and /detokenize
            kind, question, what = command
            results.send(("answered", question, *translated(engine, kind, what)))
            continue
        _, request_id, prompt, params = command
        try:
            sampling = SamplingParams(**params)
            tokens = engine.truncated(prompt_tokens(engine.tokenizer, prompt), sampling)
            waited = time.perf_counter() - received  # in the inbox, for the engine's turn
            arrived = engine.scheduler.now() - waited  # on the scheduler's clock
            engine.add_request(tokens, sampling, request_id, arrival_time=arrived)
            if prompt.get("echo"):
                echoes.add(request_id)
            results.send(("added", request_id, tokens, None, None))
        except QueueFull as e:
            results.send(("added", request_id, None, "full", str(e)))
        except ValueError as e:
            results.send(("added", request_id, None, "bad", str(e)))
        except Exception as e:  # a bug a request's content reached: it fails, the engine serves on
            traceback.print_exc()
            results.send(("added", request_id, None, "failed", f"{type(e).__name__}: {e}"))


def translated(engine, kind: str, what) -> tuple:
    """A prompt's token ids, or token ids' text: (answer, None), or (None, why not)."""
    in_vocabulary = lambda ids: all(isinstance(t, int) and 0 <= t < engine.run.model.args.vocab_size
                                    for t in ids)
    try:
        ids = prompt_tokens(engine.tokenizer, what) if kind == "tokenize" else what
        if not in_vocabulary(ids):  # /tokenize of ids answers what /detokenize takes
            return None, "a token id is outside the vocabulary"
        if kind == "detokenize":
            return engine.tokenizer.decode(ids), None
        strs = engine.tokenizer.token_strs(ids) if what.get("token_strs") else None
        return (ids, strs), None
    except ValueError as e:
        return None, str(e)
    except Exception as e:  # a bug a request's content reached: it fails, the engine serves on
        traceback.print_exc()
        return None, f"the tokenizer failed at this text ({type(e).__name__}: {e})"


def prompt_tokens(tokenizer, prompt: dict) -> list[int]:
    """prompt: {"ids"}, {"messages"} or {"text"}; a text's begin-of-text token is left out
    where "plain" (vLLM's /tokenize with add_special_tokens false)."""
    if "ids" in prompt:
        return prompt["ids"]
    if "messages" in prompt:
        return tokenizer.chat(prompt["messages"],  # the model's chat template
                              prompt.get("add_generation_prompt", True),
                              prompt.get("continue_final_message", False))
    if prompt.get("plain"):
        return tokenizer.encode(prompt["text"], special=True)
    return tokenizer.encode_prompt(prompt["text"])


# --- The server's side ---------------------------------------------------------------------------

class EngineClient:
    """What serve.py's handlers hold: add a request and read its updates, abort it, read the
    latest metrics. Runs on the event loop; the engine's messages wake it (`loop.add_reader`)."""

    def __init__(self, cache: str, max_num_seqs: int, argv: list[str]):
        # spawn: a fresh interpreter, which initializes CUDA itself (a fork may not)
        context = multiprocessing.get_context("spawn")
        engine_commands, self.commands = context.Pipe(duplex=False)
        self.results, engine_results = context.Pipe(duplex=False)
        self.process = context.Process(target=engine_main, name="engine", daemon=True,
                                       args=(cache, max_num_seqs, argv, engine_commands,
                                             engine_results))
        self.process.start()
        engine_commands.close()  # the engine's ends are the engine's: when it ends, ours see EOF
        engine_results.close()
        self.info = self._wait_until_ready()
        self.failed = None  # what stopped the engine, if anything did
        self.added: dict[str, asyncio.Future] = {}  # request id -> its "added" answer
        self.listeners: dict[str, asyncio.Queue] = {}  # request id -> its handler's updates

    def _wait_until_ready(self) -> dict:
        if not self.results.poll(START_TIMEOUT_S):
            self.process.kill()
            raise UserError(f"The engine did not start in {START_TIMEOUT_S // 60} minutes.")
        try:
            kind, payload = self.results.recv()
        except EOFError:  # killed (out of host memory?) before it could say anything
            self.process.join()
            raise UserError(f"The engine's process ended while starting (exit code "
                            f"{self.process.exitcode}).") from None
        if kind == "exit":  # it printed its paragraph already
            raise SystemExit(payload)
        return payload

    def close(self, timeout: float = 10.0) -> None:
        """End the engine's process: its pipe closes, so it exits (`drain`); killed if it has
        not within `timeout` seconds."""
        self.commands.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def attach(self, loop: asyncio.AbstractEventLoop, metrics) -> None:
        """Read the engine's messages on `loop`; each step's figures go to `metrics`
        (engine/metrics.py's ServerMetrics)."""
        self.loop, self.server_metrics = loop, metrics
        fd = self.results.fileno()
        loop.add_reader(fd, self._read)
        # uvloop (uvicorn's loop where installed) makes a watched descriptor non-blocking; a
        # message that has only begun to arrive must be waited for, not taken as the pipe's end
        os.set_blocking(fd, True)

    async def add(self, request_id: str, prompt: dict, params: dict) -> tuple[list, asyncio.Queue]:
        """Returns the prompt's token ids and the queue its updates arrive on. Raises
        ValueError (a request the engine cannot run), OverflowError (no free row now) or
        RequestFailed (the engine failed at this request, and serves on)."""
        if self.failed:
            raise RuntimeError(self.failed)
        answer = self.added[request_id] = self.loop.create_future()
        self.listeners[request_id] = asyncio.Queue()
        self._send(("add", request_id, prompt, params))
        prompt_token_ids, error_kind, message = await answer
        if error_kind is not None:
            self.listeners.pop(request_id)
            kinds = {"full": OverflowError, "bad": ValueError, "failed": RequestFailed}
            raise kinds[error_kind](message)
        return prompt_token_ids, self.listeners[request_id]

    async def ask(self, kind: str, what) -> object:
        """The engine's tokenizer, through its process: "tokenize" a prompt dict (as `add` takes
        it) or "detokenize" token ids. Raises ValueError for what it cannot read."""
        if self.failed:
            raise RuntimeError(self.failed)
        question = f"{kind}-{secrets.token_hex(8)}"
        answer = self.added[question] = self.loop.create_future()
        self._send((kind, question, what))
        result, why_not = await answer
        if why_not is not None:
            raise ValueError(why_not)
        return result

    def abort(self, request_id: str) -> None:
        self.listeners.pop(request_id, None)
        if not self.failed:
            self._send(("abort", request_id))

    def _send(self, message: tuple) -> None:
        """To the engine; a pipe found closed (the engine ended a moment ago, its end-of-file
        not read yet) stops the server's side as that end-of-file would."""
        try:
            self.commands.send(message)
        except OSError:  # BrokenPipeError
            self._stop("the engine's process ended")

    def forget(self, request_id: str) -> None:
        """The handler has read its last update."""
        self.listeners.pop(request_id, None)

    def _read(self) -> None:
        """On the event loop, when the engine's pipe has data: every message waiting."""
        try:
            while self.results.poll():
                self._dispatch(self.results.recv())
        except (EOFError, OSError):
            self.loop.remove_reader(self.results.fileno())
            self.process.join(timeout=5)
            ended = "" if self.process.exitcode is None else f" (exit code {self.process.exitcode})"
            self._stop(f"the engine's process ended{ended}")

    def _dispatch(self, message: tuple) -> None:
        if message[0] == "step":
            for request_id, *update in message[1]:
                if request_id in self.listeners:
                    self.listeners[request_id].put_nowait(tuple(update))
            self.server_metrics.update(message[2])
        elif message[0] in ("added", "answered"):
            future = self.added.pop(message[1])
            if not future.done():
                future.set_result(message[2:])
        elif message[0] == "failed":
            self._stop(message[1])

    def _stop(self, why: str) -> None:
        """Every waiting handler hears that the engine stopped."""
        self.failed = self.failed or why
        for future in self.added.values():
            if not future.done():
                future.set_exception(RuntimeError(why))
        for listener in self.listeners.values():
            listener.put_nowait(None)

    @property
    def alive(self) -> bool:
        return self.failed is None and self.process.is_alive()

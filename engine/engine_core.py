"""The engine's loop: schedule a step, launch it, record its tokens (vLLM's EngineCore; nano-vllm's
LLMEngine.step). Every run of the engine drives `step`: a script's feature run through
`generate`, the Python API and the server through engine/llm_engine.py's LLMEngine.

More in docs/engine-notes.md.
"""

import time

import torch

from engine.model_runner import ModelRunner, EngineGeneration, StepInFlight
from engine.request import Status, append_tokens_at
from engine.scheduler import Scheduler, Step
from plumbing import cli


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, stop_ids=frozenset()):
        """stop_ids: the tokens that end a script's request, left out of its output as the
        lesson's loop does; a served engine passes none and judges stops itself."""
        self.runner, self.scheduler, self.stop_ids = runner, scheduler, stop_ids
        self.in_flight: StepInFlight | None = None  # overlap: the step the GPU is computing
        self.stopped = set()  # requests let go of while in flight: their next token is dropped

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> Step | None:
        """Launch a step and record its tokens; with overlap, launch step t+1 first and then
        record step t's. Returns the step whose tokens were recorded (None: none was yet)."""
        runner, scheduler = self.runner, self.scheduler
        if not runner.overlap:
            waited = runner.launch(scheduler.schedule(), scheduler)
        else:
            waited = self.in_flight  # step t, which step t+1 is launched behind
            if waited:
                scheduler.finish(self._last_token_in_flight(waited))
            self.in_flight = (runner.launch(scheduler.schedule(), scheduler)
                              if scheduler.has_work() else None)
        if not waited:
            return None
        self._record(waited)
        return waited.step

    @torch.inference_mode()  # as the lesson's generate, and the mode CUDA graphs are captured
    # in: without it autograd tracks every op and compiled layers compile for that mode too
    # (W2's prefill took seconds longer on the host: docs/layout.md)
    def generate(self, progress: bool = True) -> EngineGeneration:
        """Every request queued, stepped to its end: a script's run."""
        runner, scheduler = self.runner, self.scheduler
        requests = list(scheduler.waiting)
        runner.start_run(requests)
        prefilled_before = runner.num_prefilled
        scheduler.start_clock()
        seconds = [0.0, 0.0]  # [in prefill, in decode]
        with cli.decode_progress(scheduler, runner.manager, progress) as advance_the_bar:
            start = time.perf_counter()
            while self.has_work():
                step = self.step()
                if step is None:
                    continue
                decodes = step.kind != "prefill"  # mixed steps do both
                seconds[decodes] += time.perf_counter() - start
                start = time.perf_counter()
                if decodes:
                    advance_the_bar()
        return runner.generation(requests, *seconds, runner.num_prefilled - prefilled_before,
                                 scheduler)

    def let_go(self, request) -> None:
        """The host ends a running request between steps (engine/llm_engine.py: an abort, a stop
        string): its blocks are free at once, and the token the step in flight draws for it,
        if any, is thrown away."""
        self.scheduler.finish([request])
        if self.in_flight and request in self.in_flight.requests:
            self.stopped.add(request)

    @staticmethod
    def _last_token_in_flight(in_flight: StepInFlight) -> list:
        """The requests that the step in flight gives their last allowed token."""
        return [r for r in in_flight.requests if r.status is Status.RUNNING
                and len(r.output_tokens) + 1 >= r.max_new_tokens]

    def _record(self, in_flight: StepInFlight) -> None:
        """Append the step's tokens, but those drawn after the host let go of their request, and
        let go of the requests that are done."""
        tokens, drawing = self.runner.wait_for_tokens(in_flight), in_flight.requests
        logprobs = self.runner.logprobs
        scored = None if in_flight.logprobs is None else in_flight.logprobs.numpy()
        for request, first, part in in_flight.prompt_logprobs:
            request.prompt_logprobs.update(zip(range(first, first + len(part)), part.numpy()))
        if self.stopped:
            kept = [i for i, r in enumerate(drawing) if r not in self.stopped]
            self.stopped.difference_update(drawing)  # stopped while this step ran: done with
            tokens, drawing = tokens[kept], [drawing[i] for i in kept]
            scored = None if scored is None else scored[kept]
        before = None if scored is None else [len(r.output_tokens) for r in drawing]
        finished = append_tokens_at(drawing, tokens, self.stop_ids, self.scheduler.now())
        if scored is not None:  # a row for each token taken (a stop token is not)
            for request, count, row in zip(drawing, before, scored):
                if len(request.output_tokens) > count and logprobs.k[request.row] >= 0:
                    request.logprobs.append(row)
        for request in finished:
            if request.status is Status.FINISHED:
                continue  # its last token: let go of already
            if request.status is Status.WAITING:  # preempted while its stop token was in flight
                self.scheduler.drop(request)
            else:
                self.let_go(request)

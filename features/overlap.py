"""Overlapped steps: the host schedules step t+1 while the GPU computes step t (on CUDA by default;
--no-overlap runs the core loop).

In the lesson's loop (llama3_paged.py) the host waits for a step's tokens, records them, lets the finished
requests go, schedules the next step and only then queues it: all that time the GPU has nothing to
do. Here the host queues step t+1 first and waits for step t's tokens after, so the GPU finds the
next step queued when it finishes one. Two things make that possible:

- A step's inputs never wait for the host. Each request's last token stays on the device, where
  the next step reads it (features/timed_engine.py), and every copy to the device is from pinned memory,
  queued like a kernel (block_manager.py's `to_device`).
- The scheduler runs one step behind: when it schedules step t+1 it has not seen step t's tokens.
  That matters only for who is done. A request whose token in flight is its last (its
  max_new_tokens) is let go before step t+1 is scheduled. One that draws a stop token at step t is
  found out only once step t+1 is queued: it runs one step too many, whose token is thrown away.
  vLLM's and SGLang's overlapped schedulers do the same.

Blocks freed while a step is in flight can go to the next step at once: the GPU runs the steps in
order, so the in-flight step's writes into them come first. (Unmapping a page is not ordered with
the GPU's work: features/mapping_ahead.py's thread waits for the steps queued before it.)
Admission, preemption and recompute are unchanged: a request preempted while scheduling step t+1
ran in step t, whose token it has before it can be readmitted.
"""

from features.timed_engine import StepInFlight, TimedEngine
from features.request_state import Status, append_tokens_at


def why_not_overlapped(args, manager=None) -> str | None:
    """What keeps a run on the core loop, if anything: each of these reads on the host what the
    step in flight has not brought back yet, or changes what it may still touch. Without a
    manager, what the flags alone say (features/engine_args.py's load asks before loading the model)."""
    from features.page_manager import PageManager
    if args.continuous and args.max_batched_tokens:
        return "mixed steps read the running requests' last tokens on the host"
    if args.continuous and args.preemption == "swap":
        return "swapping checks on the host whether a victim has its last token"
    if isinstance(manager, PageManager) or args.sync_mapping:
        return ("mapping in the loop (--sync-mapping; --find-max-batch's runs too) unmaps a "
                "finished request's pages at once")
    return None


class OverlappedEngine(TimedEngine):
    def steps(self, scheduler, stop_ids):
        """Queue step t+1, then wait for step t's tokens and record them. Yields each step once
        its tokens are recorded."""
        self.stopped = set()  # requests that drew a stop token: their later tokens are thrown away
        self.in_flight = None
        while scheduler.has_work() or self.in_flight:
            in_flight = self.in_flight
            if in_flight:
                scheduler.finish(self._last_token_in_flight(in_flight))
            queued = self.launch(scheduler.schedule(), scheduler) if scheduler.has_work() else None
            self.in_flight = queued
            if in_flight:
                self._record(in_flight, scheduler, stop_ids)
                yield in_flight.step
            # the in-flight step is `queued` now (self.in_flight); None at the end

    def let_go(self, request, scheduler) -> None:
        """The host ends a running request between steps (features/llm_engine.py: an abort, a stop
        string): its blocks are free at once, and the token the step in flight draws for it,
        if any, is thrown away."""
        scheduler.finish([request])
        if self.in_flight and request in self.in_flight.requests:
            self.stopped.add(request)

    @staticmethod
    def _last_token_in_flight(in_flight: StepInFlight) -> list:
        """The requests that the step in flight gives their last allowed token."""
        return [r for r in in_flight.requests if r.status is Status.RUNNING
                and len(r.output_tokens) + 1 >= r.max_new_tokens]

    def _record(self, in_flight: StepInFlight, scheduler, stop_ids) -> None:
        """Append the step's tokens, but those drawn after a stop token, and let go of the
        requests that drew a stop token."""
        tokens, drawing = self.wait_for_tokens(in_flight), in_flight.requests
        if self.stopped:
            kept = [i for i, r in enumerate(drawing) if r not in self.stopped]
            self.stopped.difference_update(drawing)  # stopped while this step ran: done with
            tokens, drawing = tokens[kept], [drawing[i] for i in kept]
        for request in append_tokens_at(drawing, tokens, stop_ids, scheduler.now()):
            if request.status is Status.FINISHED:
                continue  # its last token: let go of already
            if request.status is Status.WAITING:  # preempted while its stop token was in flight
                scheduler.waiting.remove(request)
                request.status = Status.FINISHED
            else:
                self.let_go(request, scheduler)

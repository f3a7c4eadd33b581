"""The engine behind a request queue, so that callers on other threads (HTTP handlers, agents) share one
continuously batched engine.

`submit` may be called from any thread and returns a future; the thread that calls `serve_forever`
owns the engine: each round it takes what was submitted, runs one engine step and resolves the futures
of the requests whose samples all finished. Requests that arrive while others decode join the running
batch at the next step (continuous batching)::

    handler threads ──submit──> inbox ──> [owner thread: add_request, step, step, ...] ──> futures
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future

from rlhf.engine.types import CapacityError, Request, SamplingParams


class EngineService:
    """Owns ``engine`` from the thread that runs `serve_forever`; `submit` from anywhere."""

    def __init__(self, engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, tuple[Future, int, list]] = {}  # request id: future, samples, finished
        self._ids = itertools.count()
        self._stop = threading.Event()

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        """Queue a request; its future resolves to its ``params.n`` SampleResults in sample order, or to the
        CapacityError / EngineConfigError that refused it."""
        future: Future = Future()
        self._inbox.put((list(prompt), params, future))
        return future

    def serve_forever(self) -> None:
        """Run rounds until `stop`; waits on the inbox while nothing is in flight."""
        while not self._stop.is_set():
            self.run_round(wait=0.0 if self.engine.has_unfinished() else 0.05)

    def stop(self) -> None:
        self._stop.set()

    def run_round(self, wait: float = 0.0) -> None:
        """Admit what was submitted (waiting up to ``wait`` seconds for the first), then one engine step."""
        try:
            item = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            self._admit(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        if self.engine.has_unfinished():
            for result in self.engine.step():
                future, n, done = self._pending[result.request_id]
                done.append(result)
                if len(done) == n:
                    del self._pending[result.request_id]
                    future.set_result(sorted(done, key=lambda r: r.sample_index))

    def _admit(self, prompt: list[int], params: SamplingParams, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        request = Request(f"s{next(self._ids)}", tuple(prompt), params)
        try:
            self.engine.add_request(request)
        except CapacityError as exc:
            future.set_exception(exc)
            return
        self._pending[request.request_id] = (future, params.n, [])

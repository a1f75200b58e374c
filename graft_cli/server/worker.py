"""The model's one worker: requests run one at a time in arrival order, on a thread of their own, behind a bounded
queue; each request's pieces go back to the event loop that serves its client.

A model forward holds the CPU or GPU for its whole length, so generations cannot usefully overlap on one model;
the queue bounds how many wait (a full queue is a 429 at once, never a client left hanging), and a request whose
client went away is skipped, or stopped at its next step if it is running.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from graft_cli.api import Completion, Generator, Piece, Request
from graft_cli.core import GraftError


@dataclass
class Done:
    completion: Completion


@dataclass
class Failed:
    message: str
    status: int = 500  # 503: the server is shutting down


@dataclass
class Job:
    """One request on its way through the worker; ``events`` carries Piece, then Done or Failed, to its client."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, event: Any) -> None:
        """From the worker thread to the client's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server is gone, and so is the client
            self.cancelled.set()


class Full(Exception):
    """The queue holds as many waiting requests as it may."""


class Worker:
    """``ended``: told of every completion, a cut-off one included (the server's metrics)."""

    def __init__(self, generator: Generator, max_queue: int,
                 ended: Callable[[Completion], None] | None = None) -> None:
        self.generator, self.max_queue, self.ended = generator, max_queue, ended
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0  # submitted and not started
        self._lock = threading.Lock()
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="graft-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; Full when ``max_queue`` requests already wait."""
        with self._lock:
            if self._waiting >= self.max_queue:
                raise Full
            self._waiting += 1
        self._jobs.put(job)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def busy(self) -> bool:
        return self._running is not None

    def cancel_all(self) -> None:
        """Stop what runs at its next step and skip what waits (the server is shutting down)."""
        running = self._running
        if running is not None:
            running.cancelled.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.send(Failed("the server is shutting down: the request was never run; send it again", 503))
                with self._lock:
                    self._waiting -= 1

    def stop(self, timeout: float = 30.0) -> None:
        """Finish: cancel everything, then let the thread end (the generator closes, saving what it keeps)."""
        self.cancel_all()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
            if job.cancelled.is_set():
                continue
            self._running = job
            try:
                self._run(job)
            finally:
                self._running = None
        self.generator.close()

    def _run(self, job: Job) -> None:
        try:
            stream = self.generator.run(job.request, should_stop=job.cancelled.is_set)
            for piece in stream:
                job.send(piece)
            if self.ended is not None:
                self.ended(stream.completion)
            job.send(Done(stream.completion))
        except GraftError as e:
            job.send(Failed(str(e)))
        except Exception as e:  # noqa: BLE001 - a bug must fail its request, never the worker every request needs
            job.send(Failed(f"internal error: {type(e).__name__}: {e}"))


__all__ = ["Done", "Failed", "Full", "Job", "Piece", "Worker"]

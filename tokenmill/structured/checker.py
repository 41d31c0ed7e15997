"""The server's grammar checks: each runs in a worker process that is killed when the check passes its time limit.
A compile cannot be interrupted inside a process (llguidance offers no way to cancel one, and a thread cannot be
stopped), so a check run on a thread would go on burning CPU, and holding the thread, after its request was
refused; on the default thread pool, which tokenization shares, a few hostile schemas would starve every request.
Here a check costs at most its limit on one of a few workers, waited for (without CPU) by a thread of this
module's own small pool.

Workers are spawned (never forked from a threaded process) lazily, import llguidance and this package's plain
modules only (no torch), and a killed one is replaced at the next check.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from tokenmill.errors import InvalidRequest
from tokenmill.structured import backend
from tokenmill.structured.backend import Checked, GrammarCache, answer
from tokenmill.structured_params import COMMON_CONSTRAINTS, StructuredOutputsParams

CHECK_WORKERS = 2  # checks at once; those beyond wait their turn, their time limit running


def _serve(conn: Connection) -> None:
    """A worker: constraints in, (grammar text, error) out, until the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server; the closed pipe then stops us
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(backend._checked(spec))


class _Worker:
    """One checking process and the server's end of its pipe."""

    def __init__(self, ctx: Any):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), name="tokenmill-grammar-check", daemon=True)
        self.proc.start()
        child.close()

    def run(self, spec: StructuredOutputsParams, deadline: float) -> Checked:
        """The worker's answer; TimeoutError at `deadline` (monotonic), EOFError or OSError if it died."""
        self.conn.send(spec)
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class GrammarChecker:
    """Constraint -> checked grammar text, under a time limit: InvalidRequest naming the field for a constraint
    that is refused, TimeoutError for one not checked within its limit (its worker killed). Outcomes are cached
    (a bounded LRU, as GrammarCache), time-outs not: under load a usable schema may pass next time. The common
    constraints (params.COMMON_CONSTRAINTS, known to build in milliseconds) are checked here at once, in this
    process: no worker has to start, on a busy CPU, before the first of them is answered."""

    def __init__(self, workers: int = CHECK_WORKERS):
        self.cache = GrammarCache()
        for spec in COMMON_CONSTRAINTS:
            self.cache.put(spec.key, backend._checked(spec))
        self._ctx = mp.get_context("spawn")
        self._threads = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-check")
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False

    def submit(self, spec: StructuredOutputsParams, timeout_s: float) -> cf.Future[str]:
        """The check's outcome as a future; its limit counts from now, a wait for a free worker included."""
        hit = self.cache.get(spec.key)
        if hit is None:
            return self._threads.submit(self._check, spec, time.monotonic() + timeout_s)
        done: cf.Future[str] = cf.Future()
        try:
            done.set_result(answer(spec, hit))
        except InvalidRequest as e:
            done.set_exception(e)
        return done

    def _check(self, spec: StructuredOutputsParams, deadline: float) -> str:
        hit = self.cache.get(spec.key)  # the same constraint may have been checked while this one waited
        if hit is None:
            if time.monotonic() >= deadline:
                raise TimeoutError
            hit = self.cache.put(spec.key, self._run(spec, deadline))
        return answer(spec, hit)

    def _run(self, spec: StructuredOutputsParams, deadline: float) -> Checked:
        worker = self._take()
        if time.monotonic() >= deadline:  # the limit passed while a worker process started: the check never runs
            worker.kill()
            raise TimeoutError
        try:
            hit = worker.run(spec, deadline)
        except TimeoutError:
            worker.kill()
            raise
        except (EOFError, OSError):  # the worker died on it: refused like a constraint llguidance rejects
            worker.kill()
            return None, "it crashed the grammar checker"
        except BaseException:
            worker.kill()
            raise
        self._give(worker)
        return hit

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.is_alive():
                    return worker
                worker.conn.close()
        return _Worker(self._ctx)

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def close(self) -> None:
        """Stop the workers; checks still queued are cancelled, those running end at their limit."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in idle:
            worker.kill()

"""EngineProcessClient: the API process's handle on the engine-core process (engine_process.py). It spawns the
process, waits for it to say ready, and then runs two threads: a sender that batches messages into one pipe write,
and a reader that hands each EngineOutputs to a callback and reports once if the process dies. It knows nothing
of requests; async_engine.py does."""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_process import run_engine_core
from tokenmill.engine.messages import EngineFailed, EngineOutputs, EngineReady, ErrorInfo, Shutdown, decode_output
from tokenmill.errors import TokenmillError

log = logging.getLogger("tokenmill")


class EngineDeadError(TokenmillError):
    """The engine process is gone; nothing can be served."""


class EngineProcessClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.proc: mp.process.BaseProcess | None = None
        self.stopping = False
        self._send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def spawn(self) -> None:
        """Start the engine process; it loads the model while the caller does other work (the tokenizer)."""
        ctx = mp.get_context("spawn")
        in_recv, self._in_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine_core, args=(self.config, in_recv, out_send),
                                name="tokenmill-engine", daemon=True)
        self.proc.start()
        in_recv.close()  # ours closed, so EOF reaches each side when the other dies
        out_send.close()

    def wait_ready(self, timeout: float) -> EngineReady:
        """Block until the engine has loaded and warmed up its model. Raises what the engine raised (ConfigError,
        ModelLoadError, ...), or EngineDeadError if it exited or did not start in time."""
        deadline = time.monotonic() + timeout
        while True:
            if self._out_recv.poll(0.2):
                try:
                    msg = decode_output(self._out_recv.recv_bytes())
                except (EOFError, OSError):
                    msg = EngineFailed(ErrorInfo.of(f"the engine process exited (code {self.proc.exitcode})"))
                break
            if not self.proc.is_alive():
                msg = EngineFailed(ErrorInfo.of(f"the engine process exited during start-up "
                                                f"(code {self.proc.exitcode})"))
                break
            if time.monotonic() > deadline:
                self.proc.kill()
                msg = EngineFailed(ErrorInfo.of(f"the engine did not start within {timeout:.0f} s"))
                break
        if isinstance(msg, EngineFailed):
            self.proc.join(5)
            error = msg.error.to_exception()
            if error is not None:
                raise error
            raise EngineDeadError(msg.error.text)
        assert isinstance(msg, EngineReady), msg
        return msg

    def run(self, on_outputs: Callable[[EngineOutputs], None], on_exit: Callable[[str], None]) -> None:
        """Start the sender and reader threads. `on_outputs` runs on the reader thread for each step's outputs;
        `on_exit` once, with the reason, if the process dies (not when we stop it)."""
        for target, name, args in ((self._read_loop, "tokenmill-engine-reader", (on_outputs, on_exit)),
                                   (self._send_loop, "tokenmill-engine-sender", ())):
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def send(self, msg: object) -> None:
        """Queue a message for the engine; the sender thread writes what is queued together."""
        self._send_q.put(msg)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (it aborts whatever is left) and the threads."""
        self.stopping = True
        if self.proc is None:
            return
        if not self._threads:  # never running (stopped during start-up): nothing to say goodbye to
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
            return
        if self.proc.is_alive():
            self._send_q.put(Shutdown())
            self._send_q.put(None)
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        else:
            self._send_q.put(None)
        for t in self._threads:
            t.join(2)

    def _send_loop(self) -> None:
        while True:
            batch = [self._send_q.get()]
            while True:
                try:
                    batch.append(self._send_q.get_nowait())
                except queue.Empty:
                    break
            stop = any(m is None for m in batch)
            batch = [m for m in batch if m is not None]
            if batch:
                try:
                    self._in_send.send(batch)
                except (OSError, EOFError, ValueError):
                    return  # the engine is gone; the reader notices and reports
            if stop:
                return

    def _read_loop(self, on_outputs: Callable[[EngineOutputs], None], on_exit: Callable[[str], None]) -> None:
        reason = None
        while True:
            try:
                if not self._out_recv.poll(1.0):
                    if not self.proc.is_alive():
                        break
                    continue
                msg = decode_output(self._out_recv.recv_bytes())
            except (EOFError, OSError):
                self.proc.join(2)
                break
            except msgspec.DecodeError as e:  # a message off its schema (a bug): its outputs are lost, so stop
                log.exception("a message from the engine could not be read")
                reason = f"a message from the engine could not be read ({e}); stopping"
                break
            if isinstance(msg, EngineOutputs):
                try:
                    on_outputs(msg)
                except Exception:  # a bug there must not kill the reader silently
                    log.exception("error while processing engine outputs")
        if not self.stopping:
            on_exit(reason or f"the engine process exited (code {self.proc.exitcode})")

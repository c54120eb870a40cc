"""Adapter reads in worker processes, so they never contend with the engine thread for the GIL.

Why: a read of a PEFT dir is ~1000 short numpy operations, each of which releases the GIL and must win it back. In a
server whose engine thread is busy in Python, every win-back waits up to the interpreter's switch interval (5 ms):
on the H200 host a 7B rank-8 read that takes 40 ms alone took 350-570 ms under load (benchmarks/NOTES.md, session
9), and admission waited on it. A worker process reads with its own interpreter; the host tier's IO thread only
waits on a pipe (one GIL release) and takes the rows back with one file read.

Protocol (one request at a time per worker): the parent writes a length-prefixed pickle of ``(source, name,
model_cfg, max_rank, dtype, out_path)`` to the worker's stdin; the worker writes ``rows.vectors`` raw into
``out_path`` (in a private directory on a memory file system where there is one) and answers one JSON line on its
own copy of stdout (the real stdout is sent to stderr, so a library's print cannot break the protocol) with the
small tables, or with the error. Requests come only from this process, so the pickle is trusted; answers from the
worker (which reads untrusted files) are JSON and a raw array of the size the answer states, never unpickled. A
worker exits when its stdin closes, so it never outlives its server.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError, AdapterNotAllowed
from slora_jax.lora.pool_rows import AdapterRows
from slora_jax.lora.sources import PeftDirSource

__all__ = ["InlineReader", "ReadWorkers", "WorkerLost", "adapter_reader"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
_TABLES = ("rank", "a_off", "b_off", "scale", "layer_num_vectors")
READ_TIMEOUT_S = 120.0  # a read still running after this fails as the adapter's error (worker or thread alike)
MAX_HUNG_READS = 32  # in-process reads given up on whose threads still run; beyond, reads fail at once


class WorkerLost(RuntimeError):
    """A worker died or answered nonsense: the read should be retried another way (not the adapter's fault)."""


class _TimedOut(Exception):
    pass


class _Crashed(WorkerLost):
    """The worker took the request, then died or answered nonsense: maybe the adapter's doing (a crafted file), so
    its read is retried in a fresh worker once, never in the server's own process."""


class _Worker:
    def __init__(self, env: dict[str, str]):
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "slora_jax.engine.read_workers"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except OSError as e:
            raise WorkerLost(f"cannot start an adapter read worker: {e}") from None
        self._poll = select.poll()  # not select.select: it refuses descriptors above 1024 (a busy server has them)
        self._poll.register(self.proc.stdout, select.POLLIN)

    def ask(self, request: bytes, timeout_s: float) -> dict:
        try:
            self.proc.stdin.write(_HEADER.pack(len(request)) + request)
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # it was gone before it took the request
            raise WorkerLost(f"adapter read worker {self.proc.pid}: {e}") from None
        try:
            if not self._poll.poll(timeout_s * 1000):
                raise _TimedOut
            line = self.proc.stdout.readline()
        except (OSError, ValueError) as e:
            raise _Crashed(f"adapter read worker {self.proc.pid}: {e}") from None
        if not line:
            raise _Crashed(f"adapter read worker {self.proc.pid} exited ({self.proc.poll()}) while reading")
        try:
            return json.loads(line)
        except ValueError:
            raise _Crashed(f"adapter read worker {self.proc.pid} answered {line[:80]!r}") from None

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _transfer_dir() -> Path:
    """A private dir for the rows in transit: on /dev/shm when it has room (containers often give it 64 MB, less
    than two 7B adapters), else in the default temp dir."""
    shm = Path("/dev/shm")
    try:
        roomy = shm.is_dir() and shutil.disk_usage(shm).free >= 1 << 30
    except OSError:
        roomy = False
    return Path(tempfile.mkdtemp(prefix="slora-reads-", dir=shm if roomy else None))


class ReadWorkers:
    """Up to ``n`` worker processes reading adapter sources into :class:`AdapterRows`; thread-safe (a caller blocks
    until a worker is free). A worker starts at the first read that finds none idle (an engine that never reads a
    PEFT dir starts none; each costs ~2 s of imports once); one that dies is replaced. Closed by :meth:`close`, or
    when this object is collected."""

    def __init__(self, n: int, timeout_s: float = READ_TIMEOUT_S):
        """``timeout_s``: a read still running after it is stopped (its worker killed) and fails as the adapter's
        error, so a file crafted to make the reader spin or block ties up no IO thread for good."""
        if n < 1 or timeout_s <= 0:
            raise ValueError("ReadWorkers needs at least one worker and a positive timeout")
        self.timeout_s = float(timeout_s)
        self._dir = _transfer_dir()
        self._env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
            p for p in [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")] if p)}
        self._n = n
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._count = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._all, self._dir)
        self._inline = InlineReader(self.timeout_s)  # reads in this process: under the same timeout

    def _take(self) -> _Worker:
        """An idle worker, a new one while fewer than ``n`` run, else the next to come back."""
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self._closed:
                    raise WorkerLost("adapter read workers closed")
                if len(self._all) < self._n:
                    worker = _Worker(self._env)
                    self._all.append(worker)
                    return worker
            try:
                return self._idle.get(timeout=0.2)
            except queue.Empty:
                pass

    def _drop(self, worker: _Worker) -> None:
        worker.stop(kill=True)
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)  # the next read that finds none idle starts a new one

    def read(self, source, name: str, model_cfg, max_rank: int, dtype) -> AdapterRows:
        """``source.load_rows(name, model_cfg, max_rank, dtype)`` in a worker. Raises :class:`AdapterError` (or
        :class:`AdapterNotAllowed`) for the adapter's faults (a read past the timeout, or one that killed two
        workers, included), :class:`WorkerLost` when the workers failed for reasons of their own."""
        if self._closed:
            raise WorkerLost("adapter read workers closed")
        dtype = np.dtype(dtype)
        with self._lock:
            self._count += 1
            out = self._dir / f"{self._count}.bin"
        request = pickle.dumps((source, name, model_cfg, max_rank, dtype, str(out)))
        for attempt in (1, 2):
            worker = self._take()
            try:
                answer = worker.ask(request, self.timeout_s)
            except BaseException as e:  # whatever happened (an interrupt too), this worker is not handed out again
                self._drop(worker)
                out.unlink(missing_ok=True)
                if isinstance(e, _TimedOut):
                    raise AdapterError(name, f"reading it took longer than {self.timeout_s:g} s; the read was "
                                             "stopped", RETRY_AFTER_S) from None  # a slow disk may recover
                if isinstance(e, _Crashed) and attempt == 1:
                    log.warning("%s; reading adapter %r again in a fresh worker", e, name)
                    continue
                if isinstance(e, _Crashed):
                    raise AdapterError(name, f"reading it stopped the reader twice ({e})") from None
                raise
            self._idle.put(worker)
            try:
                if "transport" in answer:  # read, but not handed over (the transfer dir full): read it here
                    raise WorkerLost(f"adapter read worker could not hand {name!r} over: {answer['transport']}")
                return _rows_from(answer, name, out, dtype)
            finally:
                out.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def load_rows(self, source, name: str, model_cfg, max_rank: int, dtype) -> AdapterRows:
        """A PEFT dir's rows from a worker (one that fails is not the adapter's fault: then read here); any other
        source (in memory, synthetic, a mix) reads in this process, as :class:`InlineReader` reads."""
        if isinstance(source, PeftDirSource):
            try:
                return self.read(source, name, model_cfg, max_rank, dtype)
            except WorkerLost as e:
                log.warning("%s; reading adapter %r in this process", e, name)
        return self._inline.read(source, name, model_cfg, max_rank, dtype, self.timeout_s)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._finalizer()


class InlineReader:
    """Every source read in this process, each on a daemon thread of its own that the caller waits on for at most
    ``timeout_s`` (as long as a worker's read may take).

    Why a thread per read: a Python thread cannot be stopped, so a read that hangs (a network file system that never
    answers, a source crafted to block) would hold the host tier's IO thread running it for good, and as many hung
    reads as IO threads would leave every other client's adapters queued forever. Here the caller gives up after the
    timeout: the read fails as the adapter's error (retryable, as a worker's timed-out read), the caller goes on to
    the next read and the hung thread is left to end on its own. At most ``max_hung`` such threads may exist; while
    that many do, reads fail at once (retryable too) rather than pile up threads. A thread costs ~0.1 ms a read.
    """

    def __init__(self, timeout_s: float = READ_TIMEOUT_S, max_hung: int = MAX_HUNG_READS):
        if timeout_s <= 0 or max_hung < 1:
            raise ValueError("InlineReader needs a positive timeout and max_hung >= 1")
        self.timeout_s, self.max_hung = float(timeout_s), int(max_hung)
        self.hung = 0  # reads given up on whose threads still run
        self._lock = threading.Lock()

    def load_rows(self, source, name: str, model_cfg, max_rank: int, dtype) -> AdapterRows:
        return self.read(source, name, model_cfg, max_rank, dtype, self.timeout_s)

    def read(self, source, name: str, model_cfg, max_rank: int, dtype, timeout_s: float) -> AdapterRows:
        """``source.load_rows(...)`` on a thread of its own; raises what it raises, or :class:`AdapterError` if it
        takes longer than ``timeout_s`` (or ``max_hung`` earlier reads still hang)."""
        with self._lock:
            if self.hung >= self.max_hung:
                raise AdapterError(name, f"not read: {self.hung} earlier adapter reads still hang past the "
                                         f"{timeout_s:g} s read timeout", RETRY_AFTER_S)
        read = _Read()
        threading.Thread(target=self._run, args=(read, source, name, model_cfg, max_rank, dtype), daemon=True,
                         name=f"adapter-read {name[:60]}").start()
        try:
            read.done.wait(timeout_s)
        finally:  # timed out (or interrupted): the thread is abandoned, unless it ended just now
            with self._lock:
                abandoned = read.abandoned = not read.finished
                self.hung += abandoned
        if abandoned:
            raise AdapterError(name, f"reading it took longer than {timeout_s:g} s; the read was abandoned",
                               RETRY_AFTER_S)  # a slow disk may recover
        rows, error = read.rows, read.error
        del read
        if error is None:
            return rows
        try:
            raise error
        finally:
            del error  # no cycle through this frame (see lora.errors.rejecting)

    def _run(self, read: _Read, source, name: str, model_cfg, max_rank: int, dtype) -> None:
        t0 = time.monotonic()
        try:
            read.rows = source.load_rows(name, model_cfg, max_rank, dtype)
        except BaseException as e:  # noqa: BLE001 - raised on the waiting thread
            read.error = e.with_traceback(None)  # this thread's frames stay here
        with self._lock:
            read.finished = True
            self.hung -= read.abandoned
        read.done.set()
        if read.abandoned:
            read.rows = read.error = None
            log.warning("a read of adapter %r abandoned after the timeout ended after %.0f s", name,
                        time.monotonic() - t0)

    def close(self) -> None:
        pass


class _Read:
    __slots__ = ("done", "finished", "abandoned", "rows", "error")

    def __init__(self):
        self.done, self.finished, self.abandoned = threading.Event(), False, False
        self.rows: AdapterRows | None = None
        self.error: BaseException | None = None


def adapter_reader(processes: int) -> ReadWorkers | InlineReader:
    """What reads adapter sources for the host tier: ``processes`` > 0 worker processes for PEFT dirs, else inline."""
    return ReadWorkers(processes) if processes else InlineReader()


def _stop_all(workers: list[_Worker], directory: Path) -> None:
    """Stop every worker and remove the transfer dir (not a method: the finalizer must not hold the object)."""
    while workers:
        workers.pop().stop()
    shutil.rmtree(directory, ignore_errors=True)


def _rows_from(answer: dict, name: str, out: Path, dtype: np.dtype) -> AdapterRows:
    if "error" in answer:
        cls = AdapterNotAllowed if answer.get("not_allowed") else AdapterError
        retry = answer.get("retry_after_s")
        raise cls(name, str(answer["error"]), float(retry) if isinstance(retry, int | float) else None)
    try:
        shape = tuple(int(d) for d in answer["shape"])
        vectors = np.fromfile(out, dtype=dtype)
        if vectors.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{vectors.size} values for shape {shape}")
        tables = {k: np.asarray(answer[k], dtype=answer[k + "_dtype"]) for k in _TABLES}
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise WorkerLost(f"adapter read worker answered badly for {name!r}: {e}") from None
    return AdapterRows(name=name, vectors=vectors.reshape(shape), **tables)


def _serve() -> None:
    """The worker: answer requests until stdin closes."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the answers
    sys.stdout = sys.stderr
    stdin = sys.stdin.buffer
    while True:
        head = stdin.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return
        source, name, model_cfg, max_rank, dtype, out = pickle.loads(stdin.read(_HEADER.unpack(head)[0]))
        rows = None
        try:
            rows = source.load_rows(name, model_cfg, max_rank, dtype)
            answer = {"shape": list(rows.vectors.shape)}
            for k in _TABLES:
                table = np.asarray(getattr(rows, k))
                answer[k], answer[k + "_dtype"] = table.tolist(), table.dtype.str
        except AdapterError as e:
            answer = {"error": e.reason, "not_allowed": isinstance(e, AdapterNotAllowed),
                      "retry_after_s": e.retry_after_s}
        except Exception as e:  # noqa: BLE001 - reported to the parent as the adapter's failure
            answer = {"error": f"load failed: {type(e).__name__}: {e}",
                      "retry_after_s": RETRY_AFTER_S if isinstance(e, OSError) else None}
        if rows is not None:
            try:  # a failed hand-over is not the adapter's fault: the parent reads it itself
                np.ascontiguousarray(rows.vectors).tofile(out)
            except OSError as e:
                answer = {"transport": f"{type(e).__name__}: {e}"}
                Path(out).unlink(missing_ok=True)
        del rows  # an idle worker holds no adapter
        try:
            proto.write(json.dumps(answer) + "\n")
            proto.flush()
        except OSError:  # the parent is gone
            Path(out).unlink(missing_ok=True)
            return


if __name__ == "__main__":
    _serve()

"""Ranks 1.. of a tensor-parallel engine: processes that build the same engine as rank 0 and
repeat every call that changes it.

The engine is deterministic: given the same requests, in the same order, a scheduler makes the
same plans; every rank's forward ends in the same logits (the collectives give every rank the
same bits: tandem/parallel/group.py), and sampling is keyed by (seed, position), so every rank
samples the same tokens without exchanging them, and every rank's scheduler, grammars and
drafts stay in lockstep. Rank 0 (the caller's process) sends each call that changes the
engine (`add_request`, `abort_request`, `step`) to the other ranks before running it itself:
a step's collectives then meet on every rank. What only one rank may measure (the KV blocks
its memory allows) is agreed through the group (TPGroup.min_int); a choice made from timings
(num_speculative_tokens_per_batch_size="auto") is refused under tensor parallelism.

Each worker says it started before rank 0 joins the group: one that exits first (a script that
makes the LLM at its top level, which every spawned rank imports) is reported with what to do,
not waited for; rank 0 joins once every worker has said it is joining (TPGroup's store key), and
a worker that fails before that has its error raised, not waited for. A worker that fails to
build its engine reports its error through its pipe and rank 0 raises it: once rank 0 has built
its own engine, or, when the failed rank makes rank 0's next collective fail (gloo: the peer's
connection reset, at once; NCCL, not run across GPUs here, may notice only at TPGroup's
timeout), in place of that collective's error. A worker whose own call fails later (its memory,
say: a bad request fails on every rank alike and is not one) reports the error and exits, so
rank 0's collectives fail at once rather than wait for it, and rank 0 raises that error. Once a
worker has exited, every later call but an abort raises a fatal StepError; a step that fails on
rank 0 stops the engine (fatal too), since the other ranks may have run it and gone on
(Engine.tensor_parallel), and so does one interrupted there (Ctrl-C).
"""
from __future__ import annotations

import inspect
import logging
import os
import signal
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from tandem.errors import ConfigError, RequestError, StepError, TandemError
from tandem.parallel.group import joining_key

logger = logging.getLogger("tandem")

# The engine calls repeated on every rank, in rank 0's order.
REPLICATED_CALLS = ("add_request", "abort_request", "step", "reset_prefix_cache")
START_TIMEOUT_S = 1800  # building a rank's engine: loading, profiling, compiling the CPU kernels


def threads_per_rank(size: int) -> int:
    """CPU threads each rank's torch uses: the cores shared out, so the ranks do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // size)


class Workers:
    """Processes running ranks 1..size-1, each `LLM(**llm_kwargs)` on its rank, then the calls sent."""

    def __init__(self, size: int, port: int, llm_kwargs: dict):
        """port: rank 0's group store (tandem.parallel.group.host_store)."""
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, size, port, llm_kwargs, child),
                               name=f"tandem-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_started(self) -> None:
        """Return once every rank's process runs its engine's code; raise if one exits before (a
        spawned process imports the caller's main module first, and an LLM made at that module's
        top level would start ranks of its own there, which multiprocessing refuses)."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _started(conn):
                if not proc.is_alive() or time.monotonic() > deadline:
                    proc.join(timeout=5)
                    self.close()
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited while starting (exit code {proc.exitcode}; its error is "
                        "above). The ranks are spawned processes that import your main module first: create the "
                        "LLM under `if __name__ == \"__main__\":`, not at the module's top level")

    def wait_joining(self, store) -> None:
        """Return once every rank has said it joins the group (its key in rank 0's store), so rank
        0's join, which waits for them all, cannot wait for a rank that failed before; raise that
        rank's error."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not store.check([joining_key(rank)]):
                error = None
                if conn.poll(0.05) or not proc.is_alive():  # it said something before joining: its failure
                    error = _startup_error(rank, conn, proc) or RuntimeError(
                        f"tensor-parallel rank {rank} said it was ready before joining")
                elif time.monotonic() > deadline:
                    error = RuntimeError(f"tensor-parallel rank {rank} did not join within {START_TIMEOUT_S} s")
                if error is not None:
                    self.close()
                    raise error

    def wait_ready(self) -> None:
        """Return once every rank has built its engine; raise the first rank's start-up error."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            if not conn.poll(START_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S} s")
            error = _startup_error(rank, conn, proc)
            if error is not None:
                self.close()
                raise error

    def failed_rank(self, wait_s: float = 5.0) -> Exception | None:
        """After rank 0's start-up failed in a collective: the error of the rank that caused it, or
        None. A rank that fails (out of memory while loading, say) makes the others' next
        collective fail with the transport's error ("connection closed by peer"); its own error,
        not theirs, is the one to show (a ConfigError first, then any but a transport error)."""
        deadline = time.monotonic() + wait_s
        errors = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            if conn.poll(max(0.0, deadline - time.monotonic())):
                error = _startup_error(rank, conn, proc)
                if error is not None:
                    errors.append(error)
        errors.sort(key=lambda e: (not isinstance(e, ConfigError), is_transport_error(e)))
        return errors[0] if errors and not is_transport_error(errors[0]) else None

    def send(self, name: str, args: tuple, kwargs: dict) -> list[int]:
        """Send a call to every live rank; -> the ranks whose process has exited. A call that
        cannot be sent (a request's extra_args that do not pickle) is refused before any rank gets it."""
        try:
            message = ForkingPickler.dumps((name, args, kwargs))  # what conn.send would send
        except Exception as e:
            raise RequestError(f"{name}: its arguments cannot be sent to the other tensor-parallel ranks ({e}); "
                               "a request's SamplingParams (extra_args too) must be picklable") from None
        gone = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            if not proc.is_alive():
                gone.append(rank)
                continue
            conn.send_bytes(message)
        return gone

    def failed_call(self, wait_s: float = 2.0) -> StepError | None:
        """After a call failed on rank 0 (a collective broken by a rank that left): the error the
        first rank that failed reported, or None."""
        deadline = time.monotonic() + wait_s
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    status, detail = conn.recv()
                    if status == "failed":
                        return StepError(f"tensor-parallel rank {rank} failed, so the engine stopped; restart the "
                                         f"process. Its error: {detail}", [], fatal=True)
            except (EOFError, OSError):
                continue
        return None

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


class ReplicatedEngine:
    """Rank 0's Engine: the calls that change it go to every other rank first, and so does setting
    one of its attributes (a setting such as grammar_drafting changes the drafts, hence the steps);
    everything else is the engine's own (reading attributes, validation, read-only calls)."""

    def __init__(self, engine, workers: Workers, tp, threads: int):
        """threads: the caller's torch threads, which rank 0 gave up for its share of the CPU (the
        count now). The ranks stop and the threads come back on close(), or once the engine is
        dropped (or at exit), unless something changed the count meanwhile: another tensor-parallel
        engine closed first and gave back the count this one found (it had lowered it too)."""
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_workers", workers)
        object.__setattr__(self, "_tp", tp)
        object.__setattr__(self, "_threads", threads)
        object.__setattr__(self, "_release", weakref.finalize(self, _release_ranks, workers, tp, threads,
                                                             torch.get_num_threads()))

    def __setattr__(self, name, value):
        self._workers.send("__setattr__", (name, value), {})
        setattr(self._engine, name, value)

    def __getattr__(self, name):
        attr = getattr(self._engine, name)
        if name in REPLICATED_CALLS:
            def replicated(*args, **kwargs):
                if self._engine.stopped:  # it raises or reports what ended; the other ranks take no more
                    return attr(*args, **kwargs)
                # A call that cannot bind (a wrong keyword) raises here, not on the ranks, which would exit on it
                inspect.signature(attr).bind(*args, **kwargs)
                gone = self._workers.send(name, args, kwargs)
                if gone and name != "abort_request":  # (an abort still ends the request here)
                    error = self._workers.failed_call(0) or StepError(
                        f"tensor-parallel rank {gone[0]} has exited, and the engine cannot run without it; restart "
                        "the process", [], fatal=True)
                    self._engine.stop(str(error))
                    raise error
                try:
                    return attr(*args, **kwargs)
                except StepError as e:
                    cause = self._workers.failed_call() if e.fatal else None
                    if cause is None:
                        raise
                    self._engine.stop(str(cause))
                    raise StepError(str(cause), e.request_ids, fatal=True) from e

            return replicated
        return attr

    def close(self) -> None:
        """Stop the other ranks and leave the group: the engine takes no more work (a later call
        says it was closed); the process gets its torch threads back."""
        self._engine.stop("the engine was closed (engine.close()); make a new LLM to generate again")
        self._release()


def _release_ranks(workers: Workers, tp, threads: int, share: int) -> None:
    """Stop the other ranks, leave the group and give the caller its torch threads back (once),
    where they are still rank 0's share."""
    workers.close()
    tp.close()
    if torch.get_num_threads() == share:
        torch.set_num_threads(threads)


# What a collective raises when another rank has gone (gloo's socket errors; NCCL's remote errors).
_TRANSPORT_ERRORS = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
                     "NCCL communicator was aborted")


def is_transport_error(e: BaseException) -> bool:
    """Whether e is a collective's failure because another rank went away (not a cause of its own)."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _TRANSPORT_ERRORS)


def _startup_error(rank: int, conn: Connection, proc) -> Exception | None:
    """The rank's start-up message (conn has one) -> None when it says ready, else its error."""
    try:
        status, detail = conn.recv()
    except EOFError:
        proc.join(timeout=5)
        status, detail = "error", f"its process exited (code {proc.exitcode})"
    if status == "ready":
        return None
    if status == "config":
        return ConfigError(f"tensor-parallel rank {rank}: {detail}")
    return RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")


def _started(conn: Connection) -> bool:
    """Whether the rank at conn's other end has said it started (False: not yet, or it has exited)."""
    if not conn.poll(0.1):
        return False
    try:
        return conn.recv()[0] == "started"
    except EOFError:
        return False


def _worker_main(rank: int, size: int, port: int, llm_kwargs: dict, conn: Connection) -> None:
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides (a server drains its requests
    # first) and the other ranks end with it (None, or the pipe's EOF), not with the interrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(("started", None))
    torch.set_num_threads(threads_per_rank(size))
    logging.getLogger("tandem").setLevel(logging.ERROR)  # rank 0 logs the engine's progress and warnings
    try:
        from tandem.engine.llm import LLM

        llm = LLM(**llm_kwargs, _rank=(rank, port))
    except ConfigError as e:
        conn.send(("config", str(e)))
        return
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=8)))
        return
    conn.send(("ready", None))
    engine = llm.engine
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        name, args, kwargs = msg
        try:
            getattr(engine, name)(*args, **kwargs)
        except TandemError:  # a bad request: rank 0 refuses it the same way
            pass
        except BaseException as e:
            # This rank's own failure (its memory, say), which rank 0 may not share: the ranks no longer
            # agree. Say so and leave, so rank 0's collectives fail at once instead of waiting for this rank.
            logger.error("tensor-parallel rank %d: %s failed", rank, name, exc_info=True)
            try:
                conn.send(("failed", f"{name}: {e!r}"))
            except (OSError, ValueError):
                pass
            break
    llm.tp.close()

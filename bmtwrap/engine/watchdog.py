"""Naming the rank at fault when a collective fails: heartbeats in the job's store, and the errors built from them.

[Note: heartbeats]
A collective that fails or times out tells each surviving rank almost nothing: gloo names a peer's
socket address ("Connection reset by peer [10.0.0.7]:41235", "Timed out waiting 600000ms for recv
operation"), never a rank, and never the buffer the engine was moving. So every rank of a job of
more than one keeps a :class:`Watchdog`:

- the engine counts the collectives it issues (``begin``; a local integer and a tuple, no I/O) and
  marks the one it waits in;
- a daemon thread publishes, every ``interval`` seconds (1 s), one small record per rank into the
  job's ``torch.distributed`` store: a beat counter, how many collectives the rank has issued, the
  last ``RECENT`` of them, the one it is blocked waiting in (:class:`RankRecord`, in ``verdicts.py``
  with the reading of it). One ``set`` of a few hundred bytes per rank per second is the whole
  steady-state cost;
- when a collective fails on a rank, that rank reads every record, then polls the ranks whose beat
  has not moved since, for up to ``STALE_BEATS`` intervals (3 s). A rank whose beat never moved is
  dead (SIGKILL, a segfault, a lost host: nothing ran to say goodbye); one that marked itself
  ``exited`` left through a normal exit or an exception; one that is alive but has issued fewer
  collectives than the one that failed never arrived (stuck in computation, data loading, or a
  collective of its own); one whose recent collectives differ from ours under the same numbers
  runs other blocks. The :class:`CollectiveError` raised names them.

Under hybrid sharding (see [Note: hybrid sharding] in ``collectives.py``) a collective runs in a
sub-group: its peers. Every rank still issues the same sequence, so the numbers agree across the
world, but only the peers can stall it: a rank of another shard group that lags behind is no cause.
So the diagnosis judges the peers first; the other ranks are named as causes only when no peer is
one (a chain: this rank's replica waits in its own shard group for a dead rank there), and a dead or
exited one among them is otherwise mentioned as context. A rank that waits ends early (see
[Note: a failed step]) only for a peer that will never arrive.

Beats are counters, not timestamps: staleness is judged on the reader's clock alone, so hosts need
no synchronised clocks.

Where the store lives decides what survives. Under ``torchrun`` the agent of the first node hosts
it (``TORCHELASTIC_USE_AGENT_STORE=True``, the default for both the static and the c10d rendezvous),
so it outlives any worker. Started without an agent (``env://`` from mpirun or a scheduler), rank 0
hosts it inside its own process: when rank 0 dies the records die too, and the error says so.

Each thread talks to the store through its own clone (``Store.clone()``: a second connection), with
a short timeout, so that neither blocks the process group's own use of the store nor hangs on a store
that is gone.

On NCCL a collective's ``wait()`` does not block the host, and on a timeout ProcessGroupNCCL's own
watchdog aborts the process, after waiting a minute for its debug dump; no Python error is raised
for us to enrich. There a ``wait()`` records a CUDA event behind its collective (one such probe at a
time, so that it costs nothing per collective); the heartbeat thread checks it each beat, writes the
same diagnosis to stderr shortly before the timeout, so that the log names the rank and the buffer,
and ends the process ``EXIT_GRACE_S`` past the timeout: a collective stuck that long never completes,
and the job should fail now, not a minute later. (A peer's death that NCCL notices first, as a
remote error, still ends the process with NCCL's message only.)
"""

from __future__ import annotations

import atexit
import collections
import datetime
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .verdicts import RankRecord, Verdict, among, judge, moved

__all__ = ["CollectiveError", "CompletionWatch", "RankRecord", "Watchdog", "default_store", "describe"]

# Seconds between two records of one rank. A rank is dead once STALE_BEATS intervals pass without a
# new record: three, so that one late beat (a busy host, a long GIL hold) is not a death.
HEARTBEAT_INTERVAL_S = 1.0
STALE_BEATS = 3
# Collectives each record lists (the last ones issued), to find where two ranks' sequences part.
RECENT = 8
# The store operations of the watchdog give up after this long (the store's host may be gone).
STORE_TIMEOUT = datetime.timedelta(seconds=10)
# NCCL: seconds past the timeout after which a collective still incomplete ends the process (see
# [Note: heartbeats]); ProcessGroupNCCL would end it too, but only after a minute spent on its dump.
EXIT_GRACE_S = 5.0
_KEY = "bmtwrap/heartbeat/"

Operation = Tuple[str, str]  # (kind, label): ("all-gather", "layers.3"), formatted only for messages
Peers = Tuple[int, ...]  # the global ranks a collective runs among, this one included


def describe(op: Operation) -> str:
    """``("all-gather", "layers.3")`` → ``"all-gather of 'layers.3'"``."""
    kind, label = op
    return f"{kind} of {label!r}" if label else kind


class CollectiveError(RuntimeError):
    """A collective of the job failed, timed out, or ran different operations on different ranks.

    The message names the operation (``"all-gather of 'layers.3'"``), the ranks at fault and what
    happened to them, and the backend's own error.

    Attributes:
        operation: the operation this rank was running, e.g. ``"reduce-scatter of 'layers.0'"``.
        ranks: the ranks found at fault (dead, exited, not arrived, or running another operation);
            empty when none could be told.

    Raised by the engine's collectives, ``bmtwrap.synchronize()`` and ``bmtwrap.sum_loss()`` in a job
    of more than one rank; the process should end (the process group is unusable after a failure).

    Example::

        try:
            train(model)
        except bmt.CollectiveError as error:  # e.g. "rank 3 is dead: no heartbeat for 3 s ..."
            log.error("step failed in %s; ranks at fault: %s", error.operation, error.ranks)
            raise
    """

    def __init__(self, message: str, *, operation: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.operation = operation
        self.ranks = tuple(ranks)


def default_store() -> Optional[dist.Store]:
    """The store of the default process group, or ``None`` where torch does not expose it.

    ``_get_default_store`` is private but long-standing; without it the watchdog still raises
    :class:`CollectiveError` naming the operation, only not the rank.
    """
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, ValueError, RuntimeError):
        return None


def _own_connection(store: dist.Store) -> dist.Store:
    try:
        clone = store.clone()
    except (RuntimeError, NotImplementedError):  # a store without clone(): share the connection
        return store
    clone.set_timeout(STORE_TIMEOUT)
    return clone


class _Probe(NamedTuple):
    seq: int  # the last collective waited for when it was set
    op: Operation
    since: float  # time.monotonic() when it was set
    done: Callable[[], bool]  # whether everything waited for up to then has completed
    first: int  # the first collective not yet seen complete


class CompletionWatch:
    """NCCL: whether the collectives waited for have completed, at the cost of one probe at a time.

    ``wait()`` on NCCL only orders the current stream after the collective. A CUDA event recorded on
    that stream afterwards completes once the collective, and every one waited for before it, has:
    that is the probe. The Work itself is not kept (it holds the collective's buffers), and an event
    per collective would cost ~10 us each; instead the first wait sets a probe, and the heartbeat
    thread, finding it complete, sets the next one on the same stream if collectives were waited for
    since. So a collective stuck on the GPU is covered by a probe within one beat even when the host
    then blocks (``.item()``) and waits for nothing more.

    Args:
        marker: records a marker behind the work queued so far and returns its ``done()``; default a
            CUDA event, on the current stream of the main thread's last wait that set a probe (the
            thread's own current stream is another).
    """

    def __init__(self, marker: Optional[Callable[[], Callable[[], bool]]] = None) -> None:
        self.last_waited: Tuple[int, Operation] = (0, ("", ""))
        self.seen_complete = 0  # every collective up to this one has completed
        self.probe: Optional[_Probe] = None
        self._marker: Callable[[bool], Callable[[], bool]] = (lambda _: marker()) if marker else self._cuda_marker
        self._event: Optional[torch.cuda.Event] = None
        self._stream: Optional[torch.cuda.Stream] = None

    def waited(self, seq: int, op: Operation) -> None:
        """The main thread waited for collective ``seq``: a tuple assignment, and the first probe."""
        self.last_waited = (seq, op)
        if self.probe is None:
            self.arm(main_thread=True)

    def arm(self, main_thread: bool = False) -> None:
        seq, op = self.last_waited
        self.probe = _Probe(seq, op, time.monotonic(), self._marker(main_thread), self.seen_complete + 1)

    def _cuda_marker(self, main_thread: bool) -> Callable[[], bool]:
        if self._event is None:
            self._event = torch.cuda.Event()
        if main_thread:  # about once a beat: the stream the engine's waits go to
            self._stream = torch.cuda.current_stream()
        self._event.record(self._stream)
        return self._event.query

    def check(self) -> Optional[_Probe]:
        """The heartbeat thread's look: the probe if it is still incomplete, else ``None`` (and the next one set)."""
        probe = self.probe
        if probe is None or not probe.done():
            return probe
        self.seen_complete = probe.seq
        self.probe = None
        # Cleared before this test, so that a wait in between sets a probe itself; both setting one is harmless.
        if self.last_waited[0] > probe.seq:
            self.arm(main_thread=False)
        return None


class Watchdog:
    """One rank's heartbeat and the diagnosis of a failed collective (see [Note: heartbeats]).

    Made and started by :func:`bmtwrap.init_distributed` for a job of more than one rank, stopped at
    process exit, when the default process group is destroyed, or by :meth:`stop`.

    Args:
        store: the job's store (every rank's), or ``None``: then failures name no rank.
        rank, world_size: this process's place in the default group.
        timeout: the collectives' timeout (for messages, and the NCCL report's deadline).
        check_collectives: whether the engine's collectives first check that every rank issues the
            same operation (see :func:`bmtwrap.engine.collectives.agree`).
        watch_completion: whether ``wait()`` leaves the host running (NCCL): then a
            :class:`CompletionWatch` follows the collectives waited for, and the thread reports those
            stuck shortly before ``timeout`` and ends the process ``EXIT_GRACE_S`` after it.
        interval: seconds between heartbeats.
        alive: whether the watched group still exists; the thread stops once it returns False
            (``destroy_process_group()`` cannot be hooked, so each beat asks).
    """

    def __init__(self, store: Optional[dist.Store], rank: int, world_size: int, timeout: datetime.timedelta, *,
                 check_collectives: bool = False, watch_completion: bool = False,
                 interval: float = HEARTBEAT_INTERVAL_S, alive: Callable[[], bool] = dist.is_initialized) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.check_collectives = check_collectives
        self.interval = interval
        self._alive = alive
        self._store = store  # the diagnosis's own connection once started (see [Note: heartbeats])
        # The main thread writes these, the heartbeat thread reads them: one reference each, so every
        # read sees a whole value (assignments are atomic under the GIL).
        self.issued = 0
        self._recent: Deque[Tuple[int, Operation]] = collections.deque(maxlen=RECENT)
        # (number, operation, peers: the ranks taking part, None for every rank)
        self._waiting: Optional[Tuple[int, Operation, Optional[Peers]]] = None
        self._completion: Optional[CompletionWatch] = CompletionWatch() if watch_completion else None
        self._reported = -1  # the collective the stall report was written for
        self._failed: Optional[Tuple[int, str]] = None  # (step, what) of a step that failed here, until a collective
        self._last_wait = 0  # the collective waited for at the last beat (the heartbeat thread's own)
        self._suspects: Dict[int, int] = {}  # peer -> its collective count when it was first seen failed or exited
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()

    # --- the engine's side: one call per collective ------------------------------------------
    def begin(self, op: Operation) -> int:
        """Count a collective being issued; returns its number (1, 2, … on every rank alike)."""
        if self._failed is not None:  # this rank goes on after a failed step: the others need not stop
            self._failed = None
        self.issued += 1
        self._recent.append((self.issued, op))
        return self.issued

    @contextmanager
    def blocking(self, op: Operation) -> Iterator[None]:
        """Around a collective that blocks until done (a barrier, ``all_reduce`` without ``async_op``): counts it
        and turns the backend's error into a :class:`CollectiveError`, as :meth:`wait` does."""
        seq = self.begin(op)
        self._waiting = (seq, op, None)
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise self.failure(seq, op, error) from error
        finally:
            self._waiting = None

    def wait(self, work: Any, seq: int, op: Operation, peers: Optional[Peers] = None) -> None:
        """``work.wait()``, turning the backend's error into a :class:`CollectiveError` naming the ranks at fault.

        ``peers``: the ranks of the sub-group the collective runs in (``None``: every rank).
        """
        self._waiting = (seq, op, peers)
        try:
            work.wait()
        except RuntimeError as error:  # gloo's and NCCL's errors (DistBackendError is one)
            raise self.failure(seq, op, error, peers=peers) from error
        finally:
            self._waiting = None
        if self._completion is not None and self._thread is not None:
            self._completion.waited(seq, op)

    def step_failed(self, step: int, what: str) -> None:
        """An exception escapes the engine's part of ``step`` on this rank (see [Note: a failed step])."""
        self._failed = (step, what)

    # --- the thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the heartbeat thread (a daemon) and stop it at process exit."""
        if self._store is None or self._thread is not None:
            return
        beats = _own_connection(self._store)
        self._store = _own_connection(self._store)
        self._thread = threading.Thread(target=self._beat_loop, args=(beats,),
                                        name=f"bmtwrap-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        _end_promptly_after_uncaught_exception()  # registered first, so that it runs after stop()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the heartbeat thread after it marks this rank as exited. Safe to call twice, or in a forked child."""
        thread, self._thread = self._thread, None
        if thread is None or os.getpid() != self._pid:  # a fork copies the object but not the thread
            return
        self._stop.set()
        thread.join(timeout=STORE_TIMEOUT.total_seconds())
        atexit.unregister(self.stop)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _record(self, beat: int, exited: bool = False) -> RankRecord:
        waiting = self._waiting
        recent = [(seq, describe(op)) for seq, op in list(self._recent)]  # list(): one step, under the GIL
        failed = self._failed
        blocked = "" if waiting is None else f"#{waiting[0]}, {describe(waiting[1])}"
        return RankRecord(beat, self.issued, recent, blocked, exited, "" if failed is None else failed[1],
                          0 if failed is None else failed[0])

    def _beat_loop(self, store: dist.Store) -> None:
        key = f"{_KEY}{self.rank}"
        beat = 0
        while self._alive():
            beat += 1
            try:
                store.set(key, self._record(beat).encode())
            except (RuntimeError, OSError):
                # The store's host is gone (a TCPStore connection does not come back): stop beating, rather
                # than have c10d log a failed send each second. Failures then say the store is unreachable.
                return
            probe = self._check_completion()
            self._check_peers(store, probe)
            if self._stop.wait(self.interval):
                break
        try:
            store.set(key, self._record(beat + 1, exited=True).encode())
        except (RuntimeError, OSError):
            pass

    def _check_completion(self) -> Optional[_Probe]:
        """NCCL: report (once) collectives incomplete for longer than the timeout minus a margin; end the process
        once they are ``EXIT_GRACE_S`` past the timeout (ProcessGroupNCCL has given up on them by then). Returns
        the probe still incomplete, if one is."""
        probe = None if self._completion is None else self._completion.check()
        if probe is None:
            return None
        waited = time.monotonic() - probe.since
        timeout = self.timeout.total_seconds()
        margin = min(timeout / 2, STALE_BEATS * self.interval + 10)  # time to diagnose before NCCL aborts
        if probe.seq != self._reported and waited > timeout - margin:
            self._reported = probe.seq
            # On a thread of its own: the diagnosis takes up to STALE_BEATS intervals, during which this thread
            # must go on beating, or the other ranks, diagnosing the same stall, would find this one dead.
            threading.Thread(target=self._report_stall, args=(probe.seq, probe.op, waited, probe.first),
                             daemon=True).start()
        if waited > timeout + EXIT_GRACE_S:
            print(f"[bmtwrap watchdog, rank {self.rank}] ending the process: collective #{probe.seq} "
                  f"({describe(probe.op)}) is still incomplete {waited - timeout:.0f} s past the timeout",
                  file=sys.stderr, flush=True)
            self._end_process(1)
        return probe

    def _check_peers(self, store: dist.Store, probe: Optional[_Probe]) -> None:
        """End this process if it waits for a collective that a rank which failed or exited will never issue.

        [Note: a failed step]
        When an exception escapes the engine's part of a step on one rank (``Engine.step_failed``:
        out of memory in a block, an error in the model's code), the other ranks go on to collectives
        that rank never issues, and would wait for them until the timeout (ten minutes by default),
        or for ever where a collective hangs on the GPU. So each rank's record says that its step
        failed, and with what, until it issues another collective (a program that catches the error
        and goes on clears it). A rank whose wait has lasted a beat reads the others' records; one
        that has failed (in a step this rank did not fail in too) and has issued fewer collectives
        than the one waited for, or that has exited (a collective it finished would have finished
        here too), will never arrive: seen so on two beats in a row, this
        rank prints what that rank said and ends with status 1, within about three seconds. A rank
        dying of an uncaught exception ends promptly too (:func:`_end_promptly_after_uncaught_exception`).
        """
        waiting = self._waiting
        seq = waiting[0] if waiting is not None else probe.seq if probe is not None else 0
        peers = waiting[2] if waiting is not None else None
        waited_before, self._last_wait = self._last_wait, seq
        if seq == 0 or seq != waited_before:  # not waiting, or not for a whole beat yet
            self._suspects.clear()
            return
        try:
            records = {r: RankRecord.decode(raw) for r, raw in zip(self._others(), store.multi_get(
                [f"{_KEY}{r}" for r in self._others()]))}
        except (RuntimeError, OSError, ValueError):
            return
        mine = self._failed
        # An exited rank never finishes what it issued either: a collective it finished would have finished here.
        gone = {r: rec for r, rec in records.items() if (peers is None or r in peers) and (rec.exited or (
            rec.issued < seq and rec.failed and not (mine is not None and mine[0] == rec.failed_step)))}
        confirmed = [r for r, rec in gone.items() if self._suspects.get(r) == rec.issued]
        self._suspects = {r: rec.issued for r, rec in gone.items()}
        if not confirmed:
            return
        rank = confirmed[0]
        rec = gone[rank]
        why = (f"rank {rank} failed in step {rec.failed_step}: {rec.failed}" if rec.failed else
               f"rank {rank} has exited")
        print(f"[bmtwrap watchdog, rank {self.rank}] ending the process: {why}; it issued {rec.issued} collectives "
              f"and will not finish #{seq}, which this rank waits for", file=sys.stderr, flush=True)
        self._end_process(1)

    def _report_stall(self, seq: int, op: Operation, waited: float, first: int) -> None:
        error = self.failure(seq, op, None, waited=waited, first=first)
        print(f"[bmtwrap watchdog, rank {self.rank}] {error}", file=sys.stderr, flush=True)

    # Ends the process from the heartbeat thread: nothing else can, while the main thread waits on the GPU.
    _end_process = staticmethod(os._exit)

    # --- diagnosis --------------------------------------------------------------------------------
    def failure(self, seq: int, op: Operation, error: Optional[BaseException], *, waited: Optional[float] = None,
                first: Optional[int] = None, peers: Optional[Peers] = None) -> CollectiveError:
        """The error for collective ``seq`` (``op``), which failed with ``error`` (``None``: is still stuck, it or
        one of those from ``first`` on); ``peers``: the ranks it runs among (``None``: every rank).

        Reads the other ranks' records for ``STALE_BEATS`` intervals (less when every rank's beat moves).
        """
        operation = describe(op)
        backend = "" if error is None else str(error).strip()
        if error is None:
            what = f"has been waiting {waited:.1f} s (timeout {self.timeout.total_seconds():g} s)"
            if first is not None and first < seq:  # a probe covers every collective waited for since the last one
                before = f"#{first}" if first == seq - 1 else f"one of #{first}-#{seq - 1}"
                what = f"(or {before} before it) {what}"
        elif "timed out" in backend.lower() or "timeout" in backend.lower():
            what = f"timed out after {self.timeout.total_seconds():g} s"
        else:
            what = "failed"
        head = f"{operation} (collective #{seq}) {what} on rank {self.rank}"
        verdicts, unknown = self._verdicts(seq)
        verdicts = among(verdicts, peers)
        causes = [v for v in verdicts if v.cause]
        followers = [v for v in verdicts if not v.cause]
        if causes:
            body = "; ".join(v.says for v in causes) + "".join(f" ({v.says})" for v in followers) + "."
            if any(v.parted for v in causes):
                body += (" The ranks run different blocks: look for control flow that depends on the rank or its data; "
                         "init_distributed(check_collectives=True) stops at the first difference.")
            body += (" Look at the log of the ranks named for what happened first; a rank stuck outside the "
                     "collectives shows where with `py-spy dump --pid <pid>`.")
        elif followers:
            body = "; ".join(v.says for v in followers) + ": see their logs for the first error."
        else:
            body = unknown or ("every other rank is alive and has reached this collective: a network fault or a "
                               "backend error (below).")
        tail = f" Backend error: {backend}" if backend else ""
        return CollectiveError(f"{head}: {body}{tail}", operation=operation,
                               ranks=[v.rank for v in (causes or followers)])

    def _verdicts(self, seq: int) -> Tuple[List[Verdict], str]:
        """What the other ranks did, or why it cannot be told."""
        if self._store is None:
            return [], "the job's store is not reachable from here, so the ranks at fault cannot be named."
        window = STALE_BEATS * self.interval
        try:
            first = self._read(self._others())
            latest = dict(first)
            # Poll the ranks that have not beaten since the first read, until each has or the window ends: then a
            # silent one is dead. Only those are read again, so that in a large job the failing ranks do not read
            # every record over and over.
            silent = [r for r in self._others() if not (r in first and first[r].exited)]
            deadline = time.monotonic() + window
            while silent and time.monotonic() < deadline:
                time.sleep(min(self.interval / 4, max(deadline - time.monotonic(), 0)))
                latest.update(self._read(silent))
                silent = [r for r in silent
                          if not (moved(first.get(r), latest.get(r)) or (r in latest and latest[r].exited))]
        except (RuntimeError, OSError) as error:
            return [], (f"the other ranks' heartbeats could not be read from the job's store ({error}); the store's "
                        "host is probably gone: torchrun's agent, or rank 0 when the job was started without torchrun.")
        mine = {number: describe(op) for number, op in list(self._recent)}
        verdicts = [judge(r, first.get(r), latest.get(r), seq, self.rank, mine, window) for r in self._others()]
        return [v for v in verdicts if v is not None], ""

    def _others(self) -> List[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _read(self, ranks: List[int]) -> Dict[int, RankRecord]:
        store = self._store
        keys = [f"{_KEY}{r}" for r in ranks]
        if store.check(keys):
            raws = store.multi_get(keys)
        else:  # some never wrote (died before their first beat): get() would wait for them
            raws = [store.get(key) if store.check([key]) else None for key in keys]
        return {r: RankRecord.decode(raw) for r, raw in zip(ranks, raws) if raw is not None}


_UNCAUGHT: List[bool] = []  # set once by the hook below: the process is dying of an uncaught exception


def _end_promptly_after_uncaught_exception() -> None:
    """Make a process that dies of an uncaught exception end at once, after its atexit handlers registered since.

    Its interpreter would otherwise tear down the process group with collectives still in flight,
    which waits for peers that never come (NCCL kernels spin until the timeout). The exception has
    been printed by then, and the watchdog has marked this rank exited; the status is 1, as Python's.
    Installed once, by the first watchdog started.
    """
    if getattr(sys.excepthook, "_bmtwrap", False):
        return
    previous = sys.excepthook

    def hook(kind: Any, value: Any, traceback: Any) -> None:
        _UNCAUGHT.append(True)
        previous(kind, value, traceback)

    hook._bmtwrap = True  # type: ignore[attr-defined]
    sys.excepthook = hook

    def end() -> None:
        if not _UNCAUGHT:
            return
        import logging
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    atexit.register(end)

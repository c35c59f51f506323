"""A torchrun job kept running across tests: the pytest process sends it requests, one at a time.

tests/launch.py runs a case script once and reads what it wrote at exit, which suits a fixed list of
cases. A property-based test decides its next example from the last one's outcome (hypothesis
shrinks a failure by trying smaller inputs), so the cases cannot be listed before the launch; and a
launch per example (torch imported by every rank, a rendezvous) costs seconds where an example costs
a fraction of one. So the job stays up and serves:

    pytest process                               rank 0 of the job             other ranks
    listens on 127.0.0.1, starts the ranks <-->  connects, says the token
    send(request: one JSON line)           -->   receives it, broadcasts  -->  receive it
                                                 runs it               (all)   run it
    receive(result: one JSON line)         <--   sends rank 0's result
    close(): send null                     -->   every rank leaves its loop and exits

:func:`serve` is the job's side of it. A request that does not get its answer within the timeout,
or a job that dies, raises :class:`WorkerGroupError` with the end of the job's output; the job is
killed and the next request starts a new one.

The ranks are forked from a server that has imported torch and bmtwrap (tests/forked_ranks.py), with
what torchrun gives its workers: the environment variables, and a TCPStore hosted outside the ranks
(here, in the pytest process) as torchrun's agent hosts it. A torchrun job cost an agent and every rank
their imports of torch, seconds of CPU each.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from forked_ranks import ForkedScript

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
LOG_TAIL = 6000  # characters of the job's output an error shows


class WorkerGroupError(AssertionError):
    """The job died, or did not answer in time; the message ends with its output."""


def _send_line(sock: socket.socket, message: Any) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class _LineReader:
    """Reads newline-terminated JSON from a socket, keeping what arrived past the newline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = b""

    def read(self, deadline: float, alive: Callable[[], bool]) -> Any:
        while b"\n" not in self._pending:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer in time")
            if not alive():
                raise ConnectionError("the job exited")
            ready, _, _ = select.select([self._sock], [], [], 0.5)
            if ready:
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the job closed the connection")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


class WorkerGroup:
    """``world_size`` ranks running ``tests/dist_cases/<script>``, which calls :func:`serve`.

    Started by the first :meth:`request`; :meth:`close` stops it.

    Args:
        script: the case script, under tests/dist_cases/.
        world_size: processes (gloo ranks).
        timeout: seconds one request may take before the job is killed.
        start_timeout: seconds the job may take to start and connect.
    """

    def __init__(self, script: str, world_size: int, *, timeout: float = 60.0, start_timeout: float = 120.0) -> None:
        self.script = script
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._ranks: List[ForkedScript] = []
        self._store: Optional[dist.TCPStore] = None
        self._sock: Optional[socket.socket] = None
        self._reader: Optional[_LineReader] = None
        self._log: Optional[Any] = None
        self._last_log = ""  # the output of the last job killed or closed

    def request(self, message: Any) -> Any:
        """Send ``message`` (JSON-able) to every rank; return rank 0's answer."""
        if not self._ranks:
            self._start()
        assert self._sock is not None and self._reader is not None
        try:
            _send_line(self._sock, message)
            return self._reader.read(time.monotonic() + self.timeout, self._alive)
        except (OSError, TimeoutError, ConnectionError, ValueError) as error:
            raise self._fail(f"{type(error).__name__}: {error}") from None

    def stop(self) -> None:
        """Ask the ranks to exit, without waiting (several groups then exit at once); see :meth:`close`."""
        if self._sock is not None:
            try:
                _send_line(self._sock, None)
            except OSError:
                pass  # the job is gone already; close() reaps it

    def close(self) -> None:
        """Ask the ranks to exit; kill them if they do not within 30 s."""
        if not self._ranks:
            return
        self.stop()
        deadline = time.monotonic() + 30
        for rank in self._ranks:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _alive(self) -> bool:
        """Every rank still runs (as under torchrun, whose agent ends the job when one rank has ended)."""
        return bool(self._ranks) and all(rank.returncode is None for rank in self._ranks)

    def _start(self) -> None:
        token = secrets.token_hex(16)
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(0.5)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        self._log = tempfile.NamedTemporaryFile(mode="w+")
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(minutes=30), wait_for_workers=False)
        world = str(self.world_size)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
                   WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._store.port), TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        self._ranks = [ForkedScript(str(TESTS / "dist_cases" / self.script), [address, token],
                                    dict(env, RANK=str(r), LOCAL_RANK=str(r)), self._log.name, self._log.name)
                       for r in range(self.world_size)]
        deadline = time.monotonic() + self.start_timeout
        try:
            while True:
                if not self._alive():
                    raise self._fail("the job exited before rank 0 connected")
                if time.monotonic() > deadline:
                    raise self._fail(f"rank 0 did not connect within {self.start_timeout:.0f} s")
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                sock.setblocking(True)
                reader = _LineReader(sock)
                try:
                    hello = reader.read(time.monotonic() + 10, self._alive)
                except (OSError, TimeoutError, ValueError):
                    hello = None
                if hello == token:
                    self._sock, self._reader = sock, reader
                    return
                sock.close()  # someone else's connection
        finally:
            server.close()

    def _fail(self, what: str) -> WorkerGroupError:
        """Kill the job; the error to raise, with the end of the job's output."""
        self._kill()
        return WorkerGroupError(f"{self.script} at world size {self.world_size}: {what}\n--- job output (end) ---\n"
                                f"{self._last_log[-LOG_TAIL:]}")

    def _kill(self) -> None:
        for rank in self._ranks:
            rank.kill()
            rank.wait()
        if self._sock is not None:
            self._sock.close()
        if self._log is not None:
            self._log.seek(0)
            self._last_log = self._log.read()
            self._log.close()
        self._ranks = []
        self._store = self._sock = self._reader = self._log = None


def serve(handle: Callable[[Any], Any]) -> None:
    """The job's side (call it in a case script on every rank after ``bmtwrap.init_distributed``):
    answer requests with ``handle(request)``, run on every rank, until the pytest process sends ``null``.

    argv[1] is the address to connect to, argv[2] the token to say first. Rank 0's return value is
    the answer; ``handle`` must not raise (catch and describe errors in the answer).
    """
    import torch.distributed as dist

    link: Optional[socket.socket] = None
    reader: Optional[_LineReader] = None
    if dist.get_rank() == 0:
        host, port = sys.argv[1].rsplit(":", 1)
        link = socket.create_connection((host, int(port)))
        reader = _LineReader(link)
        _send_line(link, sys.argv[2])
    while True:
        # Rank 0 waits for the pytest process as long as it takes (the next test may be far off).
        box = [reader.read(float("inf"), lambda: True) if reader is not None else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        answer = handle(box[0])
        if link is not None:
            _send_line(link, answer)
    if link is not None:
        link.close()

"""Processes that run a script as ``python script.py`` would, forked from a server that has imported torch and
bmtwrap once.

test_faults.py starts its jobs' ranks itself, with no launcher that would stop the others once one fails
(torchrun's agent, tests/fork_server.py): how the others fail is what it watches. As interpreters of their own,
its 19 ranks spent most of that file's minute importing torch and bmtwrap, 19 times over, on two cores. Forked
from :mod:`multiprocessing`'s fork server, which imports them once (this module is its preload), each starts with
them loaded and ends as the interpreter would: its atexit handlers run (the watchdog marks its record exited)
and its exit status is Python's (1 after an uncaught exception, printed by ``sys.excepthook``), or minus the
signal that killed it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
from typing import Dict, List, Optional

import torch
import torch._dynamo  # noqa: F401  (bmtwrap.init_distributed imports it: once, in the fork server)

import bmtwrap  # noqa: F401  (loaded once, in the fork server)

_CONTEXT = multiprocessing.get_context("forkserver")
# The fork server imports its preload by name, each module's ImportError ignored, and starts with this process's
# environment but not its sys.path (Python 3.11 passes sys_path to the server, which drops it): under pytest,
# which puts tests/ on sys.path itself, this module is not found there. torch, torch._dynamo and bmtwrap, named
# first, are (installed); this module then loads in each rank at its start, the heavy modules already there.
_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "bmtwrap", __name__])


def _run_script(script: str, args: List[str], env: Dict[str, str], stdout: str, stderr: str) -> None:
    """In the forked process: ``python script args...`` in ``env``, its output appended to the two files."""
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the server loaded torch before env applied
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` would
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()  # noqa: SLF001  (what the interpreter's exit runs; the process ends below)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkedScript:
    """``python script args...`` with ``env`` (the whole environment), stdout and stderr appended to the files
    named; started at once. Only its own thread waits for it, so :attr:`returncode` is read without a race."""

    def __init__(self, script: str, args: List[str], env: Dict[str, str], stdout: str, stderr: str) -> None:
        self._process = _CONTEXT.Process(target=_run_script, args=(script, args, env, stdout, stderr))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: Optional[int] = None  # set once it has ended
        self.ended = float("inf")  # time.time() when it ended
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self._process.join()
        self.ended = time.time()
        self.returncode = self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Its exit status, or None if it still runs after ``timeout`` seconds."""
        self._waiter.join(timeout)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # it has ended already
            pass


def first_line(process: ForkedScript, path: str) -> str:
    """The first line written to the file ``path`` (``process``'s stdout), once it is whole, with its newline; ``""``
    when the process ended without writing one (as ``readline()`` on a pipe from it would return)."""
    while True:
        ended = process.returncode is not None  # before reading: a line written just before the exit is seen
        with open(path) as f:
            text = f.read()
        if "\n" in text:
            return text[:text.index("\n") + 1]
        if ended:
            return ""
        time.sleep(0.01)

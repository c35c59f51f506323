"""A launcher that imports torch, bmtwrap and transformers once, and forks the ranks of every case script from there.

[Note: why fork]
A torchrun launch of a case script costs about 10 s on two cores before the first case runs, and 20 s at
world size 4: the agent imports torch, then every rank imports torch, bmtwrap (whose init_distributed
imports torch._dynamo) and often transformers, 5-7 s of CPU each, and tears all of it down at exit. The
tests launch some 50 such jobs. This process pays the imports once; a launch forks ``world_size`` ranks
from it, which start with every module already loaded, and each ends with ``os._exit`` after its
script, skipping the interpreter's teardown.

What torchrun gives a worker, a rank forked here gets too: the same environment variables (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, ...), a
session of its own, and a TCPStore hosted outside the ranks, as torchrun's agent hosts it
(TORCHELASTIC_USE_AGENT_STORE=True), so that the store outlives any rank. When a rank fails, the others
are killed a few seconds later, as torchrun's agent stops its workers.

Forking is safe because this process never runs an operator and so starts no thread (it asserts
that): no OpenMP pool, no gloo thread, no CUDA context (tests/launch.py uses this launcher only where
torch sees no GPU). OMP_NUM_THREADS=1, as torchrun sets it for several processes per machine, is in this
process's environment before torch loads.

Protocol (one job at a time): tests/launch.py writes one JSON line per launch to this process's stdin,
``{"script", "world_size", "args", "env", "runner", "log", "timeout"}``, or ``{"code", "args", "cwd", "env",
"log", "timeout"}`` for a single process that runs ``code`` as ``python -c`` would, outside any job; the
processes' stdout and stderr go to the file ``log``; this process answers one JSON line
``{"returncode": ...}`` (-9 after a timeout), and exits at the end of its input.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch._dynamo  # noqa: F401  (bmtwrap.init_distributed imports it: once here, for every rank)
import torch.distributed as dist

import bmtwrap  # noqa: F401

try:  # what the Hugging Face tests load; the other scripts run without them
    import accelerate  # noqa: F401
    import transformers.trainer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
except ImportError:
    pass
try:  # tests/dist_cases/trl_trainers.py
    import trl  # noqa: F401
    from trl import DPOTrainer, SFTTrainer  # noqa: F401
except ImportError:
    pass

FAILED_RANK_GRACE_S = 5.0  # how long the other ranks may go on after one failed, before they are killed
POLL_S = 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_environment(rank: int, world_size: int, port: int) -> Dict[str, str]:
    """What torchrun's agent sets for worker ``rank`` of one node (torch/distributed/elastic/agent)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def _become(log_fd: int, env: Dict[str, str]) -> None:
    """In a forked child: a session of its own, output to the log, no stdin, the job's environment."""
    os.setsid()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)


def _run_main(job: Dict[str, Any]) -> int:
    """Run the job's script, its runner module or its code as ``__main__``; its exit status."""
    try:
        if "code" in job:  # as `python -c CODE` in the job's folder
            os.chdir(job["cwd"])
            sys.argv = ["-c", *job["args"]]
            sys.path.insert(0, "")
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif job["runner"]:
            sys.argv = [job["runner"], job["script"], *job["args"]]
            runpy.run_module(job["runner"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [job["script"], *job["args"]]
            sys.path.insert(0, os.path.dirname(job["script"]))  # as `python script.py` would
            runpy.run_path(job["script"], run_name="__main__")
        return 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:  # what the interpreter would print, and its status
        traceback.print_exc()
        return 1


def _fork(log_fd: int, env: Dict[str, str], body: Callable[[], int]) -> int:
    """Fork a child that becomes ``env``'s process and exits with ``body()``'s status; its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _become(log_fd, env)
        code = body()
    finally:  # never back into this process's loop
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _host_store(port: int, ready: int) -> int:
    """The job's TCPStore, in a process of its own until it is killed (torchrun's agent hosts it likewise); writes
    one byte to the pipe ``ready`` once it listens."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30))
    os.write(ready, b"1")
    os.close(ready)
    while store is not None:
        time.sleep(3600)
    return 0


def _kill(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # the rank and anything it started
        except ProcessLookupError:
            pass


def launch(job: Dict[str, Any]) -> int:
    """Fork the job's store and ranks (or, for ``code``, one process of no job), wait for the ranks (killing
    them after the timeout, or a few seconds after one failed), then kill the store; the job's exit status as
    torchrun's: the first failing rank's."""
    assert threading.active_count() == 1, "a thread in the fork server: forking is not safe"
    env = job["env"]
    with open(job["log"], "ab") as log:
        if "code" in job:
            store, ranks = None, [_fork(log.fileno(), env, lambda: _run_main(job))]
        else:
            world_size, port = job["world_size"], _free_port()
            ready, told = os.pipe()
            store = _fork(log.fileno(), env, lambda: _host_store(port, told))
            os.close(told)
            with os.fdopen(ready, "rb") as listening:
                started = listening.read(1) == b"1"  # nothing: the store process ended without listening
            if not started:
                _kill([store])
                os.waitpid(store, 0)
                # Another process took the port between _free_port() and the store: tests/launch.py tries again.
                _note(job["log"], f"the store could not listen on port {port}: address already in use")
                return 1
            ranks = [_fork(log.fileno(), {**env, **_rank_environment(rank, world_size, port)},
                           lambda: _run_main(job)) for rank in range(world_size)]
    deadline = time.monotonic() + job["timeout"]
    running, returncode = list(ranks), 0
    while running:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            running.remove(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and returncode == 0:
                returncode = code
                deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
                ended = f"was ended by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                _note(job["log"], f"rank {ranks.index(pid)} (pid {pid}) {ended}; the others stop in "
                                  f"{FAILED_RANK_GRACE_S:g} s")
        if running and time.monotonic() > deadline:
            if returncode == 0:
                _note(job["log"], f"the job ran past its timeout of {job['timeout']} s; its ranks are killed")
            _kill(running)
            returncode = returncode or -signal.SIGKILL
            deadline = float("inf")  # reap them
        time.sleep(POLL_S if running else 0)
    if store is not None:
        _kill([store])
        os.waitpid(store, 0)
    return returncode


def _note(log: str, line: str) -> None:
    """A line in the job's output, from this launcher (as torchrun's agent reports a failed worker)."""
    with open(log, "a") as out:
        out.write(f"fork_server: {line}\n")


def serve() -> None:
    assert os.environ.get("OMP_NUM_THREADS") == "1", "start the fork server with OMP_NUM_THREADS=1"
    for line in sys.stdin:
        job = json.loads(line)
        try:
            answer = {"returncode": launch(job)}
        except Exception:  # the job could not start; the test shows why
            answer = {"returncode": 1, "error": traceback.format_exc()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()

"""Run a multi-process case script once and return what rank 0 reported.

A case script starts one process group and runs many cases in it (cheap on 2 CPU cores); it
writes a JSON object {case name: result} to the path given as its only argument.

Where torch sees no GPU, the ranks are forked from tests/fork_server.py, which has imported torch,
bmtwrap and transformers once for the whole session (see [Note: why fork] there): they get what
torchrun gives its workers, without the imports. Set BMTWRAP_TEST_LAUNCHER=torchrun to launch every
job under torchrun instead (for instance to have an environment variable that torch reads when it
loads take effect); on a GPU machine they always are.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(script: str, world_size: int, *args: str, timeout: int = 900,
              runner: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Launch ``tests/dist_cases/<script>`` on ``world_size`` processes; return rank 0's results.

    ``runner``: a module that runs the script (``bmtwrap.bmtrain``: a BMTrain program). The
    rendezvous port is picked free and then released, so another job may take it first; a launch
    that fails that way is tried again on a new port. ``env``: variables added to the processes'.
    """
    for attempt in range(3):
        try:
            return _run_once(script, world_size, args, timeout, runner, env)
        except _PortTaken:
            if attempt == 2:
                raise AssertionError(f"{script}: no free rendezvous port after 3 tries") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def launch(script: str, world_size: int, out: Optional[Path], args: tuple, timeout: int,
           runner: Optional[str] = None, wrapper: Sequence[str] = (),
           env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``tests/dist_cases/<script> OUT ARGS...`` under torchrun on ``world_size`` processes (the whole
    command after ``wrapper``, e.g. ``unshare ...``); return the finished launcher's process (its exit
    status and output), whatever it is. ``out`` None: no OUT, the script's own arguments alone."""
    cmd = [*wrapper, 
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *(["-m", runner] if runner else []),
        str(TESTS / "dist_cases" / script), *_arguments(out, args),
    ]
    return subprocess.run(cmd, env=_environment(env), capture_output=True, text=True, timeout=timeout)


def _environment(env: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The ranks' environment: this process's, the job's ``env``, one OpenMP thread, the repository importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}),
                PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))


class _ForkServer:
    """tests/fork_server.py, started on first use and stopped when this process exits."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._log: Optional[Any] = None

    def run(self, job: Dict[str, Any], timeout: int) -> Tuple[int, str]:
        """Run one job (see tests/fork_server.py for its keys, less ``log`` and ``timeout``); its exit status and
        the output of its processes."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            self._proc.stdin.write(json.dumps({**job, "log": log.name, "timeout": timeout}) + "\n")
            self._proc.stdin.flush()
            # The server kills the job at its timeout; this waits a little longer for the answer.
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout + 60)
            line = self._proc.stdout.readline() if ready else ""
            if not line:
                self.close()
                raise AssertionError(f"the fork server did not answer for {job}:\n{self._server_output()}")
            answer = json.loads(line)
            return answer["returncode"], log.read() + answer.get("error", "")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _start(self) -> None:
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([sys.executable, str(TESTS / "fork_server.py")], env=_environment(None),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        atexit.register(self.close)

    def _server_output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-6000:]


_FORK_SERVER = _ForkServer()


def run_job(script: str, world_size: int, out: Optional[Path], args: tuple, timeout: int,
            runner: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
    """Run ``tests/dist_cases/<script> OUT ARGS...`` on ``world_size`` ranks, forked from the fork server or
    under torchrun (see the module's docstring); its exit status, non-zero when a rank failed, and the
    ranks' output. ``script`` may be an absolute path (a program outside tests/dist_cases/); ``out`` None:
    no OUT, for a program that takes only its own arguments."""
    if _forks():
        return _FORK_SERVER.run({"script": str(TESTS / "dist_cases" / script), "world_size": world_size,
                                 "args": _arguments(out, args), "runner": runner, "env": _environment(env)}, timeout)
    proc = launch(script, world_size, out, args, timeout, runner, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def _arguments(out: Optional[Path], args: Sequence[str]) -> list:
    return [*([str(out)] if out is not None else []), *args]


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def run_reference(script: str, work: Path, timeout: int = 600) -> Dict[str, Any]:
    """``python tests/dist_cases/<script> OUT WORK --reference``: the plain library a case script compares
    against, in one process of its own (started afresh, without bmtwrap imported) with no torchrun variables;
    the JSON object it wrote to OUT."""
    out = Path(work) / "reference.json"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(TESTS / "dist_cases" / script), str(out), str(work), "--reference"],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), f"the reference run failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(out.read_text())


def run_python(code: str, *args: str, env: Optional[Dict[str, str]] = None, cwd: Path = ROOT,
               timeout: int = 300) -> Tuple[int, str]:
    """``python -c code args...`` in ``cwd``, a process of its own outside any job (forked from the fork server
    where jobs are: every module loaded, nothing run); its exit status and output (stdout and stderr together).
    ``env``: the whole environment (default: this process's, with the repository importable)."""
    environment = env if env is not None else _environment(None)
    if _forks():
        return _FORK_SERVER.run({"code": code, "args": list(args), "cwd": str(cwd), "env": environment}, timeout)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _forks() -> bool:
    return os.environ.get("BMTWRAP_TEST_LAUNCHER", "fork") != "torchrun" and not torch.cuda.is_available()


def _run_once(script: str, world_size: int, args: tuple, timeout: int, runner: Optional[str],
              env: Optional[Dict[str, str]]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        returncode, output = run_job(script, world_size, out, args, timeout, runner, env)
        if returncode != 0 and "address already in use" in output.lower():
            raise _PortTaken()
        if returncode != 0 or not out.exists():
            raise AssertionError(f"{script} at world size {world_size} failed (exit {returncode}):\n{output[-6000:]}")
        return json.loads(out.read_text())


def case(results: Any, name: str) -> Any:
    """``(world size, result)`` of case ``name`` from a ``(world size, run_cases(...))`` fixture; fails with
    the case's own error if it raised."""
    world, all_results = results
    result = all_results[name]
    assert "error" not in result, result.get("error")
    return world, result

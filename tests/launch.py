"""Run a multi-process case script once under torchrun and return what rank 0 reported.

A case script starts one process group and runs many cases in it (cheap on 2 CPU cores); it
writes a JSON object {case name: result} to the path given as its only argument.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

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


def launch(script: str, world_size: int, out: Path, args: tuple, timeout: int,
           runner: Optional[str] = None, wrapper: Sequence[str] = (),
           env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``tests/dist_cases/<script> OUT ARGS...`` under torchrun on ``world_size`` processes (the whole
    command after ``wrapper``, e.g. ``unshare ...``); return the finished launcher's process (its exit
    status and output), whatever it is."""
    cmd = [*wrapper, 
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *(["-m", runner] if runner else []),
        str(TESTS / "dist_cases" / script), str(out), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _run_once(script: str, world_size: int, args: tuple, timeout: int, runner: Optional[str],
              env: Optional[Dict[str, str]]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = launch(script, world_size, out, args, timeout, runner, env=env)
        if proc.returncode != 0 and "address already in use" in (proc.stdout + proc.stderr).lower():
            raise _PortTaken()
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-6000:]
            raise AssertionError(f"{script} at world size {world_size} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def case(results: Any, name: str) -> Any:
    """``(world size, result)`` of case ``name`` from a ``(world size, run_cases(...))`` fixture; fails with
    the case's own error if it raised."""
    world, all_results = results
    result = all_results[name]
    assert "error" not in result, result.get("error")
    return world, result

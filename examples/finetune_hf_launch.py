"""How examples/finetune_hf.py's processes start and end: torchrun, the workers' reports of how the run
ended, and the one message and exit status made of them (see [Note: how a run ends]).

Plumbing, kept apart so that finetune_hf.py reads as the fine-tune itself; its docstring lists the
exit statuses.
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, NoReturn, Optional, Tuple, Union

import torch

from finetune_hf_cli import (EXAMPLE, FAILED, INTERRUPTED, LEARNED, PROG, REPORT_ENV, Outcome, RunFailed,
                             folders_written)

# [Note: how a run ends]
# torchrun prints a ChildFailedError traceback for any worker that exits non-zero, and each rank of a
# failed job prints its own traceback: together they bury the line that says what happened. So each
# worker catches whatever stops it, writes how it ended to a file in the folder REPORT_ENV names, and
# exits 0. The launching process picks the first cause (a rank's own failure before those of the ranks
# that lost a collective with it), prints it once, with the checkpoint the run can continue from,
# writes the tracebacks of a crash to --out/errors.log, and exits with the status. A worker killed
# outright (by the kernel, by SIGKILL) still gets torchrun's own report.
#
# Ctrl-C reaches the launching process and torchrun, not the workers (torchrun starts each in a
# session of its own). torchrun is started with SIGINT ignored, or it would stop the workers and print
# its own traceback; the launching process passes the interrupt on to each worker (by the process id
# it left in the folder), each stops where it is, quietly, and torchrun then ends as after any run.


def run_under_torchrun(argv: List[str], nproc: int, args: argparse.Namespace) -> Outcome:
    """Started with plain ``python``: run this script under torchrun, one process per GPU (else 2).

    The workers report how the run ended (see [Note: how a run ends]); this process prints the one
    message and returns the status.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1" if not torch.cuda.is_available() else str(max(1, os.cpu_count() // nproc)))
    # torchrun's --signals-to-handle without SIGINT (torch 2.9 on; an older torchrun still stops the workers
    # on Ctrl-C itself, with its own traceback).
    env["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGHUP,SIGQUIT"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(EXAMPLE), *argv]
    print(f"finetune_hf: starting {nproc} processes: torchrun --standalone --nproc_per_node={nproc} ...", flush=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="finetune_hf-") as scratch:
        env[REPORT_ENV] = scratch
        status, interrupted = wait_for_workers(cmd, env, Path(scratch))
        reports = [Outcome(**json.loads(path.read_text())) for path in sorted(Path(scratch).glob("rank*.json"))]
    if interrupted:
        return settle([Outcome(INTERRUPTED)], args, started)
    if status != 0:
        return Outcome(status, f"{PROG}: the workers stopped with an error (torchrun exit status {status}); "
                       "their output above says where")
    if not reports:
        return Outcome(FAILED, f"{PROG}: the workers exited without reporting how the run ended")
    return settle(reports, args, started)


def wait_for_workers(cmd: List[str], env: Dict[str, str], scratch: Path) -> Tuple[int, bool]:
    """torchrun's exit status, and whether it was interrupted: a Ctrl-C is passed on to the workers as
    SIGINT (also to those that start after it), a second one kills torchrun and the workers at once."""
    ignoring = signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun inherits SIGINT ignored
    try:
        torchrun = subprocess.Popen(cmd, env=env)
    finally:
        signal.signal(signal.SIGINT, ignoring)
    interrupts, signalled = 0, set()
    while True:
        try:
            for pid_file in sorted(scratch.glob("rank*.pid")) if interrupts else []:
                if pid_file.name not in signalled:
                    signalled.add(pid_file.name)
                    send(int(pid_file.read_text()), signal.SIGINT if interrupts == 1 else signal.SIGKILL)
            return torchrun.wait(timeout=0.2 if interrupts else None), interrupts > 0
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts > 1:
                send(torchrun.pid, signal.SIGKILL)
                signalled.clear()  # and every worker, next time round


def send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it has ended already
        pass


def joined_as_worker() -> bool:
    """In one of our torchrun workers: take Ctrl-C again (torchrun passed it on ignored) and leave this
    process's id for the launching process to interrupt. False in any other process."""
    folder = os.environ.get(REPORT_ENV)
    if folder is None:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pid_file = Path(folder) / f"rank{int(os.environ.get('RANK', '0')):05d}.pid"
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").replace(pid_file)  # whole when the launching process reads it
    return True


# The errors of a file that this machine, not the program, refuses: named, without a traceback.
REFUSED_WRITES = {errno.ENOSPC: "free space on its disk", errno.EDQUOT: "free space (the disk quota is used up)",
                  errno.EROFS: "its file system is read-only: make it writable or give another --out",
                  errno.EACCES: "make it writable or give another --out",
                  errno.EPERM: "make it writable or give another --out"}


def cannot_write(path: Union[Path, str], error: OSError) -> str:
    return f"cannot write {path} ({error.strerror or error}); {REFUSED_WRITES.get(error.errno, 'give another --out')}"


def ended_by(error: BaseException) -> Outcome:
    """How this process's run ended on ``error``: what it tells the launching process."""
    from bmtwrap import CollectiveError

    if isinstance(error, KeyboardInterrupt):
        return Outcome(INTERRUPTED, stopped=True)
    if isinstance(error, RunFailed):
        return Outcome(FAILED, f"{PROG}: {error}", stopped=error.resumable)
    if isinstance(error, OSError) and error.errno in REFUSED_WRITES and error.filename:
        return Outcome(FAILED, f"{PROG}: {cannot_write(error.filename, error)}", stopped=True)
    # A rank whose collective lost its peer failed because another one did: that one says why.
    lost_peer = isinstance(error, (CollectiveError, torch.distributed.DistError)) or any(
        text in str(error) for text in ("Connection closed by peer", "Connection reset by peer"))
    rank = int(os.environ.get("RANK", "0"))
    return Outcome(FAILED, f"{PROG}: rank {rank} crashed: {type(error).__name__}: {error}", stopped=True,
                   traceback=f"--- rank {rank}\n" + "".join(traceback.format_exception(error)), consequence=lost_peer)


def settle(reports: List[Outcome], args: argparse.Namespace, started: float) -> Outcome:
    """The job's one outcome from its ranks' (rank order); a stopped run's message says where to go on from."""
    failed = [report for report in reports if report.status != LEARNED]
    if not failed:
        return reports[0]
    first = next((report for report in failed if not report.consequence), failed[0])
    if first.status == INTERRUPTED:
        step = last_logged_step(args.out, started)
        where = "before the first step" if step is None else f"at step {step}"
        return Outcome(INTERRUPTED, f"{PROG}: interrupted {where}; {resume_hint(args, started)}")
    if not first.stopped:
        return first
    message = first.message
    crashes = "".join(report.traceback for report in reports) if first.traceback else ""  # else: the cause is known
    if crashes:
        message += f" (the traceback of every rank is in {keep_tracebacks(args.out, crashes)})"
    return Outcome(first.status, f"{message}; {resume_hint(args, started)}")


def resume_hint(args: argparse.Namespace, started: float) -> str:
    """Which checkpoint in --out a stopped run can continue from (one saved before this run: only when resuming)."""
    index = args.out / "checkpoint" / "index.json"
    try:
        step = json.loads(index.read_text())["step"]
        ours = args.resume or index.stat().st_mtime >= started
    except (OSError, ValueError, KeyError, TypeError):
        step, ours = None, False
    if step is None or not ours:
        return "no checkpoint of this run was saved: run it again from the start, without --resume"
    return f"the checkpoint of step {step} in {args.out / 'checkpoint'} is intact; continue with --resume"


def last_logged_step(out: Path, started: float) -> Optional[int]:
    """The last step this run logged in --out/log.jsonl (None: none), read back after the workers ended."""
    log = out / "log.jsonl"
    try:
        lines = log.read_text().splitlines() if log.stat().st_mtime >= started else []
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short
    return None


def keep_tracebacks(out: Path, text: str) -> Path:
    """--out/errors.log with ``text``, or a file in the temporary folder where --out cannot take it."""
    path = out / "errors.log"
    try:
        path.write_text(text)
    except OSError:
        handle, name = tempfile.mkstemp(prefix="finetune_hf-errors-", suffix=".log", text=True)
        with os.fdopen(handle, "w") as kept:
            kept.write(text)
        path = Path(name)
    return path


def remove_empty_folders(args: argparse.Namespace) -> None:
    """After a failed run: the folders under --out it made and left empty go (deepest first)."""
    for folder in reversed(folders_written(args)):
        try:
            folder.rmdir()  # only an empty one
        except OSError:
            pass


def stopped(error: BaseException, args: argparse.Namespace, worker: bool, started: float) -> Outcome:
    """How this process ends on ``error`` (see [Note: how a run ends])."""
    outcome = ended_by(error)
    if worker:
        return outcome  # the launching process makes the one message of every rank's
    if "LOCAL_RANK" not in os.environ:
        return settle([outcome], args, started)  # this process was the whole job
    # A torchrun of the user's own: every rank gets an interrupt, and rank 0 tells it; a failure is
    # told by the rank that saw it; a crash keeps its traceback.
    if outcome.traceback and not outcome.consequence:
        raise error
    if outcome.consequence:
        return Outcome(FAILED)  # the rank whose failure this one follows says why
    outcome = settle([outcome], args, started)
    if outcome.status != INTERRUPTED:
        print(outcome.message, file=sys.stderr, flush=True)
        outcome = outcome._replace(message="")
    return outcome


def leave(outcome: Outcome, args: Optional[argparse.Namespace] = None) -> NoReturn:
    """End this process: the message printed once, by rank 0, or handed to the process that started us."""
    # The run's garbage is collected now (what it left open is closed); what is still alive, the modules'
    # objects, is left out of the collections of the interpreter's exit, which would walk every object
    # of torch and transformers again: 1.5 s of each process's end on two CPU cores, waited for by torchrun
    # and the user. Nothing of it is needed any more.
    gc.collect()
    gc.freeze()
    rank = int(os.environ.get("RANK", "0"))
    report = os.environ.get(REPORT_ENV)
    if report is not None:  # one of our workers: see [Note: how a run ends]
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # it has stopped: a late interrupt changes nothing
        (Path(report) / f"rank{rank:05d}.json").write_text(json.dumps(outcome._asdict()))
        sys.exit(0)
    if rank == 0 and outcome.status != LEARNED and args is not None:
        remove_empty_folders(args)
    if rank == 0 and outcome.message:
        print(outcome.message, file=sys.stderr if outcome.status else sys.stdout, flush=True)
    sys.exit(outcome.status)  # under a torchrun of the user's own, every rank with the same status

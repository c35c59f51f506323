"""Faults: a rank killed, a rank hung, ranks running different blocks, a rank out of memory, and the errors that name them.

The multi-process tests launch 3 ranks (2 for one of the out-of-memory jobs) of tests/dist_cases/faults.py as
plain processes (forked from a server that has imported torch and bmtwrap, tests/forked_ranks.py), each with
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK, around a TCPStore that this process hosts, as
torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE=True``). Not under torchrun itself: its agent
would kill the survivors of a failed worker before they could fail on their own, which is what is
tested here. The unit tests drive a :class:`bmtwrap.engine.watchdog.Watchdog` against a HashStore in which
the other ranks' records are written by hand.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch.distributed as dist

import bmtwrap as bmt
import bmtwrap.engine.watchdog
from bmtwrap.engine.watchdog import CompletionWatch, RankRecord, Watchdog
from forked_ranks import ForkedScript

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPT = TESTS / "dist_cases" / "faults.py"
WORLD, VICTIM = 3, 1
# The collectives' timeout of each job: short for the hang (the test waits it out), a little longer for
# the others (they must fail long before it; a loaded CI machine may start its ranks seconds apart).
TIMEOUT_S = {"hang": 10.0, "kill": 15.0, "reorder": 15.0, "oom": 60.0, "oom-backward": 60.0}
SLACK_S = 6.0  # allowed past the deadline for the error: 3 s to tell a dead rank from a live one, and slack
EXIT_S = 20.0  # for the process to end after the error (a loaded machine takes its time tearing torch down)
OPERATION = r"(all-gather|reduce-scatter|all-reduce) of '[^']+' \(collective #(\d+)\)"


@dataclass
class Rank:
    returncode: Optional[int]  # None: still running when the job was ended
    ended: float  # time.time() when it exited
    stdout: str
    stderr: str
    record: Optional[RankRecord]  # its last heartbeat record in the store

    def fault_time(self) -> float:
        return self._time_of("FAULT [\\w-]+", "the victim did not reach its fault")

    def raised_time(self) -> float:
        return self._time_of("RAISED", "no CollectiveError reached the top")

    def _time_of(self, event: str, missing: str) -> float:
        found = re.search(rf"^{event} ([\d.]+)$", self.stdout, re.M)
        assert found, f"{missing}:\n{self.stdout}\n{self.stderr[-3000:]}"
        return float(found.group(1))


class Job:
    """The 3 ranks of faults.py in one mode, started at once; :meth:`finish` waits for the survivors."""

    def __init__(self, tmp_path: Path, mode: str, *, check: bool = False, world: int = WORLD,
                 shard_size: Optional[int] = None) -> None:
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)
        env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   BMTWRAP_SHARD_SIZE=str(shard_size or world))
        name = f"{mode}-shard{shard_size}" if shard_size else mode
        args = [mode, str(VICTIM), str(TIMEOUT_S[mode]), *(["check"] if check else [])]
        self.logs = [tuple(open(tmp_path / f"{name}.rank{r}.{kind}", "w+") for kind in ("out", "err"))
                     for r in range(world)]
        # Forked from a server that has imported torch and bmtwrap (see tests/forked_ranks.py), as
        # `python faults.py ARGS` with this environment.
        self.procs = [ForkedScript(str(SCRIPT), args, dict(env, RANK=str(r), LOCAL_RANK=str(r)), out.name, err.name)
                      for r, (out, err) in enumerate(self.logs)]
        self._ranks: Optional[List[Rank]] = None

    def finish(self, wait_s: float = 300, *, victim_too: bool = False) -> List[Rank]:
        """Wait for the ranks (but the victim, unless ``victim_too``), kill any still running; what each did.

        The wait is long: the jobs start side by side, and on a loaded 2-core machine their 19 processes may
        take long to reach the first step (they wait for each other first, see ``wait_for_every_rank`` in
        faults.py); a job that works ends long before it."""
        if self._ranks is not None:
            return self._ranks
        deadline = time.time() + wait_s
        for r, proc in enumerate(self.procs):
            if r != VICTIM or victim_too:
                proc.wait(timeout=max(0.0, deadline - time.time()))
        codes = [proc.returncode for proc in self.procs]
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
            proc.wait()
        # The default group's store prefixes our keys ("default_pg/0//bmtwrap/heartbeat/1").
        keys = {int(key.rsplit("/", 1)[1]): key for key in self.store.list_keys() if "bmtwrap/heartbeat/" in key}
        ranks = []
        for r, (out, err) in enumerate(self.logs):
            out.seek(0), err.seek(0)
            record = RankRecord.decode(self.store.get(keys[r])) if r in keys else None
            ranks.append(Rank(codes[r], self.procs[r].ended if codes[r] is not None else float("inf"),
                              out.read(), err.read(), record))
            out.close(), err.close()
        self._ranks = ranks
        return ranks


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Dict[str, Job]:
    """The three faulty jobs, run side by side: their start-up (importing torch) is most of their time."""
    tmp = tmp_path_factory.mktemp("faults")
    started = {"kill": Job(tmp, "kill"), "hang": Job(tmp, "hang"), "reorder": Job(tmp, "reorder", check=True),
               "oom": Job(tmp, "oom"), "oom-backward": Job(tmp, "oom-backward", world=2),
               "kill-hybrid": Job(tmp, "kill", world=4, shard_size=2)}
    yield started
    for job in started.values():
        job.finish(wait_s=0)  # kills what a failed test left running


def survivors(ranks: List[Rank]) -> List[Rank]:
    return [rank for r, rank in enumerate(ranks) if r != VICTIM]


def error_line(rank: Rank) -> str:
    lines = [line for line in rank.stderr.splitlines() if "CollectiveError: " in line]
    assert lines, f"no CollectiveError in this rank's stderr:\n{rank.stderr[-4000:]}"
    return lines[-1]


# --- one of 3 ranks killed, hung, or running other blocks ----------------------------------------------


def test_a_killed_rank_is_named_by_the_survivors(jobs):
    ranks = jobs["kill"].finish()
    killed_at = ranks[VICTIM].fault_time()
    assert ranks[VICTIM].returncode == -9
    for r, rank in zip((0, 2), survivors(ranks)):
        line = error_line(rank)
        assert rank.returncode not in (0, None), line
        assert rank.raised_time() - killed_at < TIMEOUT_S["kill"] + SLACK_S, line
        assert rank.ended - rank.raised_time() < EXIT_S, line
        assert re.search(OPERATION + rf" (failed|timed out after 15 s) on rank {r}: ", line), line
        assert f"rank {VICTIM} is dead: no heartbeat for 3 s" in line, line
        assert rank.record is not None and rank.record.exited, "the watchdog did not stop at exit"
    assert ranks[VICTIM].record is not None and not ranks[VICTIM].record.exited


def test_a_killed_rank_is_named_by_its_peers_under_hybrid_sharding(jobs):
    """Shard groups {0, 1} and {2, 3}; rank 1 is killed in a forward. Rank 0 fails in its shard group and rank 3 in its
    all-reduce over the replicas {1, 3}: each names rank 1 first, and no rank of another sub-group that lags behind.
    Rank 2, whose replica is rank 0, ends once rank 0 has."""
    ranks = jobs["kill-hybrid"].finish()
    killed_at = ranks[VICTIM].fault_time()
    assert ranks[VICTIM].returncode == -9
    for r in (0, 3):
        line = error_line(ranks[r])
        op = "(all-gather|reduce-scatter)" if r == 0 else r"all-reduce of '[^']+ over replicas'"
        head = rf"{op}( of '[^']+')? \(collective #\d+\) (failed|timed out after 15 s) on rank {r}: "
        assert re.search(head + r"rank 1 is dead: no heartbeat for 3 s", line), line
        assert not re.search(r"rank [023] is alive but", line), line
        assert ranks[r].raised_time() - killed_at < TIMEOUT_S["kill"] + SLACK_S, line
    rank = ranks[2]
    assert rank.returncode not in (0, None), rank.stderr[-3000:]
    assert rank.ended - killed_at < TIMEOUT_S["kill"] + SLACK_S + EXIT_S, rank.stderr[-3000:]
    assert ("ending the process: rank 0 has exited" in rank.stderr
            or re.search(r"on rank 2: rank 0 (has exited|is alive but)", error_line(rank))), rank.stderr[-3000:]


def test_a_hung_rank_is_named_when_the_timeout_fires(jobs):
    ranks = jobs["hang"].finish()
    hung_at = ranks[VICTIM].fault_time()
    assert ranks[VICTIM].returncode is None, "the hung rank should still be running (sleeping) when the others end"
    for r, rank in zip((0, 2), survivors(ranks)):
        line = error_line(rank)
        assert rank.returncode not in (0, None), line
        assert TIMEOUT_S["hang"] - 1 < rank.raised_time() - hung_at < TIMEOUT_S["hang"] + SLACK_S, line
        assert rank.ended - rank.raised_time() < EXIT_S, line
        found = re.search(OPERATION + rf" timed out after 10 s on rank {r}: rank {VICTIM} is alive but has not "
                          r"reached collective #(\d+): it is outside the collectives since #(\d+), ", line)
        assert found, line
        assert found.group(2) == found.group(3) and int(found.group(4)) < int(found.group(2)), line


def test_check_collectives_names_both_blocks_and_their_ranks(jobs):
    ranks = jobs["reorder"].finish(victim_too=True)
    assert ranks[VICTIM].fault_time()
    expected = (r"the ranks issue different collectives \(found by check_collectives=True\): ranks 0 and 2 run "
                r"#(\d+), all-gather of 'layers\.(\d)'; rank 1 runs #\1, all-gather of 'layers\.(\d)'\.")
    for rank in ranks:
        line = error_line(rank)
        assert rank.returncode not in (0, None), line
        found = re.search(expected, line)
        assert found and found.group(2) != found.group(3), line
        # Every rank's own check fails at once: no waiting for the timeout.
        assert rank.raised_time() - ranks[VICTIM].fault_time() < TIMEOUT_S["reorder"], line


@pytest.mark.parametrize("mode, where", [("oom", "the forward of block 'layers.2'"),
                                         ("oom-backward", "the recomputation of block 'layers.2' in backward")])
def test_out_of_memory_on_one_rank_stops_every_rank_at_once(jobs, mode, where):
    """Nothing hangs: the rank out of memory raises with a note naming it, the step and what to change; the others
    end within seconds (the collectives' timeout is 60 s), naming that rank; no rank finishes the step."""
    job = jobs[mode]
    ranks = job.finish(victim_too=True)
    failed_at = ranks[VICTIM].fault_time()
    victim = ranks[VICTIM]
    assert victim.returncode == 1, victim.stderr[-3000:]
    note = f"bmtwrap: raised on rank {VICTIM} of {job.world} in step 3, in {where}."
    assert "torch.OutOfMemoryError: CUDA out of memory" in victim.stderr and note in victim.stderr, victim.stderr[-3000:]
    assert victim.ended - failed_at < EXIT_S, "the rank out of memory did not end promptly"
    for r, rank in enumerate(ranks):
        assert f"rank {r} step 3 " not in rank.stdout, f"rank {r} finished the step that failed:\n{rank.stdout}"
        if r == VICTIM:
            continue
        assert rank.returncode == 1, rank.stderr[-3000:]
        assert rank.ended - failed_at < 3 * SLACK_S, f"rank {r} took {rank.ended - failed_at:.1f} s to stop"
        # The watchdog ends a rank waiting on the GPU; on gloo, the victim's exit fails the collective at once.
        said = re.escape(f"rank {VICTIM} failed in step 3: OutOfMemoryError in {where}. The host ran out of memory")
        assert (re.search(rf"\[bmtwrap watchdog, rank {r}\] ending the process: {said}", rank.stderr)
                # "since, after #N ..." when it never issued this collective; "since, after issuing this
                # collective" when it had (a prefetch) before it failed
                or re.search(rf"CollectiveError: {OPERATION} failed on rank {r}: {said}[^;]*; it has exited since",
                             rank.stderr)), rank.stderr[-3000:]


# --- the diagnosis, against records written by hand -----------------------------------------------------


class FakeRanks:
    """Other ranks' heartbeat records in a HashStore; ``beating`` ranks get a new beat every 20 ms."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.records: Dict[int, RankRecord] = {}
        self.beating: List[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def set(self, rank: int, issued: int, recent: list, waiting: str = "", exited: bool = False) -> None:
        self.records[rank] = RankRecord(1, issued, recent, waiting, exited)
        self.store.set(f"bmtwrap/heartbeat/{rank}", self.records[rank].encode())

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for rank in self.beating:
                record = self.records[rank]
                self.records[rank] = record._replace(beat=record.beat + 1)
                self.store.set(f"bmtwrap/heartbeat/{rank}", self.records[rank].encode())

    def __enter__(self) -> "FakeRanks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def watchdog(store: Optional[dist.Store], world: int = 3, **kwargs) -> Watchdog:
    """Rank 0's watchdog, its thread not started, having issued collectives #1-#5 (#5: all-gather of 'layers.2')."""
    dog = Watchdog(store, 0, world, datetime.timedelta(seconds=10), interval=0.05, **kwargs)
    for label in ("layers.0", "layers.1", "layers.0", "layers.1", "layers.2"):
        dog.begin(("all-gather", label))
    return dog


def test_failure_names_dead_behind_and_diverged_ranks():
    store = dist.HashStore()
    with FakeRanks(store) as fake:
        fake.set(1, 4, [(3, "all-gather of 'layers.0'"), (4, "all-gather of 'layers.1'")])  # silent: dead
        fake.set(2, 5, [(4, "all-gather of 'layers.1'"), (5, "all-gather of 'layers.3'")])  # beats, other block
        fake.set(3, 3, [(3, "all-gather of 'layers.0'")], waiting="#3, all-gather of 'layers.0'")  # beats, behind
        fake.beating = [2, 3]
        error = watchdog(store, world=4).failure(5, ("all-gather", "layers.2"), RuntimeError("Timed out waiting 10000ms"))
    message = str(error)
    assert message.startswith("all-gather of 'layers.2' (collective #5) timed out after 10 s on rank 0: ")
    assert ("rank 1 is dead: no heartbeat for 0.15 s (killed, crashed, or its host is gone; its last heartbeat came "
            "after #4, all-gather of 'layers.1')") in message
    assert "rank 2 is alive but ran all-gather of 'layers.3' as collective #5, where rank 0 ran all-gather of 'layers.2'" \
        in message
    assert "init_distributed(check_collectives=True) stops at the first difference" in message
    assert "rank 3 is alive but has not reached collective #4: it is waiting in #3, all-gather of 'layers.0'" in message
    assert message.endswith("Backend error: Timed out waiting 10000ms")
    assert isinstance(error, bmt.CollectiveError) and isinstance(error, RuntimeError) and error.ranks == (1, 2, 3)
    assert error.operation == "all-gather of 'layers.2'"


def test_failure_tells_exited_ranks_and_ranks_that_never_beat():
    store = dist.HashStore()
    with FakeRanks(store) as fake:
        fake.set(1, 7, [(7, "reduce-scatter of 'layers.0'")], exited=True)  # reached #5, then left: a follower
        error = watchdog(store).failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset by peer"))
    message = str(error)
    assert "failed on rank 0: rank 2 never started its heartbeat (it died or hung before joining) " \
           "(rank 1 has exited since, after reaching this collective)." in message
    assert error.ranks == (2,)

    store = dist.HashStore()
    with FakeRanks(store) as fake:
        fake.set(1, 2, [(2, "all-gather of 'layers.1'")], exited=True)  # left before #5: a cause
        fake.set(2, 9, [(9, "all-gather of 'layers.0'")])
        fake.beating = [2]
        error = watchdog(store).failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset by peer"))
    assert ("rank 1 has exited (an exception, a normal end, or destroy_process_group()) after #2, all-gather of "
            "'layers.1', and has not reached collective #3") in str(error)
    assert error.ranks == (1,)


def test_a_rank_waiting_for_a_failed_rank_ends_after_two_beats(monkeypatch, capsys):
    """[Note: a failed step]: a rank waiting (here in #5) for a rank whose step failed before it issued #5 ends on the
    second beat that sees it so; not when the peer went on, nor when this rank failed in the same step."""
    ended = []
    monkeypatch.setattr(Watchdog, "_end_process", staticmethod(ended.append))
    failed = RankRecord(1, 4, [(4, "all-gather of 'layers.1'")], "", False, "OutOfMemoryError in the forward of "
                        "block 'layers.1'. GPU memory: ...", 3)
    for peer, mine, ends in ((failed, None, True), (failed._replace(issued=5), None, False),
                             (failed, (3, "ValueError in the forward of block 'layers.2'"), False),
                             (failed._replace(failed="", failed_step=0, exited=True), None, True),
                             # it issued #5 (a prefetch) before it failed and exited: it will not finish it
                             (failed._replace(issued=5, exited=True), None, True)):
        store = dist.HashStore()
        store.set("bmtwrap/heartbeat/1", peer.encode())
        dog = watchdog(store, world=2)
        dog._failed = mine
        for peers, waits_for_it in ((None, True), ((0, 1), True), ((0, 2), False)):
            dog._waiting = (5, ("all-gather", "layers.2"), peers)
            for _ in range(3):  # the wait is a beat old at the second; the peer is seen so twice by the third
                dog._check_peers(store, None)
            # Only for a rank that takes part in the collective waited for (hybrid sharding's sub-groups).
            assert ended == ([1] if ends and waits_for_it else []), (peer, mine, peers)
            ended.clear()
            dog._last_wait = 0
    err = capsys.readouterr().err
    assert ("[bmtwrap watchdog, rank 0] ending the process: rank 1 failed in step 3: OutOfMemoryError in the forward "
            "of block 'layers.1'. GPU memory: ...; it issued 4 collectives and will not finish #5, which this rank "
            "waits for") in err
    assert "ending the process: rank 1 has exited; it issued 4 collectives" in err


def test_failure_in_a_sub_group_blames_its_peers_first():
    """Hybrid sharding: a collective among ranks 0 and 1 fails. A rank of another shard group that lags behind is no
    cause, and one that is gone is context; with no cause among the peers, every rank is judged (a chain)."""
    store = dist.HashStore()
    with FakeRanks(store) as fake:
        fake.set(1, 4, [(4, "all-gather of 'layers.1'")])  # silent: dead
        fake.set(2, 3, [(3, "all-gather of 'layers.0'")], waiting="#3, all-gather of 'layers.0'")  # behind
        fake.set(3, 2, [(2, "all-gather of 'layers.1'")], exited=True)  # left before #5
        fake.beating = [2]
        dog = watchdog(store, world=4)
        error = dog.failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset"), peers=(0, 1))
        everyone = dog.failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset"))
        behind = dog.failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset"), peers=(0, 2))
        fake.set(2, 6, [(5, "all-gather of 'layers.2'"), (6, "all-gather of 'layers.3'")])
        # Rank 2, the only peer, has gone past: the fault lies outside the sub-group (a chain), so every rank is judged.
        chained = dog.failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset"), peers=(0, 2))
    message = str(error)
    assert error.ranks == (1,) and "rank 2" not in message, message
    assert re.search(r"failed on rank 0: rank 1 is dead: no heartbeat for 0.15 s \(killed, [^)]*\) \(rank 3 has "
                     r"exited \(an exception", message), message
    assert everyone.ranks == (1, 2, 3) and "rank 2 is alive but has not reached collective #4" in str(everyone)
    assert behind.ranks == (2,) and re.search(r"on rank 0: rank 2 is alive but has not reached collective #4: it "
                                              r"is waiting in #3, all-gather of 'layers.0' \(rank 1 is dead: ",
                                              str(behind))
    assert chained.ranks == (1, 3), str(chained)


def test_failure_names_a_rank_that_failed_after_issuing_the_collective():
    """A rank that prefetched this collective, then failed and exited, is the cause, and its reason is given."""
    store = dist.HashStore()
    with FakeRanks(store):
        record = RankRecord(1, 6, [(6, "all-gather of 'layers.1'")], "", True, "OutOfMemoryError in the forward", 3)
        store.set("bmtwrap/heartbeat/1", record.encode())
        error = watchdog(store, world=2).failure(5, ("all-gather", "layers.2"), RuntimeError("Connection reset"))
    assert ("failed on rank 0: rank 1 failed in step 3: OutOfMemoryError in the forward; it has exited since, after "
            "issuing this collective.") in str(error)
    assert error.ranks == (1,)


def test_failure_without_a_store_still_names_the_operation():
    error = watchdog(None).failure(5, ("reduce-scatter", "layers.2"), RuntimeError("Connection closed by peer"))
    assert str(error).startswith("reduce-scatter of 'layers.2' (collective #5) failed on rank 0: the job's store is "
                                 "not reachable from here, so the ranks at fault cannot be named.")
    assert error.ranks == ()


def test_the_heartbeat_stops_when_the_group_goes_and_says_so():
    store = dist.HashStore()
    alive = threading.Event()
    alive.set()
    dog = watchdog(store, alive=alive.is_set)
    dog.start()
    time.sleep(0.2)
    record = RankRecord.decode(store.get("bmtwrap/heartbeat/0"))
    assert record.beat >= 2 and record.issued == 5 and record.last == "#5, all-gather of 'layers.2'"
    assert not record.exited
    alive.clear()  # what destroy_process_group() does to dist.is_initialized()
    time.sleep(0.2)
    assert not dog.running
    assert RankRecord.decode(store.get("bmtwrap/heartbeat/0")).exited
    dog.stop()  # a second stop is harmless


def test_a_collective_stuck_on_nccl_is_reported_before_the_timeout_then_ends_the_process(capfd, monkeypatch):
    ended = threading.Event()
    monkeypatch.setattr(Watchdog, "_end_process", staticmethod(lambda code: ended.set()))
    monkeypatch.setattr(bmtwrap.engine.watchdog, "EXIT_GRACE_S", 0.6)
    store = dist.HashStore()
    dog = Watchdog(store, 0, 2, datetime.timedelta(seconds=0.4), interval=0.05, alive=lambda: True)
    dog._completion = CompletionWatch(marker=lambda: lambda: False)  # never completes: it waits for a dead peer
    with FakeRanks(store) as fake:
        fake.set(1, 0, [])  # silent from the start: dead
        dog.start()
        seq = dog.begin(("all-gather", "layers.0"))
        dog.wait(Done(), seq, ("all-gather", "layers.0"))
        time.sleep(0.6)
        err = capfd.readouterr().err
        assert re.search(r"\[bmtwrap watchdog, rank 0\] all-gather of 'layers.0' \(collective #1\) has been waiting "
                         r"0\.\d s \(timeout 0.4 s\) on rank 0: rank 1 is dead", err), err
        assert not ended.is_set()
        assert ended.wait(timeout=2), "the process was not ended past the timeout"
        dog.stop()
    assert re.search(r"ending the process: collective #1 \(all-gather of 'layers.0'\) is still incomplete \d s past "
                     r"the timeout", capfd.readouterr().err)


class Done:
    """A collective's work that has completed."""

    def wait(self) -> bool:
        return True


def test_the_thread_sets_the_next_probe_behind_the_collectives_waited_for_since():
    markers = []  # the done flag of each probe set, in order

    def marker():
        markers.append([False])
        return lambda flag=markers[-1]: flag[0]

    watch = CompletionWatch(marker)
    watch.waited(1, ("all-gather", "a"))
    watch.waited(2, ("all-gather", "b"))  # a probe is set already: no new one
    assert len(markers) == 1 and watch.check().seq == 1
    markers[0][0] = True  # #1 completes; #2 was waited for since: the thread sets a probe behind it
    assert watch.check() is None and len(markers) == 2
    assert watch.probe.seq == 2 and watch.probe.first == 2 and watch.seen_complete == 1
    markers[1][0] = True  # #2 completes, nothing waited for since: no probe until the next wait
    assert watch.check() is None and watch.probe is None and len(markers) == 2
    watch.waited(3, ("reduce-scatter", "c"))
    assert watch.probe.seq == 3 and len(markers) == 3
    # A stall across several collectives names the range not seen complete.
    watch.waited(4, ("all-gather", "d"))
    watch.waited(5, ("all-gather", "e"))
    markers[2][0] = True
    assert watch.check() is None and watch.probe.seq == 5 and watch.probe.first == 4


# --- the timeout argument ------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout, error, message", [
    (-5, ValueError, r"timeout must be a positive, finite time, got -5; the default is 1800 s"),
    (datetime.timedelta(0), ValueError, r"timeout must be a positive, finite time, got datetime.timedelta\(0\)"),
    (float("inf"), ValueError, r"timeout must be a positive, finite time, got inf"),
    ("600", TypeError, r"timeout must be a datetime.timedelta or a number of seconds, got str '600'"),
    (True, TypeError, r"timeout must be a datetime.timedelta or a number of seconds, got bool True"),
])
def test_init_distributed_rejects_a_bad_timeout(timeout, error, message):
    with pytest.raises(error, match=message):
        bmt.init_distributed(seed=0, timeout=timeout)


def test_default_timeout_is_documented():
    assert bmt.engine.dist.DEFAULT_TIMEOUT == datetime.timedelta(minutes=30)
    assert "30 minutes" in bmt.init_distributed.__doc__

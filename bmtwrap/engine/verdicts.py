"""A rank's heartbeat record, and what it says about a collective that failed on another rank.

The records and their reading are described in [Note: heartbeats] (``watchdog.py``): the watchdog
publishes a :class:`RankRecord` per rank, and on a failure turns each other rank's into a
:class:`Verdict` with :func:`judge`, keeping those that bear on the collective with :func:`among`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

__all__ = ["RankRecord", "Verdict", "among", "judge", "moved"]


class RankRecord(NamedTuple):
    """What one rank last published (see [Note: heartbeats])."""

    beat: int  # how many records it has written
    issued: int  # how many collectives it has issued
    recent: List[Tuple[int, str]]  # the last few of them (watchdog.RECENT), (number, described), oldest first
    waiting: str  # the collective it is blocked waiting in ("#12, all-gather of 'layers.3'"), or ""
    exited: bool  # it stopped its watchdog: a normal exit, an exception, destroy_process_group()
    # A step failed on it (see [Note: a failed step]) and it has issued no collective since: what failed, else "".
    failed: str = ""
    failed_step: int = 0

    def encode(self) -> str:
        return json.dumps(self._asdict())

    @classmethod
    def decode(cls, raw: bytes) -> "RankRecord":
        fields = json.loads(raw)
        fields["recent"] = [tuple(entry) for entry in fields["recent"]]
        return cls(**fields)

    @property
    def last(self) -> str:
        """The last collective issued: ``"#12, all-gather of 'layers.3'"``, or ``""``."""
        return f"#{self.recent[-1][0]}, {self.recent[-1][1]}" if self.recent else ""


@dataclass(frozen=True)
class Verdict:
    """What one other rank did, said in a sentence; ``cause``: it explains the failure (else it followed it)."""

    rank: int
    says: str
    cause: bool
    parted: bool = False  # it ran a different collective under the same number
    gone: bool = False  # it is dead, has exited, or never started: a fault whichever collective failed


def among(verdicts: List[Verdict], peers: Optional[Tuple[int, ...]]) -> List[Verdict]:
    """The verdicts on a collective run among ``peers`` (``None``: every rank; see [Note: heartbeats]): when a peer
    explains it, the other ranks are context, and only those that are gone; else every rank's, as for the world."""
    if peers is None or not any(v.cause and v.rank in peers for v in verdicts):
        return verdicts
    return [v if v.rank in peers else dataclasses.replace(v, cause=False)
            for v in verdicts if v.rank in peers or v.gone]


def moved(before: Optional[RankRecord], after: Optional[RankRecord]) -> bool:
    """Whether the rank beat between the two reads."""
    return after is not None and (before is None or after.beat != before.beat)


def judge(rank: int, first: Optional[RankRecord], latest: Optional[RankRecord], seq: int, me: int,
          mine: Dict[int, str], window: float) -> Optional[Verdict]:
    """What ``rank`` did, if it bears on the failure of rank ``me``'s collective ``seq`` (``mine``: its recent ones)."""
    if latest is None:
        return Verdict(rank, f"rank {rank} never started its heartbeat (it died or hung before joining)", True,
                        gone=True)
    parted = next(((n, theirs) for n, theirs in latest.recent if n in mine and mine[n] != theirs), None)
    if parted is not None:
        n, theirs = parted
        where = f"ran {theirs} as collective #{n}, where rank {me} ran {mine[n]}"
    elif latest.issued < seq:
        where = (f"has not reached collective #{latest.issued + 1}: " + (
            f"it is waiting in {latest.waiting}" if latest.waiting else
            f"it is outside the collectives since {latest.last} (computing, loading data, or blocked elsewhere)"
            if latest.issued else "it has not issued any collective yet"))
    else:
        where = ""
    history = f"after {latest.last}" if latest.issued else "before its first collective"
    parted_too = f", and it {where}" if parted else ""
    failed = f"rank {rank} failed in step {latest.failed_step}: {latest.failed}; " if latest.failed else ""
    if latest.exited:
        if failed:  # the cause, even when it issued this collective before it failed (a prefetch)
            tail = f"{history}, and {where}" if where else "after issuing this collective"
            return Verdict(rank, f"{failed}it has exited since, {tail}", True, parted is not None, gone=True)
        if not where:
            return Verdict(rank, f"rank {rank} has exited since, after reaching this collective", False, gone=True)
        return Verdict(rank, f"rank {rank} has exited (an exception, a normal end, or destroy_process_group()) "
                        f"{history}, and {where}", True, parted is not None, gone=True)
    if not moved(first, latest):
        return Verdict(rank, f"rank {rank} is dead: no heartbeat for {window:g} s (killed, crashed, or its host is "
                        f"gone; its last heartbeat came {history}){parted_too}", True, parted is not None, gone=True)
    if not where:
        return None
    return Verdict(rank, f"{failed}it is alive but {where}" if failed else f"rank {rank} is alive but {where}", True,
                    parted is not None)

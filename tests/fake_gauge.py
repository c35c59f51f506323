"""A stand-in for a GPU's memory counters, so that ``checkpoint="auto"`` decides on the CPU
(``bmtwrap.engine.memory.Gauge``)."""

GIB = 2**30


class FakeGauge:
    """A card of ``card`` GiB: ``allocated()`` moves 1 GiB per call, so each measured recomputation keeps 1 GiB
    (1 GiB is allocated as the first step starts, 10 GiB at the decision after 4 blocks); every step peaks at
    ``peak`` GiB; ``outside`` GiB live outside the allocator. With the defaults the next step is predicted at
    21 GiB, and 2 blocks fit under 24 GiB less the 4 % margin."""

    def __init__(self, card: float = 24, peak: float = 12, outside: float = 0) -> None:
        self.card, self.top, self.outside = int(card * GIB), int(peak * GIB), int(outside * GIB)
        self.now = 0

    def card_bytes(self) -> int:
        return self.card

    def allocated(self) -> int:
        self.now += GIB
        return self.now

    def peak(self) -> int:
        return self.top

    def reserved_peak(self) -> int:
        return self.top

    def reset_peak(self) -> None:
        pass

    def outside_allocator(self) -> int:
        return self.outside

"""Unit tests of the shard arithmetic (bmtwrap/engine/param.py): no process group needed.

[Note: what a layout must guarantee]
For a layout of parameters with ``numels`` over ``world_size`` ranks, with ``align`` elements =
64 bytes / element size:
- every offset is a multiple of ``align`` and parameters do not overlap, in order;
- ``shard_size`` is a multiple of ``align`` and ``shard_size * world_size`` holds every parameter;
- for each parameter, the pieces of ranks 0..W-1 are disjoint, ordered by rank and cover exactly
  ``[0, numel)``; each lies inside its rank's shard ``[0, shard_size)``, at the place the full
  buffer puts it (``offset + param_start == rank * shard_size + shard_start``);
- so scattering a flat buffer into shards through the pieces and concatenating the shards gives
  the flat buffer back.
"""

from __future__ import annotations

import random
from typing import List, Sequence

import pytest
import torch

from bmtwrap.engine.param import ALIGN_BYTES, FlatLayout, LocalPiece, build_layout

ELEMENT_SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _align(element_size: int) -> int:
    return ALIGN_BYTES // element_size


def check_layout(layout: FlatLayout, numels: Sequence[int], world_size: int, element_size: int) -> None:
    """Assert every invariant of [Note: what a layout must guarantee]."""
    align = _align(element_size)
    assert layout.numels == tuple(numels)
    assert layout.world_size == world_size
    assert len(layout.offsets) == len(numels)
    assert layout.shard_size >= 0 and layout.shard_size % align == 0
    assert layout.padded_total == layout.shard_size * world_size
    cursor = 0
    for offset, numel in zip(layout.offsets, numels):
        assert offset % align == 0 and (offset * element_size) % ALIGN_BYTES == 0
        assert offset >= cursor, "parameters overlap or are out of order"
        cursor = offset + numel
    assert layout.padded_total >= cursor
    if numels:
        assert layout.padded_total >= layout.offsets[-1] + numels[-1]

    for index, numel in enumerate(numels):
        covered = 0
        for rank in range(world_size):
            piece = layout.piece(index, rank)
            assert isinstance(piece, LocalPiece)
            assert 0 <= piece.param_start <= piece.param_end <= numel
            assert 0 <= piece.shard_start <= piece.shard_end <= layout.shard_size
            if piece.numel == 0:
                continue
            # Disjoint, ordered by rank, no gap: each non-empty piece starts where the last ended.
            assert piece.param_start == covered, f"param {index}: rank {rank} starts at {piece.param_start}, expected {covered}"
            # At the place the full buffer puts it.
            assert layout.offsets[index] + piece.param_start == rank * layout.shard_size + piece.shard_start
            covered = piece.param_end
        assert covered == numel, f"param {index}: pieces cover [0, {covered}) of [0, {numel})"


def scatter_gather_roundtrip(layout: FlatLayout, numels: Sequence[int], dtype: torch.dtype, seed: int) -> None:
    """Scatter random parameters into per-rank shards through the pieces, then reassemble."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(dtype) for n in numels]
    shards = []
    for rank in range(layout.world_size):
        shard = torch.zeros(layout.shard_size, dtype=dtype)
        for index, param in enumerate(params):
            piece = layout.piece(index, rank)
            shard[piece.shard_start : piece.shard_end] = param[piece.param_start : piece.param_end]
        shards.append(shard)
    full = torch.cat(shards) if shards else torch.zeros(0, dtype=dtype)
    assert full.numel() == layout.padded_total
    # The concatenated shards are the flat buffer: every parameter at its offset, zeros elsewhere.
    expected = torch.zeros(layout.padded_total, dtype=dtype)
    for offset, param in zip(layout.offsets, params):
        expected[offset : offset + param.numel()] = param
    assert torch.equal(full, expected)
    for offset, param in zip(layout.offsets, params):
        assert torch.equal(full[offset : offset + param.numel()], param)


# --- hand-picked layouts ----------------------------------------------------------------------------


def test_divisible_single_parameter():
    layout = build_layout([64], world_size=4, element_size=4)  # align 16: 4 shards of 16
    assert layout.offsets == (0,)
    assert layout.shard_size == 16
    assert [layout.piece(0, r) for r in range(4)] == [LocalPiece(16 * r, 16 * (r + 1), 0) for r in range(4)]
    check_layout(layout, [64], 4, 4)


def test_not_divisible_single_parameter():
    layout = build_layout([100], world_size=3, element_size=4)
    # 100 elements -> 112 (multiple of 16) -> ceil(112 / 3) = 38 -> 48 per shard.
    assert layout.shard_size == 48
    assert layout.piece(0, 0) == LocalPiece(0, 48, 0)
    assert layout.piece(0, 1) == LocalPiece(48, 96, 0)
    assert layout.piece(0, 2) == LocalPiece(96, 100, 0)
    check_layout(layout, [100], 3, 4)


@pytest.mark.parametrize("dtype", list(ELEMENT_SIZES), ids=str)
def test_offsets_aligned_to_64_bytes(dtype):
    size = ELEMENT_SIZES[dtype]
    assert torch.empty((), dtype=dtype).element_size() == size
    numels = [1, 3, 17, 31, 32, 33, 0, 100, 5]
    layout = build_layout(numels, world_size=3, element_size=size)
    for offset in layout.offsets:
        assert (offset * size) % 64 == 0
    assert (layout.shard_size * size) % 64 == 0
    check_layout(layout, numels, 3, size)
    scatter_gather_roundtrip(layout, numels, dtype, seed=0)


def test_uneven_sizes_offsets():
    layout = build_layout([5, 16, 17, 1], world_size=2, element_size=4)
    assert layout.offsets == (0, 16, 32, 64)
    # 65 elements -> 80 -> 40 per rank -> 48.
    assert layout.shard_size == 48
    # The 17-element parameter at [32, 49) straddles the boundary at 48.
    assert layout.piece(2, 0) == LocalPiece(0, 16, 32)
    assert layout.piece(2, 1) == LocalPiece(16, 17, 0)
    assert layout.piece(3, 0).numel == 0
    assert layout.piece(3, 1) == LocalPiece(0, 1, 16)
    check_layout(layout, [5, 16, 17, 1], 2, 4)


def test_empty_parameters_take_no_space():
    layout = build_layout([0, 10, 0, 0, 7, 0], world_size=2, element_size=4)
    assert layout.offsets == (0, 0, 16, 16, 16, 32)
    for rank in range(2):
        for index in (0, 2, 3, 5):
            assert layout.piece(index, rank).numel == 0
    check_layout(layout, [0, 10, 0, 0, 7, 0], 2, 4)


def test_only_empty_parameters():
    layout = build_layout([0, 0], world_size=3, element_size=2)
    assert layout.shard_size == 0 and layout.padded_total == 0
    assert all(layout.piece(i, r).numel == 0 for i in range(2) for r in range(3))
    check_layout(layout, [0, 0], 3, 2)


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_empty_layout(world_size):
    layout = build_layout([], world_size=world_size, element_size=4)
    assert layout.numels == () and layout.offsets == ()
    assert layout.shard_size == 0 and layout.padded_total == 0
    scatter_gather_roundtrip(layout, [], torch.float32, seed=0)


def test_world_larger_than_parameter():
    # 3 elements, 8 ranks: rank 0 owns all of it, the others own an empty piece.
    layout = build_layout([3], world_size=8, element_size=4)
    assert layout.shard_size == 16
    assert layout.piece(0, 0) == LocalPiece(0, 3, 0)
    for rank in range(1, 8):
        piece = layout.piece(0, rank)
        assert piece.numel == 0 and piece.param_start == piece.param_end
    check_layout(layout, [3], 8, 4)


def test_small_parameter_owned_by_a_middle_rank():
    # The small parameter sits after a large one: a later rank owns it and rank 0 owns none of it.
    layout = build_layout([64, 2], world_size=5, element_size=4)
    owners = [r for r in range(5) if layout.piece(1, r).numel]
    assert len(owners) == 1 and owners[0] > 0
    assert layout.piece(1, 0).numel == 0
    check_layout(layout, [64, 2], 5, 4)


def test_parameter_split_across_many_ranks():
    layout = build_layout([10, 200], world_size=4, element_size=2)  # align 32
    assert layout.offsets == (0, 32)
    assert layout.shard_size == 64  # 232 -> 256 -> 64 per rank
    pieces = [layout.piece(1, r) for r in range(4)]
    assert pieces == [LocalPiece(0, 32, 32), LocalPiece(32, 96, 0), LocalPiece(96, 160, 0), LocalPiece(160, 200, 0)]
    assert sum(1 for p in pieces if p.numel) == 4
    check_layout(layout, [10, 200], 4, 2)
    scatter_gather_roundtrip(layout, [10, 200], torch.bfloat16, seed=1)


def test_world_size_one_holds_everything_in_place():
    numels = [7, 0, 33]
    layout = build_layout(numels, world_size=1, element_size=4)
    for index, numel in enumerate(numels):
        piece = layout.piece(index, 0)
        assert (piece.param_start, piece.param_end) == (0, numel)
        if numel:
            assert piece.shard_start == layout.offsets[index]
    check_layout(layout, numels, 1, 4)


def test_local_piece_repr_and_equality():
    piece = LocalPiece(2, 5, 7)
    assert piece.numel == 3 and piece.shard_end == 10
    assert piece == LocalPiece(2, 5, 7) and piece != LocalPiece(2, 5, 8) and piece != (2, 5, 7)
    assert "param[2:5]" in repr(piece) and "shard[7]" in repr(piece)


# --- the property over many random layouts ----------------------------------------------------------


def _random_numels(rng: random.Random) -> List[int]:
    count = rng.randint(0, 8)
    choices = [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65]
    return [rng.choice(choices) if rng.random() < 0.5 else rng.randint(0, 300) for _ in range(count)]


def test_random_layouts_cover_exactly():
    rng = random.Random(20240601)
    for trial in range(400):
        numels = _random_numels(rng)
        world_size = rng.randint(1, 7)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        size = ELEMENT_SIZES[dtype]
        layout = build_layout(numels, world_size, size)
        try:
            check_layout(layout, numels, world_size, size)
            scatter_gather_roundtrip(layout, numels, dtype, seed=trial)
        except AssertionError as err:
            raise AssertionError(f"numels={numels} world_size={world_size} element_size={size}: {err}") from err


def test_layout_is_tight():
    # Padding is bounded: less than one alignment unit per parameter, plus less than one unit per rank.
    rng = random.Random(7)
    for _ in range(200):
        numels = _random_numels(rng)
        world_size = rng.randint(1, 7)
        size = rng.choice([2, 4])
        align = _align(size)
        layout = build_layout(numels, world_size, size)
        payload = sum(numels)
        assert layout.padded_total < payload + align * (len(numels) + world_size) + 1


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [0, -1])
def test_rejects_world_size_below_one(world_size):
    with pytest.raises(ValueError, match=rf"world_size must be >= 1, got {world_size}"):
        build_layout([4], world_size=world_size, element_size=4)


def test_rejects_negative_sizes():
    with pytest.raises(ValueError, match=r"parameter sizes must be >= 0, got -3"):
        build_layout([4, -3], world_size=2, element_size=4)

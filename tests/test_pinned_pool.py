"""The exact-size pinned host memory of offloaded shards (bmtwrap.engine.offload.PinnedPool), on the CPU.

cudaHostRegister needs a GPU, so here it is replaced by a recorder: these tests check the pool's
bookkeeping (exact sizes, reuse only after a tensor's memory is freed, views keeping it alive). On a GPU,
tests/test_gpu.py::test_offloaded_parameters_on_one_gpu checks the same memory is page-locked and trains.
"""

import gc

import pytest
import torch

from bmtwrap.engine import offload


class FakeCudart:
    def __init__(self):
        self.registered = []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return 0


@pytest.fixture
def pool(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    fresh = offload.PinnedPool()
    monkeypatch.setattr(offload, "PINNED", fresh)
    return fresh, cudart


def test_blocks_have_the_exact_size_asked_for(pool):
    fresh, cudart = pool
    a = offload.host_empty(1000, torch.bfloat16, pinned=True)
    b = offload.host_empty(3, torch.float32, pinned=True)
    assert (a.dtype, a.shape, b.dtype, b.shape) == (torch.bfloat16, (1000,), torch.float32, (3,))
    assert [size for _, size, _ in cudart.registered] == [2000, 12]
    assert fresh.registered_bytes == 2012
    assert all(flags == 1 for _, _, flags in cudart.registered)  # portable: pinned for every context
    a.fill_(1.5)
    b.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert a.float().sum().item() == 1500.0 and b.tolist() == [1.0, 2.0, 3.0]


def test_a_block_is_reused_once_its_tensor_and_views_are_gone(pool):
    fresh, cudart = pool
    a = offload.host_empty(256, torch.float32, pinned=True)
    address = a.data_ptr()
    view = a[10:20]
    del a
    gc.collect()
    b = offload.host_empty(256, torch.float32, pinned=True)
    assert b.data_ptr() != address, "a view still held the block, yet it was handed out again"
    del b, view
    gc.collect()
    c = offload.host_empty(256, torch.float32, pinned=True)
    d = offload.host_empty(256, torch.float32, pinned=True)
    assert {c.data_ptr(), d.data_ptr()} == {address, cudart.registered[1][0]}
    assert len(cudart.registered) == 2 and fresh.registered_bytes == 2048


def test_other_sizes_get_other_blocks(pool):
    fresh, cudart = pool
    a = offload.host_empty(100, torch.uint8, pinned=True)
    del a
    gc.collect()
    b = offload.host_empty(101, torch.uint8, pinned=True)
    assert len(cudart.registered) == 2 and b.numel() == 101


def test_a_failed_registration_names_the_size_and_the_cause(monkeypatch):
    class Refusing(FakeCudart):
        def cudaHostRegister(self, ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 1\.0 MiB .*ulimit -l"):
        offload.PinnedPool().take(2**20)


def test_unpinned_and_empty_requests_do_not_touch_the_pool(pool):
    fresh, cudart = pool
    assert offload.host_empty(10, torch.float32, pinned=False).numel() == 10
    assert not cudart.registered


def test_bytes_in_use_count_live_blocks_only(pool):
    fresh, _ = pool
    a = offload.host_empty(100, torch.uint8, pinned=True)
    b = offload.host_empty(50, torch.uint8, pinned=True)
    assert fresh.bytes_in_use() == 150
    del a
    gc.collect()
    assert fresh.bytes_in_use() == 50 and fresh.registered_bytes == 150

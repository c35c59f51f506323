"""bmtwrap's optimizers in one process: their errors, and agreement with torch's AdamW."""

import copy

import pytest
import torch
from torch import nn

import bmtwrap as bmt


@pytest.fixture(scope="module", autouse=True)
def world():
    if not bmt.engine.dist.is_initialized():
        bmt.init_distributed(seed=0)


def wrapped_mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    return copy.deepcopy(model), bmt.wrap(model)


@pytest.mark.parametrize("cls", [bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer])
def test_master_must_be_fp32(cls):
    _, model = wrapped_mlp()
    with pytest.raises(TypeError, match="the master copy must be fp32"):
        cls(model.parameters(), master_dtype=torch.bfloat16)


@pytest.mark.parametrize("cls", [bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer])
def test_parameters_of_an_unwrapped_copy_are_warned_about(cls):
    plain, _ = wrapped_mlp()
    with pytest.warns(UserWarning, match="none of the 6 parameters is sharded by bmtwrap.*the wrapped model will not"):
        opt = cls(plain.parameters())
    before = [p.detach().clone() for p in plain.parameters()]
    sum(p.sum() for p in plain.parameters()).backward()
    opt.step()  # a plain model beside a sharded one trains (BMTrain's programs compare them so)
    assert all(not torch.equal(a, p) for a, p in zip(before, plain.parameters()))


@pytest.mark.parametrize("fraction, message", [(1.5, r"offload_fraction must be 'auto' or in \[0, 1\], got 1.5"),
                                               ("half", r"offload_fraction must be 'auto' or in \[0, 1\], got 'half'"),
                                               (0.5, "offload_fraction=0.5 keeps optimizer state on the GPU, but no "
                                                     "parameter is on one")])
def test_bad_offload_fraction(fraction, message):
    _, model = wrapped_mlp()
    with pytest.raises(ValueError, match=message):
        bmt.optim.AdamOffloadOptimizer(model.parameters(), offload_fraction=fraction)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls", [bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer])
def test_parameters_on_the_cpu_beside_the_gpu_are_refused(cls):
    """Only shards offloaded by wrap(offload_params=True) may sit on the CPU beside GPU parameters."""
    params = [nn.Parameter(torch.zeros(4, device="cuda")), nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match=r"only shards that wrap\(offload_params=True\) keeps on the CPU"):
        cls(params)


def test_only_offloaded_shards_may_sit_on_the_cpu_beside_a_gpu():
    """The device rule on its own (it reads only each parameter's .device and the shard registry), so that a
    machine without a GPU checks it too: a stand-in for a GPU parameter beside offloaded shards passes,
    beside a plain CPU parameter it fails."""
    from bmtwrap.optim.adam_state import _check_params

    class OnGPU:
        device = torch.device("cuda", 0)

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4)) for _ in range(2)])
    bmt.wrap(blocks, offload_params=True)
    _check_params([OnGPU(), *blocks.parameters()], "test")
    with pytest.raises(ValueError, match=r"only shards that wrap\(offload_params=True\) keeps on the CPU"):
        _check_params([OnGPU(), nn.Parameter(torch.zeros(2))], "test")


def test_parameters_on_meta_are_refused():
    with torch.device("meta"):
        layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="parameters are on"):
        bmt.optim.AdamOptimizer(layer.parameters())


@pytest.mark.parametrize("kwargs, message", [(dict(lr=-1.0), "lr, eps and weight_decay must be >= 0"),
                                             (dict(betas=(0.9, 1.0)), r"betas must be in \[0, 1\)")])
def test_bad_hyper_parameters(kwargs, message):
    _, model = wrapped_mlp()
    with pytest.raises(ValueError, match=message):
        bmt.optim.AdamOptimizer(model.parameters(), **kwargs)


def _train(model, optimizer, steps=4):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def test_state_of_another_shape_is_refused():
    _, small = wrapped_mlp()
    optimizer = bmt.optim.AdamOptimizer(small.parameters())
    _train(small, optimizer, steps=1)
    state = optimizer.state_dict()
    first = next(iter(state["state"]))
    state["state"][first]["exp_avg"] = torch.zeros(3)
    other = bmt.optim.AdamOptimizer(wrapped_mlp()[1].parameters())
    with pytest.raises(ValueError, match="has 3 elements but the parameter has"):
        other.load_state_dict(state)


@pytest.mark.parametrize("cls", [bmt.optim.AdamOptimizer, bmt.optim.AdamOffloadOptimizer])
def test_matches_torch_adamw(cls):
    plain, model = wrapped_mlp()
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1))
    _train(model, cls(model.parameters(), lr=1e-2, weight_decay=0.1))
    full = bmt.full_state_dict(model)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_parameters_hold_half_of_their_master():
    """A bf16 parameter is its master rounded, and the state keeps the master's low halves: 10 bytes an
    element. The fp32 master it stands for is what a whole fp32 master fed the same gradients becomes."""
    torch.manual_seed(3)
    model = bmt.wrap(nn.Linear(64, 32).to(torch.bfloat16))
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    split = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    whole = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        model(torch.randn(16, 64).to(torch.bfloat16)).float().pow(2).mean().backward()
        for p, master in zip(model.parameters(), masters):
            master.grad = p.grad.float().view(master.shape)  # one process: the shard is the whole gradient
        split.step()
        whole.step()
        split.zero_grad()
    weight = next(model.parameters())
    state = split.state[weight]
    assert "master" not in state and state["master_low"].dtype == torch.int16
    assert sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim()) == 64 * 32 * 10
    saved = split.state_dict()["state"]
    assert all(entry["master"].dtype == torch.float32 and "master_low" not in entry for entry in saved.values())
    for index, (p, master) in enumerate(zip(model.parameters(), masters)):
        torch.testing.assert_close(saved[index]["master"].view(-1), master.detach().view(-1), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach().view(-1), saved[index]["master"].view(-1).to(torch.bfloat16))
    assert "master_low" in split.state[weight]  # state_dict() left the optimizer's own state alone


@pytest.mark.parametrize("cls", [bmt.optim.AdamOptimizer, torch.optim.AdamW])
def test_injected_inf_skips_the_step_and_shrinks_the_scale(cls):
    _, model = wrapped_mlp()
    optimizer = cls(model.parameters(), lr=1e-2)
    manager = bmt.optim.OptimManager(loss_scale=1024.0)
    manager.add_optimizer(optimizer)
    before = bmt.full_state_dict(model)
    manager.zero_grad()
    manager.backward(model(torch.randn(5, 8)).square().mean())
    next(iter(model.parameters())).grad[0] = float("inf")
    assert manager.step() is False
    assert manager.loss_scale == 512.0
    after = bmt.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) and torch.isfinite(after[k]).all() for k in before)
    # A clean step afterwards goes through, unscaled.
    manager.zero_grad()
    manager.backward(model(torch.randn(5, 8)).square().mean())
    assert manager.step() is True
    assert not all(torch.equal(before[k], v) for k, v in bmt.full_state_dict(model).items())


def test_automatic_offload_fraction_without_a_gpu_keeps_everything_on_the_cpu():
    plain, model = wrapped_mlp(seed=3)
    optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, offload_fraction="auto")
    reference = bmt.optim.AdamOffloadOptimizer(bmt.wrap(plain).parameters(), lr=1e-2)
    for opt, net in ((optimizer, model), (reference, plain)):
        for _ in range(2):
            (net(torch.ones(2, 8)) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert optimizer.offload_fraction == 1.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_host_available_memory_is_read_from_meminfo(tmp_path):
    from bmtwrap.engine.offload import host_available_bytes
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   125000000 kB\n")
    assert host_available_bytes(str(meminfo)) == 125000000 * 1024
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert host_available_bytes(str(meminfo)) is None
    assert host_available_bytes(str(tmp_path / "missing")) is None


def test_automatic_fraction_refuses_state_the_host_cannot_hold():
    """offload_fraction='auto' raises before making host state larger than the host's available memory,
    naming both sizes and what to change; it is silent when the state fits or the memory is unknown."""
    from bmtwrap.optim.state_placement import _check_host_room
    _check_host_room(10 << 30, 11 << 30, 0)
    _check_host_room(10 << 30, None, 0)
    with pytest.raises(MemoryError, match=r"the CPU\) needs 100\.0 GiB, but the host has 90\.0 GiB available \(the GPU keeps "
                                          r"30\.0 GiB of it\).*smaller batch"):
        _check_host_room(100 << 30, 90 << 30, 30 << 30)


@pytest.mark.parametrize("env, value, expected, sets", [
    (None, None, True, True),
    ("PYTORCH_ALLOC_CONF", "expandable_segments:True", True, False),
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments: true", True, False),
    ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128", False, False),
])
def test_expandable_segments_unless_the_allocator_is_configured(monkeypatch, env, value, expected, sets):
    """The optimizer that fills the card turns on expandable segments, but never overrides a configuration
    the user gave."""
    from bmtwrap.engine.offload import expandable_segments
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    if env is not None:
        monkeypatch.setenv(env, value)
    calls = []
    _patch_allocator_settings(monkeypatch, calls.append)
    assert expandable_segments() is expected
    assert calls == (["expandable_segments:True"] if sets else [])


def test_expandable_segments_refused_by_the_backend(monkeypatch):
    from bmtwrap.engine.offload import expandable_segments
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)

    def refuse(_):
        raise RuntimeError("not supported")

    _patch_allocator_settings(monkeypatch, refuse)
    assert expandable_segments() is False


def _patch_allocator_settings(monkeypatch, setter):
    """Replace the allocator's setting call: the accelerator-generic one where torch has it, else CUDA's."""
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter)
    else:
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", setter)


def test_offload_threads_beside_a_gpu_take_this_process_share_of_the_cores(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for several processes per machine: the offload update still gets this
    process's share of the cores, less one for the training loop."""
    import os

    from bmtwrap.optim.adam_offload import default_cpu_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_cpu_threads() == max(1, cores - 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more processes than cores: one thread each
    assert default_cpu_threads() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores + 4)  # asked for more: granted
    assert default_cpu_threads() == cores + 3

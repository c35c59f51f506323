"""Every user-facing error of the engine, and cheap behaviour of a Block, in one process (world size 1).

``bmt.init_distributed`` without a launcher makes a world of one over gloo, so these tests need no
torchrun. At world size 1 every rank owns every element: a sharded parameter is a 1-D view of the
whole value, and gathered results must equal the unwrapped module's bit for bit.
"""

from __future__ import annotations

import copy
import datetime
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import bmtwrap as bmt
import bmtwrap.engine.dist
from bmtwrap.engine.schedule import engine


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """One process group for the whole module; torn down only if this module made it."""
    made_here = not bmtwrap.engine.dist.is_initialized()
    ctx = bmt.init_distributed(seed=0)
    assert ctx.world_size == 1 and ctx.rank == 0
    yield ctx
    if made_here:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        bmtwrap.engine.dist._CONTEXT = None


@pytest.fixture
def uninitialised(monkeypatch):
    """bmtwrap as it is before init_distributed(); the context comes back after the test."""
    monkeypatch.setattr(bmtwrap.engine.dist, "_CONTEXT", None)


def mlp(seed: int, dim: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))


def twin(seed: int, dim: int = 4):
    """Two modules with identical values: one stays plain, the other is to be wrapped."""
    return mlp(seed, dim), mlp(seed, dim)


class OneOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, y):
        return self.lin(x)


# --- init_distributed ---------------------------------------------------------------------------------


def test_init_distributed_rejects_zero_level_1():
    with pytest.raises(ValueError, match=r"zero_level must be 2 or 3, got 1"):
        bmt.init_distributed(seed=0, zero_level=1)


def test_init_distributed_rejects_sequence_parallelism_and_a_pipeline_the_world_cannot_hold():
    with pytest.raises(NotImplementedError, match=r"sequence parallelism is not supported \(sp_size=2\)"):
        bmt.init_distributed(seed=0, sp_size=2)
    with pytest.raises(ValueError, match=r"pipe_size \* tp_size = 2 \* 1 must divide the world size 1; start a "
                                         r"multiple of 2 processes"):
        bmt.init_distributed(seed=0, pipe_size=2)
    with pytest.raises(ValueError, match=r"pipe_size must be a whole number of ranks >= 1, got 0"):
        bmt.init_distributed(seed=0, pipe_size=0)
    with pytest.raises(NotImplementedError, match=r"shard_size=2\) with pipe_size=2: .* leave shard_size out"):
        bmt.init_distributed(seed=0, pipe_size=2, shard_size=2)


def test_init_distributed_rejects_bad_tensor_parallel_sizes():
    with pytest.raises(ValueError, match=r"tp_size must be a whole number of ranks >= 1, got 0"):
        bmt.init_distributed(seed=0, tp_size=0)
    with pytest.raises(NotImplementedError, match=r"shard_size=2\) with tp_size=2: .* leave shard_size out"):
        bmt.init_distributed(seed=0, tp_size=2, shard_size=2)


def test_init_distributed_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be 'nccl', 'gloo' or None, got 'mpi'"):
        bmt.init_distributed(seed=0, backend="mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is missing")
def test_init_distributed_nccl_without_cuda(uninitialised):
    with pytest.raises(ValueError, match=r"backend='nccl' needs CUDA"):
        bmt.init_distributed(seed=0, backend="nccl")
    assert bmtwrap.engine.dist._CONTEXT is None


def test_init_distributed_twice_warns_and_keeps_context(world_of_one):
    with pytest.warns(UserWarning, match=r"init_distributed\(\) was called again"):
        again = bmt.init_distributed(seed=5)
    assert again is world_of_one


def test_init_distributed_on_a_group_made_before_warns_only_for_another_timeout(uninitialised):
    # The module's group was made with the default timeout; bmtwrap adopts it as a program's own group.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = bmt.init_distributed(seed=0, timeout=1800)
    assert same.timeout == datetime.timedelta(minutes=30)
    bmtwrap.engine.dist._CONTEXT = None  # adopt it again (the fixture restores the module's context)
    with pytest.warns(UserWarning, match=r"init_distributed\(timeout=60 s\) has no effect: torch.distributed was "
                                         r"initialised before, with a timeout of 1800 s; pass the timeout to "
                                         r"init_process_group instead"):
        other = bmt.init_distributed(seed=0, timeout=60)
    assert other.timeout == datetime.timedelta(minutes=30)


_TEARDOWN_PROBE = """
import gc, weakref
import torch.distributed as dist
import bmtwrap as bmt
group = weakref.ref(bmt.init_distributed(seed=0).group)
dist.destroy_process_group()
gc.collect()
print("GROUP_ALIVE" if group() is not None else "GROUP_FREED", bmt.engine.dist.is_initialized())
"""


def test_destroy_process_group_frees_group():
    # torch's documented teardown must really tear down: while bmtwrap's context still holds the
    # ProcessGroup, gloo's worker threads outlive destroy_process_group() and can abort the
    # process during interpreter shutdown (a finished collective's tensors are released from a
    # worker thread that can no longer take the GIL). A fresh interpreter: this module's own
    # group must stay up.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GROUP_FREED" in proc.stdout, (
        "bmtwrap keeps the ProcessGroup alive after torch.distributed.destroy_process_group(): "
        + proc.stdout.strip()
    )


# --- helpers before init_distributed ----------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: bmt.sum_loss(torch.ones(())),
        lambda: bmt.synchronize(),
        lambda: bmt.rank(),
        lambda: bmt.world_size(),
        lambda: bmt.Block(nn.Linear(2, 2)),
        lambda: bmt.DistributedParameter(torch.zeros(3)),
    ],
    ids=["sum_loss", "synchronize", "rank", "world_size", "Block", "DistributedParameter"],
)
def test_helpers_before_init_distributed(uninitialised, call):
    with pytest.raises(RuntimeError, match=r"call bmtwrap\.init_distributed\(\)"):
        call()


def test_context_restored_after_uninitialised_tests(world_of_one):
    assert bmtwrap.engine.dist._CONTEXT is world_of_one
    assert bmt.rank() == 0 and bmt.world_size() == 1


# --- sum_loss -----------------------------------------------------------------------------------------


def test_sum_loss_rejects_unknown_method():
    with pytest.raises(ValueError, match=r"method must be 'mean' or 'sum', got 'max'"):
        bmt.sum_loss(torch.ones(()), method="max")


def test_sum_loss_rejects_non_tensor():
    with pytest.raises(TypeError, match=r"sum_loss expects a tensor, got float"):
        bmt.sum_loss(1.0)


def test_sum_loss_is_detached_copy():
    loss = torch.tensor(2.5, requires_grad=True)
    out = bmt.sum_loss(loss)
    assert out.item() == 2.5 and not out.requires_grad
    assert bmt.sum_loss(loss, method="sum").item() == 2.5


# --- DistributedParameter ---------------------------------------------------------------------------


def test_distributed_parameter_rejects_non_tensor():
    with pytest.raises(TypeError, match=r"DistributedParameter expects a tensor, got list"):
        bmt.DistributedParameter([1.0, 2.0])


def test_distributed_parameter_rejects_a_split_dim_it_lacks():
    with pytest.raises(ValueError, match=r"tp_split_dim=2 is not a dimension of a tensor of shape \(4, 2\); give one "
                                         r"below 2, or -1 for no split"):
        bmt.DistributedParameter(torch.zeros(4, 2), tp_mode=True, tp_split_dim=2)


def test_distributed_parameter_deepcopy_is_a_snapshot_of_the_piece():
    param = bmt.DistributedParameter(torch.arange(4.0))
    copied = copy.deepcopy([param, param])
    assert copied[0] is copied[1] and type(copied[0]) is nn.Parameter
    assert torch.equal(copied[0], param.detach()) and copied[0].data_ptr() != param.data_ptr()
    with torch.no_grad():
        param.add_(1)
    assert not torch.equal(copied[0], param.detach())


# --- Block --------------------------------------------------------------------------------------------


def test_block_rejects_non_module():
    with pytest.raises(TypeError, match=r"Block expects an nn\.Module, got function"):
        bmt.Block(lambda x: x)


def test_block_rejects_block():
    block = bmt.Block(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"Block got a Block; a module is wrapped once"):
        bmt.Block(block)


def test_block_rejects_zero_level_4():
    with pytest.raises(ValueError, match=r"zero_level must be 2 or 3, got 4"):
        bmt.Block(nn.Linear(2, 2), zero_level=4)


def test_block_rejects_mixed_devices():
    module = nn.Module()
    module.a = nn.Parameter(torch.zeros(2))
    module.b = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match=r"mixes devices \('a' on cpu, 'b' on meta\)"):
        bmt.Block(module)
    # Nothing was sharded: the parameters keep their shapes.
    assert module.a.shape == (2,) and module.a.device.type == "cpu"


def test_block_rejects_meta_module():
    module = nn.Linear(2, 2, device="meta")
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' is on the meta device"):
        bmt.Block(module)


def test_parameter_owned_by_two_blocks():
    shared = nn.Linear(3, 3)
    bmt.Block(nn.Sequential(shared, nn.ReLU()))
    with pytest.raises(ValueError, match=r"parameter '0\.weight' of Sequential\S* already belongs to another block"):
        bmt.Block(nn.Sequential(shared))


def test_same_module_wrapped_twice():
    module = nn.Linear(3, 3)
    bmt.Block(module)
    with pytest.raises(ValueError, match=r"already belongs to another block"):
        bmt.Block(module)


# --- TransformerBlockList -----------------------------------------------------------------------------


def test_block_list_rejects_num_hidden_0():
    with pytest.raises(ValueError, match=r"num_hidden must be >= 1, got 0"):
        bmt.TransformerBlockList([bmt.Block(nn.Linear(2, 2))], num_hidden=0)


def test_block_list_rejects_non_module():
    with pytest.raises(TypeError, match=r"TransformerBlockList element 0 is a int, not an nn\.Module"):
        bmt.TransformerBlockList([3, nn.Linear(2, 2)])


def test_block_list_rejects_empty():
    with pytest.raises(ValueError, match=r"TransformerBlockList needs at least one module"):
        bmt.TransformerBlockList([])


def test_block_in_two_lists():
    block = bmt.Block(nn.Linear(2, 2))
    first = bmt.TransformerBlockList([block])  # alive: the block is taken
    with pytest.raises(ValueError, match=r"block 0 \(Linear\) already belongs to another TransformerBlockList"):
        bmt.TransformerBlockList([block])
    del first
    assert bmt.TransformerBlockList([block])[0] is block  # a list that is gone holds nothing


def test_failed_block_list_does_not_claim_blocks():
    # A list whose construction raised does not exist; its blocks must stay free for the next try.
    block = bmt.Block(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"element 1 is a int"):
        bmt.TransformerBlockList([block, 3])
    blocks = bmt.TransformerBlockList([block])
    assert blocks[0] is block


def test_block_list_needs_num_hidden_positional_arguments():
    blocks = bmt.TransformerBlockList([bmt.Block(OneOutput())], num_hidden=2)
    with torch.no_grad(), pytest.raises(ValueError, match=r"num_hidden=2\) needs at least 2 positional arguments, got 1"):
        blocks(torch.zeros(1, 3), y=torch.zeros(1, 3))


def test_block_list_block_returns_too_few_values():
    blocks = bmt.TransformerBlockList([bmt.Block(OneOutput())], num_hidden=2)
    with torch.no_grad(), pytest.raises(ValueError, match=r"block 0 returned 1 value\(s\) but num_hidden=2"):
        blocks(torch.zeros(1, 3), torch.zeros(1, 3))


def test_same_block_object_twice_in_one_list():
    block = bmt.Block(nn.Linear(2, 2))
    with pytest.raises(bmt.BlockSharingError, match=r"block 1 \(Linear\) is given twice to one TransformerBlockList"):
        bmt.TransformerBlockList([block, block])
    with pytest.raises(AssertionError, match=r"list the plain module twice"):  # what BMTrain raises
        bmt.TransformerBlockList([block, block])


def test_pipeline_list_takes_blocks_of_either_mode():
    blocks = bmt.PipelineTransformerBlockList([bmt.Block(nn.Linear(2, 2), mode="PIPE"), nn.Linear(2, 2),
                                               bmt.Block(nn.Linear(2, 2))])
    assert len(blocks) == 3
    with pytest.raises(ValueError, match=r"mode must be 'BLOCK' or 'PIPE', got 'pipe'"):
        bmt.Block(nn.Linear(2, 2), mode="pipe")


@pytest.mark.parametrize("use_checkpoint", [True, False], ids=["ckpt", "no_ckpt"])
@pytest.mark.parametrize("zero_level", [2, 3], ids=["zero2", "zero3"])
def test_same_module_twice_in_one_list(use_checkpoint, zero_level):
    # A plain module listed twice: two blocks over one runner (BMTrain's reference blocks).
    plain, inner = twin(seed=11)
    blocks = bmt.TransformerBlockList([inner, inner])
    block = blocks[0]
    assert len(blocks) == 2 and blocks[0] is not blocks[1] and blocks[0].runner is blocks[1].runner
    block.runner.recompute, block.runner.zero_level = use_checkpoint, zero_level

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = plain(plain(x_ref))
    ours = blocks(x_ours)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    (ref * torch.arange(4.0)).sum().backward()
    (ours * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    for (name, p_ref), p_ours in zip(plain.named_parameters(), inner.parameters()):
        assert p_ours.grad is not None, name
        torch.testing.assert_close(p_ours.grad, p_ref.grad.reshape(-1), msg=name)
    assert not block.runner.group.gathered, "the block's parameters are still gathered after backward"


# --- OptimManager -------------------------------------------------------------------------------------


def test_optim_manager_rejects_zero_loss_scale():
    with pytest.raises(ValueError, match=r"loss_scale must be > 0 or None, got 0"):
        bmt.optim.OptimManager(loss_scale=0)


def test_optim_manager_rejects_factor_1():
    with pytest.raises(ValueError, match=r"loss_scale_factor must be > 0 and != 1, got 1"):
        bmt.optim.OptimManager(loss_scale=1024, loss_scale_factor=1)


def test_optim_manager_rejects_bounds_out_of_order():
    with pytest.raises(ValueError, match=r"need 0 < min_loss_scale <= max_loss_scale, got 8 and 4"):
        bmt.optim.OptimManager(loss_scale=1024, min_loss_scale=8, max_loss_scale=4)


def test_optim_manager_add_optimizer_rejects_non_optimizer():
    manager = bmt.optim.OptimManager()
    with pytest.raises(TypeError, match=r"add_optimizer expects a torch\.optim\.Optimizer, got list"):
        manager.add_optimizer([nn.Parameter(torch.zeros(2))])


def test_optim_manager_load_state_dict_optimizer_count():
    manager = bmt.optim.OptimManager(loss_scale=1024)
    manager.add_optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
    state = manager.state_dict()
    empty = bmt.optim.OptimManager(loss_scale=1024)
    with pytest.raises(ValueError, match=r"state holds 1 optimizers but this manager has 0"):
        empty.load_state_dict(state)


# --- Block behaviour at world size 1 ------------------------------------------------------------------


def test_wrapping_keeps_parameter_objects():
    _, inner = twin(seed=1)
    before = [(name, p, p.shape.numel()) for name, p in inner.named_parameters()]
    block = bmt.Block(inner)
    after = dict(inner.named_parameters())
    for name, param, numel in before:
        assert after[name] is param, f"{name} was replaced by another object"
        assert param.dim() == 1 and param.numel() == numel, f"{name}: {tuple(param.shape)}"
    # The block's parameters are exactly those objects, each once, and the engine knows them all.
    assert [id(p) for p in block.parameters()] == [id(p) for _, p, _ in before]
    group_params = [slot.param for slot in block.runner.group.slots]
    assert {id(p) for p in group_params} == {id(p) for p in block.parameters()}
    registry = engine().registry
    assert all(registry.lookup(p) is not None for p in block.parameters())


def test_block_state_dict_keys_match_inner_module():
    plain, inner = twin(seed=2)
    block = bmt.Block(inner)
    assert list(block.state_dict()) == list(plain.state_dict())
    nested = bmt.TransformerBlockList([block])
    assert list(nested.state_dict()) == [f"0.{k}" for k in plain.state_dict()]


def test_block_state_dict_round_trip():
    _, inner = twin(seed=3)
    block = bmt.Block(inner)
    saved = {k: v.clone() for k, v in block.state_dict().items()}
    with torch.no_grad():
        for p in block.parameters():
            p.zero_()
    block.load_state_dict(saved)
    for key, value in block.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_block_loads_plain_module_state_dict():
    _, inner = twin(seed=4)
    donor = mlp(seed=99)
    block = bmt.Block(inner)
    block.load_state_dict(donor.state_dict())
    for key, value in bmt.full_state_dict(block).items():
        assert torch.equal(value, donor.state_dict()[key]), key


def test_full_state_dict_matches_unwrapped():
    plain, inner = twin(seed=5)
    block = bmt.Block(inner)
    full = bmt.full_state_dict(block)
    expected = plain.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        assert full[key].shape == value.shape, key
        assert torch.equal(full[key], value), key


def test_full_state_dict_of_list_and_root_parameters():
    class Model(bmt.DistributedModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = bmt.DistributedParameter(torch.arange(6.0).reshape(2, 3))
            self.layers = bmt.TransformerBlockList([bmt.Block(mlp(seed=6)), bmt.Block(mlp(seed=7))])

    model = Model()
    full = bmt.full_state_dict(model)
    assert torch.equal(full["scale"], torch.arange(6.0).reshape(2, 3))
    for index, seed in enumerate((6, 7)):
        for key, value in mlp(seed=seed).state_dict().items():
            assert torch.equal(full[f"layers.{index}.{key}"], value), f"layers.{index}.{key}"


def test_block_no_grad_matches_unwrapped():
    plain, inner = twin(seed=8)
    block = bmt.Block(inner)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = block(x), plain(x)
    assert not ours.requires_grad
    assert torch.equal(ours, ref)
    assert not block.runner.group.gathered, "no_grad forward left the parameters gathered"


def test_block_forward_backward_matches_unwrapped():
    plain, inner = twin(seed=9)
    block = bmt.Block(inner)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    block(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p_ref), p_ours in zip(plain.named_parameters(), inner.parameters()):
        assert torch.equal(p_ours.grad, p_ref.grad.reshape(-1)), name


def test_block_without_parameters():
    block = bmt.Block(nn.Tanh())
    x = torch.randn(2, 3, requires_grad=True)
    block(x).sum().backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_block_with_empty_parameter():
    torch.manual_seed(0)
    plain = nn.Linear(0, 3)
    inner = nn.Linear(0, 3)
    with torch.no_grad():
        inner.bias.copy_(plain.bias)
    block = bmt.Block(inner)
    x = torch.randn(2, 0)
    out = block(x)
    torch.testing.assert_close(out, plain(x))
    out.sum().backward()
    assert inner.weight.grad is None or inner.weight.grad.numel() == 0
    torch.testing.assert_close(inner.bias.grad, torch.full((3,), 2.0))

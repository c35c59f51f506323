"""BMTrain's helper names: ParameterInitializer, config, inspect, nccl, PipelineTransformerBlockList,
and the ``bmtrain`` import alias. Each case runs in a process of its own (a world of one), started by
tests/launch.py's run_python."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from launch import run_python

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    returncode, output = run_python(textwrap.dedent(code))
    assert returncode == 0, output
    return output


def test_parameter_initializer_matches_unsharded_call() -> None:
    _run("""
        import torch, bmtwrap as bmt
        bmt.init_distributed(seed=3)
        class M(bmt.DistributedModule):
            def __init__(self):
                super().__init__()
                self.w = bmt.DistributedParameter(torch.empty(7, 5),
                    init_method=bmt.ParameterInitializer(torch.nn.init.normal_, 0.5, std=0.02))
            def forward(self, x):
                return x @ self.w.t()
        m = M()
        torch.manual_seed(11); bmt.init_parameters(m)
        torch.manual_seed(11); ref = torch.empty(7, 5); torch.nn.init.normal_(ref, 0.5, std=0.02)
        assert torch.equal(bmt.full_state_dict(m)["w"], ref)
        try:
            bmt.ParameterInitializer(3)
        except TypeError as e:
            assert "callable" in str(e)
        else:
            raise AssertionError
    """)


def test_config_reads_the_context() -> None:
    _run("""
        import bmtwrap as bmt
        try:
            bmt.config["rank"]
        except RuntimeError as e:
            assert "init_distributed" in str(e)
        else:
            raise AssertionError
        bmt.init_distributed(seed=0, zero_level=2)
        c = bmt.config
        assert (c["rank"], c["world_size"], c["local_rank"], c["zero_level"]) == (0, 1, 0, 2)
        assert (c["pipe_size"], c["tp_size"], c["zero_rank"]) == (1, 1, 0)
        assert dict(c)["world_size"] == 1 and "rank" in c and c.get("load_event") is None
        assert c["comm"].ranks == (0,) and c["topology"].get_group_rank("zero") == 0
        for key, words in (("nope", "no key"),
                           ("load_stream", "runs on cpu"), ("calc_stream", "runs on cpu"),
                           ("load_event", "wait_loader")):
            try:
                c[key]
            except KeyError as e:
                assert words in str(e), e
            else:
                raise AssertionError(key)
        try:
            c["rank"] = 3
        except TypeError as e:
            assert "read-only" in str(e)
        else:
            raise AssertionError
    """)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False")
def test_config_streams_order_with_the_engine_on_a_gpu() -> None:
    """BMTrain's pattern: work queued on the load stream, the compute stream waiting for it, around a model
    whose shards come from the host through that stream."""
    _run("""
        import torch
        import bmtwrap as bmt
        from bmtwrap.engine.dist import current
        bmt.init_distributed(seed=0)
        c = bmt.config
        assert c["load_stream"] is current().copy_stream("to_device") and "load_stream" in dict(c)
        assert c["calc_stream"] == torch.cuda.default_stream()
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
        ref = [p.detach().clone() for p in layers.parameters()]
        model = bmt.wrap(torch.nn.Sequential(*layers), offload_params=True)
        x = torch.randn(64, 256, device="cuda")
        with torch.cuda.stream(c["load_stream"]):
            y = x * 2
        torch.cuda.current_stream().wait_stream(c["load_stream"])
        assert torch.equal(y, x * 2)
        out = model(x)
        expected = x
        for i in range(4):
            expected = torch.nn.functional.linear(expected, ref[2 * i], ref[2 * i + 1])
        torch.testing.assert_close(out, expected)
    """)


def test_nccl_communicator_makers_refuse() -> None:
    import bmtwrap.bmtrain.nccl as nccl
    for name in ("getUniqueId", "commInitRank", "commDestroy"):
        with pytest.raises(NotImplementedError, match=r"no NCCL communicators of its own. Use those of bmt.config"):
            getattr(nccl, name)()


def test_format_summary_layout() -> None:
    from bmtwrap.bmtrain.inspect import format_summary
    text = format_summary([{"name": "a.w", "shape": (2, 3), "max": 1.0, "min": -1.0, "std": 0.5, "mean": 0.0,
                            "grad_std": None, "grad_mean": None}])
    header, row = text.split("\n")
    assert header.split() == ["name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean"]
    assert row.split() == ["a.w", "(2,", "3)", "1.0000", "-1.0000", "0.5000", "0.0000", "None", "None"]
    assert len(header) == len(row) == (len("name") + 4) + 20 + 6 * 10


def test_inspect_model_and_tensor() -> None:
    _run("""
        import math, torch, bmtwrap as bmt
        bmt.init_distributed(seed=0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        ref = {k: v.clone() for k, v in model.state_dict().items()}
        class Net(bmt.DistributedModule):
            def __init__(self):
                super().__init__()
                self.blocks = bmt.TransformerBlockList([model])
            def forward(self, x):
                h = self.blocks(x)
                bmt.inspect.record_tensor(h, "out")
                return h
        net = Net()
        stats = bmt.inspect.inspect_model(net, "*.weight")
        assert [s["name"] for s in stats] == ["blocks.0.0.weight", "blocks.0.2.weight"], stats
        w = ref["0.weight"]
        assert stats[0]["shape"] == (6, 4) and stats[0]["grad_std"] == 0.0 == stats[0]["grad_mean"]
        assert math.isclose(stats[0]["std"], w.std().item(), rel_tol=1e-6)
        assert math.isclose(stats[0]["max"], w.max().item())
        x = torch.randn(3, 4)
        with bmt.inspect.inspect_tensor() as inspector:
            net(x).sum().backward()
        summary = inspector.get_summary()
        assert summary[0]["name"] == "out" and summary[0]["shape"] == (3, 2)
        assert summary[0]["grad_mean"] == 1.0 and summary[0]["grad_std"] == 0.0
        assert inspector.get_tensor("out") is not None
        stats = bmt.inspect.inspect_model(net, "blocks.0.2.*")
        assert [s["name"] for s in stats] == ["blocks.0.2.weight", "blocks.0.2.bias"]
        assert math.isclose(stats[1]["grad_mean"], 3.0, rel_tol=1e-6)  # d(sum)/d(bias) = batch size
        print(bmt.inspect.format_summary(stats + summary))
        net(x)  # outside the with: nothing recorded, no error
    """)


def test_pipeline_block_list_is_a_block_list() -> None:
    _run("""
        import torch, bmtwrap as bmt
        bmt.init_distributed(seed=0)
        blocks = bmt.PipelineTransformerBlockList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
        assert isinstance(blocks, bmt.TransformerBlockList) and len(blocks) == 2
        assert list(blocks.layer_ids) == [0, 1]  # one stage holds every layer
    """)


def test_bmtrain_alias_script() -> None:
    out = _run("""
        from bmtwrap.bmtrain.compat import install_bmtrain_alias
        install_bmtrain_alias()
        import torch
        import bmtrain as bmt
        import bmtwrap
        from bmtrain.block_layer import CheckpointBlock, TransformerBlockList
        from bmtrain.global_var import config
        from bmtrain.param_init import init_parameters
        from bmtrain.layer import DistributedModule
        from bmtrain.store import save, load
        import bmtrain.inspect, bmtrain.distributed, bmtrain.lr_scheduler, bmtrain.loss, bmtrain.optim
        assert CheckpointBlock is bmtwrap.CheckpointBlock and config is bmtwrap.config
        assert init_parameters is bmtwrap.init_parameters and save is bmtwrap.save and load is bmtwrap.load
        assert bmtrain.optim.AdamOptimizer is bmtwrap.optim.AdamOptimizer
        assert bmtrain.inspect.inspect_model is bmtwrap.bmtrain.inspect.inspect_model
        assert not hasattr(bmtwrap, "block_layer")  # the alias adds nothing to bmtwrap
        bmt.init_distributed(seed=1)
        class Model(DistributedModule):
            def __init__(self):
                super().__init__()
                self.w = bmt.DistributedParameter(torch.empty(4, 4), init_method=torch.nn.init.eye_)
                self.blocks = TransformerBlockList([CheckpointBlock(torch.nn.Linear(4, 4))])
            def forward(self, x):
                return self.blocks(x @ self.w)
        model = Model()
        init_parameters(model)
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        bmt.print_rank("rank", config["rank"], "of", config["world_size"], "loss", bmt.sum_loss(loss).item())
        try:
            import bmtrain.nn
        except ImportError:
            pass
    """)
    assert "rank 0 of 1" in out


def test_block_follows_bmtrain() -> None:
    """Attributes read through to the inner module; a list comes back as a tuple; a block list hands
    everything a block returned to the next (BMTrain's TransformerBlockList)."""
    _run("""
        import torch, bmtwrap as bmt
        bmt.init_distributed(seed=0)
        class Listing(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 3)
            def forward(self, x):
                return [self.lin(x), x * 2]
        block = bmt.Block(Listing())
        assert block.lin.weight.dim() == 1 and block.lin is block._module.lin
        out = block(torch.ones(2, 3))
        assert isinstance(out, tuple) and len(out) == 2, type(out)
        try:
            block.missing
        except AttributeError as e:
            assert "missing" in str(e)
        else:
            raise AssertionError
        seen = []
        class Extra(torch.nn.Module):
            def forward(self, h, *rest):
                seen.append(len(rest))
                return h + 1, h * 0  # one hidden state and one extra value
        blocks = bmt.TransformerBlockList([Extra(), Extra(), Extra()])
        assert blocks[0] is not blocks[1] and blocks[0].runner is not blocks[1].runner
        h = blocks(torch.zeros(2), "mask")
        # block 0 gets (h, "mask"); blocks 1 and 2 get (h, extra, "mask"), as in BMTrain
        assert seen == [1, 2, 2] and torch.equal(h, torch.full((2,), 3.0)), (seen, h)
        h, extra, stacked = blocks(torch.zeros(2), "mask", return_hidden_states=True)
        assert stacked.shape == (3, 2) and torch.equal(stacked[:, 0], torch.tensor([0.0, 1.0, 2.0]))
    """)


def test_op_parallel_linear_needs_gather_input_to_split() -> None:
    import bmtwrap.bmtrain.nn as bnn
    with pytest.raises(ValueError, match=r"split_input=True needs gather_input=True"):
        bnn.OpParallelLinear.apply(torch.ones(2, 4), torch.ones(3, 4), None, False, False, True)


def test_bmtrain_module_paths() -> None:
    _run("""
        from bmtwrap.bmtrain.compat import install_bmtrain_alias
        install_bmtrain_alias()
        import torch, bmtwrap
        import bmtrain as bmt
        from bmtrain.block_layer import ZeroContext, CheckpointBlockContext, Block, TransformerBlockList
        from bmtrain.pipe_layer import PipelineTransformerBlockList
        from bmtrain.synchronize import gather_result, wait_loader, synchronize
        from bmtrain.utils import print_block, print_dict, see_memory, AverageRecorder, round_up, print_rank
        from bmtrain.init import is_initialized
        from bmtrain.optim import optim_manager
        from bmtrain.zero_context import ZeroContext as Z2
        import bmtrain.loss._function as F, bmtrain.debug, bmtrain.distributed, bmtrain.nn
        assert ZeroContext is CheckpointBlockContext is Z2 is bmtwrap.bmtrain.zero_context.ZeroContext
        assert PipelineTransformerBlockList is bmtwrap.PipelineTransformerBlockList
        assert gather_result is bmtwrap.gather_result and optim_manager.OptimManager is bmtwrap.optim.OptimManager
        assert bmtrain.nn.Linear is bmtwrap.bmtrain.nn.Linear
        from bmtrain.nn.parallel_projection import VPProjection
        from bmtrain.nn.column_parallel_linear import ColumnParallelLinear
        from bmtrain.nn.parallel_linear_func import OpParallelLinear, ReduceType
        assert VPProjection is bmtwrap.bmtrain.nn.VPProjection and ReduceType is bmtwrap.bmtrain.nn.ReduceType
        assert ColumnParallelLinear is bmt.nn.ColumnParallelLinear and OpParallelLinear is bmt.nn.OpParallelLinear
        assert bmtrain.distributed.all_reduce is bmtwrap.bmtrain.distributed.all_reduce
        assert bmt.debug.set is bmtwrap.bmtrain.debug.set and round_up(5, 4) == 8 and not is_initialized()
        flag = torch.zeros((), dtype=torch.uint8)
        F.has_inf_nan(torch.tensor([1.0, 2.0]), flag)
        assert flag.item() == 0
        F.has_inf_nan(torch.tensor([1.0, float("nan")]), flag)
        assert flag.item() == 1
        F.has_inf_nan(torch.tensor([1.0]), flag)
        assert flag.item() == 1  # set, never cleared: the caller zeroes it
        flag.zero_()
        F.has_inf_nan_bf16(torch.tensor([1.0, 2.0]).bfloat16(), flag)
        assert flag.item() == 0
        F.has_inf_nan_bf16(torch.tensor([float("inf"), 2.0]).bfloat16(), flag)
        assert flag.item() == 1
        print_block("title", "body")
        print_dict("config", {"lr": 0.1, "a long name": "x" * 70})
        bmt.init_distributed(seed=0)
        see_memory("after init")
        wait_loader()
    """)


def test_print_helpers_layout(capsys) -> None:
    import bmtwrap as bmt
    bmt.print_block("abc", "text")
    bmt.print_dict("cfg", {"lr": 0.5, "key": "v" * 65})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "=" * 27 + " abc " + "=" * 28 and len(lines[0]) == 60 and lines[1] == "text"
    assert lines[3] == "lr   : 0.5" and lines[4] == "key  : " + "v" * 60 and lines[5] == "       " + "v" * 5


def test_bmtrain_runner(tmp_path, capsys) -> None:
    """``python -m bmtwrap.bmtrain`` as a user runs it, once; the missing program through the same main() here."""
    from bmtwrap.bmtrain.__main__ import main

    program = tmp_path / "train.py"
    program.write_text("import sys\nimport bmtrain as bmt\nfrom helper import VALUE\n"
                       "bmt.init_distributed(seed=0)\nprint('args', sys.argv[1:], VALUE, bmt.world_size())\n")
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    done = subprocess.run([sys.executable, "-m", "bmtwrap.bmtrain", str(program), "--lr", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "args ['--lr', '1'] 42 1" in done.stdout
    with pytest.raises(SystemExit) as missing:
        main([str(tmp_path / "nope.py")])
    stderr = capsys.readouterr().err
    assert missing.value.code == 2 and "no program file" in stderr and "usage:" in stderr


def test_optimizer_and_manager_option_errors() -> None:
    import torch
    import bmtwrap as bmt
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"hold_steps must be an int >= 0, got -1"):
        bmt.optim.AdamOptimizer([param], hold_steps=-1)
    with pytest.raises(ValueError, match=r"grad_scale must be > 0 or None \(the number of ranks\), got 0"):
        bmt.optim.OptimManager(grad_scale=0)

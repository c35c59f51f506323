"""bmtwrap: ZeRO-sharded, activation-checkpointed training of PyTorch models on many GPUs.

Public names only; see each one's docstring. A BMTrain program runs after ``import bmtwrap as bmt``.
"""

# Module map: one concept per file. Imports flow one way (A ← B: B imports A, never the reverse):
#   engine ← BMTrain API ← wrap ← checkpoint / optim front ends
# Each file below imports only files listed above it; a layer may skip the ones between (optim
# imports the engine directly).
#
# engine
#   watchdog.py      heartbeats in the job's store: a failed collective names the rank at fault
#   dist.py          DistContext: the process group, device and copy streams of this process
#   param.py         DistributedParameter and the shard arithmetic (FlatLayout, LocalPiece)
#   collectives.py   all-gather, reduce-scatter, all-reduce: one free function each
#   offload.py       what a flat buffer keeps on the host, and the host memory it lives in
#   memory.py        sizes ("24GiB"), the GPU memory gauge, and what an out-of-memory step says
#   ops/             checked entry points to the compiled kernels (the only importer of _C)
#   group.py         the communication unit: flat buffers, ShardState, gather/release/reduce-scatter
#   on_demand.py     a forward's torch-function mode: a block's parameter used outside it is gathered
#   shard.py         sharding a module's parameters into a group (build_group, lone_group)
#   schedule.py      the Engine (per-process run-time state, TrainingState, reductions in flight) and
#                    the Schedule: execution order, prefetch policy, in-flight reduction bound
#   runners.py       BlockRunner (a module run as a block), RootRunner (the root group around a
#                    forward), BlockModule (the mark of a module that holds its own runner)
#   full_state.py    full-shaped state: the load hook, full_state_dict, full_grad_dict
# BMTrain API: thin classes over the runners
#   block.py         Block / CheckpointBlock
#   blocklist.py     TransformerBlockList
#   module.py        DistributedModule (the root of a hand-written model), init_parameters
# wrap/              the converter: detect.py, plan.py, adapters.py, convert.py (wrap, plan, materialize),
#                    auto.py (checkpoint="auto": the decision from measured memory, and its recovery);
#                    it reaches the engine directly, never through the BMTrain classes
# front ends
#   optim/           AdamOptimizer, AdamOffloadOptimizer, OptimManager (import the engine only)
#   checkpoint/      full, sharded and Hugging Face checkpoints (import wrap, optim and the engine)
#   loss.py, lr_scheduler.py, hf.py (Trainer), __main__.py (the CLI)
# BMTrain compatibility (read the engine through dist/full_state only)
#   initializer.py   ParameterInitializer;  config_view.py  bmt.config, a read-only view of DistContext
#   inspect/         inspect_model, inspect_tensor/record_tensor, format_summary;  nccl.py  refusals
#   nn/              bmt.nn.Linear / OpLinear (DistributedModule layers); the tensor-parallel names refuse
#   distributed.py   autograd-aware collectives (bmt.distributed);  zero_context.py  ZeroContext
#   utils.py         print_block, print_dict, see_memory, AverageRecorder;  debug.py  bmt.debug's store
#   bmtrain.py       `python -m bmtwrap.bmtrain program.py`: run a BMTrain program unchanged
#   compat.py        install_bmtrain_alias(): `import bmtrain` resolves to bmtwrap's objects

from . import debug, distributed, inspect, loss, lr_scheduler, nccl, nn, optim, utils, zero_context
from .block import Block, BlockSharingError, CheckpointBlock
from .blocklist import PipelineTransformerBlockList, TransformerBlockList
from .checkpoint import (CheckpointInfo, from_pretrained, load, load_checkpoint, load_pretrained, load_state_dict, save,
                         save_checkpoint, save_pretrained)
from .dist import init_distributed, print_rank, rank, sum_loss, synchronize, wait_loader, world_size
from .config_view import config
from .full_state import full_grad_dict, full_state_dict
from .initializer import ParameterInitializer
from .distributed import gather_result
from .module import DistributedModule, grouped_parameters, init_parameters
from .param import DistributedParameter
from .utils import print_block, print_dict, see_memory
from .watchdog import CollectiveError
from .wrap import WrapPlan, materialize, plan, wrap

BMTrainModelWrapper = wrap
"""BMTrain's name of :func:`wrap` (the same function)."""

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockSharingError",
    "BMTrainModelWrapper",
    "CheckpointBlock",
    "CheckpointInfo",
    "CollectiveError",
    "config",
    "debug",
    "distributed",
    "DistributedModule",
    "DistributedParameter",
    "from_pretrained",
    "full_grad_dict",
    "full_state_dict",
    "gather_result",
    "grouped_parameters",
    "init_distributed",
    "init_parameters",
    "inspect",
    "load",
    "load_checkpoint",
    "load_pretrained",
    "load_state_dict",
    "loss",
    "lr_scheduler",
    "materialize",
    "nccl",
    "nn",
    "optim",
    "ParameterInitializer",
    "PipelineTransformerBlockList",
    "plan",
    "print_block",
    "print_dict",
    "print_rank",
    "rank",
    "save",
    "save_checkpoint",
    "save_pretrained",
    "see_memory",
    "sum_loss",
    "synchronize",
    "TransformerBlockList",
    "utils",
    "wait_loader",
    "world_size",
    "wrap",
    "WrapPlan",
    "zero_context",
]

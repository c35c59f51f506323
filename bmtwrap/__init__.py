"""bmtwrap: ZeRO-sharded, activation-checkpointed training of PyTorch models on many GPUs.

Public names only; see each one's docstring. A BMTrain program runs after ``import bmtwrap as bmt``.
"""

# The package, by folder. Imports flow one way (A <- B: B imports A, never the reverse):
#   ops <- engine <- bmtrain (the BMTrain API) <- wrap <- optim / checkpoint / front ends
# A layer may skip the ones between (optim imports the engine directly); tests/test_layering.py checks it.
#
#   ops/             checked entry points to the compiled kernels (the only importer of _C)
#   engine/          sharded parameters, gathers and reductions, blocks' runs, the run-time state
#                    (its __init__ lists its modules in import order)
#   bmtrain/         BMTrain's API over the engine: Block, TransformerBlockList, DistributedModule,
#                    bmt.config, bmt.nn, bmt.inspect, ...; `python -m bmtwrap.bmtrain` and `import bmtrain`
#   wrap/            the converter: detect.py, plan.py, adapters.py, convert.py (wrap, plan, materialize),
#                    auto.py (checkpoint="auto"); it reaches the engine directly, never through bmtrain/
#   optim/           AdamOptimizer, AdamOffloadOptimizer, OptimManager (import the engine only)
#   checkpoint/      full, sharded and Hugging Face checkpoints (import wrap, optim and the engine)
#   loss.py, lr_scheduler.py, hf.py (Trainer), hf_trl.py (TRL's trainers), hf_limits.py, __main__.py (the CLI):
#                    the other front ends
#   data/            training data for causal LMs: records read, rendered with chat templates, tokenized with
#                    labels, padded (imports no other part; datasets only when data is read; not imported here)

import importlib as _importlib
import sys as _sys

from . import loss, lr_scheduler, optim
from .bmtrain import debug, distributed, inspect, nccl, nn, utils, zero_context
from .bmtrain.block import Block, BlockSharingError, CheckpointBlock
from .bmtrain.blocklist import TransformerBlockList
from .bmtrain.pipeline import PipelineTransformerBlockList
from .checkpoint import (CheckpointInfo, clean, from_pretrained, load, load_checkpoint, load_pretrained,
                         load_state_dict, save, save_checkpoint, save_pretrained)
from .engine.dist import init_distributed, print_rank, rank, sum_loss, synchronize, wait_loader, world_size
from .bmtrain.config_view import config
from .engine.full_state import full_grad_dict, full_state_dict
from .bmtrain.initializer import ParameterInitializer
from .bmtrain.distributed import gather_result
from .bmtrain.module import DistributedModule, grouped_parameters, init_parameters
from .engine.param import DistributedParameter
from .bmtrain.utils import print_block, print_dict, see_memory
from .engine.watchdog import CollectiveError
from .wrap import Float8, WrapPlan, materialize, plan, wrap

# The module paths these had before the engine and the BMTrain API got folders of their own, for programs
# that import them by path (``from bmtwrap.compat import install_bmtrain_alias``); new code uses the new ones.
MOVED_MODULES = {**{f"{__name__}.{name}": f"{__name__}.bmtrain.{name}" for name in
                    ("compat", "debug", "distributed", "inspect", "nccl", "nn", "utils", "zero_context")},
                 f"{__name__}.dist": f"{__name__}.engine.dist"}
for _old, _new in MOVED_MODULES.items():
    _sys.modules.setdefault(_old, _importlib.import_module(_new))
    globals().setdefault(_old.rpartition(".")[2], _sys.modules[_old])  # `import bmtwrap.dist` binds bmtwrap
del _old, _new

BMTrainModelWrapper = wrap
"""BMTrain's name of :func:`wrap` (the same function)."""

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockSharingError",
    "BMTrainModelWrapper",
    "CheckpointBlock",
    "CheckpointInfo",
    "clean",
    "CollectiveError",
    "config",
    "debug",
    "distributed",
    "DistributedModule",
    "DistributedParameter",
    "Float8",
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

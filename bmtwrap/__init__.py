"""bmtwrap: ZeRO-sharded, activation-checkpointed training of PyTorch models on many GPUs.

Public names only; see each one's docstring. A BMTrain program runs after ``import bmtwrap as bmt``.
"""

from . import loss, lr_scheduler, optim
from .block import Block, CheckpointBlock
from .blocklist import TransformerBlockList
from .checkpoint import load, load_state_dict, save
from .dist import init_distributed, print_rank, rank, sum_loss, synchronize, world_size
from .module import DistributedModule, full_grad_dict, full_state_dict, init_parameters
from .param import DistributedParameter
from .wrap import WrapPlan, materialize, plan, wrap

BMTrainModelWrapper = wrap

__version__ = "0.1.0"

__all__ = [
    "BMTrainModelWrapper",
    "Block",
    "CheckpointBlock",
    "DistributedModule",
    "DistributedParameter",
    "TransformerBlockList",
    "full_grad_dict",
    "full_state_dict",
    "init_distributed",
    "init_parameters",
    "load",
    "load_state_dict",
    "loss",
    "lr_scheduler",
    "materialize",
    "optim",
    "plan",
    "print_rank",
    "rank",
    "save",
    "sum_loss",
    "synchronize",
    "world_size",
    "wrap",
    "WrapPlan",
]

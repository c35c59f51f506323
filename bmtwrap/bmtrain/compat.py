"""``import bmtrain`` for unchanged BMTrain programs: :func:`install_bmtrain_alias`.

Why a meta-path finder, not module objects made up front: BMTrain's submodule paths
(``bmtrain.block_layer``, ``bmtrain.global_var``, ...) are many and most programs import two or
three. A finder answers only the paths asked for, creates each entry in ``sys.modules`` on
request, and installs nothing else; the table below is the whole mapping, in one place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import torch

from .. import ops

__all__ = ["has_inf_nan", "has_inf_nan_bf16", "install_bmtrain_alias"]

# BMTrain's module path -> bmtwrap's module whose names stand in for it.
_ALIASES: Mapping[str, str] = MappingProxyType({
    "bmtrain": "bmtwrap",
    "bmtrain.block_layer": "bmtwrap.bmtrain.blocklist",
    "bmtrain.pipe_layer": "bmtwrap.bmtrain.pipeline",
    "bmtrain.zero_context": "bmtwrap.bmtrain.zero_context",
    "bmtrain.global_var": "bmtwrap.bmtrain.config_view",
    "bmtrain.param_init": "bmtwrap.bmtrain.module",
    "bmtrain.parameter": "bmtwrap.engine.param",
    "bmtrain.init": "bmtwrap.engine.dist",
    "bmtrain.synchronize": "bmtwrap.engine.dist",
    "bmtrain.utils": "bmtwrap.bmtrain.utils",
    "bmtrain.debug": "bmtwrap.bmtrain.debug",
    "bmtrain.inspect": "bmtwrap.bmtrain.inspect",
    "bmtrain.nccl": "bmtwrap.bmtrain.nccl",
    "bmtrain.store": "bmtwrap.checkpoint",
    "bmtrain.layer": "bmtwrap.bmtrain.module",
    "bmtrain.distributed": "bmtwrap.bmtrain.distributed",
    "bmtrain.lr_scheduler": "bmtwrap.lr_scheduler",
    "bmtrain.loss": "bmtwrap.loss",
    "bmtrain.loss._function": "bmtwrap.loss",
    "bmtrain.optim": "bmtwrap.optim",
    "bmtrain.nn": "bmtwrap.bmtrain.nn",
    # BMTrain's files of the tensor-parallel layers, one module here.
    "bmtrain.nn.column_parallel_linear": "bmtwrap.bmtrain.nn.parallel",
    "bmtrain.nn.row_parallel_linear": "bmtwrap.bmtrain.nn.parallel",
    "bmtrain.nn.parallel_embedding": "bmtwrap.bmtrain.nn.parallel",
    "bmtrain.nn.parallel_projection": "bmtwrap.bmtrain.nn.parallel",
    "bmtrain.nn.parallel_linear_func": "bmtwrap.bmtrain.nn.parallel",
    "bmtrain.wrapper": "bmtwrap.wrap",
})
# Names BMTrain's module has that bmtwrap keeps elsewhere: (alias, name) -> (module, name).
_EXTRA: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "bmtrain.block_layer": {"CheckpointBlock": "bmtwrap.bmtrain.block", "Block": "bmtwrap.bmtrain.block",
                            "ZeroContext": "bmtwrap.bmtrain.zero_context",
                            "CheckpointBlockContext": "bmtwrap.bmtrain.zero_context"},
    "bmtrain.global_var": {"rank": "bmtwrap.engine.dist", "world_size": "bmtwrap.engine.dist"},
    "bmtrain.init": {"is_initialized": "bmtwrap.engine.dist"},
    "bmtrain.synchronize": {"gather_result": "bmtwrap.bmtrain.distributed"},
    "bmtrain.parameter": {"ParameterInitializer": "bmtwrap.bmtrain.initializer"},
    "bmtrain.utils": {"print_rank": "bmtwrap.engine.dist"},
    "bmtrain.store": {"allgather_object": "bmtwrap.bmtrain.distributed",
                      "broadcast_object": "bmtwrap.bmtrain.distributed"},
    "bmtrain.wrapper": {"BMTrainModelWrapper": "bmtwrap"},
    "bmtrain.loss._function": {"has_inf_nan": "bmtwrap.bmtrain.compat",
                               "has_inf_nan_bf16": "bmtwrap.bmtrain.compat"},
})


def has_inf_nan(x: torch.Tensor, out: torch.Tensor) -> None:
    """BMTrain's kernel entry (``bmtrain.loss._function.has_inf_nan``): ``out`` (one uint8 element) is
    set to 1 if ``x`` holds an inf or a NaN, and left as it is otherwise."""
    ops.has_inf_nan_into(x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1), out.view(-1))


has_inf_nan_bf16 = has_inf_nan
"""BMTrain's bf16 kernel entry (``bmtrain.loss._function.has_inf_nan_bf16``): :func:`has_inf_nan`, which
reads every float dtype."""


class _BMTrainAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``bmtrain`` and its submodules in :data:`_ALIASES` and loads bmtwrap's modules for them."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _ALIASES or importlib.util.find_spec(_ALIASES[fullname]) is None:
            return None
        # Packages: those with submodules in the table (bmtrain, bmtrain.loss).
        package = any(other.startswith(fullname + ".") for other in _ALIASES)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        # A new module holding bmtwrap's objects, never bmtwrap's module itself: importing
        # bmtrain.X sets attribute X on the parent, which must not add names to bmtwrap.
        target = importlib.import_module(_ALIASES[spec.name])
        alias = types.ModuleType(spec.name, target.__doc__)
        alias.__dict__.update({k: v for k, v in vars(target).items() if not k.startswith("__")})
        for name, module in _EXTRA.get(spec.name, {}).items():
            setattr(alias, name, getattr(importlib.import_module(module), name))
        if spec.name == "bmtrain.global_var":
            alias.config = importlib.import_module("bmtwrap").config
        return alias

    def exec_module(self, module: types.ModuleType) -> None:
        del module  # nothing to run: create_module filled the module


def install_bmtrain_alias() -> None:
    """Make ``import bmtrain`` (and BMTrain's submodule paths) give bmtwrap's objects.

    After this call, ``import bmtrain as bmt`` gives a module holding ``bmtwrap``'s names (the same objects), and
    ``from bmtrain.block_layer import CheckpointBlock``, ``from bmtrain.global_var import
    config``, ``from bmtrain.param_init import init_parameters``, ``bmtrain.inspect``,
    ``bmtrain.nccl``, ``bmtrain.store`` (``save``/``load``), ``bmtrain.layer``
    (``DistributedModule``), ``bmtrain.distributed``, ``bmtrain.lr_scheduler``,
    ``bmtrain.loss``, ``bmtrain.optim`` resolve to bmtwrap's. Calling it again does nothing.

    Raises:
        ImportError: a real ``bmtrain`` is already imported in this process (the two cannot
            share the name).

    Example::

        from bmtwrap.bmtrain.compat import install_bmtrain_alias
        install_bmtrain_alias()
        import bmtrain as bmt   # bmtwrap's names
    """
    if any(isinstance(finder, _BMTrainAliasFinder) for finder in sys.meta_path):
        return
    loaded = sys.modules.get("bmtrain")
    if loaded is not None:
        raise ImportError("a real bmtrain is already imported; call install_bmtrain_alias() before importing bmtrain")
    # First on the path, so that an installed BMTrain does not answer instead.
    sys.meta_path.insert(0, _BMTrainAliasFinder())

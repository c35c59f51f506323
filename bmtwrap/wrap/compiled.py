"""Blocks whose forward runs compiled by ``torch.compile``: ``wrap(compile=...)``.

[Note: compiled blocks]
Each block's own forward (the layer's code, nothing of the engine's) is compiled with
``torch.compile``, and runs compiled in training: in training mode with gradients. Evaluation and
``generate()`` run it eagerly: a decoding step with a key/value cache would compile a graph per
layer (each updates the cache at its own index) and per length, for calls that are not the bulk of
the work. The engine's work stays outside the compiled code, in eager mode: gathers and
their prefetch, the swap of full parameter views into the module, activation checkpointing (the
compiled call is what ``checkpoint`` runs, and runs again in backward), the hooks that start
gradient reductions. Blocks of one class share one code object, and dynamo's cache lives on the code
object with parameters as graph inputs, so the first block compiles and the others of the same shapes
reuse its graphs (regional compilation): start-up costs one layer's compilation, not the model's. A
block whose layers differ (a sliding-window layer among full-attention ones) adds a graph of its
own.

Compilation fuses what a layer runs as many small kernels in eager mode (the RMSNorm's upcast,
square, mean, rsqrt and scale; the rotary embedding's halves and products; SwiGLU's ``silu(gate) *
up``) into a few generated kernels, and saves fewer, smaller tensors for backward.

Activation checkpointing runs the compiled call again in backward and requires it to save the same
tensors, so forward and recomputation must pick the same graph. Two things could make them differ,
and both are removed around the compiled call: the forward's on-demand torch-function mode (see
``engine/on_demand.py``), absent in backward, is taken off the mode stack while the compiled code
runs (dynamo guards on that stack); and dynamo's reordering of a code object's cache entries by last
use is turned off for the process once a block is compiled, so that when a static and a
dynamic-shape graph both fit a call, the same one is tried first in both passes. Inside a compiled
block, the on-demand mode therefore does not see the block's code. Instead, the graph dynamo traces
is checked before the backend compiles it: if one of its inputs is a sharded parameter (inside a
running block, another block's: its own are full views), the compilation fails. So a layer that
reads another block's parameters fails to compile on every rank alike, whatever each rank's piece of
that parameter (a rank whose piece has the wrong shape fails earlier, while tracing), and runs in
eager mode, where the on-demand mode gathers them. (Without that check, a rank whose piece happened
to have the full shape would run the compiled code while the others fell back and gathered: a hang.)
The check runs once per graph, at compilation, and adds nothing to the calls that run the compiled
code: an earlier check, a torch-function mode around every compiled call, cost a float8 block about
280 Python calls per forward, host time that a fast GPU waits for. A block compiled in pieces runs
its graph breaks eagerly, and for those a mode of its own, there in both passes, checks every torch
call.

A block is first compiled whole (``fullgraph=True`` unless the options say otherwise): a graph
break runs part of the block eagerly, and if a later part failed, what that part saved for
backward would stay in the checkpoint beside the eager rerun's. A block that does not trace as one
graph (dynamo refuses before anything runs) is compiled again in pieces, as ``torch.compile`` does
by default. A block whose compiled forward
raises (an operation dynamo or the backend cannot handle, a graph break) runs that call again in
eager mode: if that succeeds the block stays eager, with one warning naming it and the
error; if eager mode raises too, the error is the model's and eager mode's is raised. Running out of
memory is not a compilation failure and is raised as it is.

Outside the blocks, a model's own small modules that also run inside them are compiled the same way: the
final norm after the last layer (``compiled_outside_blocks``). In eager mode a Llama's final RMSNorm runs some 20
kernels over the last hidden state in fp32 (its upcast, square, mean, scale and casts, each a pass over memory):
1.5 ms of a 1B step at 8 x 2048 tokens on an H200, where the compiled norm takes a few passes. Modules of
torch's own (``nn.LayerNorm``, ``nn.Linear``, ``nn.Embedding``) already run as one kernel and stay eager.

``compile="auto"`` (the default) compiles on CUDA when triton is importable (on H100s: +15 % at 8B and
+24 % at 1B, for a first step a few seconds longer), and leaves the CPU eager: on two cores a Llama of
four 512-wide layers ran 5 % faster compiled, after a first step of 17 s instead of 1.3 s.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

from ..engine.on_demand import OnDemandGathers
from ..engine.schedule import engine

__all__ = ["CompileOption", "compile_options", "compiled_forward", "compiled_outside_blocks"]

CompileOption = Union[bool, str, Mapping[str, Any]]

try:
    from torch.utils.checkpoint import _StopRecomputationError as _StopRecomputation
except ImportError:  # a torch without early stopping never raises it
    class _StopRecomputation(Exception):  # type: ignore[no-redef]
        pass

# A block is compiled whole first: a graph break runs part of it eagerly, and if a later part then failed, what
# that part saved for backward would stay in the checkpoint beside the eager rerun's.
WHOLE = {"fullgraph": True}

# Raised through a compiled call as they are: not compilation failures.
_NOT_COMPILATION = (torch.OutOfMemoryError, _StopRecomputation)


def _triton_available() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def compile_options(option: CompileOption, device: torch.device) -> Optional[Dict[str, Any]]:
    """``torch.compile``'s keyword arguments for a ``wrap(compile=option)`` on ``device``, or ``None`` for eager.

    Raises:
        ValueError: ``option`` is not ``True``, ``False``, ``"auto"`` or a mapping of ``torch.compile`` options.
    """
    if option is False:
        return None
    if option == "auto":
        return dict(WHOLE) if device.type == "cuda" and _triton_available() else None
    if option is True:
        return dict(WHOLE)
    if isinstance(option, Mapping):
        return {**WHOLE, **option}
    raise ValueError(f"compile must be True, False, 'auto' or a dict of torch.compile options, got {option!r}")


def _fix_cache_order() -> None:
    """Dynamo tries a code object's cache entries in a fixed order from now on, in this process (see [Note:
    compiled blocks]); a torch without the switch keeps its order."""
    set_lru = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if set_lru is not None:
        set_lru(False)


class ForeignParameter(RuntimeError):
    """A compiled block's code reached a sharded parameter of another block (see [Note: compiled blocks])."""


class _OwnParametersOnly(TorchFunctionMode):
    """Raises when a torch function receives a parameter the engine holds sharded: inside a running block its own
    parameters are full views, so such a parameter is another block's. Around a block compiled in pieces, whose
    graph breaks run eagerly; dynamo traces through it too, so the check fails a compilation on every rank alike."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        _check_own_parameters(getattr(func, "__name__", func), (*args, *kwargs.values()))
        return func(*args, **kwargs)


def _check_own_parameters(where: Any, values: Iterable[Any]) -> None:
    lookup = engine().registry.lookup
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, nn.Parameter) and lookup(item) is not None:
                raise ForeignParameter(f"{where} received a sharded parameter of another block")


class _CheckedBackend:
    """The backend ``torch.compile`` would build from the blocks' options, with a check of each graph it is given:
    no input may be another block's sharded parameter (see [Note: compiled blocks]). The check runs once per
    graph, at compilation. One object per set of options, shared by every block: dynamo reuses a graph traced
    for one block in another only under an equal backend."""

    def __init__(self, key: str, options: Mapping[str, Any]) -> None:
        self.key = key  # the options that make the backend, as _compile reads them
        backend = options.get("backend", "inductor")
        mode, settings, dynamic = options.get("mode"), options.get("options"), options.get("dynamic")
        self.inner = (torch._TorchCompileInductorWrapper(mode, settings, dynamic) if backend == "inductor"
                      else torch._TorchCompileWrapper(backend, mode, settings, dynamic))

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: List[Any]) -> Any:
        _check_own_parameters("the compiled block's graph", (*example_inputs, *graph.parameters()))
        return self.inner(graph, example_inputs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CheckedBackend) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __getattr__(self, name: str) -> Any:  # the inner backend's reset(), get_compiler_config(), compiler_name
        if name in ("inner", "key"):
            raise AttributeError(name)
        return getattr(self.inner, name)


_BACKENDS: Dict[str, _CheckedBackend] = {}


def _compile(forward: Callable[..., Any], options: Dict[str, Any]) -> Callable[..., Any]:
    """``torch.compile(forward, **options)``, its backend checking each graph for other blocks' parameters."""
    key = repr(sorted((k, repr(v)) for k, v in options.items() if k in ("backend", "mode", "options", "dynamic")))
    backend = _BACKENDS.get(key)
    if backend is None:
        backend = _BACKENDS[key] = _CheckedBackend(key, options)
    rest = {k: v for k, v in options.items() if k not in ("backend", "mode", "options")}
    return torch.compile(forward, backend=backend, **rest)


@contextlib.contextmanager
def _same_as_in_backward(pieces: bool) -> Iterator[None]:
    """The same torch-function modes in forward as in the recomputation in backward: the forward's on-demand
    mode taken off; for a block compiled in ``pieces``, the check for other blocks' parameters on."""
    popped = contextlib.nullcontext()
    if isinstance(_get_current_function_mode(), OnDemandGathers):
        popped = _pop_mode_temporarily()
    with popped, (_OwnParametersOnly() if pieces else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _hook_guards() -> Iterator[None]:
    """Dynamo guards on modules' hooks while it compiles here (it skips them by default). Set and restored by hand:
    ``torch._dynamo.config.patch`` costs some 80 us a call on a two-core machine, paid by every block's forward."""
    config = torch._dynamo.config
    before = config.skip_nnmodule_hook_guards
    config.skip_nnmodule_hook_guards = False
    try:
        yield
    finally:
        config.skip_nnmodule_hook_guards = before


def _graph_break(error: Exception) -> bool:
    """Whether ``error`` is dynamo refusing to trace a block in one graph (not the code raising while traced)."""
    unsupported = getattr(getattr(torch._dynamo, "exc", None), "Unsupported", ())
    return isinstance(error, unsupported) and "Observed exception" not in str(error)


def compiled_outside_blocks(model: nn.Module, blocks: Iterable[nn.Module]) -> List[Tuple[str, nn.Module]]:
    """The modules of ``model`` outside every block that are compiled on their own (see [Note: compiled blocks]):
    those without children, with parameters, whose class is defined outside torch and also runs inside a block."""
    inside = {id(m) for block in blocks for m in block.modules()}
    classes = {type(m) for block in blocks for m in block.modules()}
    return [(name, module) for name, module in model.named_modules()
            if id(module) not in inside and type(module) in classes
            and not type(module).__module__.startswith("torch.")
            and next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None]


def compiled_forward(forward: Callable[..., Any], what: str, options: Dict[str, Any]) -> Callable[..., Any]:
    """``forward`` compiled with ``torch.compile(**options)``; in pieces when it does not trace as one graph; in
    eager mode for good when a compiled call raises and the eager call does not (see [Note: compiled blocks]).
    ``what`` names the module in the warning (``"block 'model.layers.0'"``)."""
    _fix_cache_order()
    state = {"compiled": _compile(forward, options), "eager": False,
             "pieces": not options.get("fullgraph", False)}
    module = getattr(forward, "__self__", None)

    def attempt(args: Any, kwargs: Any) -> Tuple[Any, Optional[Exception]]:
        """(the compiled call's output, None), or (None, what it raised) when that is a failure to compile."""
        try:
            # Guards on the modules' hooks, which dynamo skips by default: a block with hooks added later (or a
            # model with hooks where another of the same class had none) compiles anew instead of running graphs
            # traced without them.
            with _hook_guards(), _same_as_in_backward(state["pieces"]):
                return state["compiled"](*args, **kwargs), None
        except _NOT_COMPILATION:
            raise
        except Exception as error:
            return None, error

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if state["eager"] or not torch.is_grad_enabled() or not getattr(module, "training", True):
            return forward(*args, **kwargs)
        out, failure = attempt(args, kwargs)
        if failure is not None and _graph_break(failure) and not state["pieces"]:
            # Refused before anything ran: compile in pieces, with graph breaks, as torch.compile does by default.
            state["pieces"] = True
            state["compiled"] = _compile(forward, {**options, "fullgraph": False})
            out, failure = attempt(args, kwargs)
        if failure is None:
            return out
        out = forward(*args, **kwargs)  # eager mode's own error, if it has one, is the one raised
        state["eager"] = True
        message = " ".join(str(failure).split())
        warnings.warn(f"bmtwrap: {what} did not compile and runs in eager mode from now on "
                      f"({type(failure).__name__}: {message[:400]}); wrap(compile=False) turns compilation off",
                      RuntimeWarning, stacklevel=2)
        return out

    run.is_eager = lambda: state["eager"]
    return run

"""A model saved as each rank's pieces (BMTrain's ``save(..., save_gather=False)``), and ``clean``.

``bmt.save(model, path, save_gather=False)`` gathers nothing: ``path`` becomes a folder holding a sharded
checkpoint of the model alone (:func:`~bmtwrap.checkpoint.save_checkpoint`'s format), which ``bmt.load``
reads here at any world size. :func:`clean` removes what ``bmt.save`` wrote, a file or such a folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from torch import nn

from ..engine.schedule import engine
from .agree import _agree
from .io import PathLike
from .sharded import load_checkpoint
from .sharded_format import INDEX

__all__ = ["clean", "load_pieces"]


def load_pieces(model: nn.Module, folder: Path, *, strict: bool) -> Tuple[List[str], List[str]]:
    """``bmt.load`` of a folder written by ``save(..., save_gather=False)``: the model alone, the RNGs left as they
    are. Returns the missing and unexpected keys.

    Raises:
        ValueError: ``folder`` holds no sharded checkpoint; as :func:`~bmtwrap.checkpoint.load_checkpoint`.
    """
    if not (folder / INDEX).is_file():
        raise ValueError(f"{folder} is a folder without {INDEX}; bmtwrap.load reads one file written by bmtwrap.save, "
                         "torch.save or safetensors, or a folder written by bmtwrap.save(..., save_gather=False)")
    load_checkpoint(folder, model, strict=strict, restore_rng=False)
    with open(folder / INDEX, encoding="utf-8") as f:
        saved = set(json.load(f)["model"])
    expected = set(model.state_dict(keep_vars=True))
    return sorted(expected - saved), sorted(saved - expected)


def clean(path: PathLike) -> None:
    """Remove what ``bmt.save`` wrote at ``path``: its file or its ``save_gather=False`` folder (BMTrain's ``clean``).

    A collective: every rank calls it; rank 0 removes, and every rank returns once it is gone. A
    folder is removed only if it holds a sharded checkpoint (its ``index.json``), so a wrong path
    cannot empty an unrelated folder.

    Raises:
        FileNotFoundError: nothing at ``path``, on every rank.
        ValueError: ``path`` is a folder without ``index.json``, on every rank (nothing is removed).
        RuntimeError: rank 0 could not remove it (the system's reason quoted), on every rank.

    (The other ranks raise rank 0's error, its rank named.)

    Example::

        bmt.save(model, "step100.pt")
        bmt.clean("step100.pt")
    """
    ctx = engine().ctx
    path = Path(path)
    failure: Optional[BaseException] = None
    if ctx.rank == 0:
        try:
            if path.is_dir():
                if not (path / INDEX).is_file():
                    raise ValueError(f"{path} is a folder without {INDEX}, not one bmt.save wrote; nothing was removed")
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            else:
                raise FileNotFoundError(f"bmt.clean: nothing at {path} to remove")
        except FileNotFoundError as err:
            failure = err
        except OSError as err:
            failure = RuntimeError(f"cannot remove {path} ({type(err).__name__}: {err}); rank 0 removes it: check "
                                   "the permissions of it and of its folder")
        except ValueError as err:
            failure = err
    _agree(ctx, failure)

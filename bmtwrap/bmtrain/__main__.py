"""Run a BMTrain program unchanged on bmtwrap: ``python -m bmtwrap.bmtrain program.py [args...]``.

The program's ``import bmtrain`` (and BMTrain's submodule paths) then give bmtwrap's objects (see
:func:`bmtwrap.bmtrain.compat.install_bmtrain_alias`). Under a launcher, name this module instead of the
program: ``torchrun --nproc_per_node=8 -m bmtwrap.bmtrain train.py --lr 1e-4``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

from .compat import install_bmtrain_alias

USAGE = "usage: python -m bmtwrap.bmtrain PROGRAM.py [ARGS...]   (runs a BMTrain program on bmtwrap)"


def main(argv: Optional[List[str]] = None) -> None:
    """Install the ``bmtrain`` alias and run ``argv[0]`` as ``__main__`` with the rest as its arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    program = argv[0]
    if not os.path.isfile(program):
        print(f"bmtwrap.bmtrain: no program file {program!r}\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    install_bmtrain_alias()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(program)))  # as `python program.py` would
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()

"""The text table of a summary, laid out as BMTrain prints it."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

__all__ = ["format_summary"]

HEADERS = ("name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean")
# Column widths after the name column, which fits the longest name plus 4.
_WIDTHS = (20, 10, 10, 10, 10, 10, 10)


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    # Each cell is one space then the text, cut to fit its column and padded on the right.
    return "".join((" " + text[: width - 1]).ljust(width) for text, width in zip(cells, widths))


def format_summary(summary: List[Dict[str, Any]]) -> str:
    """A summary as BMTrain's table: a header line, then one line per entry.

    Args:
        summary: entries as :func:`inspect_model` or :meth:`InspectTensor.get_summary` return.

    Returns:
        The table, lines joined by newlines; floats with 4 decimals, long values cut to fit.

    Raises:
        KeyError: an entry lacks one of the keys ``name``, ``shape``, ``max``, ``min``, ``std``,
            ``mean``, ``grad_std``, ``grad_mean``.

    Example::

        bmt.print_rank(bmt.inspect.format_summary(bmt.inspect.inspect_model(model, "*")))
    """
    widths = (max([len("name")] + [len(item["name"]) for item in summary]) + 4,) + _WIDTHS
    lines = [_line(HEADERS, widths)]
    lines += [_line([_cell(item[key]) for key in HEADERS], widths) for item in summary]
    return "\n".join(lines)

"""Reading training records from local files into one ``datasets.Dataset``.

JSON Lines, JSON (a list of objects, or JSON Lines under a ``.json`` name), Parquet and CSV files, a
folder of them (searched recursively, one format per folder), or a folder written by ``datasets``'
``save_to_disk``. ``datasets`` reads them and keeps an Arrow copy in its cache (``HF_DATASETS_CACHE``),
so a second read of an unchanged file is a memory map. It is imported here, when data is read, never
by ``import bmtwrap``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, List, Optional

# File suffix -> the datasets builder that reads it.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# datasets shows its progress bar while converting files of at least this many bytes (in all).
PROGRESS_FROM_BYTES = 64 << 20


class DataError(ValueError):
    """A mistake in the training data; the message names where (file, line, example) and the fix."""


def is_records(path: Path) -> bool:
    """Whether ``path`` holds records (a folder, or a file of a format in ``FORMATS``), not plain text."""
    return path.is_dir() or path.suffix.lower() in FORMATS


def read_records(path: Path, *, cache_dir: Optional[str] = None) -> Any:
    """The records under ``path`` as one ``datasets.Dataset``.

    Args:
        path: a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file; a folder of such files (all of one
            format, read in name order); or a folder written by ``Dataset.save_to_disk`` (of a
            ``DatasetDict``: its ``train`` split).
        cache_dir: where ``datasets`` keeps its Arrow copy (default: its own cache).

    Raises:
        DataError: no such path, a folder without data files or with several formats, a line that is
            not JSON (naming the file and line), a JSON file that is not a list of objects, no record.
    """
    import datasets

    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_dir() and _saved_to_disk(path):
        dataset = _load_saved(path)
    else:
        files = _data_files(path)
        builder = FORMATS[files[0].suffix.lower()]
        if all(_empty(f) for f in files):
            raise DataError(f"{path}: no example in it (empty)")
        options = _csv_options(files) if builder == "csv" else {}
        try:
            with progress_bars(sum(f.stat().st_size for f in files) >= PROGRESS_FROM_BYTES):
                dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                                cache_dir=cache_dir, **options)
        except Exception as error:  # datasets wraps the parser's error; find the line ourselves
            if builder == "json":
                for file in files:
                    check_json(file)
            raise DataError(f"{path}: datasets cannot read it as {builder}: {error}") from error
    if len(dataset) == 0:
        raise DataError(f"{path}: no example in it")
    return dataset


def _saved_to_disk(folder: Path) -> bool:
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _load_saved(folder: Path) -> Any:
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{folder}: a DatasetDict without a 'train' split (its splits: {', '.join(loaded)}); "
                            "give the folder of the split to train on")
        return loaded["train"]
    return loaded


def _data_files(path: Path) -> List[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"{path}: a folder without .jsonl, .json, .parquet or .csv files, nor one written by "
                        "datasets' save_to_disk")
    builders = {FORMATS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        raise DataError(f"{path}: a folder of several formats ({', '.join(sorted(builders))}); give a folder of "
                        "one format, or one file")
    return files


def _empty(file: Path) -> bool:
    """An empty file, or an empty JSON list: datasets' own errors for them say nothing useful."""
    return file.stat().st_size < 64 and file.read_bytes().strip() in (b"", b"[]")


def _csv_options(files: List[Path]) -> dict:
    """Every CSV column read as text: pandas would read "3." as the number 3.0, and an empty cell as NaN."""
    import csv

    import datasets

    with files[0].open(newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return dict(features=datasets.Features({name: datasets.Value("string") for name in header}),
                keep_default_na=False)


def check_json(file: Path) -> None:
    """Raise DataError naming the first line of ``file`` that is not a JSON object (JSON Lines or one JSON list)."""
    text = file.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # one JSON document: a list of objects
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{file}, line {error.lineno}: not JSON ({error.msg}, column {error.colno})") from None
        bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"{file}: item {bad + 1} of its list is not a JSON object (a record of named fields)")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{file}, line {number}: not JSON ({error.msg}, column {error.colno}); each line of "
                            "a JSON Lines file holds one JSON object") from None
        if not isinstance(record, dict):
            raise DataError(f"{file}, line {number}: a JSON {type(record).__name__}, not an object (a record of "
                            "named fields)")


@contextlib.contextmanager
def progress_bars(show: bool) -> Iterator[None]:
    """datasets' progress bars on or off for a while (the setting is global), then as they were."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if show else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()

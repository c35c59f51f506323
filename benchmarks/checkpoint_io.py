"""Checkpoint I/O: bmtwrap's full and sharded checkpoints against torch.save and torch.distributed.checkpoint.

    torchrun --nproc_per_node=8 benchmarks/checkpoint_io.py --model 8b --dir /local/nvme/ckpt
    torchrun --nproc_per_node=2 benchmarks/checkpoint_io.py --model tiny     # CPU smoke test (gloo)

The model is Llama-shaped (``--model`` as ``--size`` in ``train_llama.py``, plus ``tiny`` and
``small`` for the CPU), built on the meta device in bf16, wrapped and initialised
(``bmtwrap.materialize``). Every row moves the model's weights only, the same bytes, except
``sharded+optimizer`` (``--with-optimizer``), which adds bmtwrap's Adam state (fp32 master and
moments). One JSON line per measurement,
``RESULT {"name": "<row>.<save|load>", "seconds", "gb", "gb_s", ...}``, where ``gb`` is the size
of the files written (1e9 bytes) and ``seconds`` runs from a barrier before the operation to a
barrier after it on every rank. Rows:

- ``full.safetensors`` / ``full.pt``: ``bmtwrap.save`` (one flat buffer gathered at a time, rank 0
  streams one file) and ``bmtwrap.load`` (every rank reads only its own ranges).
- ``sharded`` (and ``sharded+optimizer``): ``bmtwrap.checkpoint.sharded.save_checkpoint`` /
  ``load_checkpoint`` (every rank writes and reads its own pieces).
- ``torch``: the plain way: ``bmtwrap.full_state_dict`` (everything gathered on every rank at
  once), rank 0 ``torch.save`` plus an ``fsync`` (the other rows' files are fsynced too); then every
  rank ``torch.load(map_location="cpu", weights_only=True)`` the whole file and
  ``bmtwrap.load_state_dict``.
- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` (default ``FileSystemWriter``, one
  file per rank) of the state dict of a plain, unwrapped model of the same shapes sharded with
  FSDP2 (``fully_shard`` on each layer and on the root): DTensors, the way DCP is meant to be used,
  so the checkpoint is resharded on load like bmtwrap's sharded one. Saving each rank's local
  bmtwrap shards as plain tensors keyed per rank was rejected: DCP could not reshard that, so it
  would not do the same job. Runs last, after the bmtwrap model is freed.

The file system type of ``--dir`` is reported as ``fs`` (``tmpfs`` would measure memory, not a
disk). Page cache: after each save, every file written is evicted from the page cache
(``posix_fadvise(DONTNEED)`` on the fsynced files, no root needed) unless ``--warm``, and the
fraction still resident just before the load (``mincore``) is reported as ``cached_before_load``;
a value near 1 means the load read memory, not the disk. Also reported per operation: rank 0's
peak host memory (``VmHWM``, reset before each operation) and, on CUDA, rank 0's peak device
memory above what was allocated before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import mmap
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import transformers
from train_llama import SIZES

import bmtwrap as bmt
from bmtwrap.engine.schedule import engine

# Beyond train_llama's sizes: "tiny" for a smoke test on the CPU, "small" (0.2B) for a CPU measurement.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, tie_word_embeddings=True)
SMALL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True)
MODELS = {"tiny": TINY, "small": SMALL, **SIZES}
ROWS = ("full.safetensors", "full.pt", "sharded", "torch", "dcp")


# --- measuring ------------------------------------------------------------------------------------


def files_under(path: Path) -> List[Path]:
    return [p for p in ([path] if path.is_file() else sorted(path.rglob("*"))) if p.is_file()]


def evict(path: Path) -> None:
    """Drop the (clean, fsynced) pages of every file under ``path`` from the page cache."""
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: Path) -> float:
    """The fraction of the bytes under ``path`` resident in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    resident = total = 0
    for file in files_under(path):
        size = file.stat().st_size
        if size == 0:
            continue
        with open(file, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            anchor = ctypes.c_char.from_buffer(mapped)
            pages = (size + page - 1) // page
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector) == 0:
                resident += sum(v & 1 for v in vector) * page
                total += pages * page
            del anchor
            mapped.close()
    return round(resident / total, 3) if total else 0.0


def filesystem_of(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts): tmpfs would measure memory, not a disk."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and str(path.resolve()).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def reset_peak_host() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)


def peak_host_gib() -> Optional[float]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 2)
    return None


@contextlib.contextmanager
def measured(record: Dict[str, Any]) -> Iterator[None]:
    """Time from a barrier before to a barrier after; note rank 0's peak host and device memory."""
    device = bmt.engine.dist.current().device
    reset_peak_host()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    bmt.synchronize()
    start = time.perf_counter()
    yield
    bmt.synchronize()
    record["seconds"] = round(time.perf_counter() - start, 3)
    record["peak_host_gib"] = peak_host_gib()
    if device.type == "cuda":
        record["peak_device_gib_above_start"] = round((torch.cuda.max_memory_allocated(device) - before) / 2**30, 2)


def report(record: Dict[str, Any]) -> None:
    if "seconds" in record and "gb" in record:
        record["gb_s"] = round(record["gb"] / max(record["seconds"], 1e-9), 3)
    bmt.print_rank("RESULT " + json.dumps(record), flush=True)


def run_row(name: str, where: Path, common: Dict[str, Any], save: Callable[[], Any], load: Callable[[], Any],
            warm: bool, needs_bytes: int) -> None:
    """Save, evict, load; one result line for each."""
    free = shutil.disk_usage(where.parent).free
    if needs_bytes > 0.95 * free:
        report({**common, "name": name, "skipped": f"needs about {needs_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"})
        return
    saved: Dict[str, Any] = {**common, "name": f"{name}.save"}
    with measured(saved):
        save()
    saved["gb"] = round(sum(p.stat().st_size for p in files_under(where)) / 1e9, 6)
    report(saved)
    if not warm:
        evict(where)
    bmt.synchronize()
    loaded: Dict[str, Any] = {**common, "name": f"{name}.load", "gb": saved["gb"],
                              "cached_before_load": cached_fraction(where), "cache": "warm" if warm else "evicted"}
    with measured(loaded):
        load()
    report(loaded)
    bmt.synchronize()
    if bmt.rank() == 0:
        shutil.rmtree(where) if where.is_dir() else where.unlink()
    bmt.synchronize()


# --- the model ------------------------------------------------------------------------------------


def llama_config(name: str) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(max_position_embeddings=128, **MODELS[name])


def build_wrapped(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(name)).to(torch.bfloat16)
    model = bmt.wrap(model)
    bmt.materialize(model)
    return model


def fill_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """bmtwrap's Adam with its state created (one step on zero gradients)."""
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def fsdp2_model(name: str, device: torch.device) -> torch.nn.Module:
    """A plain unwrapped model of the same shapes, sharded by FSDP2 (for the DCP row)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(name)).to(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)  # values do not matter for I/O; uninitialised memory may hold NaNs
    return model


# --- the rows -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """What every row shares."""

    folder: Path
    common: Dict[str, Any]  # fields of every result line
    warm: bool
    weight_bytes: int

    def row(self, name: str, where: Path, save: Callable[[], Any], load: Callable[[], Any],
            needs_bytes: int = 0) -> None:
        run_row(name, where, self.common, save, load, self.warm, needs_bytes or self.weight_bytes)


def full_rows(bench: Bench, model: torch.nn.Module, suffixes: List[str]) -> None:
    for suffix in suffixes:
        path = bench.folder / f"full{suffix}"
        bench.row(f"full{suffix}", path, functools.partial(bmt.save, model, path),
                  functools.partial(bmt.load, model, path))


def sharded_rows(bench: Bench, model: torch.nn.Module, weights: bool, with_optimizer: bool) -> None:
    try:
        from bmtwrap.checkpoint.sharded import load_checkpoint, save_checkpoint
    except ImportError as err:
        report({**bench.common, "name": "sharded", "skipped": f"bmtwrap.checkpoint.sharded is not available ({err})"})
        return
    path = bench.folder / "sharded"
    if weights:
        bench.row("sharded", path, functools.partial(save_checkpoint, path, model),
                  functools.partial(load_checkpoint, path, model))
    if with_optimizer:
        optimizer = fill_optimizer(model)
        # fp32 master and two fp32 moments: 12 bytes per 2-byte weight.
        bench.row("sharded+optimizer", path, functools.partial(save_checkpoint, path, model, optimizer),
                  functools.partial(load_checkpoint, path, model, optimizer), needs_bytes=7 * bench.weight_bytes)


def torch_row(bench: Bench, model: torch.nn.Module) -> None:
    """The plain way: everything gathered everywhere, one torch.save; every rank reads the whole file."""
    path = bench.folder / "torch.pt"

    def save() -> None:
        state = bmt.full_state_dict(model)
        if bmt.rank() == 0:
            with open(path, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())

    def load() -> None:
        bmt.load_state_dict(model, torch.load(path, map_location="cpu", weights_only=True))

    bench.row("torch", path, save, load)


def dcp_row(bench: Bench, name: str) -> None:
    """DCP on an FSDP2 model of the same shapes (see the module docstring for why)."""
    path = bench.folder / "dcp"
    try:
        import torch.distributed.checkpoint as dcp

        state = fsdp2_model(name, bmt.engine.dist.current().device).state_dict()
    except Exception as err:  # FSDP2 or DCP missing or unsupported on this device: say so, keep the other rows
        report({**bench.common, "name": "dcp", "skipped": f"{type(err).__name__}: {err}"})
        return
    bench.row("dcp", path, functools.partial(dcp.save, state, checkpoint_id=path),
              functools.partial(dcp.load, state, checkpoint_id=path))


def weight_bytes_of(model: torch.nn.Module) -> int:
    """Bytes of the full parameters, each once (tied ones too, as .pt and DCP store them)."""
    eng = engine()
    total = 0
    for param in model.parameters():
        buffer, index = eng.registry.buffer_of(eng.ctx, param)
        total += buffer.slots[index].numel * param.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1b", choices=sorted(MODELS))
    parser.add_argument("--dir", default=None, help="where to write (default: a new folder in the temporary directory)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument("--with-optimizer", action="store_true", help="add a sharded row with the Adam state")
    parser.add_argument("--warm", action="store_true", help="do not evict the files from the page cache before loading")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")

    ctx = bmt.init_distributed(seed=0)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "bmtwrap_checkpoint_io"
    folder = base / f"run-{args.model}-w{ctx.world_size}"
    if ctx.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    bmt.synchronize()
    bmt.print_rank(f"# writing under {folder}", flush=True)

    model = build_wrapped(args.model)
    weight_bytes = weight_bytes_of(model)
    common = {"bench": "checkpoint_io", "model": args.model, "world": ctx.world_size, "device": str(ctx.device),
              "torch": torch.__version__, "weights_gb": round(weight_bytes / 1e9, 6), "fs": filesystem_of(folder)}
    bench = Bench(folder, common, args.warm, weight_bytes)

    full_rows(bench, model, [s for s in (".safetensors", ".pt") if f"full{s}" in rows])
    if "sharded" in rows or args.with_optimizer:
        sharded_rows(bench, model, "sharded" in rows, args.with_optimizer)
    if "torch" in rows:
        torch_row(bench, model)
    del model  # DCP's model replaces it in memory
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    if "dcp" in rows:
        dcp_row(bench, args.model)

    bmt.synchronize()
    if ctx.rank == 0 and not args.dir:
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

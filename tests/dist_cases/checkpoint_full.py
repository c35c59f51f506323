"""bmtwrap.save / bmtwrap.load across world sizes (gloo), in one process group per launch.

Arguments: ``<result.json> <mode> <folder>``.

- ``save`` (world 4): saves the test GPT (BMTrain-style blocks) and a tiny Hugging Face Llama with
  tied embeddings (through ``bmt.wrap``) in both formats into ``folder``, with references written
  by plain ``torch.save``; checks the files against the unwrapped models; checks that save gathers
  one flat buffer at a time; checks that errors raise on every rank instead of hanging.
- ``load`` (any world): loads every file written by ``save`` into fresh models (the Llama built on
  the meta device) and compares with the references.
- ``save_loop`` (plain ``python``, a world of one): saves over one file again and again, each
  time with every value set to the iteration number, until killed mid-write.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import safetensors.torch
import torch
import transformers
from torch import nn

import bmtwrap as bmt
import bmtwrap.checkpoint.full_format as full_format
from bmtwrap.engine.group import ShardState
from common import flat_buffers, run
from gpt_model import GPT, ShardedGPT

MODE = sys.argv[2] if len(sys.argv) > 2 else "save"
FOLDER = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(".")
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
FORMATS = (".pt", ".safetensors")


def gpt(seed: int) -> ShardedGPT:
    torch.manual_seed(seed)
    return ShardedGPT()


def llama_reference() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def llama_on_meta() -> transformers.LlamaForCausalLM:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    return bmt.wrap(model)


def read_plain(path: Path) -> Dict[str, torch.Tensor]:
    """The file as plain torch / safetensors read it, without bmtwrap."""
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    return torch.load(path, weights_only=True)


def equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def all_ranks(value: Any) -> List[Any]:
    every: List[Any] = [None] * bmt.world_size()
    torch.distributed.all_gather_object(every, value)
    return every


def outcome(action: Callable[[], Any]) -> str:
    """'ok', or the error's type and message."""
    try:
        action()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


# --- mode "save" (world 4) ------------------------------------------------------------------------


def save_gpt() -> Dict[str, Any]:
    model = gpt(1234)
    saved = bmt.full_state_dict(model)
    torch.manual_seed(1234)
    unwrapped = GPT().state_dict()  # the same model as plain torch: same keys, same values
    keys = list(unwrapped)
    out: Dict[str, Any] = {"sharded_equals_unwrapped": equal(saved, unwrapped)}
    for suffix in FORMATS:
        bmt.save(model, FOLDER / f"gpt{suffix}")
        if bmt.rank() == 0:
            plain = read_plain(FOLDER / f"gpt{suffix}")
            out[suffix] = {"equal": equal(plain, saved),
                           "keys": list(plain) == keys if suffix == ".pt" else sorted(plain) == sorted(keys)}
    bmt.save(model, FOLDER / "gpt_pieces.pt", save_gather=False)  # BMTrain's name; a folder of each rank's pieces
    out["pieces_is_a_folder"] = (FOLDER / "gpt_pieces.pt" / "index.json").is_file()
    if bmt.rank() == 0:
        torch.save(saved, FOLDER / "gpt_reference.pt")
    return out


def clean() -> Dict[str, Any]:
    """bmt.clean removes a file or a save_gather=False folder; refuses an unrelated folder and a missing path."""
    model = gpt(5)
    out: Dict[str, Any] = {}
    for name, gather in (("clean_me.pt", True), ("clean_me_pieces", False)):
        bmt.save(model, FOLDER / name, save_gather=gather)
        existed = (FOLDER / name).exists()
        bmt.clean(FOLDER / name)
        out[name] = [existed, (FOLDER / name).exists()]
    (FOLDER / "unrelated").mkdir(exist_ok=True)
    (FOLDER / "unrelated" / "keep.txt").write_text("mine")
    bmt.synchronize()
    out["unrelated"] = all_ranks(outcome(lambda: bmt.clean(FOLDER / "unrelated")))
    out["unrelated_kept"] = (FOLDER / "unrelated" / "keep.txt").is_file()
    out["missing"] = all_ranks(outcome(lambda: bmt.clean(FOLDER / "never_written.pt")))
    return out


def save_llama() -> Dict[str, Any]:
    ref = llama_reference()
    model = bmt.wrap(copy.deepcopy(ref))
    saved = bmt.full_state_dict(model)
    expected = ref.state_dict()
    out: Dict[str, Any] = {"wrapped_equals_reference": equal(saved, expected)}
    for suffix in FORMATS:
        bmt.save(model, FOLDER / f"llama{suffix}")
        if bmt.rank() == 0:
            plain = read_plain(FOLDER / f"llama{suffix}")
            same_keys = list(plain) == list(expected) if suffix == ".pt" else sorted(plain) == sorted(expected)
            out[suffix] = {"equal": equal(plain, expected), "keys": same_keys}
            if suffix == ".pt":  # tied weights share one storage, as in torch.save(ref.state_dict())
                out[suffix]["tied_shared"] = (plain["lm_head.weight"].data_ptr()
                                              == plain["model.embed_tokens.weight"].data_ptr())
    bmt.save(model, FOLDER / "hf" / "model.safetensors")  # a new folder, with the config beside it
    if bmt.rank() == 0:
        torch.save(expected, FOLDER / "llama_plain.pt")
        ref.config.save_pretrained(FOLDER / "hf")
    return out


def one_buffer_at_a_time() -> Dict[str, Any]:
    """Count the model's gathered buffers each time one of them starts or finishes a gather."""
    model = bmt.wrap(llama_reference())
    buffers = flat_buffers(model)
    seen: List[int] = []
    gathers = {id(b): 0 for b in buffers}

    def probe(buffer, method):
        def probed(*args, **kwargs):
            if method.__name__ == "issue_gather":
                gathers[id(buffer)] += 1
            result = method(*args, **kwargs)
            seen.append(sum(b.state is not ShardState.SHARDED for b in buffers))
            return result
        return probed

    for buffer in buffers:
        buffer.issue_gather = probe(buffer, buffer.issue_gather)
        buffer.wait_gather = probe(buffer, buffer.wait_gather)
    # The probe itself: two buffers gathered together must show as two.
    buffers[0].ensure_gathered()
    buffers[1].ensure_gathered()
    probe_sees_two = max(seen) == 2
    buffers[0].release()
    buffers[1].release()
    seen.clear()
    gathers = dict.fromkeys(gathers, 0)
    out: Dict[str, Any] = {"probe_sees_two": probe_sees_two, "buffers": len(buffers)}
    for suffix in FORMATS:
        bmt.save(model, FOLDER / f"scratch{suffix}")
        out[suffix] = {"max_gathered": max(seen), "events": len(seen),
                       "gathers_per_buffer": sorted(set(gathers.values())),
                       "all_released": all(b.state is ShardState.SHARDED for b in buffers)}
        seen.clear()
        gathers = dict.fromkeys(gathers, 0)
    return out


def save_errors() -> Dict[str, Any]:
    """Failures on one rank raise on every rank (none hangs), and change nothing."""
    model = bmt.wrap(llama_reference())
    before = bmt.full_state_dict(model)
    out: Dict[str, Any] = {}
    blocker = FOLDER / "a_file"
    if bmt.rank() == 0:
        blocker.write_text("not a folder")
    bmt.synchronize()
    out["unwritable"] = all_ranks(outcome(lambda: bmt.save(model, blocker / "model.pt")))

    # A fault on rank 0 alone while it prepares the file.
    original_init = full_format._TorchWriter.__init__

    def broken_init(self, path, entries):
        raise AssertionError("torch.save laid out storage 0 unexpectedly")

    full_format._TorchWriter.__init__ = broken_init
    try:
        out["writer_fails_to_start"] = all_ranks(outcome(lambda: bmt.save(model, FOLDER / "never.pt")))
    finally:
        full_format._TorchWriter.__init__ = original_init

    # A full disk on rank 0 halfway through: the previous file stays, the temporary file goes.
    target = FOLDER / "llama.safetensors"
    old_bytes = target.read_bytes() if bmt.rank() == 0 and target.exists() else b""  # never raise on one rank only
    original = full_format._SafetensorsWriter.write
    calls = [0]

    def failing(self, entry, value):
        calls[0] += 1
        if calls[0] == 5:
            raise OSError(28, "No space left on device")
        original(self, entry, value)

    full_format._SafetensorsWriter.write = failing
    try:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # so that a completed write would change the file
        out["disk_full"] = all_ranks(outcome(lambda: bmt.save(model, target)))
        with torch.no_grad():
            next(model.parameters()).sub_(1.0)
    finally:
        full_format._SafetensorsWriter.write = original
    if bmt.rank() == 0:
        out["disk_full_file_kept"] = target.read_bytes() == old_bytes
        out["temporary_files_left"] = [p.name for p in FOLDER.iterdir() if ".tmp-" in p.name]

    out["missing_file"] = all_ranks(outcome(lambda: bmt.load(model, FOLDER / "nothing_here.pt")))
    out["wrong_model"] = all_ranks(outcome(lambda: bmt.load(model, FOLDER / "gpt.safetensors")))
    # Only rank 1 cannot read its file: every rank raises, and no rank loads anything.
    path = FOLDER / ("nothing_here.pt" if bmt.rank() == 1 else "llama.pt")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    zeroed = bmt.full_state_dict(model)
    out["one_rank_missing"] = all_ranks(outcome(lambda: bmt.load(model, path)))
    out["unchanged"] = equal(bmt.full_state_dict(model), zeroed) and not equal(zeroed, before)
    return out


# --- mode "load" (world 1, 2, 3) -----------------------------------------------------------------


def load_gpt(suffix: str) -> Dict[str, Any]:
    reference = torch.load(FOLDER / "gpt_reference.pt", weights_only=True)
    model = gpt(99)
    differs_before = not equal(bmt.full_state_dict(model), reference)
    bmt.load(model, FOLDER / f"gpt{suffix}")
    return {"differs_before": differs_before, "equal": equal(bmt.full_state_dict(model), reference)}


def load_llama(name: str) -> Dict[str, Any]:
    """Into a model built on the meta device and wrapped; then one forward against the unwrapped reference."""
    reference = torch.load(FOLDER / "llama_plain.pt", weights_only=True)
    ref = llama_reference()
    model = llama_on_meta()
    bmt.load(model, FOLDER / name)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        loss, ref_loss = model(ids, labels=ids).loss.item(), ref(ids, labels=ids).loss.item()
    return {"equal": equal(bmt.full_state_dict(model), reference),
            "inv_freq_equal": torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq),
            "loss_rel": abs(loss - ref_loss) / ref_loss}


# --- mode "save_loop" (no launcher) ---------------------------------------------------------------


def save_loop(path: Path) -> None:
    """~64 MB of fp32 saved again and again; save i writes every value as i.

    From the third save on, after two of the four tensors are written, the process prints
    "mid-write <i>" and pauses, so that the parent's SIGKILL lands mid-write every time.
    """
    bmt.init_distributed(seed=0)
    model = bmt.wrap(nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(4)]))
    writer = full_format._SafetensorsWriter if path.suffix == ".safetensors" else full_format._TorchWriter
    original = writer.write
    progress = {"iteration": 0, "written": 0}

    def write(self, entry, value):
        original(self, entry, value)
        progress["written"] += 1
        if progress["iteration"] >= 2 and progress["written"] == 2:
            print(f"mid-write {progress['iteration']}", flush=True)
            time.sleep(60)

    writer.write = write
    while True:
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(progress["iteration"]))
        progress["written"] = 0
        bmt.save(model, path)
        progress["iteration"] += 1


if __name__ == "__main__":
    if MODE == "save_loop":
        save_loop(FOLDER)
    elif MODE == "save":
        run({"save_gpt": save_gpt, "save_llama": save_llama, "one_buffer_at_a_time": one_buffer_at_a_time,
             "save_errors": save_errors, "clean": clean})
    else:
        run({**{f"load_gpt{s}": (lambda s=s: load_gpt(s)) for s in FORMATS + ("_pieces.pt",)},
             **{f"load_llama{s}": (lambda s=s: load_llama(f"llama{s}")) for s in FORMATS},
             "load_llama_plain_torch_save": lambda: load_llama("llama_plain.pt")})

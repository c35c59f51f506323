"""Hugging Face import/export over gloo: every checkpoint is written and read back by plain transformers.

Argument 2: a folder shared by the ranks (the test's temporary directory). Each case that needs a
source checkpoint saves a seeded, unwrapped transformers model with transformers' own
``save_pretrained`` on rank 0; every rank builds the same reference in memory to compare with.
"""

from __future__ import annotations

import ctypes
import gc
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist
import transformers as T
from safetensors.torch import load_file, save_file

import bmtwrap as bmt
from bmtwrap.checkpoint import hf, hf_export
from bmtwrap.engine.dist import current
from bmtwrap.engine.schedule import engine
from common import run

ROOT = Path(sys.argv[2])
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _error_text(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:  # the message is what the case reports
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# Checked before common.run() initialises bmtwrap: this process has no context yet.
NOT_INITIALISED = _error_text(lambda: hf.from_pretrained(ROOT / "nowhere"))


def _all(flag: bool) -> bool:
    """True on every rank only if ``flag`` holds on every rank."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _source(name: str, build: Callable[[], torch.nn.Module], **save: Any) -> Tuple[torch.nn.Module, Path]:
    """A seeded reference model (on every rank) saved by plain transformers (on rank 0)."""
    torch.manual_seed(0)
    ref = build()
    folder = ROOT / name
    if bmt.rank() == 0:
        ref.save_pretrained(folder, **save)
    bmt.synchronize()
    return ref, folder


def _same_tensors(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _buffers_equal(model: torch.nn.Module, ref: torch.nn.Module) -> bool:
    mine = dict(model.named_buffers())
    return all(torch.equal(mine[k], v) for k, v in ref.named_buffers())


# --- the architectures ---------------------------------------------------------------------------

Batch = Callable[[int, int], Dict[str, torch.Tensor]]


def _tokens(seed: int, rows: int) -> Dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (rows, 10), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _images(seed: int, rows: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(rows, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 5, (rows,), generator=gen)}


ARCHS: Dict[str, Tuple[Callable[[], torch.nn.Module], Any, Batch, Dict[str, Any]]] = {
    "llama_tied": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=True)),
                   T.AutoModelForCausalLM, _tokens, {}),
    "llama_untied": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=False)),
                     T.AutoModelForCausalLM, _tokens, {"max_shard_size": "30KB"}),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                    bos_token_id=1, eos_token_id=2)),
             T.AutoModelForCausalLM, _tokens, {}),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                           num_heads=4, decoder_start_token_id=0)),
           T.AutoModelForSeq2SeqLM, _tokens, {}),
    # Mixtral's experts are one file tensor each and one fused 3-D parameter in the model (and
    # ``block_sparse_moe`` is renamed ``mlp``): transformers 5 converts both ways.
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)),
                T.AutoModelForCausalLM, _tokens, {"max_shard_size": "20KB"}),
    # ViT's files keep the old names (encoder.layer.N.attention.attention.query); the model renamed them.
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                            intermediate_size=64, image_size=16, patch_size=4,
                                                            num_labels=5)),
            T.AutoModelForImageClassification, _images, {}),
}


def _file_keys(folder: Path) -> list:
    index = folder / hf.INDEX_NAME
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    return sorted(load_file(folder / hf.WEIGHTS_NAME))


def roundtrip(arch: str) -> Callable[[], Dict[str, Any]]:
    """Import (meta-built, streamed), check, train one step, export, reload with plain transformers."""

    def case() -> Dict[str, Any]:
        build, auto, batch, save = ARCHS[arch]
        ref, src = _source(arch, build, **save)
        model = hf.from_pretrained(src, model_class=auto)
        imported = _all(_same_tensors(bmt.full_state_dict(model, with_buffers=False),
                                      dict(ref.named_parameters(remove_duplicate=False)))
                        and _same_tensors(dict(model.named_buffers()), dict(ref.named_buffers())))
        was_eval = not model.training

        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(**batch(10 + bmt.rank(), 2)).loss.backward()
        optimizer.step()
        out = ROOT / f"{arch}_out"
        hf.save_pretrained(model, out, **save)
        trained = bmt.full_state_dict(model)
        model.eval()
        inputs = batch(99, 3)
        with torch.no_grad():
            logits = model(**inputs).logits
        result: Dict[str, Any] = {"imported_equal": imported, "eval_after_import": was_eval}
        if bmt.rank() == 0:
            plain = auto.from_pretrained(out)
            with torch.no_grad():
                plain_logits = plain(**inputs).logits
            result.update(
                exported_equal=_same_tensors(plain.state_dict(), trained),
                trained_changed=any(not torch.equal(trained[k], v) for k, v in ref.state_dict().items()),
                logits_max_abs=(plain_logits - logits).abs().max().item(),
                logits_equal=torch.equal(plain_logits, logits),
                file_keys_as_transformers=_file_keys(out) == _file_keys(src),
                sharded=(out / hf.INDEX_NAME).exists(),
            )
        return result

    return case


# --- prefixes, ties, non-strict ----------------------------------------------------------------


def base_into_causal() -> Dict[str, Any]:
    """A LlamaModel checkpoint (no ``model.`` prefix) into a tied LlamaForCausalLM, strictly."""
    config = T.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    ref, src = _source("base_model", lambda: T.LlamaModel(config))
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    bmt.wrap(model)
    hf.load_pretrained(model, src)
    full = bmt.full_state_dict(model, with_buffers=False)
    want = {f"model.{k}": v for k, v in ref.state_dict().items()}
    want["lm_head.weight"] = want["model.embed_tokens.weight"]
    return {"equal": _all(_same_tensors(full, want)), "inv_freq": _all(_buffers_equal(model.model, ref))}


def causal_into_base() -> Dict[str, Any]:
    """A tied LlamaForCausalLM checkpoint (keys under ``model.``) into a LlamaModel, strictly."""
    config = T.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    ref, src = _source("causal_tied", lambda: T.LlamaForCausalLM(config))
    with torch.device("meta"):
        model = T.LlamaModel(config)
    bmt.wrap(model)
    hf.load_pretrained(model, src)
    want = {k.removeprefix("model."): v for k, v in ref.model.state_dict().items()}
    return {"equal": _all(_same_tensors(bmt.full_state_dict(model, with_buffers=False), want))}


def missing_initialised() -> Dict[str, Any]:
    """Not strict: an untied head absent from a base checkpoint is initialised (as transformers does)."""
    config = T.LlamaConfig(**LLAMA, tie_word_embeddings=False)
    ref, src = _source("base_untied", lambda: T.LlamaModel(config))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hf.from_pretrained(src, model_class=T.LlamaForCausalLM, config=config)
    full = bmt.full_state_dict(model, with_buffers=False)
    head = full.pop("lm_head.weight")
    want = {f"model.{k}": v for k, v in ref.state_dict().items()}
    return {"rest_equal": _all(_same_tensors(full, want)), "head_std": head.std().item(),
            "warned": any("lm_head.weight" in str(w.message) for w in caught) or bmt.rank() != 0}


def legacy_names() -> Dict[str, Any]:
    """A BERT file with the old ``LayerNorm.gamma/beta`` names: transformers' legacy renaming applies."""
    config = T.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64)
    ref, src = _source("bert", lambda: T.BertModel(config))
    if bmt.rank() == 0:
        tensors = load_file(src / hf.WEIGHTS_NAME)
        renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                   for k, v in tensors.items()}
        save_file(renamed, src / hf.WEIGHTS_NAME, metadata={"format": "pt"})
    bmt.synchronize()
    model = hf.from_pretrained(src, model_class=T.AutoModel, strict=True)
    return {"equal": _all(_same_tensors(bmt.full_state_dict(model, with_buffers=False), ref.state_dict())),
            "buffers": _all(_buffers_equal(model, ref)),
            "file_had_gamma": any(k.endswith("LayerNorm.gamma") for k in _file_keys(src))}


# --- errors ------------------------------------------------------------------------------------


def _meta_llama(tied: bool = True) -> torch.nn.Module:
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=tied))
    return bmt.wrap(model)


def strict_mismatch() -> Dict[str, Any]:
    """One key missing, one unexpected, one of the wrong shape: all three named; nothing written."""
    _, src = _source("mismatch", lambda: T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=True)))
    if bmt.rank() == 0:
        tensors = load_file(src / hf.WEIGHTS_NAME)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.0.extra.weight"] = torch.zeros(3)
        tensors["model.norm.weight"] = torch.zeros(7)
        save_file(tensors, src / hf.WEIGHTS_NAME, metadata={"format": "pt"})
    bmt.synchronize()
    model = _meta_llama()
    hf.load_pretrained(model, ROOT / "llama_tied")  # a good checkpoint first
    before = bmt.full_state_dict(model)
    message = _error_text(lambda: hf.load_pretrained(model, src))
    return {"message": message, "unchanged": _all(_same_tensors(bmt.full_state_dict(model), before))}


def other_architecture() -> Dict[str, Any]:
    return {"message": _error_text(lambda: hf.load_pretrained(_meta_llama(), ROOT / "gpt2", strict=False))}


def missing_shard() -> Dict[str, Any]:
    folder = ROOT / "missing_shard"
    shards = sorted(p.name for p in (ROOT / "llama_untied").glob("model-*"))
    if bmt.rank() == 0:
        shutil.copytree(ROOT / "llama_untied", folder)
        (folder / shards[1]).unlink()
    bmt.synchronize()
    return {"removed": shards[1], "message": _error_text(lambda: hf.load_pretrained(_meta_llama(tied=False), folder))}


def no_weights() -> Dict[str, Any]:
    folder = ROOT / "no_weights"
    if bmt.rank() == 0:
        folder.mkdir()
        (folder / "pytorch_model.bin").write_bytes(b"")
    bmt.synchronize()
    return {"message": _error_text(lambda: hf.load_pretrained(_meta_llama(), folder))}


def not_hf_model() -> Dict[str, Any]:
    return {"message": _error_text(lambda: hf.load_pretrained(bmt.wrap(torch.nn.Linear(4, 4)), ROOT / "gpt2"))}


def unwrapped_meta_model() -> Dict[str, Any]:
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=True))
    return {"message": _error_text(lambda: hf.load_pretrained(model, ROOT / "llama_tied"))}


def save_onto_a_file() -> Dict[str, Any]:
    target = ROOT / "a_file"
    if bmt.rank() == 0:
        target.write_text("")
    bmt.synchronize()
    model = _meta_llama()
    hf.load_pretrained(model, ROOT / "llama_tied")
    return {"message": _error_text(lambda: hf.save_pretrained(model, target))}


def bad_dtype() -> Dict[str, Any]:
    return {"message": _error_text(lambda: hf.from_pretrained(ROOT / "llama_tied", torch_dtype="float99"))}


def bf16_import() -> Dict[str, Any]:
    """torch_dtype casts on load, as transformers does: the values are the reference's, rounded to bf16."""
    ref, _ = _source("llama_tied", lambda: T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=True)))
    model = hf.from_pretrained(ROOT / "llama_tied", torch_dtype=torch.bfloat16)
    want = {k: v.to(torch.bfloat16) for k, v in ref.named_parameters(remove_duplicate=False)}
    full = bmt.full_state_dict(model, with_buffers=False)
    return {"equal": _all(_same_tensors(full, want)), "dtype": str(next(model.parameters()).dtype)}


def not_initialised() -> Dict[str, Any]:
    return {"message": NOT_INITIALISED}


# --- the atomic folder ---------------------------------------------------------------------------


def overwrite_keeps_other_files() -> Dict[str, Any]:
    """Saving over a folder: stale shards go, a tokenizer file stays, no temporary folder is left."""
    folder = ROOT / "overwrite"
    if bmt.rank() == 0:
        shutil.copytree(ROOT / "llama_untied", folder)  # 4 shards + index
        (folder / "tokenizer.json").write_text("{}")
    bmt.synchronize()
    model = hf.from_pretrained(ROOT / "llama_tied")
    hf.save_pretrained(model, folder)  # one file now
    names = sorted(p.name for p in folder.iterdir())
    return {"names": names, "siblings": sorted(p.name for p in ROOT.iterdir() if p.name.startswith("."))}


def failed_save_leaves_folder() -> Dict[str, Any]:
    """A write that fails on rank 0 midway: the old folder is intact, every rank raises."""
    folder = ROOT / "llama_untied"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    model = hf.from_pretrained(folder)
    real, calls = hf_export._write_shard, []

    def failing(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        real(path, tensors)

    hf_export._write_shard = failing
    try:
        message = _error_text(lambda: hf.save_pretrained(model, folder, max_shard_size="30KB"))
    finally:
        hf_export._write_shard = real
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    return {"message": message, "unchanged": _all(after == before), "every_rank_raised": _all(message != "no error"),
            "siblings": sorted(p.name for p in ROOT.iterdir() if p.name.startswith("."))}


# --- memory --------------------------------------------------------------------------------------

MEMORY = dict(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
              num_key_value_heads=12, max_position_embeddings=128, tie_word_embeddings=False)


def _write_random_checkpoint(folder: Path, config: T.LlamaConfig, max_shard: int) -> None:
    """A ~200 MB checkpoint written file by file, so the writer never holds the whole model."""
    from huggingface_hub import split_torch_state_dict_into_shards

    with torch.device("meta"):
        shapes = T.LlamaForCausalLM(config).state_dict()
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard)
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(5)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: torch.randn(shapes[k].shape, generator=gen) * 0.02 for k in keys}, folder / filename)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (folder / hf.INDEX_NAME).write_text(json.dumps(index))


class _Peak:
    """Peak resident memory of this process from now on: the kernel's high-water mark, reset."""

    def __enter__(self) -> "_Peak":
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.sampler = None
        except OSError:  # no permission: sample RSS instead
            self.sampler, self.high, self.stop = threading.Thread(target=self._sample, daemon=True), 0, False
            self.sampler.start()
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.sampler is None:
            self.peak = self._status("VmHWM")
        else:
            self.stop = True
            self.sampler.join()
            self.peak = max(self.high, self._status("VmRSS"))

    def _sample(self) -> None:
        while not self.stop:
            self.high = max(self.high, self._status("VmRSS"))
            time.sleep(0.001)

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)


def memory() -> Dict[str, Any]:
    """Peak RSS growth of each rank during load_pretrained of a ~200 MB model in 50 MB shards."""
    config = T.LlamaConfig(**MEMORY)
    folder = ROOT / "memory"
    if bmt.rank() == 0:
        _write_random_checkpoint(folder, config, max_shard=50 * 2**20)
    bmt.synchronize()
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    bmt.wrap(model)
    registry = engine().registry
    buffers = {id(b): b for b in (registry.buffer_of(current(), p)[0] for p in model.parameters())}
    shard_bytes = sum(b.local.numel() * b.local.element_size() for b in buffers.values())
    with torch.device("meta"):
        shapes = T.LlamaForCausalLM(config).state_dict()
    model_bytes = sum(t.numel() * 4 for t in shapes.values())
    layer_bytes = sum(t.numel() * 4 for k, t in shapes.items() if k.startswith("model.layers.0."))
    largest_tensor = max(t.numel() * 4 for t in shapes.values())
    gc.collect()
    try:  # hand memory freed by rank 0's writing back to the system, so that reusing it cannot hide growth
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    started = time.perf_counter()
    with _Peak() as peak:
        hf.load_pretrained(model, folder)
    seconds = time.perf_counter() - started
    # Spot check: this rank's piece of two tensors equals the file's.
    spot = True
    weight_map = json.loads((folder / hf.INDEX_NAME).read_text())["weight_map"]
    for key in ("model.embed_tokens.weight", "model.layers.5.mlp.down_proj.weight"):
        whole = load_file(folder / weight_map[key])[key]
        param = model.get_parameter(key)
        buffer, index = registry.buffer_of(current(), param)
        piece = buffer.slots[index].piece
        spot = spot and torch.equal(param.detach(), whole.reshape(-1)[piece.param_start : piece.param_end])
        del whole
    growth = torch.tensor([peak.peak - peak.start])
    every = [torch.zeros_like(growth) for _ in range(bmt.world_size())]
    dist.all_gather(every, growth)
    bmt.synchronize()
    if bmt.rank() == 0:
        shutil.rmtree(folder)
    return {"growth": [int(g) for g in every], "shard_bytes": shard_bytes, "model_bytes": model_bytes,
            "layer_bytes": layer_bytes, "largest_tensor": largest_tensor, "files": len(set(weight_map.values())),
            "seconds": seconds, "spot_equal": _all(spot),
            "measured_by": "VmHWM" if peak.sampler is None else "sampling"}


if __name__ == "__main__":
    cases: Dict[str, Callable[[], Dict[str, Any]]] = {"memory": memory}  # first: the heap is still small
    cases.update({f"roundtrip_{arch}": roundtrip(arch) for arch in ARCHS})
    cases.update(base_into_causal=base_into_causal, causal_into_base=causal_into_base,
                 missing_initialised=missing_initialised, legacy_names=legacy_names,
                 strict_mismatch=strict_mismatch, other_architecture=other_architecture, missing_shard=missing_shard,
                 no_weights=no_weights, not_hf_model=not_hf_model, not_initialised=not_initialised,
                 unwrapped_meta_model=unwrapped_meta_model, save_onto_a_file=save_onto_a_file, bad_dtype=bad_dtype,
                 bf16_import=bf16_import,
                 overwrite_keeps_other_files=overwrite_keeps_other_files,
                 failed_save_leaves_folder=failed_save_leaves_folder)
    run(cases)

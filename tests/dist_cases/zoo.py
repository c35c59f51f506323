"""``bmt.wrap`` on a zoo of models, each against an unwrapped copy of itself, in one process group.

Every case runs twice, in float64 and then in float32 (all float64 runs first; rank 0 reports
"<case>/float64" and "<case>/float32"). A run builds a tiny model (``torch.manual_seed(0)``, no
downloads; built in float32, then converted to the run's dtype), deep-copies it as the reference
*before* wrapping, wraps the original, and checks:

1. the blocks ``bmt.plan`` detects on the reference (the plan ``wrap`` applies) are the expected ones;
2. ``STEPS`` training steps (AdamW, lr 1e-3, eps 1e-6), each rank of the wrapped model on its
   ``BATCH / world`` share of the step's batch of ``BATCH`` samples, the reference as below, on one
   trajectory (see [Note: one trajectory]): at every step the reference holds the wrapped model's
   parameters; the loss averaged over ranks (``bmt.sum_loss``) and every gradient
   (``bmt.full_grad_dict``) are compared with the reference's; then the reference's AdamW steps on
   the wrapped model's gradients and every parameter (``bmt.full_state_dict``) must equal the
   wrapped model's after its own step, bit for bit. The first step is the "one forward and backward"
   check, the later ones run on the updated weights with new batches;
3. after the steps, ``bmt.full_state_dict`` against ``ref.state_dict()``: the same keys.

Dropout, layer drop and router jitter are off in every config, and models stay in ``train()`` mode
so the training code paths run. Losses are means over equal-sized shares (no ignored label
positions, no auxiliary router losses), so the mean of the ranks' losses is the whole batch's loss
and averaged gradients are the whole batch's gradients.

float64, against the whole batch: the reference runs all ``BATCH`` samples in one forward and
backward. Splitting a batch changes only the rounding, ~1e-14 in float64 (~1e-6 for Hugging Face
models that compute parts in float32 whatever the model's dtype, RMSNorm for one), so this
run shows that the wrapped model trains as the unwrapped one does on the whole batch, with limits
(tests/test_wrap_zoo.py) far above rounding, while an engine fault (a gradient missed, doubled or
stale, a stale gather) still moves gradients by O(1).

float32, against the same split: the precision of the spec (loss and gradients relative 1e-5). Here
the whole batch and a split of it differ by rounding near that limit, bmtwrap or not (measured
against a whole-batch reference: gradients 1.5e-5 relative (gpt2, opt, world 3)). So the reference
computes what data-parallel training computes on the same split (:func:`reference_step`): in this
one process, each rank's share alone from zeroed gradients, the shares' gradients summed in rank
order and divided by the world size, the loss the mean of the shares' losses. This run shows that
bmtwrap computes what DDP computes, to float32 rounding. What is left is the order of sums: at world
sizes 1 and 2 mostly bitwise equal; t5 and bart associate the sum of the decoder blocks'
contributions to the encoder output's gradient differently (each block's backward is one autograd
node), layer_reuse_0101 reduces a block run twice after each use ((B0+B1)/2 + (A0+A1)/2, not
((A0+B0)+(A1+B1))/2), and at world 3 gloo adds the three shares in an order that varies by element.
Measured: gradients within 9e-7 relative (opt, world 3), with torch's AVX2 kernels and with its
default ones (ATEN_CPU_CAPABILITY=default).

[Note: one trajectory]
Two runs that each step their own parameters drift apart where AdamW divides a rounding-level
gradient by its own magnitude: a key bias's gradient is zero in exact arithmetic (see [Note:
gradients that are zero in exact arithmetic]), float32 noise of ~1e-9 whose sign depends on the
order of the sums, and a change of ~1e-8 in it changes its AdamW step (eps 1e-6) by up to
~lr * 1e-8 / 1e-6 = 1e-5. Two such runs ended up to 2.2e-6 apart in the parameters after three
steps, and their gradients at the later steps up to 2e-5 relative (opt's self_attn_layer_norm.bias,
world 3, torch's default kernels; just under 1e-5 with its AVX2 ones), past the spec's limit, while
at the same parameters they agree within 9e-7: how far two runs drift is set by how torch's kernels
round on the CPU at hand, not by bmtwrap. So the reference takes the wrapped model's parameters
before every step: each step's gradients are compared at the same parameters, and the optimizer by
replaying it, AdamW from the same moments on the same gradients, which leaves nothing to round
differently: equal bit for bit.

Causal LMs' losses are computed here from the logits (see :func:`causal_lm_loss`) in both runs,
and MoE experts run Transformers' "eager" implementation (its grouped_mm has no float64 CPU kernel).

Arguments: 1: where rank 0 writes {"<case>/<dtype>": result}; 2 (optional): comma-separated case
names or "all"; 3 (optional): comma-separated dtypes ("float64", "float32") or "all".
"""

from __future__ import annotations

import copy
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf
from torch import nn

import bmtwrap as bmt
from bmtwrap.engine.dist import current as current_context
from common import run

try:
    import peft
except ImportError:  # the LoRA case reports itself skipped; test_wrap_zoo.py shows the reason
    peft = None

BATCH = 6  # divisible by world sizes 1, 2 and 3
SEQ = 8
VOCAB = 64
STEPS = 3
LR, EPS = 1e-3, 1e-6  # as tests/test_parity.py: a missed or doubled gradient moves a weight by ~lr
DTYPES = {"float64": torch.float64, "float32": torch.float32}
# The reference each precision is compared with (see the module docstring).
WHOLE_BATCH, SPLIT = "whole batch", "mean over the ranks' shares"
REFERENCE = {"float64": WHOLE_BATCH, "float32": SPLIT}

Batch = Dict[str, Any]
Expected = Union[Sequence[Sequence[str]], Callable[[Any], bool]]


@dataclass
class Case:
    """One model of the zoo.

    Attributes:
        build: makes the model (called right after ``torch.manual_seed(0)``).
        expected: the accepted lists of detected block names (more than one where transformers
            versions name modules differently), or a predicate on the plan.
        batch: the whole batch of a step (tensors have the sample dimension first; other values
            are passed to every rank as they are).
        loss: the scalar loss of ``model`` on a batch.
    """

    build: Callable[[], nn.Module]
    expected: Expected
    batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    lora: bool = False
    fail_once: bool = False  # first run a backward that raises half-way (caught), then train as usual


# --- data -------------------------------------------------------------------------------------------
def _gen(step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * step + salt)


def tokens(step: int) -> Batch:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=_gen(step))
    return {"input_ids": ids, "labels": ids}


def seq2seq(step: int) -> Batch:
    # Label ids start at 3: BART's decoder starts from id 2, T5's from 0, and no id is ignored.
    return {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=_gen(step)),
            "labels": torch.randint(3, VOCAB, (BATCH, SEQ - 2), generator=_gen(step, 1))}


def images(step: int) -> Batch:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=_gen(step)),
            "labels": torch.randint(0, 5, (BATCH,), generator=_gen(step, 1))}


def vectors(step: int) -> Batch:
    return {"x": torch.randn(BATCH, 32, generator=_gen(step)), "y": torch.randn(BATCH, 32, generator=_gen(step, 1))}


def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss head (``labels`` in the batch)."""
    return model(**batch).loss


def causal_lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """What a causal LM's ``labels=input_ids`` loss is (next-token cross entropy), in the logits' dtype.

    Computed here rather than by ``labels=``: Transformers' loss upcasts logits with ``.float()``,
    which in a float64 run rounds every gradient to float32 (see the module docstring).
    """
    logits = model(input_ids=batch["input_ids"]).logits  # (B, T, V)
    ids = batch["labels"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross entropy of a plain model mapping ids (B, T) to logits (B, T, V)."""
    ids = batch["input_ids"]
    logits = model(ids, **{k: v for k, v in batch.items() if k not in ("input_ids", "labels")})
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def mse_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def image_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


def layer_names(prefix: str, n: int) -> List[str]:
    return [f"{prefix}.{i}" for i in range(n)]


# --- Hugging Face models ----------------------------------------------------------------------------
EAGER = dict(attn_implementation="eager")
MOE = dict(experts_implementation="eager")  # grouped_mm has no float64 kernel on the CPU
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               attention_dropout=0.0, **EAGER)


def hf_causal(model_cls: str, config_cls: str, **config: Any) -> Callable[[], nn.Module]:
    return lambda: getattr(tf, model_cls)(getattr(tf, config_cls)(**{**DECODER, **config}))


HF_CASES: Dict[str, Case] = {
    "gpt2": Case(
        lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, **EAGER)),
        [layer_names("transformer.h", 2)], tokens, causal_lm_loss),
    "llama_tied": Case(hf_causal("LlamaForCausalLM", "LlamaConfig", tie_word_embeddings=True),
                       [layer_names("model.layers", 2)], tokens, causal_lm_loss),
    "llama_untied": Case(hf_causal("LlamaForCausalLM", "LlamaConfig", tie_word_embeddings=False),
                         [layer_names("model.layers", 2)], tokens, causal_lm_loss),
    "bert_mlm": Case(
        lambda: tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **EAGER)),
        # BERT names BertEmbeddings in _no_split_modules too, but there is one of it: no block.
        [layer_names("bert.encoder.layer", 2)], tokens, hf_loss),
    "t5": Case(
        lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1, **EAGER)),
        [layer_names("encoder.block", 2) + layer_names("decoder.block", 2)], seq2seq, hf_loss),
    "qwen2": Case(hf_causal("Qwen2ForCausalLM", "Qwen2Config"), [layer_names("model.layers", 2)], tokens,
                  causal_lm_loss),
    "mistral": Case(hf_causal("MistralForCausalLM", "MistralConfig", sliding_window=4),
                    [layer_names("model.layers", 2)], tokens, causal_lm_loss),
    "opt": Case(
        lambda: tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
            pad_token_id=1, bos_token_id=2, eos_token_id=2, **EAGER)),
        [layer_names("model.decoder.layers", 2)], tokens, causal_lm_loss),
    "vit": Case(
        lambda: tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5, **EAGER)),
        # ViTEmbeddings is in _no_split_modules but occurs once: no block. transformers 5.23 moved the
        # layers out of vit.encoder.
        [layer_names("vit.layers", 2), layer_names("vit.encoder.layer", 2)],
        images, hf_loss),
    "mixtral": Case(hf_causal("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                              router_jitter_noise=0.0, output_router_logits=False, **MOE),
                    [layer_names("model.layers", 2)], tokens, causal_lm_loss),
    # mlp_only_layers=[0]: a dense layer, then a MoE layer (blocks of different shapes).
    "qwen2_moe": Case(hf_causal("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16, shared_expert_intermediate_size=32, mlp_only_layers=[0],
                                output_router_logits=False, **MOE),
                      [layer_names("model.layers", 2)], tokens, causal_lm_loss),
    # Sliding-window layers around a global one; the window (4) is shorter than the sequence (8).
    "gemma3": Case(hf_causal("Gemma3ForCausalLM", "Gemma3TextConfig", num_hidden_layers=3, head_dim=8,
                             sliding_window=4,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                   [layer_names("model.layers", 3)], tokens, causal_lm_loss),
    "phi3": Case(hf_causal("Phi3ForCausalLM", "Phi3Config", resid_pdrop=0.0, embd_pdrop=0.0),
                 [layer_names("model.layers", 2)], tokens, causal_lm_loss),
    "bart": Case(
        lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
            **EAGER)),
        [layer_names("model.encoder.layers", 2) + layer_names("model.decoder.layers", 2)], seq2seq, hf_loss),
}


def lora_llama() -> nn.Module:
    base = hf_causal("LlamaForCausalLM", "LlamaConfig")()
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


# --- plain torch models -----------------------------------------------------------------------------
class Layer(nn.Module):
    """A pre-norm causal transformer layer."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        # No bias: a key bias has zero gradient, whose rounding noise Adam turns into step-sized differences.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, C = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(C, dim=-1)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        h = h + self.proj(att)
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of layers, final norm, head.

    ``schedule`` lists the layer indices a forward runs, in order (repeats allowed); ``tie="matmul"``
    projects with ``h @ self.embed.weight.T`` in this forward, ``tie="linear"`` makes ``head`` share
    the embedding's Parameter object, and ``share_across_blocks`` makes the first and last layer's
    ``proj`` share one weight.
    """

    def __init__(self, n_layers: int = 3, schedule: Optional[Sequence[int]] = None, tie: str = "",
                 share_across_blocks: bool = False) -> None:
        super().__init__()
        self.schedule = list(schedule) if schedule is not None else list(range(n_layers))
        self.tie = tie
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList([Layer() for _ in range(n_layers)])
        self.norm = nn.LayerNorm(32)
        if tie != "matmul":
            self.head = nn.Linear(32, VOCAB, bias=False)
        if tie == "linear":
            self.head.weight = self.embed.weight
        if share_across_blocks:
            self.layers[-1].proj.weight = self.layers[0].proj.weight

    def forward(self, ids: torch.Tensor, order: Optional[Sequence[int]] = None) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, C)
        for i in (self.schedule if order is None else order):
            h = self.layers[i](h)
        h = self.norm(h)
        return h @ self.embed.weight.T if self.tie == "matmul" else self.head(h)  # (B, T, V)


class ResidualMLP(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


class ResBlock(nn.Module):
    """conv-GroupNorm-ReLU-conv-GroupNorm plus the input (GroupNorm: no batch statistics)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(4, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stage1 = nn.Sequential(ResBlock(8), ResBlock(8))
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.stage2 = nn.Sequential(ResBlock(16), ResBlock(16))
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 16, 16) -> (B, 5)
        x = self.stage2(self.down(self.stage1(F.relu(self.stem(x)))))
        return self.fc(x.mean(dim=(2, 3)))


class FunnelMLP(nn.Module):
    """Layers of different widths held as plain attributes: nothing repeats, so wrap cuts by size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.fc2 = nn.Linear(256, 128)
        self.norm = nn.LayerNorm(128)
        self.fc3 = nn.Linear(128, 64)
        self.fc4 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = self.norm(F.gelu(self.fc2(x)))
        return self.fc4(F.gelu(self.fc3(x)))


def by_size(plan: Any) -> bool:
    return plan.rule == "size" and len(plan.block_names) > 1


# Layer orders of the three steps of "varying_order" (passed as the forward's `order` argument).
ORDERS = [[0, 1, 2], [2, 0], [1]]

PLAIN_CASES: Dict[str, Case] = {
    "plain_transformer": Case(lambda: TinyLM(3), [layer_names("layers", 3)], tokens, lm_loss),
    "sequential_stack": Case(lambda: nn.Sequential(*[ResidualMLP() for _ in range(4)]),
                             [["0", "1", "2", "3"]], vectors, mse_loss),
    "cnn_residual": Case(TinyResNet, [layer_names("stage1", 2) + layer_names("stage2", 2)], images, image_loss),
    "mlp_by_size": Case(FunnelMLP, by_size, vectors, mse_loss),
    "layer_reuse_0101": Case(lambda: TinyLM(2, schedule=[0, 1, 0, 1]), [layer_names("layers", 2)], tokens, lm_loss),
    "tied_embedding_matmul": Case(lambda: TinyLM(2, tie="matmul"), [layer_names("layers", 2)], tokens, lm_loss),
    "tied_head_linear": Case(lambda: TinyLM(3, tie="linear"), [layer_names("layers", 3)], tokens, lm_loss),
    # layers.0.proj and layers.2.proj hold one Parameter: wrap keeps it in the root group.
    "shared_linear_across_blocks": Case(lambda: TinyLM(3, share_across_blocks=True), [layer_names("layers", 3)],
                                        tokens, lm_loss),
    "varying_order": Case(lambda: TinyLM(3), [layer_names("layers", 3)],
                          lambda step: dict(tokens(step), order=ORDERS[step]), lm_loss),
    # peft over a tiny Llama: LoRA on q_proj and v_proj, everything else frozen.
    "lora_llama": Case(lora_llama, [layer_names("base_model.model.model.layers", 2)], tokens, causal_lm_loss,
                       lora=True),
    # A backward that fails half-way (as an out-of-memory error would) and is caught; the batch is
    # skipped and training goes on: the following steps must match a reference that never saw it.
    "recover_after_failed_backward": Case(lambda: TinyLM(3), [layer_names("layers", 3)], tokens, lm_loss,
                                          fail_once=True),
}

CASES_BY_NAME: Dict[str, Case] = {**HF_CASES, **PLAIN_CASES}


# --- the check --------------------------------------------------------------------------------------
def in_dtype(batch: Batch, dtype: torch.dtype) -> Batch:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def share_of(batch: Batch, rank: int, world: int) -> Batch:
    """The samples rank ``rank`` of ``world`` trains on (tensors cut along the sample dimension)."""
    size = BATCH // world
    return {k: v[rank * size:(rank + 1) * size] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def my_share(batch: Batch) -> Batch:
    return share_of(batch, bmt.rank(), bmt.world_size())


def reference_step(case: Case, ref: nn.Module, batch: Batch, reference: str) -> float:
    """Forward and backward of the unwrapped ``ref`` (its gradients zeroed before); returns the loss.

    ``WHOLE_BATCH``: one forward and backward on the whole batch. ``SPLIT``: what data-parallel
    training computes on the same split, in this one process: each rank's share alone, forward and
    backward from zeroed gradients (what that rank holds before the reduction), then the shares'
    gradients summed in rank order and divided by the world size; the loss is the mean of the
    shares' losses. (Letting autograd accumulate the shares into ``.grad`` instead would associate
    the sum differently wherever one backward adds several contributions to a parameter, a layer
    used twice, say.) A parameter no share gives a gradient keeps none.
    """
    if reference == WHOLE_BATCH:
        loss = case.loss(ref, batch)
        loss.backward()
        return loss.item()
    world = bmt.world_size()
    params = list(ref.parameters())
    sums: List[Optional[torch.Tensor]] = [None] * len(params)
    losses = []
    for rank in range(world):
        for p in params:
            p.grad = None
        loss = case.loss(ref, share_of(batch, rank, world))
        loss.backward()
        losses.append(loss.detach())
        for i, p in enumerate(params):
            if p.grad is not None:
                sums[i] = p.grad.clone() if sums[i] is None else sums[i] + p.grad
    for p, total in zip(params, sums):
        p.grad = None if total is None else total / world
    return (torch.stack(losses).sum() / world).item()


class GradDiff(NamedTuple):
    name: str
    rel: float  # diff / max(scale, ZERO_GRAD_FLOOR * the model's largest gradient)
    raw_rel: float  # diff / scale
    diff: float  # max |ours - reference|
    scale: float  # max |reference|
    floor: float  # ZERO_GRAD_FLOOR * the model's largest gradient


# [Note: gradients that are zero in exact arithmetic]
# Some gradients vanish mathematically and are pure rounding noise: a key projection's bias
# (softmax ignores a shift shared by all keys) gets ~1e-11 or less where other gradients are ~1e-1
# (BERT, OPT, ViT and BART here, in both dtypes). Relative to its own size such noise differs by
# 100% or more, whatever the engine does. So a tensor's difference is taken relative to its largest
# value, but at least ZERO_GRAD_FLOOR times the largest gradient of the whole model. A gradient
# missed or counted twice still fails: it is off by its own size s, i.e. by s / max(s, 1e-4 G) >=
# 1e-5 whenever s >= 1e-9 G. `raw_rel` reports the plain per-tensor ratio as well (and results'
# "grad_raw_rel" the largest over all tensors).
ZERO_GRAD_FLOOR = 1e-4


def worst_grads(ours: Dict[str, torch.Tensor], ref: nn.Module) -> Tuple[GradDiff, GradDiff]:
    """The gradients furthest from the reference's: by the floored ratio (the one the tests bound,
    see [Note: gradients that are zero in exact arithmetic]) and by the raw per-tensor ratio.

    A parameter without a gradient counts as a zero gradient on either side.
    """
    expected = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double() for n, p in ref.named_parameters()}
    largest = max((g.abs().max().item() for g in expected.values() if g.numel()), default=0.0)
    none = GradDiff("", 0.0, 0.0, 0.0, 0.0, ZERO_GRAD_FLOOR * largest)
    worst, worst_raw = none, none
    for name, expect in expected.items():
        if name not in ours:
            missing = GradDiff(name, float("inf"), float("inf"), float("inf"), 0.0, ZERO_GRAD_FLOOR * largest)
            return missing, missing
        diff = (ours[name].double() - expect).abs().max().item() if expect.numel() else 0.0
        scale = expect.abs().max().item() if expect.numel() else 0.0
        floor = max(scale, ZERO_GRAD_FLOOR * largest)
        rel = diff / floor if floor > 0 else (float("inf") if diff > 0 else 0.0)
        raw = diff / scale if scale > 0 else (float("inf") if diff > 0 else 0.0)
        here = GradDiff(name, rel, raw, diff, scale, ZERO_GRAD_FLOOR * largest)
        if not worst.name or rel > worst.rel:
            worst = here
        if not worst_raw.name or raw > worst_raw.raw_rel:
            worst_raw = here
    return worst, worst_raw


def worst_param(ours: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Tuple[str, float]:
    name_worst, abs_worst = "", 0.0
    for name, value in ref.items():
        if name not in ours or not value.numel():
            continue
        diff = (ours[name].double() - value.double()).abs().max().item()
        if diff > abs_worst or not name_worst:
            name_worst, abs_worst = name, diff
    return name_worst, abs_worst


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")


def failed_backward(case: Case, model: nn.Module, first_block: str, dtype: torch.dtype) -> str:
    """A forward and a backward that raises between the first block and the rest; returns the error."""
    hook = model.get_submodule(first_block).register_forward_hook(lambda m, a, out: _FailInBackward.apply(out))
    try:
        case.loss(model, my_share(in_dtype(case.batch(0), dtype))).backward()
    except RuntimeError as error:
        return str(error)
    finally:
        hook.remove()
    return "no error"


def frozen_grads_held(model: nn.Module) -> int:
    """Frozen parameters holding a local gradient, summed over ranks."""
    count = torch.tensor(sum(p.grad is not None for p in model.parameters() if not p.requires_grad))
    dist.all_reduce(count)
    return int(count)


def check(case: Case, dtype_name: str, result: Dict[str, Any]) -> None:
    """Run one case in one precision, filling ``result`` as it goes (so a failure still reports
    what came before). Every rank trains the wrapped model; rank 0, whose result is reported, alone
    runs the reference (on every rank it would be the same whole-batch work, times the world size)."""
    dtype, reference = DTYPES[dtype_name], REFERENCE[dtype_name]
    result.update(dtype=dtype_name, reference=reference)
    torch.manual_seed(0)
    model = case.build().to(dtype)
    model.train()
    ref = copy.deepcopy(model)
    plan = bmt.plan(ref)
    result.update(blocks=plan.block_names, rule=plan.rule, shared=list(plan.shared),
                  expected=None if callable(case.expected) else [list(e) for e in case.expected])
    if callable(case.expected):
        result["blocks_ok"] = bool(case.expected(plan))
    else:
        result["blocks_ok"] = any(plan.block_names == list(names) for names in case.expected)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    frozen = [n for n, p in ref.named_parameters() if not p.requires_grad]
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]

    model = bmt.wrap(model)
    make = lambda params: torch.optim.AdamW(params, lr=LR, eps=EPS)
    opt_ref, opt = make(ref.parameters()), make(model.parameters())
    if case.fail_once:
        result["injected"] = failed_backward(case, model, plan.block_names[0], dtype)
    result.update(loss_rel_per_step=[], grad_rel_per_step=[], grad_raw_rel_per_step=[], grad_keys_match=True,
                  frozen_with_grad=[], lora_without_grad=[])
    reporting = bmt.rank() == 0
    for step in range(STEPS):
        batch = in_dtype(case.batch(step), dtype)
        opt.zero_grad()
        if reporting:
            opt_ref.zero_grad()
            ref_loss = reference_step(case, ref, batch, reference)
        loss = case.loss(model, my_share(batch))
        loss.backward()
        mean = bmt.sum_loss(loss).double().item()
        grads = bmt.full_grad_dict(model)
        frozen_held = bool(case.lora and frozen_grads_held(model))
        if reporting:
            compare_step(case, ref, step, abs(mean - ref_loss) / abs(ref_loss), grads, frozen_held, result)
        opt.step()
        ours = bmt.full_state_dict(model)
        if reporting:
            opt_ref.step()
            worst_name, worst_abs = worst_param(ours, ref.state_dict())
            if worst_abs > result.get("param_abs", -1.0):
                result.update(param_worst=worst_name, param_abs=worst_abs, param_worst_step=step)
            with torch.no_grad():  # the next step starts from our parameters, whatever the last one made of them
                for name, p in ref.named_parameters():
                    p.copy_(ours[name])

    result["keys_match"] = sorted(ours) == sorted(ref.state_dict())
    if case.lora:
        result["n_trainable"], result["n_frozen"] = len(trainable), len(frozen)
        result["trainable_not_lora"] = [n for n in trainable if "lora_" not in n]
        result["lora_without_grad"] = sorted(set(result["lora_without_grad"]))
        result["frozen_with_grad"] = sorted(set(result["frozen_with_grad"]))
        result["frozen_changed"] = [n for n in frozen if not torch.equal(ours[n], initial[n])]


def compare_step(case: Case, ref: nn.Module, step: int, loss_rel: float, grads: Dict[str, torch.Tensor],
                 frozen_held: bool, result: Dict[str, Any]) -> None:
    """Record one step's loss and gradient differences (the reference's gradients at our parameters), then give
    the reference our gradients for its AdamW step (see [Note: one trajectory])."""
    result["loss_rel_per_step"].append(loss_rel)
    result["loss_rel"] = max(result["loss_rel_per_step"])
    result["grad_keys_match"] &= sorted(grads) == sorted(n for n, _ in ref.named_parameters())
    diff, raw = worst_grads(grads, ref)
    result["grad_rel_per_step"].append(diff.rel)
    result["grad_raw_rel_per_step"].append(raw.raw_rel)
    if diff.rel > result.get("grad_rel", -1.0):
        result.update(grad_worst=diff.name, grad_rel=diff.rel, grad_worst_raw_rel=diff.raw_rel,
                      grad_worst_abs=diff.diff, grad_worst_scale=diff.scale, grad_floor=diff.floor,
                      grad_worst_step=step)
    if raw.raw_rel > result.get("grad_raw_rel", -1.0):
        result.update(grad_raw_worst=raw.name, grad_raw_rel=raw.raw_rel, grad_raw_worst_abs=raw.diff,
                      grad_raw_worst_scale=raw.scale, grad_raw_worst_step=step)
    if case.lora:
        result["frozen_with_grad"] += [n for n, p in ref.named_parameters()
                                       if not p.requires_grad and (p.grad is not None or grads[n].any())]
        if frozen_held:
            result["frozen_with_grad"].append(f"<step {step}: a frozen parameter holds a local gradient>")
        result["lora_without_grad"] += [n for n, p in ref.named_parameters() if p.requires_grad and p.grad is None]
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.grad is not None:
                p.grad.copy_(grads[name])


def isolated(case: Case, dtype_name: str) -> Dict[str, Any]:
    """``check(case, dtype_name)``; a fresh engine afterwards if the case raised or broke a backward
    on purpose.

    An exception inside backward leaves bmtwrap's engine mid-step (see the case
    "recover_after_failed_backward"), which would make every later case fail for that reason
    instead of its own. Cases that end normally share one engine, as several models in one
    program do.
    """
    result: Dict[str, Any] = {}
    try:
        check(case, dtype_name, result)
    except Exception:  # reported per case, with whatever the case measured before
        current_context().engine = None
        result["error"] = f"rank {bmt.rank()}: {traceback.format_exc()}"
    finally:
        if case.fail_once:
            current_context().engine = None
    return result


def skipped(reason: str) -> Callable[[], Dict[str, Any]]:
    return lambda: {"skipped": reason}


def result_key(name: str, dtype_name: str) -> str:
    return f"{name}/{dtype_name}"


def cases() -> Dict[str, Callable[[], Dict[str, Any]]]:
    """Every wanted case in every wanted precision: all float64 runs, then all float32 runs."""
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "all" else list(CASES_BY_NAME)
    dtypes = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else list(DTYPES)
    out: Dict[str, Callable[[], Dict[str, Any]]] = {}
    for dtype_name in dtypes:
        for name in wanted:
            case = CASES_BY_NAME[name]
            if case.lora and peft is None:
                out[result_key(name, dtype_name)] = skipped("peft is not installed (pip install peft)")
            else:
                out[result_key(name, dtype_name)] = lambda case=case, d=dtype_name: isolated(case, d)
    return out


if __name__ == "__main__":
    run(cases())

"""Which modules become blocks (bmtwrap/wrap/detect.py): a block is a repeated layer.

A class a model names in ``_no_split_modules`` counts only where the model has two or more of it
(BERT and ViT name their embeddings there, which occur once); a ``GradientCheckpointingLayer``
counts alone, so a one-layer model keeps its layer. Models are built on the meta device.
"""

from __future__ import annotations

from typing import List

import torch
import transformers as T
from torch import nn

from bmtwrap.wrap.detect import find_blocks


def _blocks(model: nn.Module) -> List[str]:
    named, rule = find_blocks(model)
    assert rule == "repeated layers"
    return [name for name, _ in named]


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Staged(nn.Module):
    """Stages held as attributes (no ModuleList), found only through ``_no_split_modules``."""

    _no_split_modules = ["Stage"]

    def __init__(self, stages: int) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        for i in range(stages):
            self.add_module(f"stage{i}", Stage())


def test_a_no_split_class_counts_where_it_repeats():
    assert _blocks(Staged(2)) == ["stage0", "stage1"]
    assert _blocks(Staged(3)) == ["stage0", "stage1", "stage2"]
    _, rule = find_blocks(Staged(1))
    assert rule == "size", "a class named once is no repeated layer"


def test_bert_and_vit_embeddings_stay_in_the_root():
    with torch.device("meta"):
        bert = T.BertForMaskedLM(T.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                              num_attention_heads=2, intermediate_size=32))
        vit = T.ViTForImageClassification(T.ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                                      num_attention_heads=2, intermediate_size=32))
    assert "BertEmbeddings" in bert._no_split_modules and "ViTEmbeddings" in vit._no_split_modules
    assert _blocks(bert) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    # transformers 5.23 moved ViT's layers out of vit.encoder
    assert _blocks(vit) in (["vit.layers.0", "vit.layers.1"], ["vit.encoder.layer.0", "vit.encoder.layer.1"])


def test_a_one_layer_model_keeps_its_layer():
    with torch.device("meta"):
        llama = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    assert _blocks(llama) == ["model.layers.0"]

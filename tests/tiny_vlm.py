"""Tiny random-weight vision-language model folders for tests.

`build_tiny_vlm` writes what a Hugging Face folder of the family holds: config.json,
safetensors weights (in the checkpoint layout transformers saves), generation_config.json,
the tiny byte-level tokenizer of tiny_models.py with the family's image tokens added, and a
processor (processor_config.json with the image processor's settings, chat_template.jinja)
built from transformers' own classes with their PIL backends, so that transformers is the
reference for the prompt's placeholder tokens, the pixels and the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_models import TINY_DIMS, _randomize, build_tokenizer
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

VLM_FAMILIES = ("llava",)
IMAGE_TOKEN = {"llava": "<image>"}
# A ChatML template that writes each image part as the family's image token.
_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '@IMAGE@' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# CLIP towers: 56-pixel images in 14-pixel patches, 16 patches (+1 class embedding).
_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "image_size": 56, "patch_size": 14, "projection_dim": 32,
         "layer_norm_eps": 1e-5}


def vlm_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the family's image token(s) as special tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", IMAGE_TOKEN[family]]})
    tokenizer.chat_template = _TEMPLATE.replace("@IMAGE@", IMAGE_TOKEN[family])
    return tokenizer


def build_tiny_vlm(dir: Path, family: str = "llava", *, seed: int = 0,
                   **overrides: Any) -> Path:
    """Write a tiny random vision-language model folder of `family` (VLM_FAMILIES) in
    `dir`; `overrides` go into the text model's config. Returns `dir`."""
    assert family in VLM_FAMILIES, f"family must be one of {VLM_FAMILIES}: {family!r}"
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tokenizer = vlm_tokenizer(family)
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])
    text = LlamaConfig(**{**TINY_DIMS, "vocab_size": 512, "bos_token_id": None,
                          "eos_token_id": eos_id, "pad_token_id": eos_id, **overrides})
    config = LlavaConfig(vision_config=CLIPVisionConfig(**_CLIP), text_config=text,
                         image_token_index=image_id, vision_feature_layer=-2,
                         vision_feature_select_strategy="default",
                         projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _randomize(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, im_end_id],
                                               pad_token_id=eos_id)
    model.save_pretrained(dir)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": _CLIP["image_size"]},
            crop_size={"height": _CLIP["image_size"], "width": _CLIP["image_size"]}),
        tokenizer=tokenizer, patch_size=_CLIP["patch_size"],
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template)
    processor.save_pretrained(dir)
    return dir

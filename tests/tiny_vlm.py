"""Tiny random-weight vision-language model folders for tests.

`build_tiny_vlm` writes what a Hugging Face folder of the family holds: config.json,
safetensors weights (in the checkpoint layout transformers saves), generation_config.json,
the tiny byte-level tokenizer of tiny_models.py with the family's image tokens added, and a
processor (processor_config.json with the image processor's settings, chat_template.jinja)
built from transformers' own classes with their PIL backends, so that transformers is the
reference for the prompt's placeholder tokens, the pixels and the model.

Families (VLM_FAMILIES) and their prompts, as the published folders write them:
- llava: LLaVA-1.5 (CLIP tower, projector, Llama) with llava-interleave's ChatML template
  (each `<image>` where its part is), each image 16 patches of a 56-pixel square (the class
  embedding dropped): 16 `<image>` tokens.
- llava_next: LLaVA-NeXT (the same parts, any-resolution tiles of 56 pixels chosen among
  _PINPOINTS, an image_newline), Mistral's "[INST] <image>\\n... [/INST]"; the count of
  `<image>` tokens depends on the image's size.
- qwen2_5_vl: Qwen2.5-VL (its window-attention tower, M-RoPE), ChatML with a default system
  turn, each image `<|vision_start|>` + `<|image_pad|>` x (grid / 4) + `<|vision_end|>`, the
  grid from the image's size (28-pixel units between _QWEN_PIXELS).
- gemma3: Gemma 3 (SigLIP tower pooled to 4 tokens), "<start_of_turn>user\\n...", each
  `<start_of_image>` expanded by the processor to "\\n\\n<start_of_image>" + 4
  `<image_soft_token>` + "<end_of_image>\\n\\n".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tiny_models import GEMMA_DIMS, TINY_DIMS, _randomize, build_tokenizer
from transformers import (
    AutoProcessor,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    SiglipVisionConfig,
)

VLM_FAMILIES = ("llava", "llava_next", "qwen2_5_vl", "gemma3")
# The token the processor repeats per image (its embedding rows replace them).
IMAGE_TOKEN = {"llava": "<image>", "llava_next": "<image>", "qwen2_5_vl": "<|image_pad|>",
               "gemma3": "<image_soft_token>"}
# What the chat template writes for one {"type": "image"} part (before the processor's
# expansion).
IMAGE_PART = {"llava": "<image>", "llava_next": "<image>\n",
              "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "gemma3": "<start_of_image>"}
# Special tokens each family's tokenizer adds (beyond <|im_start|>, <|im_end|>).
_FAMILY_TOKENS = {"llava": ["<image>"], "llava_next": ["<image>"],
                  "qwen2_5_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                  "gemma3": []}
_GEMMA_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                 "eoi_token": "<end_of_image>"}
# Content of a message as the published templates iterate it: a string, or parts.
_PARTS = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
          "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '@IMAGE@' }}"
          "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
          "{% endif %}")
# LLaVA as llava-hf's llava-interleave-qwen writes it: ChatML, each image where its part is.
_LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    + _PARTS.replace("@IMAGE@", "<image>") + "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# llava-hf/llava-v1.6-mistral: [INST] images first, then the texts [/INST].
_LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] }}{% endfor %}{% endif %}{{ ' [/INST]' }}"
    "{% else %}{{ ' ' }}" + _PARTS.replace("@IMAGE@", "") + "{{ '</s>' }}{% endif %}"
    "{% endfor %}")
# Qwen2.5-VL: ChatML, a default system turn, images between vision markers.
_QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    + _PARTS.replace("@IMAGE@", "<|vision_start|><|image_pad|><|vision_end|>")
    + "{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Gemma 3: turns of user/model, trimmed texts, a system turn folded into the first user turn.
_GEMMA_TEMPLATE = (
    "{% set ns = namespace(prefix='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.prefix = (message['content'] "
    "if message['content'] is string else message['content'][0]['text']) + '\n\n' %}"
    "{% else %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' + ns.prefix }}{% set ns.prefix = '' %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<start_of_image>' }}{% elif part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
_TEMPLATES = {"llava": _LLAVA_TEMPLATE, "llava_next": _LLAVA_NEXT_TEMPLATE,
              "qwen2_5_vl": _QWEN_TEMPLATE, "gemma3": _GEMMA_TEMPLATE}
# CLIP towers: 56-pixel images in 14-pixel patches, 16 patches (+1 class embedding).
_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "image_size": 56, "patch_size": 14, "projection_dim": 32,
         "layer_norm_eps": 1e-5}
# LLaVA-NeXT's resolutions to tile (multiples of the 56-pixel tile, as [height, width]).
_PINPOINTS = [[56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]
# Qwen2.5-VL's tower: 14-pixel patches merged 2x2, 2 frames a patch; images resized to 28-pixel
# units between 4 and 24 units of area (1 to 24 tokens); windows of 2x2 merged units.
_QWEN_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "window_size": 56, "fullatt_block_indexes": [1]}
_QWEN_PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 24}
# Gemma 3's SigLIP: 56-pixel images, 16 patches average-pooled 2x2 to 4 tokens.
_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "image_size": 56, "patch_size": 14,
           "layer_norm_eps": 1e-6, "vision_use_head": False}
GEMMA3_TOKENS_PER_IMAGE = 4
# Text-model defaults per family (overrides win): Gemma 3's of tiny_models.py.
_TEXT_DIMS = {"gemma3": GEMMA_DIMS["gemma3"]}


def vlm_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the family's image tokens as special tokens."""
    tokenizer = build_tokenizer()
    if family == "gemma3":  # named tokens its processor reads (tokenizer.boi_token, ...)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer._tokenizer, eos_token="<|endoftext|>",
            pad_token="<|endoftext|>", extra_special_tokens=_GEMMA_TOKENS)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", *_FAMILY_TOKENS[family]]})
    tokenizer.chat_template = _TEMPLATES[family]
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
    ids = {token: tokenizer.convert_tokens_to_ids(token)
           for token in ("<|im_end|>", *_FAMILY_TOKENS[family], *_GEMMA_TOKENS.values())}
    text = {**TINY_DIMS, **_TEXT_DIMS.get(family, {}), "vocab_size": 512, "bos_token_id": None, "eos_token_id": eos_id,
            "pad_token_id": eos_id, **overrides}
    torch.manual_seed(seed)
    model = _MODELS[family](text, ids)
    _randomize(model, seed)
    _rescale_convolutions(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, ids["<|im_end|>"]],
                                               pad_token_id=eos_id)
    model.save_pretrained(dir)
    _PROCESSORS[family](tokenizer).save_pretrained(dir)
    for name in ("processor_config.json", "tokenizer_config.json"):  # the published class
        config = json.loads((dir / name).read_text())
        if config.get("processor_class") == "Qwen2_5_VLImagesProcessor":
            config["processor_class"] = "Qwen2_5_VLProcessor"
            (dir / name).write_text(json.dumps(config, indent=2) + "\n")
    return dir


def _rescale_convolutions(model: torch.nn.Module, seed: int) -> None:
    """Patch embeddings N(0, 1/fan_in) over every input pixel of a patch (`_randomize` scales
    by the last dimension only, the kernel's width)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                weight = module.weight
                fan_in = math.prod(weight.shape[1:])
                weight.copy_(torch.randn(weight.shape, generator=generator)
                             / math.sqrt(fan_in))


def _llava(text: dict[str, Any], ids: dict[str, int]) -> PreTrainedModel:
    config = LlavaConfig(vision_config=CLIPVisionConfig(**_CLIP),
                         text_config=LlamaConfig(**text), image_token_index=ids["<image>"],
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu")
    return LlavaForConditionalGeneration(config)


def _llava_next(text: dict[str, Any], ids: dict[str, int]) -> PreTrainedModel:
    config = LlavaNextConfig(vision_config=CLIPVisionConfig(**_CLIP),
                             text_config=LlamaConfig(**text), image_token_index=ids["<image>"],
                             vision_feature_layer=-2, vision_feature_select_strategy="default",
                             projector_hidden_act="gelu", image_grid_pinpoints=_PINPOINTS)
    return LlavaNextForConditionalGeneration(config)


def _qwen2_5_vl(text: dict[str, Any], ids: dict[str, int]) -> PreTrainedModel:
    # M-RoPE: the head's 8 rotary pairs split 2/3/3 over (time, height, width).
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = {key: value for key, value in text.items() if key not in ("head_dim", "rope_theta")}
    vision = {**_QWEN_VISION, "out_hidden_size": text["hidden_size"]}
    config = Qwen2_5_VLConfig(
        text_config={**text, "rope_parameters": rope}, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config)


def _gemma3(text: dict[str, Any], ids: dict[str, int]) -> PreTrainedModel:
    config = Gemma3Config(
        text_config=Gemma3TextConfig(**text),
        vision_config=SiglipVisionConfig(**_SIGLIP),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    return Gemma3ForConditionalGeneration(config)


_MODELS = {"llava": _llava, "llava_next": _llava_next, "qwen2_5_vl": _qwen2_5_vl,
           "gemma3": _gemma3}


def _llava_processor(tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    side = _CLIP["image_size"]
    return LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": side},
                                              crop_size={"height": side, "width": side}),
        tokenizer=tokenizer, patch_size=_CLIP["patch_size"],
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template)


def _llava_next_processor(tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    side = _CLIP["image_size"]
    return LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side},
            image_grid_pinpoints=_PINPOINTS),
        tokenizer=tokenizer, patch_size=_CLIP["patch_size"],
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template)


class Qwen2_5_VLImagesProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without its video processor: transformers' only one needs
    torchvision, which is not installed, so `AutoProcessor.from_pretrained` cannot load a
    Qwen2.5-VL folder here. Images and text are processed exactly as the full class does."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def load_processor(dir: Path) -> ProcessorMixin:
    """The folder's processor, as `AutoProcessor.from_pretrained` loads it (Qwen2.5-VL's
    without its video processor: see Qwen2_5_VLImagesProcessor)."""
    config = json.loads((Path(dir) / "processor_config.json").read_text())
    if config["processor_class"] == "Qwen2_5_VLProcessor":
        return Qwen2_5_VLImagesProcessor.from_pretrained(dir)
    return AutoProcessor.from_pretrained(dir)


def _qwen2_5_vl_processor(tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    image_processor = Qwen2VLImageProcessorPil(
        **_QWEN_PIXELS, patch_size=_QWEN_VISION["patch_size"],
        merge_size=_QWEN_VISION["spatial_merge_size"],
        temporal_patch_size=_QWEN_VISION["temporal_patch_size"])
    return Qwen2_5_VLImagesProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)


def _gemma3_processor(tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    side = _SIGLIP["image_size"]
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=tokenizer, image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
        chat_template=tokenizer.chat_template)


_PROCESSORS = {"llava": _llava_processor, "llava_next": _llava_next_processor,
               "qwen2_5_vl": _qwen2_5_vl_processor, "gemma3": _gemma3_processor}

"""The vision halves of vision-language models: what turns images into embedding rows.

The worker runs one inside its model (services/worker/models/llava.py composes it); the
encoder service runs it alone, without the language model (services/encoder/). A
`VisionPart` owns the checkpoint tensors under its prefixes, says how many rows an image of
a size becomes, and embeds a batch of the image processor's output:

    part = build_vision_part(config_json)          # on the meta device, then to_empty
    part.load(tensors)                             # (name, tensor) of the whole checkpoint
    rows = part.embed_images(processor(images=...))  # each image's [rows, H]

The towers are transformers' own modules for the tower's config (CLIP, SigLIP, Qwen2.5-VL's
window-attention tower): they run once per image, never per decode step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from meshserve.shared.errors import InvalidRequestError, ModelLoadError
from meshserve.shared.model_config import text_config_of

# Checkpoint prefixes of the vision half -> its parameters' (transformers 4 and 5 layouts).
_LLAVA_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),  # transformers 4 wrapped the tower
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def vision_tower(vision_config: dict[str, Any]) -> nn.Module:
    """transformers' vision model for a `vision_config` dict (CLIP, SigLIP, ...)."""
    from transformers import AutoConfig, AutoModel

    settings = dict(vision_config)
    model_type = settings.pop("model_type", "clip_vision_model")
    try:
        config = AutoConfig.for_model(model_type, **settings)
    except ValueError as exc:
        raise ModelLoadError(f"vision tower type {model_type!r} is not known to transformers",
                             param="vision_config") from exc
    return AutoModel.from_config(config)


class VisionPart(nn.Module):
    """A model's vision half. Subclasses set PREFIXES and the three methods below."""

    PREFIXES: tuple[tuple[str, str], ...] = ()

    def rows_for(self, width: int, height: int) -> int:
        """Embedding rows an image of that size becomes."""
        raise NotImplementedError

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The image processor's output for N images -> each image's rows [rows, H]."""
        raise NotImplementedError

    def reset_buffers(self) -> None:
        """Rebuild non-weight buffers after `to_empty` (the towers' position ids)."""
        for name, buffer in self.named_buffers():
            assert name.endswith("position_ids"), f"vision buffer {name} is not rebuilt"
            buffer.copy_(torch.arange(buffer.shape[-1], device=buffer.device).expand_as(buffer))

    @classmethod
    def own_name(cls, name: str) -> str | None:
        """This part's parameter name for a checkpoint tensor name; None: not the part's."""
        for old, new in cls.PREFIXES:
            if name.startswith(old):
                return new + name[len(old):]
        return None

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the part's tensors from a whole checkpoint's; ModelLoadError naming a
        missing or wrongly shaped one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                own = self.own_name(name)
                if own is None:
                    continue
                if own not in params:
                    raise ModelLoadError(f"unexpected vision tensor {name!r}", param=name)
                if tuple(tensor.shape) != tuple(params[own].shape):
                    raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(params[own].shape)}", param=name)
                params[own].copy_(tensor)
                loaded.add(own)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"missing vision tensors in the checkpoint: {missing[:8]}",
                                 param=missing[0])


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2: tower features [N, Dv] -> text embeddings [N, H]."""

    def __init__(self, vision_dim: int, hidden_size: int, activation: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_dim, hidden_size, bias=bias)
        self.act = ACT2FN[activation]
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaVision(VisionPart):
    """LLaVA-1.5: the tower's hidden states at `vision_feature_layer` (several layers
    concatenated when it is a list), less the class embedding with the "default" strategy,
    through the projector; every image is resized to the tower's square, so each becomes
    the same number of rows."""

    PREFIXES = _LLAVA_PREFIXES

    def __init__(self, hf: dict[str, Any], hidden_size: int) -> None:
        super().__init__()
        self.vision_tower = vision_tower(hf["vision_config"])
        layer = hf.get("vision_feature_layer", -2)
        self.feature_layers = [int(i) for i in layer] if isinstance(layer, list) else [int(layer)]
        self.feature_strategy = str(hf.get("vision_feature_select_strategy", "default"))
        tower: Any = self.vision_tower.config
        self.multi_modal_projector = LlavaProjector(
            int(tower.hidden_size) * len(self.feature_layers), hidden_size,
            str(hf.get("projector_hidden_act", "gelu")),
            bool(hf.get("multimodal_projector_bias", True)))
        patches = (int(tower.image_size) // int(tower.patch_size)) ** 2
        self.num_image_rows: int = patches + (1 if self.feature_strategy == "full" else 0)

    def rows_for(self, width: int, height: int) -> int:
        return self.num_image_rows

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return list(self.project(inputs["pixel_values"]))  # N x [rows, H]

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """Square images [N, 3, S, S] -> their projected features [N, rows, H]."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixels.to(dtype), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        if self.feature_strategy == "default":
            features = features[:, 1:]  # without the class embedding
        return self.multi_modal_projector(features)  # type: ignore[no-any-return]


# transformers' LlavaNextConfig's resolutions when a config names none, as [height, width].
_LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


class LlavaNextVision(LlavaVision):
    """LLaVA-NeXT (LLaVA-1.6): any-resolution tiling. The image processor resizes an image
    to the best of `image_grid_pinpoints` for its size, cuts it into tiles of the tower's
    square, and adds the whole image resized as a base tile first; the tower and projector
    run over every tile. An image's rows are, as transformers' `pack_image_features` packs
    them for "spatial_unpad": the base tile's, then the grid tiles' patches as one picture
    with the padding the resize added cut off (`unpad_image`), row by row, each row ended by
    the learned `image_newline`. The row count so depends on the image's size."""

    PREFIXES = (("model.image_newline", "image_newline"), ("image_newline", "image_newline"),
                *_LLAVA_PREFIXES)

    def __init__(self, hf: dict[str, Any], hidden_size: int) -> None:
        super().__init__(hf, hidden_size)
        if self.feature_strategy != "default":
            # transformers packs the tiles as squares of patches, without a class embedding.
            raise ModelLoadError(f"LLaVA-NeXT's vision_feature_select_strategy must be "
                                 f"'default', not {self.feature_strategy!r}",
                                 param="vision_feature_select_strategy")
        tower: Any = self.vision_tower.config
        self.tile = int(tower.image_size)  # pixels of a tile's side
        self.side = self.tile // int(tower.patch_size)  # patches of a tile's side
        self.pinpoints = [[int(h), int(w)] for h, w in
                          hf.get("image_grid_pinpoints") or _LLAVA_NEXT_PINPOINTS]
        self.image_newline = nn.Parameter(torch.empty(hidden_size))

    def rows_for(self, width: int, height: int) -> int:
        from transformers.models.llava_next.modeling_llava_next import unpad_image

        rows, cols = self.tile_grid(width, height)
        grid = torch.empty(0, rows * self.side, cols * self.side, device="meta")
        kept_h, kept_w = unpad_image(grid, [height, width]).shape[1:]
        return self.side * self.side + kept_h * (kept_w + 1)  # base tile; rows + newlines

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        from transformers.models.llava_next.modeling_llava_next import (
            image_size_to_num_patches,
        )

        pixels = inputs["pixel_values"]  # [N, tiles (the batch's most), 3, S, S]
        sizes = [(int(h), int(w)) for h, w in inputs["image_sizes"].tolist()]  # [N] (H, W)
        counts = [image_size_to_num_patches(size, self.pinpoints, self.tile) for size in sizes]
        tiles = torch.cat([image[:n] for image, n in zip(pixels, counts, strict=True)])
        features = self.project(tiles)  # [all tiles, side * side, H]
        return [self._pack(part, size)
                for part, size in zip(features.split(counts), sizes, strict=True)]

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of the grid tiles of an image of that size."""
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
        )

        rows, cols = get_anyres_image_grid_shape([height, width], self.pinpoints, self.tile)
        return int(rows), int(cols)

    def _pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tile features [tiles, side * side, H] -> its rows [rows, H]."""
        from transformers.models.llava_next.modeling_llava_next import unpad_image

        assert features.shape[0] > 1, "an any-resolution image has a base tile and a grid"
        base, grid = features[0], features[1:]
        rows, cols = self.tile_grid(size[1], size[0])
        side = self.side
        # [rows, cols, side, side, H] -> [H, rows * side, cols * side]: one picture of patches
        picture = grid.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3)
        picture = unpad_image(picture.flatten(1, 2).flatten(2, 3), list(size))
        newline = self.image_newline[:, None, None].to(picture.dtype)
        picture = torch.cat((picture, newline.expand(*picture.shape[:-1], 1)), dim=-1)
        return torch.cat((base, picture.flatten(1, 2).transpose(0, 1)))


# transformers' Qwen2VLImageProcessor's resize bounds (pixels of the resized image) when
# the processor's settings are not given.
_QWEN_MIN_PIXELS, _QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


class Qwen2_5_VLVision(VisionPart):
    """Qwen2.5-VL: transformers' window-attention tower with its 2x2 patch merger. An image
    is resized, keeping its aspect, to multiples of patch_size x merge_size within the image
    processor's pixel bounds (its `smart_resize`) and cut in patches; each merge x merge
    patches become one row. The grid of rows (`image_grid`) also places them in M-RoPE.

    `image_processor`: the folder's image processor settings (`ModelConfig.image_processor`),
    which `rows_for` and `image_grid` follow; without them, transformers' defaults."""

    PREFIXES = (("model.visual.", "visual."), ("visual.", "visual."))

    def __init__(self, hf: dict[str, Any], hidden_size: int,
                 image_processor: dict[str, Any] | None = None) -> None:
        super().__init__()
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        config = Qwen2_5_VLVisionConfig(**{k: v for k, v in hf["vision_config"].items()
                                           if k != "model_type"})
        if config.out_hidden_size != hidden_size:
            raise ModelLoadError(f"vision_config.out_hidden_size {config.out_hidden_size} is "
                                 f"not the language model's hidden_size {hidden_size}",
                                 param="vision_config.out_hidden_size")
        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
        settings = image_processor or {}
        size = settings.get("size") or {}
        self.patch_size = int(settings.get("patch_size") or config.patch_size)
        self.merge_size = int(settings.get("merge_size") or config.spatial_merge_size)
        self.min_pixels = int(size.get("shortest_edge") or settings.get("min_pixels")
                              or _QWEN_MIN_PIXELS)
        self.max_pixels = int(size.get("longest_edge") or settings.get("max_pixels")
                              or _QWEN_MAX_PIXELS)

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(time, height, width) of an image's rows (merged patches): (1, h, w)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        unit = self.patch_size * self.merge_size
        try:
            resized_h, resized_w = smart_resize(height, width, unit, self.min_pixels,
                                                self.max_pixels)
        except ValueError as exc:  # an aspect ratio over 200
            raise InvalidRequestError(f"a {width}x{height} image: {exc}",
                                      param="images") from exc
        return 1, resized_h // unit, resized_w // unit

    def rows_for(self, width: int, height: int) -> int:
        t, h, w = self.image_grid(width, height)
        return t * h * w

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        pixels = inputs["pixel_values"]  # [patches of all images, C * T * P * P]
        grid = inputs["image_grid_thw"]  # [N, 3] in patches
        dtype = self.visual.patch_embed.proj.weight.dtype
        rows = self.visual(pixels.to(dtype), grid_thw=grid).pooler_output  # [rows, H]
        return list(rows.split((grid.prod(-1) // self.merge_size**2).tolist()))

    def reset_buffers(self) -> None:
        """The tower's rotary inverse frequencies, in float32 as transformers keeps them."""
        rotary: Any = self.visual.rotary_pos_emb
        inv_freq, _ = rotary.compute_axial_rope_parameters(rotary.config)
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
        rotary.original_inv_freq = inv_freq.clone().to(rotary.inv_freq.device)


class Gemma3Vision(VisionPart):
    """Gemma 3: transformers' SigLIP tower over the image resized to its square, and its
    multi-modal projector: the last hidden states average-pooled to `mm_tokens_per_image`
    rows, RMS-normed (Gemma's 1 + weight) and projected to the text width. Every image
    becomes the same rows (pan-and-scan's extra crops are refused by the tokenizer)."""

    PREFIXES = _LLAVA_PREFIXES  # (the same names: vision_tower, multi_modal_projector)

    def __init__(self, hf: dict[str, Any], hidden_size: int) -> None:
        super().__init__()
        from transformers import Gemma3Config
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config = Gemma3Config.from_dict(hf)
        width = int(config.text_config.hidden_size)  # the projection's (transformers' default)
        if width != hidden_size:
            raise ModelLoadError(f"Gemma 3's projector makes rows of {width} values, not the "
                                 f"language model's {hidden_size}", param="text_config")
        self.vision_tower = vision_tower(hf["vision_config"])
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.num_image_rows = int(config.mm_tokens_per_image)

    def rows_for(self, width: int, height: int) -> int:
        return self.num_image_rows

    def embed_images(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        pixels = inputs["pixel_values"]  # [N, 3, S, S]
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        patches = self.vision_tower(pixel_values=pixels.to(dtype)).last_hidden_state
        return list(self.multi_modal_projector(patches))  # N x [rows, H]


# Architecture -> its vision half.
VISION_PARTS: dict[str, type[VisionPart]] = {
    "LlavaForConditionalGeneration": LlavaVision,
    "LlavaNextForConditionalGeneration": LlavaNextVision,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLVision,
    "Gemma3ForConditionalGeneration": Gemma3Vision,
}


def build_vision_part(hf: dict[str, Any], where: str = "config.json") -> VisionPart:
    """The vision half of the vision-language model whose config.json is `hf` (built in
    the current default device: pass through torch.device("meta") to allocate later)."""
    from meshserve.shared.model_config import architecture_of

    architecture = architecture_of(hf, where)
    if architecture not in VISION_PARTS:
        raise ModelLoadError(f"{where}: {architecture!r} is not a vision-language "
                             f"architecture meshserve encodes images for "
                             f"({', '.join(VISION_PARTS)})", param="architectures")
    hidden = int(text_config_of(hf, where)["hidden_size"])
    return VISION_PARTS[architecture](hf, hidden)

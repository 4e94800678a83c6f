"""FP8 weights for the decoder's linear layers: the `Fp8Linear` module, quantization at load
(`--quantization fp8`) and loading of FP8 checkpoints (vLLM's `fp8` and compressed-tensors).

Only the projections inside the decoder layers (qkv, o, gate_up, down) and the experts of a
mixture of experts (`quantize_experts`: per expert and output row scales) become FP8; the
embeddings, norms and the LM head stay in the model's dtype, as in vLLM, unless
`--quantize-lm-head` asks for an FP8 LM head too (`quantize_lm_head`: per-row scales over the
vocabulary; a tied model keeps its embeddings and gets an FP8 copy). At load the module
swap happens on the meta device (checkpoint) or after the bf16 weights are in (online), one
layer at a time, so an online-quantized model peaks at its bf16 size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from meshserve.kernels.fp8_linear import FP8_DTYPE, fp8_linear, quantize_per_channel
from meshserve.services.worker.models.llama import CausalLM
from meshserve.shared.errors import ModelLoadError
from meshserve.shared.quantization import QuantConfig

log = logging.getLogger(__name__)

# Checkpoint tensors that scale weights (both mean w = w_fp8 * scale).
_WEIGHT_SCALES = (".weight_scale", ".weight_scale_inv")
# Checkpoint tensors of static activation or KV scales: not used (dynamic per-token
# activation scales; KV scale 1.0), logged.
_UNUSED_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


class Fp8Linear(nn.Module):
    """y = x @ (weight_fp8 * weight_scale)^T + bias, weight [N, K] float8_e4m3fn.

    weight_scale: float32 [N] (per channel; a per-tensor scale repeated) or, with `block`
    (bn, bk), [ceil(N/bn), ceil(K/bk)]."""

    weight_scale: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None,
                 block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE),
                                   requires_grad=False)
        shape = ((out_features,) if block is None
                 else (-(-out_features // block[0]), -(-in_features // block[1])))
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32))
        self.bias = bias

    # Multi-LoRA serving hooks a callable here that adds each row's adapter product to y
    # (as on the model's own Linear: the adapters stay in the model's dtype).
    lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight, self.weight_scale, self.bias, self.block)
        if self.lora is not None:
            self.lora(x, y)  # x [T, K], y [T, N] in place
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block}"


def decoder_linears(model: CausalLM) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(parent name, parent, attribute, module) of every nn.Linear inside the decoder layers."""
    for parent_name, parent in model.model.layers.named_modules(prefix="model.layers"):
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear):
                yield parent_name, parent, attr, child


def prepare_checkpoint_layers(model: CausalLM, quant: QuantConfig) -> None:
    """Swap the decoder's linear layers for empty Fp8Linear ones (before weights are loaded,
    typically on the meta device), except those the checkpoint left unquantized."""
    for parent_name, parent, attr, linear in list(decoder_linears(model)):
        if _ignored(model, quant, f"{parent_name}.{attr}"):
            continue
        with torch.device(linear.weight.device):
            fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias,
                            quant.weight_block)
        _replace(parent, attr, linear, fp8)


def quantize_online(model: CausalLM) -> None:
    """Replace each decoder linear layer by its FP8 form (per-channel scales), and give the
    experts of a mixture of experts FP8 weights, in place."""
    quantize_experts(model)
    with torch.no_grad():
        for _, parent, attr, linear in list(decoder_linears(model)):
            q, scale = quantize_per_channel(linear.weight)
            with torch.device("meta"):
                fp8 = Fp8Linear(linear.in_features, linear.out_features, None)
            fp8.weight = nn.Parameter(q, requires_grad=False)
            fp8.weight_scale = scale
            fp8.bias = linear.bias
            _replace(parent, attr, linear, fp8)
    if torch.cuda.is_available():
        # Hand the freed bf16 weights back, or the KV cache sizing (which counts this
        # process's reserved memory) would leave them unused.
        torch.cuda.empty_cache()


def quantize_experts(model: CausalLM) -> None:
    """Give every mixture-of-experts layer FP8 expert weights, one float32 scale per expert
    and output row (the layout the MoE kernels read), in place."""
    from meshserve.services.worker.models.moe import Experts  # MoE models only

    with torch.no_grad():
        for experts in model.modules():
            if not isinstance(experts, Experts):
                continue
            for name in ("w13", "w2"):
                weight = getattr(experts, name)  # [E, N, K]
                q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
                scale = torch.empty(weight.shape[:2], dtype=torch.float32,
                                    device=weight.device)
                for e in range(weight.shape[0]):  # one expert at a time: small temporaries
                    q[e], scale[e] = quantize_per_channel(weight[e])
                setattr(experts, name, nn.Parameter(q, requires_grad=False))
                setattr(experts, f"{name}_scale", scale)  # a buffer (Experts.__init__)


def quantize_lm_head(model: CausalLM) -> None:
    """Give the model an FP8 LM head (per-channel scales: one per vocabulary row) in place
    of its own, or of the tied embedding matrix it reads (which stays, for the inputs)."""
    head = model.lm_head
    weight = model.model.embed_tokens.weight if head is None else head.weight
    assert isinstance(weight, torch.Tensor)
    with torch.no_grad():
        q, scale = quantize_per_channel(weight)
    with torch.device("meta"):
        fp8 = Fp8Linear(weight.shape[1], weight.shape[0], None)
    fp8.weight = nn.Parameter(q, requires_grad=False)
    fp8.weight_scale = scale
    model.lm_head = fp8
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 head's memory, for the KV cache sizing


def _replace(parent: nn.Module, attr: str, old: nn.Module, new: nn.Module) -> None:
    """Put `new` in `old`'s place, keeping the forward hooks others registered on it (the
    tensor-parallel all-reduce of row-parallel projections is one)."""
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        getattr(new, hooks).update(getattr(old, hooks))
    setattr(parent, attr, new)


def load_fp8_checkpoint(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]],
                        quant: QuantConfig) -> None:
    """Load an FP8 checkpoint into a model prepared by `prepare_checkpoint_layers`."""
    scales: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    fp8_params = {name for name, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    layout = model.checkpoint_layout()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name.endswith(_WEIGHT_SCALES):
                scales[name.rsplit(".", 1)[0]] = tensor
            elif name.endswith(_UNUSED_SCALES):
                unused.append(name)
            else:
                target = layout.get(name)
                quantized = target is not None and target[0] in fp8_params
                if target is not None and quantized != (tensor.dtype == FP8_DTYPE):
                    raise ModelLoadError(
                        f"tensor {name!r} is {tensor.dtype} where the quantization_config "
                        f"expects {'FP8' if quantized else 'an unquantized weight'}", param=name)
                yield name, tensor

    model.load_weights(weights())
    _fill_scales(model, scales, layout)
    if unused:
        log.info("FP8 checkpoint: %d static activation/KV scale tensors (e.g. %s) left unused: "
                 "activations are quantized per token at run time and the KV cache uses "
                 "scale 1.0", len(unused), unused[0])


def _fill_scales(model: CausalLM, scales: dict[str, torch.Tensor],
                 layout: dict[str, tuple[str, int, int]]) -> None:
    """Copy each checkpoint module's scale into its (possibly fused) Fp8Linear's rows."""
    needed = {name.removesuffix(".weight") for name, (param, _, _) in layout.items()
              if name.endswith(".weight")
              and isinstance(model.get_submodule(param.rsplit(".", 1)[0]), Fp8Linear)}
    missing = sorted(needed - scales.keys())
    if missing:
        raise ModelLoadError(f"FP8 checkpoint: no weight_scale for {missing[0]!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""),
                             param=missing[0])
    with torch.no_grad():
        for prefix in needed:
            param, offset, rows = layout[prefix + ".weight"]
            module = model.get_submodule(param.rsplit(".", 1)[0])
            assert isinstance(module, Fp8Linear)
            _copy_scale(module, scales[prefix].float(), offset, rows, prefix)


def _copy_scale(module: Fp8Linear, scale: torch.Tensor, offset: int, rows: int,
                prefix: str) -> None:
    if module.block is None:
        flat = scale.reshape(-1)  # [] per tensor, [rows] or [rows, 1] per channel
        if flat.numel() not in (1, rows):
            raise ModelLoadError(f"{prefix}: weight_scale of shape {tuple(scale.shape)} is "
                                 f"neither per tensor nor per channel of {rows} rows",
                                 param=prefix)
        module.weight_scale.narrow(0, offset, rows).copy_(flat.expand(rows))
        return
    bn = module.block[0]
    dest_rows = -(-rows // bn)
    if offset % bn or (rows % bn and offset + rows != module.out_features):
        raise ModelLoadError(f"{prefix}: {rows} rows at row {offset} of a fused projection do "
                             f"not align with the {bn}-row weight blocks", param=prefix)
    dest = module.weight_scale.narrow(0, offset // bn, dest_rows)
    if tuple(scale.shape) != tuple(dest.shape):
        raise ModelLoadError(f"{prefix}: block scales of shape {tuple(scale.shape)}, expected "
                             f"{tuple(dest.shape)}", param=prefix)
    dest.copy_(scale)


def _ignored(model: CausalLM, quant: QuantConfig, param_module: str) -> bool:
    """Whether every checkpoint module fused into this one is left unquantized (all of
    them or none: one FP8 module cannot hold a mix)."""
    names = {hf.removesuffix(".weight") for hf, (param, _, _) in model.checkpoint_layout().items()
             if param == param_module + ".weight"}
    flags = {quant.ignores(name) for name in names}
    if len(flags) > 1:
        raise ModelLoadError(f"{param_module}: the checkpoint quantizes some of the modules "
                             f"fused into it and not others ({sorted(names)})",
                             param=param_module)
    return flags == {True}


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by parameters and buffers, by dtype name (for logs and tests)."""
    out: dict[str, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out

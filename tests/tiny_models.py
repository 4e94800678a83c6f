"""Tiny random-weight Hugging Face model folders for tests.

`build_tiny_model` writes config.json, safetensors weights (single or sharded with an index),
generation_config.json and a byte-level BPE tokenizer with a ChatML template, using
transformers' own config and model classes so that transformers is the reference.
Weights are re-drawn with unit-scale statistics (not the near-zero default init) so that logits
vary strongly with every weight, norm, bias and position: a wrong kernel shows up.
"""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 450
CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                  "mistral": MistralConfig, "qwen3_moe": Qwen3MoeConfig,
                  "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig}
CONFIG_CLASSES.update({"gemma2": Gemma2Config, "gemma3": Gemma3TextConfig})
CONFIG_CLASSES["phi3"] = Phi3Config
CONFIG_CLASSES.update({"deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config})
CONFIG_CLASSES["gpt_oss"] = GptOssConfig
TINY_DIMS: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
# Mixture-of-experts defaults per architecture (overrides win): 8 / 4 experts, top-2, experts
# of intermediate 32; Qwen3-MoE keeps layer 0 dense, Qwen2-MoE has a shared expert.
MOE_DIMS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "num_hidden_layers": 3, "mlp_only_layers": [0]},
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}
# Gemma defaults (overrides win): 4 layers so both layer kinds appear, a window shorter than
# most test prompts (and not a block multiple), soft-capping strong enough to matter, tied.
GEMMA_DIMS: dict[str, dict[str, Any]] = {
    "gemma2": {"num_hidden_layers": 4, "sliding_window": 12, "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0},
    "gemma3": {"num_hidden_layers": 4, "sliding_window": 8, "query_pre_attn_scalar": 16,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention"],
               "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
               "final_logit_softcapping": 10.0},  # (Gemma 3 has no attention soft-capping)
}
# Phi-3 overrides with LongRoPE as Phi-4-mini has it (3/4 of each head rotated: 12 of 16 dims,
# 6 factors each); long factors far from the short ones, from position 64 on.
PHI3_LONGROPE: dict[str, Any] = {
    "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
    "rope_scaling": {"rope_type": "longrope",
                     "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4],
                     "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]}}
# DeepSeek defaults (overrides win): latent attention with a q_lora_rank (None: a plain
# q_proj), a latent row of 24 + 8 = 32 values, a dense layer 0, then 8 routed experts in 4
# groups (the best 2 compete for the top 3) beside 2 shared ones, weights scaled. DeepSeek-V3
# routes by sigmoid scores and its (randomised) e_score_correction_bias, renormalised.
_DEEPSEEK_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 3, "num_key_value_heads": 4, "intermediate_size": 96,
    "kv_lora_rank": 24, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3,
    "moe_intermediate_size": 32, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "n_group": 4, "topk_group": 2, "head_dim": 8,  # (transformers: head_dim is the rope dims)
}
DEEPSEEK_DIMS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {**_DEEPSEEK_SHAPE, "topk_method": "group_limited_greedy",
                    "routed_scaling_factor": 1.5},
    "deepseek_v3": {**_DEEPSEEK_SHAPE, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
}
# YaRN as DeepSeek-V2 configures it, with mscale != mscale_all_dim so that both the cos/sin
# factor and the softmax scale move.
DEEPSEEK_YARN: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 64, "mscale": 0.8, "mscale_all_dim": 1.0,
    "beta_fast": 32, "beta_slow": 1}
# gpt-oss defaults (overrides win): 4 layers alternating a 12-token window (shorter than most
# test prompts, not a block multiple) and full attention, 8 experts of intermediate 32, top 2,
# a SwiGLU limit low enough for the clamps to bite; YaRN with truncate off as the published
# configs have it, its ramp over the 8 rotary pairs, scaling from position 64 on. Its sinks
# are drawn large enough to take a sizeable share of each softmax (_randomize).
GPT_OSS_DIMS: dict[str, dict[str, Any]] = {"gpt_oss": {
    "num_hidden_layers": 4, "sliding_window": 12, "intermediate_size": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 1.0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 64}}}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "model", "serve", "token",
    "cache", "block", "prefix", "attention", "layer", "norm", "rotary", "scale", "batch",
    "stream", "worker", "gateway", "request", "reply", "hello", "world", "sky", "river",
    "mountain", "green", "blue", "seven", "eleven", "hundred", "paper", "music", "night",
    "user", "assistant", "system",
)
_CJK = "你好世界模型服务缓存注意力東京大阪こんにちは세계안녕"
_EMOJI = "😀🚀🌍🎉🔥✨🤖📦"


def training_lines(count: int = 300, seed: int = 0) -> list[str]:
    """Deterministic text mixing English words, CJK and emoji (multi-byte UTF-8)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        if rng.random() < 0.4:
            words.insert(rng.randrange(len(words)), "".join(rng.sample(_CJK, rng.randint(1, 4))))
        if rng.random() < 0.3:
            words.append(rng.choice(_EMOJI))
        lines.append(" ".join(words).capitalize() + rng.choice(".!?,"))
    return lines


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_lines(), trainer)
    return tokenizer.to_str()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer (`<|endoftext|>` is eos and pad) with ChatML."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()), eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHATML_TEMPLATE)


def build_tiny_model(dir: Path, arch: str = "llama", *, seed: int = 0,
                     vocab_size: int | None = None, shards: int = 1,
                     tie_word_embeddings: bool = False, **overrides: Any) -> Path:
    """Write a tiny random model folder for `arch` in {llama, qwen2, qwen3, mistral,
    qwen3_moe, qwen2_moe, mixtral, gemma2, gemma3, phi3, deepseek_v2, deepseek_v3, gpt_oss}
    (MoE ones with MOE_DIMS, Gemma ones with GEMMA_DIMS and tied embeddings, DeepSeek ones
    with DEEPSEEK_DIMS, gpt-oss with GPT_OSS_DIMS).

    `overrides` go into the transformers config (e.g. head_dim=24, rope_scaling=LLAMA3_ROPE).
    Returns `dir`.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = vocab_size or 64 * math.ceil(len(tokenizer) / 64)
    assert vocab >= len(tokenizer), f"vocab_size {vocab} < tokenizer size {len(tokenizer)}"
    config = CONFIG_CLASSES[arch](**{
        **TINY_DIMS, **MOE_DIMS.get(arch, {}), **GEMMA_DIMS.get(arch, {}),
        **DEEPSEEK_DIMS.get(arch, {}), **GPT_OSS_DIMS.get(arch, {}), "vocab_size": vocab,
        "tie_word_embeddings": tie_word_embeddings or arch in GEMMA_DIMS,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, im_end_id],
                                               pad_token_id=eos_id)
    model.save_pretrained(dir, max_shard_size=_shard_size(model, shards))
    tokenizer.save_pretrained(dir)
    return dir


def build_tiny_classifier(dir: Path, arch: str = "qwen2", *, labels: list[str],
                          seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `*ForSequenceClassification` folder (the decoder of `arch`, a
    `score` head of one row per label, id2label from `labels`). Returns `dir`."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = CONFIG_CLASSES[arch](**{
        **TINY_DIMS, "vocab_size": 64 * math.ceil(len(tokenizer) / 64),
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "num_labels": len(labels), "id2label": dict(enumerate(labels)),
        "label2id": {label: i for i, label in enumerate(labels)}, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(dir)
    tokenizer.save_pretrained(dir)
    return dir


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale weights: N(0, 1/fan_in) matrices, N(0, 1) embeddings, norms near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks
                param.copy_(1.5 + noise)
            elif name.endswith((".bias", "_proj_bias")):
                param.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.25 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))


def _shard_size(model: torch.nn.Module, shards: int) -> str:
    if shards <= 1:
        return "1GB"
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return f"{math.ceil(total / shards * 1.05 / 1000)}KB"

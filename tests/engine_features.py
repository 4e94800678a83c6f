"""The features of a built engine, found through its step hooks (engine.hook)."""

from __future__ import annotations

from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.lora.hook import LoraHook
from meshserve.services.worker.lora.manager import LoraManager
from meshserve.services.worker.spec.decoder import SpecDecoder
from meshserve.services.worker.structured.grammars import GrammarCompiler
from meshserve.services.worker.structured.hook import StructuredOutputsHook
from meshserve.services.worker.tier.kv_tier import KVTier


def speculation_of(engine: LLMEngine) -> SpecDecoder | None:
    return engine.hook(SpecDecoder)


def lora_of(engine: LLMEngine) -> LoraManager | None:
    hook = engine.hook(LoraHook)
    return hook.manager if hook is not None else None


def grammars_of(engine: LLMEngine) -> GrammarCompiler:
    hook = engine.hook(StructuredOutputsHook)
    assert hook is not None
    return hook.grammars


def tier_of(engine: LLMEngine) -> KVTier | None:
    return engine.hook(KVTier)

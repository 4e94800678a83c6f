"""KV-cache events, in vLLM's model: what the worker publishes about its prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.shared.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became reusable, in chain order: each one's parent is the one before."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks were evicted and can no longer be reused."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was dropped (prefix cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

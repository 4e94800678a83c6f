"""The Redis block index: which holders (workers, kvstores) hold which KV blocks.

Key schema of one KV namespace `ns` (model, dtype and sharding), all under `ms:{ns}:`:
- `blk:{hash_hex}`    HASH   holder id -> epoch of the holder that stored the block
- `holder:{holder}`   SET    hash_hex of every block the holder holds (fast clearing)
- `epoch:{holder}`    STRING the holder's current epoch (decimal)
- `seq:{holder}`      STRING the last applied event sequence number of that epoch

Redis is an index, never the source of truth: an entry whose epoch is not its holder's
current epoch is ignored, and dead holders are cleared lazily. Every operation is one
round trip; those that read before writing run as Lua scripts, so that they are atomic
when several schedulers, workers and kvstores share one server. Epochs and sequence
numbers travel as decimal strings and are compared as such in Lua (exact for uint64,
where Lua's doubles would not be).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from meshserve.shared.block_hash import BlockHash
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from meshserve.shared.redis_server import evalsha, run_pipeline

KEY_ROOT = "ms:"
KVSTORE_HOLDER_PREFIX = "kvstore:"
"""Holder ids of kvstores start with this; every other holder id is a worker id."""
_MAX_U64 = 2**64 - 1

# "a < b" for decimal strings without leading zeros: shorter is smaller, else lexicographic.
_LUA_OLDER = """
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function clear(holder_key, blk_prefix, holder)
  local members = redis.call('SMEMBERS', holder_key)
  for i = 1, #members do redis.call('HDEL', blk_prefix .. members[i], holder) end
  redis.call('DEL', holder_key)
end
"""

# KEYS: epoch, seq, holder set. ARGV: blk prefix, holder, epoch, seq, ops...
# An op is "+hex" (stored), "-hex" (removed) or "*" (all cleared).
# Returns 1 when applied, 2 when applied to a holder the index had no epoch for (its first
# write, or the index lost it), 0 when dropped (stale epoch or sequence number).
_APPLY = _LUA_OLDER + """
local epoch_key, seq_key, holder_key = KEYS[1], KEYS[2], KEYS[3]
local blk_prefix, holder, epoch, seq = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local current = redis.call('GET', epoch_key)
local result = 1
if not current then result = 2 end
if current and older(epoch, current) then return 0 end
if current ~= epoch then
  clear(holder_key, blk_prefix, holder)
  redis.call('SET', epoch_key, epoch)
else
  local last = redis.call('GET', seq_key)
  if last and not older(last, seq) then return 0 end
end
for i = 5, #ARGV do
  local op = ARGV[i]
  local code = string.sub(op, 1, 1)
  if code == '*' then
    clear(holder_key, blk_prefix, holder)
  elseif code == '+' then
    redis.call('HSET', blk_prefix .. string.sub(op, 2), holder, epoch)
    redis.call('SADD', holder_key, string.sub(op, 2))
  else
    redis.call('HDEL', blk_prefix .. string.sub(op, 2), holder)
    redis.call('SREM', holder_key, string.sub(op, 2))
  end
end
redis.call('SET', seq_key, seq)
return result
"""

# KEYS: epoch, holder set. ARGV: blk prefix, holder, epoch, then the hex hashes the holder
# holds. Replaces its holdings when `epoch` is its current one; returns 1 if it did.
_RESTORE = _LUA_OLDER + """
if redis.call('GET', KEYS[1]) ~= ARGV[3] then return 0 end
clear(KEYS[2], ARGV[1], ARGV[2])
for i = 4, #ARGV do
  redis.call('HSET', ARGV[1] .. ARGV[i], ARGV[2], ARGV[3])
  redis.call('SADD', KEYS[2], ARGV[i])
end
return 1
"""

# KEYS: epoch, seq, holder set. ARGV: blk prefix, holder, epoch ("" for any).
# Clears unless a newer epoch than ARGV[3] holds the holder id now. Returns 1 if cleared.
_CLEAR = _LUA_OLDER + """
local current = redis.call('GET', KEYS[1])
if ARGV[3] ~= '' and current and older(ARGV[3], current) then return 0 end
clear(KEYS[3], ARGV[1], ARGV[2])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: epoch, seq, holder set. ARGV: blk prefix, holder. A fresh epoch, old holdings gone.
_CLAIM = _LUA_OLDER + """
local epoch = redis.call('INCR', KEYS[1])
clear(KEYS[3], ARGV[1], ARGV[2])
redis.call('DEL', KEYS[2])
return epoch
"""

# ARGV: key prefix "ms:{ns}:", then "*" (every holder) or a count n and n holder ids,
# then the hex hashes, first block first. Returns a flat list holder, count, ... of the
# leading blocks each holder holds with its current epoch. Stops at the first block that
# no holder still in the race holds.
_MATCH = """
local prefix = ARGV[1]
local first = 3
local wanted = nil
if ARGV[2] ~= '*' then
  wanted = {}
  local n = tonumber(ARGV[2])
  for j = 1, n do wanted[ARGV[2 + j]] = true end
  first = 3 + n
end
local epochs = {}
local function current_epoch(h)
  local e = epochs[h]
  if e == nil then
    e = redis.call('GET', prefix .. 'epoch:' .. h)
    epochs[h] = e
  end
  return e
end
local alive = nil
local counts = {}
for k = first, #ARGV do
  local flat = redis.call('HGETALL', prefix .. 'blk:' .. ARGV[k])
  local next_alive = {}
  local any = false
  for j = 1, #flat, 2 do
    local h, e = flat[j], flat[j + 1]
    local in_race
    if alive == nil then in_race = (wanted == nil or wanted[h]) else in_race = alive[h] end
    if in_race and current_epoch(h) == e then
      next_alive[h] = true
      counts[h] = (counts[h] or 0) + 1
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for h, c in pairs(counts) do
  out[#out + 1] = h
  out[#out + 1] = c
end
return out
"""


def kvstore_holder(store_id: str) -> str:
    """The holder id a kvstore writes its holdings under."""
    return KVSTORE_HOLDER_PREFIX + store_id


async def holder_namespaces(redis: aioredis.Redis, holder: str) -> list[str]:
    """Namespaces where `holder` has a holder set (SCAN: for start-up, not hot paths)."""
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in holder)
    suffix = f":holder:{holder}".encode()
    namespaces = {key[len(KEY_ROOT):-len(suffix)].decode()
                  async for key in redis.scan_iter(match=f"{KEY_ROOT}*:holder:{escaped}",
                                                   count=1000)
                  if key.endswith(suffix)}
    return sorted(namespaces)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decimal(value: int, name: str) -> str:
    if not 0 <= value <= _MAX_U64:
        raise InvalidRequestError(f"{name} must be in [0, 2**64), got {value}", param=name)
    return str(int(value))


def _ops(events: Sequence[KVEvent]) -> list[str]:
    """Script arguments for events, in order: "+hex", "-hex" or "*"."""
    ops: list[str] = []
    for event in events:
        if isinstance(event, BlockStored):
            ops.extend("+" + h.hex() for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            ops.extend("-" + h.hex() for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            ops.append("*")
        else:
            raise InvalidRequestError(f"unknown KV event {event!r}", param="events")
    return ops


class Applied(enum.IntEnum):
    """What `apply_events` did with a batch (false when dropped)."""

    DROPPED = 0
    APPLIED = 1
    APPLIED_UNKNOWN = 2  # applied, but the index had no epoch of the holder: lost, or new


class KVIndex:
    """One KV namespace of the block index in Redis; see the module doc for the keys."""

    def __init__(self, redis: aioredis.Redis, namespace: str) -> None:
        if not namespace:
            raise InvalidRequestError("KV namespace must not be empty", param="namespace")
        self.redis = redis
        self.namespace = namespace
        self.prefix = f"{KEY_ROOT}{namespace}:"
        self._apply = redis.register_script(_APPLY)
        self._clear = redis.register_script(_CLEAR)
        self._restore = redis.register_script(_RESTORE)
        self._claim = redis.register_script(_CLAIM)
        self._match = redis.register_script(_MATCH)

    # Keys (the one place that spells them).
    def block_key(self, block_hash: BlockHash) -> str:
        return f"{self.prefix}blk:{block_hash.hex()}"

    def holder_key(self, holder: str) -> str:
        return f"{self.prefix}holder:{holder}"

    def epoch_key(self, holder: str) -> str:
        return f"{self.prefix}epoch:{holder}"

    def seq_key(self, holder: str) -> str:
        return f"{self.prefix}seq:{holder}"

    def _holder_keys(self, holder: str) -> list[str]:
        if not holder:
            raise InvalidRequestError("holder id must not be empty", param="holder")
        return [self.epoch_key(holder), self.seq_key(holder), self.holder_key(holder)]

    async def apply_events(self, holder: str, epoch: int, seq: int,
                           events: Sequence[KVEvent]) -> Applied:
        """Apply one batch of a holder's KV events in one atomic round trip.

        Dropped (false) when `epoch` is older than the holder's recorded epoch, or when
        `seq` is not newer than the last applied one of the same epoch. A newer epoch first
        clears everything the holder held under its old epoch. APPLIED_UNKNOWN tells a
        holder that has written before that the index lost its entries (Redis restarted
        empty): it should `restore` what it holds.
        """
        keys = self._holder_keys(holder)
        args = [f"{self.prefix}blk:", holder, _decimal(epoch, "epoch"), _decimal(seq, "seq"),
                *_ops(events)]
        return Applied(int(await self._apply(keys, args)))

    async def restore(self, holder: str, epoch: int, block_hashes: Collection[BlockHash]) -> bool:
        """Make the index hold exactly `block_hashes` for `holder` (in its current `epoch`)."""
        keys = [self.epoch_key(holder), self.holder_key(holder)]
        args = [f"{self.prefix}blk:", holder, _decimal(epoch, "epoch"),
                *(h.hex() for h in block_hashes)]
        return bool(await self._restore(keys, args))

    async def clear_holder(self, holder: str, epoch: int | None = None) -> bool:
        """Forget every block of `holder` (unless a newer epoch than `epoch` holds it now)."""
        keys = self._holder_keys(holder)
        args = [f"{self.prefix}blk:", holder, "" if epoch is None else _decimal(epoch, "epoch")]
        return bool(await self._clear(keys, args))

    async def claim_epoch(self, holder: str) -> int:
        """Start a fresh epoch for `holder` (previous holdings cleared); returns it."""
        return int(await self._claim(self._holder_keys(holder), [f"{self.prefix}blk:", holder]))

    def queue_match(self, pipe: Pipeline, block_hashes: Sequence[BlockHash],
                    holders: Collection[str] | None = None) -> None:
        """Queue match_prefix on `pipe` (read the reply with `parse_match`)."""
        selector = ["*"] if holders is None else [str(len(holders)), *holders]
        evalsha(pipe, self._match, [], [self.prefix, *selector,
                                        *(h.hex() for h in block_hashes)])

    @staticmethod
    def parse_match(raw: Any, holders: Collection[str] | None = None) -> dict[str, int]:
        """match_prefix's result from the script's reply (every asked holder, 0 if none)."""
        counts = {holder: 0 for holder in holders or ()}
        for i in range(0, len(raw), 2):
            counts[raw[i].decode()] = int(raw[i + 1])
        return counts

    @property
    def scripts(self) -> list[Any]:
        """The Lua scripts queue_* methods use (for run_pipeline)."""
        return [self._match]

    async def match_prefix(self, block_hashes: Sequence[BlockHash],
                           holders: Collection[str] | None = None) -> dict[str, int]:
        """Per holder, how many LEADING blocks of `block_hashes` it holds (one round trip).

        Only entries written under the holder's current epoch count; a holder's count
        stops at its first missing block. `holders` limits the answer to those ids (each
        present, 0 when it holds nothing); None reports every holder with at least one.
        """
        if not block_hashes:
            return {holder: 0 for holder in holders or ()}
        results = await run_pipeline(
            self.redis, lambda pipe: self.queue_match(pipe, block_hashes, holders),
            self.scripts)
        return self.parse_match(results[0], holders)

    async def holders_of(self, block_hash: BlockHash) -> dict[str, int]:
        """Holder id -> the epoch it stored `block_hash` under (current or not)."""
        raw = await self.redis.hgetall(self.block_key(block_hash))
        return {_text(holder): int(epoch) for holder, epoch in raw.items()}

    async def blocks_of(self, holder: str) -> set[BlockHash]:
        """Every block hash recorded for `holder`."""
        members = await self.redis.smembers(self.holder_key(holder))
        return {bytes.fromhex(_text(m)) for m in members}

    async def epoch_of(self, holder: str) -> int | None:
        """The holder's recorded epoch (None when it never wrote)."""
        raw = await self.redis.get(self.epoch_key(holder))
        return None if raw is None else int(raw)

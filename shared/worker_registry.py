"""The worker registry in Redis: who serves what, with which load, and who is alive.

Keys (all under `ms:`):
- `worker:{id}`        HASH   info (JSON), load (JSON), epoch, heartbeat_unix_ns
- `worker:{id}:alive`  STRING the epoch, with a TTL that every heartbeat refreshes
- `worker:{id}:epoch`  STRING the highest epoch ever registered for the id (survives
                              deregistration, so that epochs only grow)
- `workers`            SET    worker ids
- channel `events:load`       a worker id, published whenever its load or liveness changes

A worker whose alive key expired is dead: `live_workers` leaves it out, drops it from
the registry and clears its blocks from the KV index (lazily, on the next read). Every
read-then-write runs as one Lua script, so several scheduler replicas can share the
registry. Epochs are compared as decimal strings (exact for uint64).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.kv_index import KEY_ROOT, KVIndex
from meshserve.shared.redis_server import evalsha, run_pipeline

WORKERS_KEY = f"{KEY_ROOT}workers"
LOAD_CHANNEL = f"{KEY_ROOT}events:load"
_WORKER_PREFIX = f"{KEY_ROOT}worker:"
_MAX_EPOCH = 2**63 - 1  # Redis INCR works on signed 64-bit integers
RUNNER_GENERATE = "generate"
RUNNER_POOLING = "pooling"
RUNNERS = (RUNNER_GENERATE, RUNNER_POOLING)
ROLE_MIXED = "mixed"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE)

_LUA_OLDER = """
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
"""

# KEYS: worker hash, alive key, workers set, epoch counter.
# ARGV: worker id, epoch ("0": assign the next), info, load, now_ns, ttl_ms, channel.
# Returns {1, epoch} or {0, highest epoch} when the asked epoch is older than that.
_REGISTER = _LUA_OLDER + """
local highest = redis.call('GET', KEYS[4]) or '0'
local epoch = ARGV[2]
if epoch == '0' then
  redis.call('INCR', KEYS[4])
  epoch = redis.call('GET', KEYS[4])
elseif older(epoch, highest) then
  return {0, highest}
elseif older(highest, epoch) then
  redis.call('SET', KEYS[4], epoch)
end
redis.call('HSET', KEYS[1], 'info', ARGV[3], 'load', ARGV[4], 'epoch', epoch,
           'heartbeat_unix_ns', ARGV[5])
redis.call('SET', KEYS[2], epoch, 'PX', ARGV[6])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('PUBLISH', ARGV[7], ARGV[1])
return {1, epoch}
"""

# KEYS: worker hash, alive key. ARGV: epoch, load, now_ns, ttl_ms, worker id, channel.
_HEARTBEAT = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[2], 'heartbeat_unix_ns', ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
redis.call('PUBLISH', ARGV[6], ARGV[5])
return 1
"""

# KEYS: worker hash, alive key, workers set. ARGV: epoch ("" for any), worker id, channel.
# Removes the registration of that epoch; returns its info JSON, or false.
_DEREGISTER = """
local current = redis.call('HGET', KEYS[1], 'epoch')
if ARGV[1] ~= '' and current and current ~= ARGV[1] then return false end
if redis.call('SREM', KEYS[3], ARGV[2]) == 0 and not current then return false end
local info = redis.call('HGET', KEYS[1], 'info') or ''
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', ARGV[3], ARGV[2])
return info
"""

# KEYS: workers set. ARGV: worker key prefix. Returns {id, alive, info, load, epoch, hb}...
_SCAN = """
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for i = 1, #ids do
  local base = ARGV[1] .. ids[i]
  local f = redis.call('HMGET', base, 'info', 'load', 'epoch', 'heartbeat_unix_ns')
  out[i] = {ids[i], redis.call('EXISTS', base .. ':alive'), f[1] or '', f[2] or '',
            f[3] or '', f[4] or ''}
end
return out
"""

# KEYS: worker hash, alive key, workers set. ARGV: epoch seen dead, worker id.
# Drops the worker unless it came back (alive again, or registered anew since).
_REAP = """
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
local current = redis.call('HGET', KEYS[1], 'epoch')
if current and current ~= ARGV[1] then return false end
local info = redis.call('HGET', KEYS[1], 'info') or ''
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[3], ARGV[2])
return info
"""

_T = TypeVar("_T")


def _from_mapping(cls: type[_T], values: Mapping[str, Any], what: str) -> _T:
    """A frozen dataclass from a mapping; unknown keys are an error, lists become tuples."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise InvalidRequestError(f"unknown {what} fields: {', '.join(unknown)}",
                                  param=unknown[0])
    clean = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return cls(**clean)
    except TypeError as exc:
        raise InvalidRequestError(f"bad {what}: {exc}", param=what) from None


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker serves and how its KV cache is shaped; fixed for one epoch."""

    worker_id: str
    address: str
    model_names: tuple[str, ...] = ()
    block_size: int = 16
    max_model_len: int = 0
    num_total_blocks: int = 0
    lora_ids: tuple[int, ...] = ()
    lora_names: tuple[str, ...] = ()
    """Names of the LoRA adapters served, in the order of lora_ids."""
    tensor_parallel_size: int = 1
    kv_namespace: str = ""
    sampling_defaults_json: str = ""  # request fields' defaults (generation config), JSON
    epoch: int = 0
    """The epoch the worker asks for at registration (0: the registry assigns one)."""
    runner: str = RUNNER_GENERATE
    """What the worker runs its model for: "generate" or "pooling" (embeddings)."""
    embedding_size: int = 0
    """Pooling workers: the length of the vectors they pool (0 otherwise)."""
    class_labels: tuple[str, ...] = ()
    """Pooling workers of a sequence classifier: its labels by class (they pool logits)."""
    metrics_url: str = ""
    """The worker's Prometheus /metrics URL ("": none)."""
    role: str = ROLE_MIXED
    """Its part in disaggregated serving: "mixed", "prefill" or "decode" (--role)."""
    kv_handoff_address: str = ""
    """host:port where a decode worker takes KV pushed into its pool (--kv-handoff ipc)."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise InvalidRequestError("worker_id must not be empty", param="worker_id")
        if not self.address:
            raise InvalidRequestError(f"worker {self.worker_id}: address must not be empty",
                                      param="address")
        if self.block_size <= 0:
            raise InvalidRequestError(f"worker {self.worker_id}: block_size must be positive, "
                                      f"got {self.block_size}", param="block_size")
        if self.runner not in RUNNERS:
            raise InvalidRequestError(f"worker {self.worker_id}: runner must be one of "
                                      f"{list(RUNNERS)}, got {self.runner!r}", param="runner")
        if self.role not in ROLES:
            raise InvalidRequestError(f"worker {self.worker_id}: role must be one of "
                                      f"{list(ROLES)}, got {self.role!r}", param="role")
        if not 0 <= self.epoch <= _MAX_EPOCH:
            raise InvalidRequestError(f"worker {self.worker_id}: epoch must be in "
                                      f"[0, 2**63), got {self.epoch}", param="epoch")

    @property
    def namespace(self) -> str:
        """The worker's KV namespace (its canonical model name when it named none)."""
        return self.kv_namespace or (self.model_names[0] if self.model_names else self.worker_id)

    def serves(self, model: str) -> bool:
        return model in self.model_names

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        return _from_mapping(cls, values, "worker info")


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's live load, as routing scores it."""

    num_running: int = 0
    num_waiting: int = 0
    num_pending_prefill_tokens: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    max_running: int = 0
    """Most sequences the worker runs at once (0: unknown, no limit)."""
    draining: bool = False
    snapshot_unix_ns: int = 0
    num_active_tokens: int = 0
    """Tokens of the running and waiting sequences, each counted in full (shared prefix
    blocks too): what their decode steps read."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        return _from_mapping(cls, values, "worker load")


@dataclass(frozen=True)
class WorkerRecord:
    """A registered, live worker as the registry last heard of it."""

    info: WorkerInfo
    load: WorkerLoad
    epoch: int
    last_heartbeat_unix_ns: int

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role


def _info_of(info: WorkerInfo | Mapping[str, Any]) -> WorkerInfo:
    return info if isinstance(info, WorkerInfo) else WorkerInfo.from_mapping(info)


def _load_of(load: WorkerLoad | Mapping[str, Any]) -> WorkerLoad:
    return load if isinstance(load, WorkerLoad) else WorkerLoad.from_mapping(load)


def _json(value: Any) -> bytes:
    return orjson.dumps(dataclasses.asdict(value))


class WorkerRegistry:
    """Registration, heartbeats and liveness of workers, shared through Redis."""

    def __init__(self, redis: aioredis.Redis, ttl_s: float,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        """`ttl_s`: a worker without a heartbeat for this long is dead."""
        if ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s must be positive, got {ttl_s}", param="ttl_s")
        self.redis = redis
        self.ttl_s = ttl_s
        self._clock_ns = clock_ns
        self._register = redis.register_script(_REGISTER)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._deregister = redis.register_script(_DEREGISTER)
        self._scan = redis.register_script(_SCAN)
        self._reap = redis.register_script(_REAP)

    @staticmethod
    def _keys(worker_id: str) -> list[str]:
        """worker hash, alive key, workers set, epoch counter."""
        if not worker_id:
            raise InvalidRequestError("worker_id must not be empty", param="worker_id")
        base = _WORKER_PREFIX + worker_id
        return [base, f"{base}:alive", WORKERS_KEY, f"{base}:epoch"]

    @property
    def _ttl_ms(self) -> str:
        return str(max(1, round(self.ttl_s * 1000)))

    async def claim_epoch(self, worker_id: str) -> int:
        """The next epoch of `worker_id` (for a worker that picks its epoch before registering)."""
        return int(await self.redis.incr(self._keys(worker_id)[3]))

    async def register(self, info: WorkerInfo | Mapping[str, Any],
                       load: WorkerLoad | Mapping[str, Any]) -> int:
        """Register (or re-register) a worker; returns its epoch.

        `info.epoch` 0 takes the next epoch of the id; a given epoch is kept, so that
        registering twice with one epoch is idempotent. An epoch older than one already
        registered for the id is refused (InvalidRequestError).
        """
        info, load = _info_of(info), _load_of(load)
        keys = self._keys(info.worker_id)
        args: list[str | bytes] = [info.worker_id, str(info.epoch), _json(info), _json(load),
                str(self._clock_ns()), self._ttl_ms, LOAD_CHANNEL]
        ok, epoch = await self._register(keys, args)
        if not ok:
            raise InvalidRequestError(
                f"worker {info.worker_id}: epoch {info.epoch} is older than its registered "
                f"epoch {int(epoch)}", param="epoch")
        return int(epoch)

    async def heartbeat(self, worker_id: str, epoch: int,
                        load: WorkerLoad | Mapping[str, Any]) -> bool:
        """Record a worker's load and keep it alive; False: unknown, dead or stale epoch."""
        keys = self._keys(worker_id)[:2]
        args: list[str | bytes] = [str(epoch), _json(_load_of(load)), str(self._clock_ns()),
                                   self._ttl_ms, worker_id, LOAD_CHANNEL]
        return bool(await self._heartbeat(keys, args))

    async def deregister(self, worker_id: str, epoch: int | None = None) -> bool:
        """Remove a worker (only its registration of `epoch` when given) and its blocks."""
        keys = self._keys(worker_id)[:3]
        info = await self._deregister(keys, ["" if epoch is None else str(epoch), worker_id,
                                             LOAD_CHANNEL])
        if info is None:
            return False
        await self._forget_blocks(info, worker_id, epoch)
        return True

    def queue_scan(self, pipe: Pipeline) -> None:
        """Queue the registry read on `pipe` (finish with `records_from_scan`)."""
        evalsha(pipe, self._scan, [WORKERS_KEY], [_WORKER_PREFIX])

    @property
    def scripts(self) -> list[Any]:
        """The Lua scripts queue_scan uses (for run_pipeline)."""
        return [self._scan]

    async def records_from_scan(self, raw: Any, model: str | None = None
                                ) -> list[WorkerRecord]:
        """Live workers (serving `model` when given) from a scan; reaps the dead ones."""
        records: list[WorkerRecord] = []
        for worker_id, alive, info, load, epoch, heartbeat in raw:
            if not alive or not info:
                await self._reap_dead(worker_id.decode(), epoch.decode())
                continue
            record = WorkerRecord(
                info=WorkerInfo.from_mapping(orjson.loads(info)),
                load=WorkerLoad.from_mapping(orjson.loads(load)),
                epoch=int(epoch), last_heartbeat_unix_ns=int(heartbeat or 0))
            if model is None or record.info.serves(model):
                records.append(record)
        records.sort(key=lambda r: r.worker_id)
        return records

    async def live_workers(self, model: str | None = None) -> list[WorkerRecord]:
        """Workers whose alive key still exists, by id; dead ones are reaped on the way."""
        raw = await run_pipeline(self.redis, self.queue_scan, self.scripts)
        return await self.records_from_scan(raw[0], model)

    async def _reap_dead(self, worker_id: str, epoch: str) -> None:
        keys = self._keys(worker_id)[:3]
        info = await self._reap(keys, [epoch, worker_id])
        if info is not None:
            await self._forget_blocks(info, worker_id, int(epoch) if epoch else None)

    async def _forget_blocks(self, info_json: bytes, worker_id: str, epoch: int | None
                             ) -> None:
        """Clear a departed worker's blocks from its namespace of the KV index."""
        if not info_json:
            return
        info = WorkerInfo.from_mapping(orjson.loads(info_json))
        await KVIndex(self.redis, info.namespace).clear_holder(worker_id, epoch)

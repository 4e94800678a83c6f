"""The worker's direct-handoff link (services/worker/__main__.py, `TcpHandoffLink`): a prefill
worker's KV tier may queue as many bytes of saves as it may hold for the handoff, so that one
step completing a long prompt (an 8k-token prompt of the Llama-3.1-8B shape is 1 GiB of
blocks) is not dropped whole for passing the kvstore's backlog bound; other roles keep the
kvstore's bound. With ipc, a prefill worker takes a pool for the blocks it holds and a decode
worker one for the blocks pushed to it; a mixed worker takes none."""

from __future__ import annotations

from meshserve.services.worker.__main__ import TcpHandoffLink
from meshserve.services.worker.config import WorkerConfig

GiB = 1 << 30


def link(role: str, handoff: str = "tcp", hold: int = 8 * GiB) -> TcpHandoffLink:
    config = WorkerConfig.from_args(["--role", role, "--kv-handoff", handoff, "--device", "cpu",
                                     "--kv-handoff-hold-bytes", str(hold),
                                     "--kv-offload-backlog-bytes", str(GiB)])
    return TcpHandoffLink(config, None)


def test_a_prefill_worker_may_queue_what_it_may_hold() -> None:
    assert link("prefill").plan().max_save_backlog_bytes == 8 * GiB


def test_a_decode_worker_keeps_the_kvstore_bound() -> None:
    assert link("decode").plan().max_save_backlog_bytes == GiB
    assert link("mixed", "ipc", hold=64 << 20).pool is None


def test_an_ipc_decode_worker_takes_a_pool_for_pushed_blocks() -> None:
    decode = link("decode", "ipc", hold=64 << 20)
    assert decode.pool is not None and decode.pool.device.type == "cpu"
    assert decode.plan().max_save_backlog_bytes == GiB
    decode.pool.close()


def test_an_ipc_prefill_worker_takes_its_pool_at_start() -> None:
    prefill = link("prefill", "ipc", hold=64 << 20)
    assert prefill.pool is not None and prefill.pool.device.type == "cpu"
    prefill.pool.close()

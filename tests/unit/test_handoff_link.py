"""The worker's direct-handoff link (services/worker/__main__.py, `TcpHandoffLink`): a prefill
worker's KV tier may queue as many bytes of saves as it may hold for the handoff, so that one
step completing a long prompt (an 8k-token prompt of the Llama-3.1-8B shape is 1 GiB of
blocks) is not dropped whole for passing the kvstore's backlog bound; other roles keep the
kvstore's bound. With ipc, a prefill worker takes a pool for the blocks it holds and a decode
worker one for the blocks pushed to it (with --kv-handoff-push); a mixed worker takes none.
`meshserve up` gives both roles the pool size and the push switch."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.local.launcher import LauncherConfig, Stack
from meshserve.services.worker.__main__ import TcpHandoffLink
from meshserve.services.worker.config import WorkerConfig
from meshserve.shared.errors import ConfigError

GiB = 1 << 30


def link(role: str, handoff: str = "tcp", hold: int = 8 * GiB, *extra: str) -> TcpHandoffLink:
    config = WorkerConfig.from_args(["--role", role, "--kv-handoff", handoff, "--device", "cpu",
                                     "--kv-handoff-hold-bytes", str(hold),
                                     "--kv-offload-backlog-bytes", str(GiB), *extra])
    return TcpHandoffLink(config, None)


def test_a_prefill_worker_may_queue_what_it_may_hold() -> None:
    assert link("prefill").plan().max_save_backlog_bytes == 8 * GiB


def test_a_decode_worker_keeps_the_kvstore_bound() -> None:
    assert link("decode").plan().max_save_backlog_bytes == GiB
    assert link("mixed", "ipc", hold=64 << 20).pool is None


def test_an_ipc_decode_worker_takes_a_pool_for_pushed_blocks() -> None:
    decode = link("decode", "ipc", 64 << 20, "--kv-handoff-push")
    assert decode.pool is not None and decode.pool.device.type == "cpu"
    assert decode.plan().max_save_backlog_bytes == GiB
    decode.pool.close()


def test_an_ipc_prefill_worker_takes_its_pool_at_start() -> None:
    prefill = link("prefill", "ipc", hold=64 << 20)
    assert prefill.pool is not None and prefill.pool.device.type == "cpu"
    prefill.pool.close()


def test_a_decode_worker_without_pushes_takes_no_pool() -> None:
    config = WorkerConfig.from_args(["--role", "decode", "--kv-handoff", "ipc", "--device",
                                     "cpu", "--kv-handoff-hold-bytes", str(64 << 20)])
    assert not config.kv_handoff_push, "pushes are off unless asked for"
    assert TcpHandoffLink(config, None).pool is None


def workers(tmp_path: Path, **values: object) -> dict[str, WorkerConfig]:
    """The worker configs `meshserve up` would start, by name."""
    stack = Stack(LauncherConfig(model="m", device="cpu", workers=0, prefill_workers=1,
                                 decode_workers=1,
                                 kv_handoff="ipc", **values), tmp_path)
    stack.redis_url = "redis://127.0.0.1:1/0"
    stack._plan()
    return {s.name: WorkerConfig.from_args(s.argv, environ={}) for s in stack.services
            if s.role == "worker"}


def test_meshserve_up_gives_both_roles_the_pool_size_and_the_push_switch(
        tmp_path: Path) -> None:
    planned = workers(tmp_path, kv_handoff_hold_bytes=64 << 20, kv_handoff_push=True)
    assert {c.role: c.kv_handoff_hold_bytes for c in planned.values()} == {
        "prefill": 64 << 20, "decode": 64 << 20}
    assert all(c.kv_handoff_push for c in planned.values())
    off = workers(tmp_path / "off")
    assert not any(c.kv_handoff_push for c in off.values())


def test_meshserve_up_gives_prefill_workers_the_send_timeout(tmp_path: Path) -> None:
    planned = workers(tmp_path, kv_handoff_send_timeout_s=2.5)
    assert {c.role: c.kv_handoff_send_timeout_s for c in planned.values()} == {
        "prefill": 2.5, "decode": WorkerConfig().kv_handoff_send_timeout_s}
    default = workers(tmp_path / "default")
    assert {c.kv_handoff_send_timeout_s for c in default.values()} == {10.0}


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_send_timeout_that_is_not_positive_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="kv_handoff_send_timeout_s: must be positive"):
        WorkerConfig.from_args(["--kv-handoff-send-timeout-s", value], environ={})

"""Several gateways on one port: the config checks and what `meshserve up` would start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from meshserve.local.launcher import LauncherConfig, Stack
from meshserve.local.probes import port_taken
from meshserve.services.gateway.config import GatewayConfig
from meshserve.shared.errors import ConfigError, UnavailableError


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_gateways_cannot_be_negative() -> None:
    with pytest.raises(ConfigError, match="gateways: must be >= 0"):
        LauncherConfig(gateways=-1)


def test_gateways_from_flag_and_environment() -> None:
    assert LauncherConfig().num_gateways == 1
    assert LauncherConfig.from_args(["--gateways", "3"], environ={}).num_gateways == 3
    assert LauncherConfig.from_args([], environ={"MESHSERVE_GATEWAYS": "2"}).num_gateways == 2


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (8, 1), (16, 2), (31, 3),
                                                 (64, 4), (128, 4), (None, 1)])
def test_gateways_0_is_one_per_eight_cores(monkeypatch: pytest.MonkeyPatch,
                                                cores: int | None, expected: int) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    config = LauncherConfig(gateways=0)
    assert config.num_gateways == expected


def test_reuse_port_is_off_by_default_and_needs_a_fixed_port() -> None:
    assert GatewayConfig().reuse_port is False
    assert GatewayConfig.from_args(["--reuse-port"], environ={}).reuse_port is True
    with pytest.raises(ConfigError, match="reuse_port: needs a fixed --port"):
        GatewayConfig(reuse_port=True, port=0)


def plan(tmp_path: Path, **values: object) -> Stack:
    stack = Stack(LauncherConfig(model="m", device="cpu", port=8123, **values), tmp_path)
    stack.redis_url = "redis://127.0.0.1:1/0"
    stack._plan()
    return stack


def test_several_gateways_share_the_port_with_their_own_metrics_ports(tmp_path: Path) -> None:
    stack = plan(tmp_path, gateways=3)
    gateways = [s for s in stack.services if s.role == "gateway"]
    assert [g.name for g in gateways] == ["gateway-0", "gateway-1", "gateway-2"]
    assert {flag(g.argv, "--port") for g in gateways} == {"8123"}
    assert all("--reuse-port" in g.argv for g in gateways)
    metrics_ports = [int(flag(g.argv, "--metrics-port")) for g in gateways]
    assert len(set(metrics_ports)) == 3
    assert stack.gateway_metrics_urls == [f"http://127.0.0.1:{p}/metrics" for p in metrics_ports]
    # Gateways parse what the launcher gives them.
    configs = [GatewayConfig.from_args(g.argv, environ={}) for g in gateways]
    assert all(c.reuse_port and c.port == 8123 for c in configs)
    # Started last: stop() terminates the gateways first.
    assert [s.role for s in stack.services][-3:] == ["gateway"] * 3


def test_one_gateway_keeps_its_name_and_the_port_to_itself(tmp_path: Path) -> None:
    stack = plan(tmp_path)
    gateways = [s for s in stack.services if s.role == "gateway"]
    assert [g.name for g in gateways] == ["gateway"]
    assert "--reuse-port" not in gateways[0].argv


def test_every_child_gets_a_metrics_port_of_its_own(tmp_path: Path) -> None:
    stack = plan(tmp_path, workers=2, tokenizers=2)
    ports = [int(flag(s.argv, "--metrics-port")) for s in stack.services]
    assert len(set(ports)) == len(stack.services) == 7
    assert [s.metrics_url for s in stack.services] == [f"http://127.0.0.1:{p}/metrics"
                                                       for p in ports]


def test_port_taken_sees_a_listener() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.listen()
        assert port_taken("127.0.0.1", port)
    assert not port_taken("127.0.0.1", port)


def test_gateways_refuse_a_port_that_something_listens_on(tmp_path: Path) -> None:
    """With SO_REUSEPORT they could share it with its owner: `meshserve up` refuses first."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        stack = Stack(LauncherConfig(model="m", device="cpu", port=port, gateways=2), tmp_path)
        with pytest.raises(UnavailableError, match=f"port {port} on 127.0.0.1 is taken"):
            stack.start()
    assert stack.services == []

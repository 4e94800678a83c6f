"""Settings as the compose stack gives them: MESHSERVE_* variables, with flags only as
overrides; the API key from a secret file; SO_REUSEPORT for every service."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.worker.config import WorkerConfig
from meshserve.shared.errors import ConfigError


def test_the_environment_points_a_gateway_at_its_peers_and_flags_override_it() -> None:
    env = {"MESHSERVE_TOKENIZER_ADDRESSES": "dns:///tokenizer:50051",
           "MESHSERVE_SCHEDULER_ADDRESS": "scheduler:50052", "MESHSERVE_PORT": "8001"}
    config = GatewayConfig.from_args([], environ=env)
    assert config.tokenizer_addresses == ("dns:///tokenizer:50051",)
    assert (config.scheduler_address, config.port) == ("scheduler:50052", 8001)
    config = GatewayConfig.from_args(["--scheduler-address", "other:1"], environ=env)
    assert (config.scheduler_address, config.port) == ("other:1", 8001)


def test_every_service_can_share_its_port() -> None:
    assert TokenizerConfig().reuse_port is False
    assert TokenizerConfig.from_args([], environ={"MESHSERVE_REUSE_PORT": "true"}).reuse_port
    worker = WorkerConfig.from_args([], environ={"MESHSERVE_REUSE_PORT": "1",
                                                 "MESHSERVE_PORT": "0"})
    assert (worker.reuse_port, worker.port) == (True, 0)  # port 0: the metrics port shares


def test_the_api_key_comes_from_the_first_line_of_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "api_key"
    secret.write_text("  sk-from-a-secret  \nignored\n")
    config = GatewayConfig.from_args([], environ={"MESHSERVE_API_KEY_FILE": str(secret)})
    assert config.api_key == "sk-from-a-secret"
    assert config.api_key_file == secret


@pytest.mark.parametrize("content", ["", "\n", "   \nsk\n"])
def test_an_empty_key_file_is_refused(tmp_path: Path, content: str) -> None:
    secret = tmp_path / "api_key"
    secret.write_text(content)
    with pytest.raises(ConfigError, match="api_key_file: .* holds no key"):
        GatewayConfig(api_key_file=secret)


def test_a_missing_key_file_or_two_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api_key_file: cannot read"):
        GatewayConfig(api_key_file=tmp_path / "absent")
    secret = tmp_path / "api_key"
    secret.write_text("sk\n")
    with pytest.raises(ConfigError, match="not both"):
        GatewayConfig.from_args(["--api-key", "sk2", "--api-key-file", str(secret)],
                                environ={})

"""Encoder replicas added later are found by workers that name them all with one DNS name
(`dns:///encoder:50056` in compose, the headless Service on Kubernetes): gRPC resolves a
name again only when a connection ends, so an encoder given `--max-connection-age-s` ends
each client connection after that long (test_tokenizer_discovery.py shows a client
finding a replica added later that way). Here: the flag reaches the encoder's server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from meshserve.services.encoder import __main__ as encoder_main
from meshserve.services.encoder.config import EncoderConfig
from meshserve.shared.errors import ConfigError
from meshserve.shared.grpc_server import GrpcServer


def test_the_encoders_server_ends_connections_after_the_age(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options: list[list[tuple[str, Any]]] = []

    class Recording(GrpcServer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            options.append(list(self.options))

    monkeypatch.setattr(encoder_main, "GrpcServer", Recording)
    # A folder that is no model: the server starts, the load fails, the service exits 1.
    config = EncoderConfig.from_args(["--model", str(tmp_path), "--port", "0",
                                      "--max-connection-age-s", "2.5"], environ={})
    assert asyncio.run(encoder_main.serve(config)) == 1
    assert ("grpc.max_connection_age_ms", 2500) in options[0]

    options.clear()
    unset = EncoderConfig.from_args(["--model", str(tmp_path), "--port", "0"], environ={})
    assert unset.max_connection_age_s is None
    assert asyncio.run(encoder_main.serve(unset)) == 1
    assert "grpc.max_connection_age_ms" not in dict(options[0])


def test_an_age_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_connection_age_s"):
        EncoderConfig.from_args(["--model", str(tmp_path), "--max-connection-age-s", "0"],
                                environ={})

"""Run the tokenizer service: `python -m meshserve.services.tokenizer --model DIR`.

The gRPC server starts first (health NOT_SERVING) and answers health checks
while the tokenizer loads in a background thread; it turns SERVING once loaded
and drains on SIGTERM / SIGINT, also while still loading.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from meshserve.proto.v1 import tokenizer_pb2_grpc
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.tokenizer.images import load_image_placeholders
from meshserve.services.tokenizer.loader import hf_folder, load_tokenizer
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import SERVICE_NAME, TokenizerServicer
from meshserve.shared.errors import ConfigError
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.model_config import max_model_len_of, read_model_files
from meshserve.shared.model_source import resolve_model
from meshserve.shared.service_main import load_then_serve, run_service, service_telemetry
from meshserve.shared.torch_free import forbid_torch

_log = logging.getLogger("meshserve.services.tokenizer")


def read_chat_template(value: str | None) -> str | None:
    """The `--chat-template` value as Jinja text: the value itself, or a file's contents."""
    if value is None:
        return None
    # Jinja text first: a whole template is no valid path (too long, or has newlines).
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"chat_template {value!r} is neither a file nor a Jinja template",
                          param="chat_template")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read chat template file {path}: {exc}",
                          param="chat_template") from exc


def load_served_model(config: TokenizerConfig) -> ServedModel:
    """Find the model, load its tokenizer (and a vision-language model's image
    placeholders) and read its context length (blocking)."""
    source = resolve_model(config.model)
    tokenizer = load_tokenizer(config.tokenizer or source)
    folder = hf_folder(config.tokenizer or source)
    images = load_image_placeholders(folder, tokenizer.hf) if folder is not None else None
    max_model_len = config.max_model_len or max_model_len_of(read_model_files(source))
    name = config.served_model_name or source.name
    names = tuple(dict.fromkeys([name, source.name, config.model]))
    return ServedModel(tokenizer, names, max_model_len, read_chat_template(config.chat_template),
                       images)


async def _go_serving(server: GrpcServer, servicer: TokenizerServicer,
                      model: ServedModel) -> None:
    servicer.set_model(model)
    await server.set_serving()
    _log.info("tokenizer serving", extra={
        "model": model.name, "vocab_size": model.tokenizer.vocab_size,
        "max_model_len": model.max_model_len, "port": server.port})


async def serve(config: TokenizerConfig) -> int:
    """Run the service until it is stopped and drained; the process exit code."""
    async with service_telemetry("tokenizer", config) as telemetry:
        servicer = TokenizerServicer(telemetry=telemetry, limits=config.prompt_limits)
        server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                            telemetry=telemetry, grace_s=config.drain_grace_s,
                            reuse_port=config.reuse_port,
                            max_connection_age_s=config.max_connection_age_s)
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server.server)
        await server.start()
        server.install_signal_handlers()
        return await load_then_serve(
            server, lambda: load_served_model(config), "tokenizer",
            lambda model: _go_serving(server, servicer, model))


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshserve tokenizer` / `python -m meshserve.services.tokenizer`."""
    forbid_torch()  # text and HTTP only: see shared/torch_free.py
    return run_service("tokenizer", TokenizerConfig, serve, argv)


if __name__ == "__main__":
    sys.exit(main())

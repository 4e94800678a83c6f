"""The `meshserve` command.

    meshserve up [--model M] [--workers N] [--port P] ...   the whole stack, one command
    meshserve gateway|tokenizer|scheduler|worker|kvstore|encoder ... one service (its flags)
    meshserve run-batch -i IN.jsonl -o OUT.jsonl --model M   offline OpenAI batch file
    meshserve version

Each service subcommand hands the remaining arguments to that service's
`main(argv)`, the same entry point as `python -m meshserve.services.<role>`.
"""

from __future__ import annotations

import dataclasses
import importlib
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from meshserve.local.media_options import MediaOptions
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.config import option
from meshserve.shared.errors import ConfigError, MeshError

ROLES = ("gateway", "tokenizer", "scheduler", "worker", "kvstore", "encoder")
_USAGE = """usage: meshserve COMMAND [ARGS]

commands:
  up [MODEL]  start Redis, tokenizer, scheduler, kvstore, workers and the gateway
  serve MODEL the same, spelled as `vllm serve MODEL`
  gateway     run the OpenAI-compatible HTTP gateway
  tokenizer   run the tokenizer service
  scheduler   run the global scheduler
  worker      run one model worker
  kvstore     run the KV-cache store
  encoder     run a vision-language model's image encoder
  run-batch   run an OpenAI batch file offline (-i IN -o OUT --model M)
  bench       benchmark the in-process engine (bench latency|throughput ...)
  version     print versions

`meshserve COMMAND --help` lists a command's flags."""
# Short flags of run-batch, as vLLM's run-batch spells them.
_SHORT_FLAGS = {"-i": "--input-file", "-o": "--output-file"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunBatchConfig(MediaOptions, EngineConfig):
    """Run an OpenAI batch input file through an in-process engine."""

    # option() returns a dataclasses.field (the default is None), not a shared mutable value.
    input_file: Path | None = option(None, "OpenAI batch input file (JSONL), also -i")  # noqa: RUF009
    output_file: Path | None = option(None, "batch output file to write (JSONL), also -o")  # noqa: RUF009
    served_model_name: str | None = option(None, "model name the requests must name (unset: "
                                                 "the --model value)")
    progress: bool = option(True, "show a progress bar on stderr")

    def validate(self) -> None:
        super().validate()
        self.require(self.input_file is not None, "is required (-i FILE)", "input_file")
        self.require(self.output_file is not None, "is required (-o FILE)", "output_file")


def _expand_short_flags(argv: Sequence[str]) -> list[str]:
    return [_SHORT_FLAGS.get(arg, arg) for arg in argv]


def run_batch_main(argv: Sequence[str]) -> int:
    """`meshserve run-batch`: 0 when every line was processed (failed lines included)."""
    try:
        config = RunBatchConfig.from_args(_expand_short_flags(argv), strict_env=False,
                                          prog="meshserve run-batch")
    except ConfigError as exc:
        print(f"meshserve run-batch: {exc.message}", file=sys.stderr)
        return 2
    # Heavy imports only for the command that needs them.
    import torch

    from meshserve.offline.llm import OfflineLLM
    from meshserve.offline.run_batch import run_batch
    from meshserve.services.tokenizer.loader import load_tokenizer
    from meshserve.services.worker.builder import build_engine
    from meshserve.services.worker.heap import settled_heap
    from meshserve.services.worker.lora.hook import LoraHook

    assert config.input_file is not None and config.output_file is not None
    try:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        engine = build_engine(config)
        with settled_heap(engine):
            llm = OfflineLLM(engine, load_tokenizer(engine.source))
            lora = engine.hook(LoraHook)
            adapters = {m.name: m.lora_id for m in (lora.manager.served() if lora else [])}
            summary = run_batch(config.input_file, config.output_file, llm,
                                config.served_model_name or engine.source.name,
                                show_progress=config.progress, adapters=adapters,
                                images=_batch_images(config, engine, llm))
    except MeshError as exc:
        print(f"meshserve run-batch: {exc.message}", file=sys.stderr)
        return 1
    print(f"run-batch: {summary.succeeded}/{summary.total} requests succeeded, "
          f"{summary.failed} failed; {summary.prompt_tokens} prompt tokens "
          f"({summary.cached_tokens} cached), {summary.completion_tokens} completion tokens "
          f"in {summary.elapsed_s:.1f}s; output in {config.output_file}", file=sys.stderr)
    return 0


def _batch_images(config: RunBatchConfig, engine: Any, llm: Any) -> Any:
    """A vision-language model's image handling for run-batch (None for a text model)."""
    from meshserve.offline.images import batch_images
    from meshserve.services.tokenizer.images import load_image_placeholders
    from meshserve.services.tokenizer.loader import hf_folder

    folder = hf_folder(engine.source)
    placeholders = (load_image_placeholders(folder, llm.tokenizer.hf)
                    if folder is not None else None)
    return batch_images(llm.tokenizer, placeholders, engine.max_model_len,
                        config.media_settings())


def version_main(argv: Sequence[str]) -> int:
    """`meshserve version`: meshserve's version and those of the libraries it runs on."""
    names = ("meshserve", "torch", "transformers", "grpcio", "protobuf", "redis", "triton")
    for name in names:
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            found = "not installed"
        print(f"{name} {found}")
    print(f"python {platform.python_version()}")
    return 0


def _service_main(role: str) -> Callable[[Sequence[str]], int]:
    """The `main(argv)` of a service, imported only when it is run."""
    module = importlib.import_module(f"meshserve.services.{role}.__main__")
    entry: Callable[[Sequence[str]], int] = module.main
    return entry


def _launcher_main(argv: Sequence[str], prog: str = "meshserve up") -> int:
    from meshserve.cli.up import main as launcher_main

    return launcher_main(list(argv), prog)


def _bench_main(argv: Sequence[str]) -> int:
    from meshserve.bench.engine import main as bench_main

    return bench_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `meshserve` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ROLES:
        return _service_main(command)(rest)
    commands: dict[str, Callable[[Sequence[str]], int]] = {
        "up": _launcher_main, "serve": lambda rest: _launcher_main(rest, "meshserve serve"),
        "run-batch": run_batch_main, "bench": _bench_main,
        "version": version_main, "--version": version_main}
    handler = commands.get(command)
    if handler is None:
        print(f"meshserve: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
        return 2
    return handler(rest)


if __name__ == "__main__":
    sys.exit(main())

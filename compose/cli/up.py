"""`meshserve up [MODEL]` and `meshserve serve MODEL`: start the local stack and run it
until Ctrl-C or SIGTERM (the stack itself: compose/local/launcher.py)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator, Sequence

from meshserve.cli.vllm_options import translate
from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.shared.errors import ConfigError, MeshError


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While starting, SIGTERM unwinds like Ctrl-C so that started children are stopped."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def positional_model(argv: Sequence[str]) -> list[str]:
    """`MODEL --flags...` (as `vllm serve MODEL` takes it) as `--model MODEL --flags...`;
    ConfigError when the model is given both ways."""
    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        return argv
    model, rest = argv[0], argv[1:]
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise ConfigError(f"the model is given twice: {model!r} and --model", param="model")
    return ["--model", model, *rest]


def main(argv: list[str] | None = None, prog: str = "meshserve up") -> int:
    """`meshserve up [MODEL]` (also `meshserve serve MODEL`): start the stack, print the
    gateway URL, run until Ctrl-C/SIGTERM."""
    try:
        args = translate(positional_model(sys.argv[1:] if argv is None else argv))
        config = LauncherConfig.from_args(args, strict_env=False, prog=prog)
    except ConfigError as exc:
        print(f"{prog}: {exc.message}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    try:
        with _sigterm_as_exit():
            stack = start_stack(config, say=say)
    except MeshError as exc:
        say(f"failed: {exc.message}")
        return 1
    except KeyboardInterrupt:
        say("interrupted while starting; stopped")
        return 130
    with stack:
        model = ", ".join(stack.model_names())
        print(f"meshserve is up: {stack.base_url} (model {model}, {config.num_workers} "
              f"worker(s), {config.num_gateways} gateway(s)); logs in {stack.run_dir}; "
              f"launcher metrics {stack.launcher_metrics_url}; Ctrl-C stops", flush=True)
        for name, url in stack.metrics_urls.items():
            print(f"metrics {name}: {url}", flush=True)
        print(f"metrics all (merged): {stack.gateway_url}/metrics/all", flush=True)
        code = stack.wait()
        say("stopping" if code == 0 else "stopping everything")
    return code

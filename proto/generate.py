"""Generate the Python code of the meshserve.v1 gRPC contract, or check that it is current.

    python -m meshserve.proto.generate          # rewrite proto/v1/*_pb2*.py[i]
    python -m meshserve.proto.generate --check  # exit 1, listing files, if they are stale

The .proto sources live in proto/meshserve/v1/ (the directory mirrors the proto
package `meshserve.v1`). protoc sees them under the virtual path
`meshserve/proto/v1/`, the path of the Python package that holds the generated
modules, so the generated code imports `from meshserve.proto.v1 import common_pb2`
as it is: nothing is rewritten after generation.

Generated files embed the generator's version (the `GRPC_GENERATED_VERSION` guard
and the protobuf gencode check), so generation requires exactly the pinned
grpcio-tools; its guard (1.84.0) lets the code import on grpcio >= 1.84.0 and
protobuf >= 7.35.1.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata, resources
from pathlib import Path

from grpc_tools import protoc

from meshserve.shared.errors import InternalError

# The generator version the committed files were made with (see the module docstring).
PINNED_GRPC_TOOLS = "1.84.0"
# Where protoc sees the sources; equal to the generated modules' package path.
VIRTUAL_DIR = "meshserve/proto/v1"
PROTO_ROOT = Path(__file__).resolve().parent
SOURCE_DIR = PROTO_ROOT / "meshserve" / "v1"
OUTPUT_DIR = PROTO_ROOT / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def check_generator_version() -> None:
    """Fail unless the installed grpcio-tools is the pinned one."""
    found = metadata.version("grpcio-tools")
    if found != PINNED_GRPC_TOOLS:
        raise InternalError(
            f"grpcio-tools=={PINNED_GRPC_TOOLS} is required to generate the proto code "
            f"(found {found}); install it with `pip install grpcio-tools=={PINNED_GRPC_TOOLS}`",
            param="grpcio-tools",
        )


def generated_files(directory: Path) -> dict[str, Path]:
    """The generated modules in `directory`, by file name."""
    if not directory.is_dir():
        return {}
    return {p.name: p for p in sorted(directory.iterdir())
            if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)}


def run_protoc(source_dir: Path, out_root: Path) -> dict[str, Path]:
    """Generate messages, .pyi and stubs for every .proto in `source_dir` under `out_root`.

    Returns the generated files by name (they land in `out_root/meshserve/proto/v1`).
    """
    protos = sorted(source_dir.glob("*.proto"))
    if not protos:
        raise InternalError(f"no .proto files in {source_dir}", param="source_dir")
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={source_dir}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"{VIRTUAL_DIR}/{p.name}" for p in protos),
    ]
    code = protoc.main(args)
    if code != 0:
        raise InternalError(f"protoc failed with exit code {code} on {source_dir}",
                            param="source_dir")
    return generated_files(out_root / VIRTUAL_DIR)


def stale_files(fresh: dict[str, Path], committed: dict[str, Path]) -> list[str]:
    """Names that differ between freshly generated and committed files, with the reason."""
    problems = [f"{name}: missing" for name in fresh if name not in committed]
    problems += [f"{name}: not generated from any .proto" for name in committed
                 if name not in fresh]
    problems += [f"{name}: differs" for name in fresh
                 if name in committed and not filecmp.cmp(fresh[name], committed[name],
                                                          shallow=False)]
    return sorted(problems)


def write_files(fresh: dict[str, Path], output_dir: Path) -> list[str]:
    """Replace the generated files in `output_dir` with `fresh`; returns names written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, path in generated_files(output_dir).items():
        if name not in fresh:
            path.unlink()
    for name, path in fresh.items():
        (output_dir / name).write_bytes(path.read_bytes())
    return sorted(fresh)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m meshserve.proto.generate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 listing the files that are stale")
    parser.add_argument("--source-dir", type=Path, default=SOURCE_DIR,
                        help="directory of the .proto files (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR,
                        help="directory of the generated modules (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Generate (or with --check, verify) the code; returns the process exit code."""
    args = parse_args(argv)
    try:
        check_generator_version()
        with tempfile.TemporaryDirectory(prefix="meshserve-proto-") as tmp:
            fresh = run_protoc(args.source_dir.resolve(), Path(tmp))
            if args.check:
                problems = stale_files(fresh, generated_files(args.output_dir))
                for line in problems:
                    print(f"stale: {args.output_dir / line}", file=sys.stderr)
                if problems:
                    print("run `python -m meshserve.proto.generate` and commit the result",
                          file=sys.stderr)
                return 1 if problems else 0
            for name in write_files(fresh, args.output_dir):
                print(f"wrote {args.output_dir / name}")
    except InternalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

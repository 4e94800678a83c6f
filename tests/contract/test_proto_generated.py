"""The meshserve.v1 contract: generated code is current, importable, and the protos keep
the conventions (doc comments everywhere, *_UNSPECIFIED zero values, streams, bytes hashes)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from meshserve.proto import generate
from meshserve.proto.v1 import common_pb2, kvstore_pb2, scheduler_pb2, tokenizer_pb2, worker_pb2
from meshserve.shared.sampling_params import SamplingParams

PROTO_FILES = ["common", "kvstore", "scheduler", "tokenizer", "worker"]


def _run_generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshserve.proto.generate", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def repo_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the .proto sources and the committed generated code."""
    source, output = tmp_path / "src", tmp_path / "out"
    shutil.copytree(generate.SOURCE_DIR, source)
    shutil.copytree(generate.OUTPUT_DIR, output)
    return source, output


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    """The protos compiled with their comments (source info)."""
    out = tmp_path_factory.mktemp("descriptors") / "set.pb"
    code = protoc.main(["protoc", f"-I{generate.VIRTUAL_DIR}={generate.SOURCE_DIR}",
                        "--include_source_info", f"--descriptor_set_out={out}",
                        *(f"{generate.VIRTUAL_DIR}/{name}.proto" for name in PROTO_FILES)])
    assert code == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_committed_code_is_current() -> None:
    result = _run_generate("--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_when_a_proto_changes(repo_copy: tuple[Path, Path]) -> None:
    source, output = repo_copy
    args = ("--source-dir", str(source), "--output-dir", str(output))
    assert _run_generate("--check", *args).returncode == 0
    proto = source / "worker.proto"
    proto.write_text(proto.read_text().replace(
        "message GetLoadRequest {}",
        "message GetLoadRequest {\n  // Added.\n  bool verbose = 1;\n}"))
    result = _run_generate("--check", *args)
    assert result.returncode == 1
    stale = sorted(re.findall(r"stale: .*/(\w+\.pyi?): differs", result.stderr))
    assert stale == ["worker_pb2.py", "worker_pb2.pyi"]
    assert _run_generate(*args).returncode == 0  # regenerating makes it current again
    assert _run_generate("--check", *args).returncode == 0


def test_check_lists_missing_and_stray_files(repo_copy: tuple[Path, Path]) -> None:
    source, output = repo_copy
    (output / "kvstore_pb2_grpc.py").unlink()
    (output / "retired_pb2.py").write_text("# left over\n")
    result = _run_generate("--check", "--source-dir", str(source), "--output-dir", str(output))
    assert result.returncode == 1
    assert "kvstore_pb2_grpc.py: missing" in result.stderr
    assert "retired_pb2.py: not generated from any .proto" in result.stderr


def test_generated_imports_need_no_rewriting() -> None:
    text = (generate.OUTPUT_DIR / "worker_pb2.py").read_text()
    assert "from meshserve.proto.v1 import common_pb2 as" in text
    stubs = (generate.OUTPUT_DIR / "worker_pb2_grpc.py").read_text()
    assert "from meshserve.proto.v1 import worker_pb2 as" in stubs
    for path in generate.OUTPUT_DIR.glob("*_pb2*.py"):
        assert not re.search(r"^import \w+_pb2", path.read_text(), re.MULTILINE), path


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_version_guards_allow_grpcio_184_and_protobuf_736() -> None:
    for path in sorted(generate.OUTPUT_DIR.glob("*_pb2_grpc.py")):
        match = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", path.read_text())
        assert match, path
        assert _version(match.group(1)) <= (1, 84, 0), path
    for path in sorted(generate.OUTPUT_DIR.glob("*_pb2.py")):
        match = re.search(r"# Protobuf Python Version: ([\d.]+)", path.read_text())
        assert match, path
        assert _version(match.group(1))[:2] <= (7, 36), path


def _comment_paths(fd: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments.strip()
            for loc in fd.source_code_info.location}


def _undocumented(fd: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Messages, fields, enums, values, services and methods without a leading comment."""
    comments = _comment_paths(fd)
    missing = []

    def check(path: tuple[int, ...], what: str) -> None:
        if not comments.get(path):
            missing.append(f"{fd.name}: {what}")

    def walk_enum(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]) -> None:
        check(path, enum.name)
        for i, value in enumerate(enum.value):
            check((*path, 2, i), f"{enum.name}.{value.name}")

    def walk_message(msg: descriptor_pb2.DescriptorProto, path: tuple[int, ...]) -> None:
        check(path, msg.name)
        for i, field in enumerate(msg.field):
            check((*path, 2, i), f"{msg.name}.{field.name}")
        for i, nested in enumerate(msg.nested_type):
            if not nested.options.map_entry:
                walk_message(nested, (*path, 3, i))
        for i, enum in enumerate(msg.enum_type):
            walk_enum(enum, (*path, 4, i))

    for i, msg in enumerate(fd.message_type):
        walk_message(msg, (4, i))
    for i, enum in enumerate(fd.enum_type):
        walk_enum(enum, (5, i))
    for i, service in enumerate(fd.service):
        check((6, i), service.name)
        for j, method in enumerate(service.method):
            check((6, i, 2, j), f"{service.name}.{method.name}")
    return missing


def test_every_element_has_a_doc_comment(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    missing = [line for fd in descriptor_set.file for line in _undocumented(fd)]
    assert missing == []


def test_one_versioned_package_one_file_per_service(
        descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    assert {fd.package for fd in descriptor_set.file} == {"meshserve.v1"}
    services = {fd.name: [s.name for s in fd.service] for fd in descriptor_set.file}
    assert services == {
        "meshserve/proto/v1/common.proto": [],
        "meshserve/proto/v1/kvstore.proto": ["KVStore"],
        "meshserve/proto/v1/scheduler.proto": ["Scheduler"],
        "meshserve/proto/v1/tokenizer.proto": ["Tokenizer"],
        "meshserve/proto/v1/worker.proto": ["Worker"],
    }


def test_enums_start_with_unspecified(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    enums = [e for fd in descriptor_set.file for e in fd.enum_type]
    enums += [e for fd in descriptor_set.file for m in fd.message_type for e in m.enum_type]
    assert {e.name for e in enums} >= {"FinishReason", "KVDType"}
    for enum in enums:
        zero = enum.value[0]
        assert zero.number == 0 and zero.name.endswith("_UNSPECIFIED"), enum.name
        prefix = zero.name.removesuffix("UNSPECIFIED")
        assert all(v.name.startswith(prefix) for v in enum.value), enum.name
    assert common_pb2.FINISH_REASON_UNSPECIFIED == 0


def test_block_hashes_are_bytes(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    hash_fields = [(m.name, f) for fd in descriptor_set.file for m in fd.message_type
                   for f in m.field if "hash" in f.name]
    assert len(hash_fields) >= 5
    for message, field in hash_fields:
        assert field.type == descriptor_pb2.FieldDescriptorProto.TYPE_BYTES, (message, field.name)


def test_streams_where_output_flows() -> None:
    def method(module: object, service: str, name: str) -> object:
        return module.DESCRIPTOR.services_by_name[service].methods_by_name[name]  # type: ignore[attr-defined]

    for module, service, name in ((worker_pb2, "Worker", "Session"),
                                  (tokenizer_pb2, "Tokenizer", "DetokenizeSession"),
                                  (scheduler_pb2, "Scheduler", "RouteSession")):
        session = method(module, service, name)
        assert session.client_streaming and session.server_streaming, name
    put = method(kvstore_pb2, "KVStore", "Put")
    assert put.client_streaming and not put.server_streaming
    get = method(kvstore_pb2, "KVStore", "Get")
    assert not get.client_streaming and get.server_streaming
    # The retired per-request calls are gone; the session streams replace them.
    assert "Generate" not in worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name
    assert "Detokenize" not in (
        tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].methods_by_name)
    assert {"Route", "Release"}.isdisjoint(
        scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].methods_by_name)
    # A stream message carries every new token of every sequence, never one token.
    for message in (worker_pb2.SessionResponse, tokenizer_pb2.DetokenizeSessionRequest):
        fields = message.DESCRIPTOR.fields_by_name
        assert fields["token_ids"].is_repeated and fields["num_tokens"].is_repeated


def test_sampling_params_has_every_domain_field() -> None:
    proto_fields = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    for field in dataclasses.fields(SamplingParams):
        assert field.name in proto_fields or f"{field.name}_json" in proto_fields, field.name


def test_sampling_params_values_survive_the_wire() -> None:
    """Every non-default domain value has a lossless proto encoding."""
    domain = SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, presence_penalty=-1.5,
        frequency_penalty=0.25, repetition_penalty=1.1, logit_bias={5: -100.0, 7: 2.5},
        seed=-(2**63), min_tokens=2, max_tokens=None, stop=("\n\n", "END"),
        stop_token_ids=(2, 3), include_stop_str_in_output=True, ignore_eos=True, logprobs=0,
        prompt_logprobs=20, skip_special_tokens=False, spaces_between_special_tokens=False)
    message = common_pb2.SamplingParams(
        n=domain.n, temperature=domain.temperature, top_p=domain.top_p, top_k=domain.top_k,
        min_p=domain.min_p, presence_penalty=domain.presence_penalty,
        frequency_penalty=domain.frequency_penalty,
        repetition_penalty=domain.repetition_penalty, logit_bias=domain.logit_bias,
        seed=domain.seed, min_tokens=domain.min_tokens, stop=domain.stop,
        stop_token_ids=domain.stop_token_ids,
        include_stop_str_in_output=domain.include_stop_str_in_output,
        ignore_eos=domain.ignore_eos, logprobs=domain.logprobs,
        prompt_logprobs=domain.prompt_logprobs, skip_special_tokens=domain.skip_special_tokens,
        spaces_between_special_tokens=domain.spaces_between_special_tokens)
    back = common_pb2.SamplingParams.FromString(message.SerializeToString())
    optional = ("n", "temperature", "top_p", "repetition_penalty", "seed", "max_tokens",
                "logprobs", "prompt_logprobs", "skip_special_tokens",
                "spaces_between_special_tokens")
    values = {name: getattr(back, name) if back.HasField(name) else None for name in optional}
    rebuilt = SamplingParams(
        **values, top_k=back.top_k, min_p=back.min_p, presence_penalty=back.presence_penalty,
        frequency_penalty=back.frequency_penalty, logit_bias=dict(back.logit_bias),
        min_tokens=back.min_tokens, stop=tuple(back.stop),
        stop_token_ids=tuple(back.stop_token_ids),
        include_stop_str_in_output=back.include_stop_str_in_output, ignore_eos=back.ignore_eos)
    assert rebuilt == domain
    # An unset optional field is distinguishable from an explicit zero.
    assert not common_pb2.SamplingParams().HasField("temperature")
    assert common_pb2.SamplingParams(temperature=0.0).HasField("temperature")

"""Pure logic of embeddings: the request body, the response body, pooler config, runners."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import pytest

from meshserve.services.scheduler.router import RouteQuery, _runners_of
from meshserve.services.worker.models.pooling_config import (
    PoolerConfig,
    parse_override,
    resolve_pooler_config,
)
from meshserve.services.worker.runner_config import RunnerOptions
from meshserve.shared.errors import ConfigError, InvalidRequestError
from meshserve.shared.openai_embeddings import embedding_response, parse_embedding_request
from meshserve.shared.worker_registry import WorkerInfo, WorkerLoad, WorkerRecord


def test_inputs_take_every_openai_shape() -> None:
    assert parse_embedding_request({"input": "hi"}).inputs == ("hi",)
    assert parse_embedding_request({"input": ["a", "b"]}).inputs == ("a", "b")
    assert parse_embedding_request({"input": [1, 2]}).inputs == ((1, 2),)
    assert parse_embedding_request({"input": [[1], [2, 3]]}).inputs == ((1,), (2, 3))
    for bad in ("", [], [""], [[]], [1, "a"], [[1], []], 5, [-1]):
        with pytest.raises(InvalidRequestError) as refused:
            parse_embedding_request({"input": bad})
        assert refused.value.param == "input"


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
])
def test_bad_bodies_name_their_parameter(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_embedding_request(body)
    assert refused.value.param == param


def test_options_are_read() -> None:
    parsed = parse_embedding_request({
        "input": "x", "model": "m", "encoding_format": "base64", "dimensions": 8,
        "truncate_prompt_tokens": -1, "add_special_tokens": False, "normalize": False,
        "user": "u", "embed_dtype": "float32"})
    assert (parsed.model, parsed.encoding_format, parsed.dimensions) == ("m", "base64", 8)
    assert (parsed.truncate_prompt_tokens, parsed.add_special_tokens, parsed.normalize) == (
        -1, False, False)


def test_the_response_is_openais_shape_in_both_encodings() -> None:
    rows = [[1.5, -2.0, 0.25], [0.0, 1.0, -0.125]]
    data = b"".join(struct.pack("<3f", *row) for row in rows)
    body = embedding_response("m", data, 3, 7, "float")
    assert body == {"object": "list", "model": "m",
                    "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": rows[0]},
                             {"object": "embedding", "index": 1, "embedding": rows[1]}]}
    encoded = embedding_response("m", data, 3, 7, "base64")["data"]
    assert [struct.unpack("<3f", base64.b64decode(d["embedding"])) for d in encoded] == [
        tuple(r) for r in rows]


def test_pooler_override_refuses_what_it_does_not_know() -> None:
    assert parse_override('{"pooling_type": "mean", "normalize": false}') == {
        "pooling_type": "MEAN", "normalize": False}
    for bad in ("[1]", "{", '{"pooling_type": "MAX"}', '{"softmax": true}',
                '{"normalize": 1}', '{"dimensions": 0}'):
        with pytest.raises(ConfigError):
            parse_override(bad)


def test_dimensions_follow_the_models_matryoshka_config(tmp_path: Path) -> None:
    plain = resolve_pooler_config({}, 64, None, None)
    assert (plain.pooling_type, plain.normalize, plain.source) == ("LAST", True, "default")
    assert plain.resolve_dimensions(None, "m") == 64
    with pytest.raises(InvalidRequestError, match="does not support matryoshka") as refused:
        plain.resolve_dimensions(32, "m")
    assert refused.value.param == "dimensions"
    listed = resolve_pooler_config({"matryoshka_dimensions": [16, 32]}, 64, None, None)
    assert listed.resolve_dimensions(32, "m") == 32
    with pytest.raises(InvalidRequestError, match=r"only supports \[16, 32\]"):
        listed.resolve_dimensions(48, "m")
    free = PoolerConfig(hidden_size=64, is_matryoshka=True)
    assert free.resolve_dimensions(48, "m") == 48
    with pytest.raises(InvalidRequestError, match="larger than"):
        free.resolve_dimensions(65, "m")
    default = resolve_pooler_config({"is_matryoshka": True}, 64, None, '{"dimensions": 8}')
    assert default.resolve_dimensions(None, "m") == 8
    with pytest.raises(ConfigError):  # a default the model does not allow
        resolve_pooler_config({}, 64, None, '{"dimensions": 8}')


def test_runner_flags_follow_vllms_spelling() -> None:
    assert not RunnerOptions().pooling
    assert RunnerOptions(runner="pooling").runner_flags() == ["--runner", "pooling"]
    assert RunnerOptions(convert="embed").pooling
    for bad in ({"runner": "generate", "convert": "embed"},
                {"runner": "pooling", "convert": "none"},
                {"pooler_config": '{"pooling_type": "MEAN"}'}):
        with pytest.raises(ConfigError):
            RunnerOptions(**bad)  # type: ignore[arg-type]


def _record(worker_id: str, runner: str) -> WorkerRecord:
    return WorkerRecord(WorkerInfo(worker_id, "127.0.0.1:1", ("m",), runner=runner),
                        WorkerLoad(), epoch=1, last_heartbeat_unix_ns=0)


def test_requests_go_only_to_workers_of_their_runner() -> None:
    mixed = [_record("g", "generate"), _record("p", "pooling")]
    embed = RouteQuery("r", "m", num_prompt_tokens=3, runner="pooling")
    generate = RouteQuery("r", "m", num_prompt_tokens=3)
    assert [r.worker_id for r in _runners_of(embed, mixed)] == ["p"]
    assert [r.worker_id for r in _runners_of(generate, mixed)] == ["g"]
    with pytest.raises(InvalidRequestError, match="is an embedding model"):
        _runners_of(generate, mixed[1:])
    with pytest.raises(InvalidRequestError, match="is a generation model"):
        _runners_of(embed, mixed[:1])
    assert _runners_of(embed, []) == []  # nobody serves it: the router's own 503

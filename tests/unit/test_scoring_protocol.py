"""The /score, /rerank and /pooling bodies at the gateway's edge: parsing, pairing, cosine
scores, vLLM's token count and the answers' shapes (pure, torch-free logic)."""

from __future__ import annotations

import base64
import math
import struct

import pytest

from meshserve.services.gateway.api import scoring_protocol as protocol
from meshserve.shared.errors import InvalidRequestError


def test_each_pair_of_side_names_vllm_accepts() -> None:
    for left, right in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                        ("data_1", "data_2")):
        parsed = protocol.parse_score_request({left: "a", right: ["b", "c"], "priority": 2})
        assert (parsed.left, parsed.right, parsed.priority) == (("a",), ("b", "c"), 2)
    both = protocol.parse_score_request({"queries": "q", "documents": "d", "text_1": "t1",
                                         "text_2": "t2"})
    assert (both.left, both.right) == (("q",), ("d",))  # vLLM's first request type wins
    with pytest.raises(InvalidRequestError) as missing:
        protocol.parse_score_request({"text_1": "a", "documents": "b"})
    assert missing.value.param == "text_1"


def test_pairings_are_one_to_one_one_to_many_or_many_to_many() -> None:
    assert len(protocol.parse_score_request({"text_1": ["a", "b"], "text_2": ["c", "d"]})
               .right) == 2
    with pytest.raises(InvalidRequestError, match="1:1, 1:N or N:N"):
        protocol.parse_score_request({"text_1": ["a", "b"], "text_2": "c"})
    with pytest.raises(InvalidRequestError, match="At least one text element"):
        protocol.parse_score_request({"text_1": [], "text_2": "c"})


def test_cosine_scores_pair_one_left_vector_with_every_right_one() -> None:
    rows = [[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [1.0, 1.0]]
    scores = protocol.pair_scores(rows, num_left=1)
    assert scores == pytest.approx([1.0, 0.0, 2 ** -0.5], abs=1e-12)
    assert protocol.pair_scores(rows, num_left=2) == pytest.approx([0.0, 2 ** -0.5])
    assert protocol.cosine_similarity([0.0, 0.0], [1.0, 0.0]) == 0.0  # eps, not NaN


def test_tokens_count_both_inputs_of_every_pair_and_the_separator() -> None:
    assert protocol.pair_tokens([3, 5, 7], num_left=1, separator=1) == (3 + 1 + 5) + (3 + 1 + 7)
    assert protocol.pair_tokens([3, 4, 5, 7], num_left=2, separator=0) == 3 + 5 + 4 + 7


def test_rerank_sorts_best_first_keeps_ties_in_order_and_cuts_to_top_n() -> None:
    request = protocol.parse_rerank_request({"query": "q", "documents": ["a", "b", "c", "d"],
                                             "top_n": 3})
    body = protocol.rerank_response("m", request, [0.5, 0.9, 0.5, 0.1], prompt_tokens=12)
    assert [r["index"] for r in body["results"]] == [1, 0, 2]
    assert body["results"][0]["document"] == {"text": "b", "multi_modal": None}
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    everything = protocol.parse_rerank_request({"query": "q", "documents": ["a", "b"]})
    assert len(protocol.rerank_response("m", everything, [0.1, 0.2], 4)["results"]) == 2


def test_pooling_reads_input_as_embeddings_do_and_answers_vectors() -> None:
    parsed = protocol.parse_pooling_request({"input": [[1, 2], [3]], "use_activation": False,
                                             "encoding_format": "base64", "task": "embed"})
    assert parsed.inputs.inputs == ((1, 2), (3,)) and parsed.use_activation is False
    assert parsed.inputs.encoding_format == "base64"
    assert protocol.check_task(parsed.task, ("embed",)) == "embed"
    assert protocol.check_task(None, ("classify",)) == "classify"
    with pytest.raises(InvalidRequestError, match="Unsupported task: 'embed'"):
        protocol.check_task("embed", ("classify",))
    vectors = struct.pack("<4f", 1.0, 2.0, 3.0, 4.5)
    rows = protocol.float_rows(vectors, 2)
    floats = protocol.pooling_response("m", rows, 3, "float")
    assert [d["data"] for d in floats["data"]] == [[1.0, 2.0], [3.0, 4.5]]
    assert floats["usage"]["prompt_tokens"] == 3 and floats["id"].startswith("pool-")
    packed = protocol.pooling_response("m", rows, 3, "base64")
    assert base64.b64decode(packed["data"][1]["data"]) == vectors[8:]


def test_classification_activates_and_labels_the_best_class() -> None:
    body = protocol.classify_response("m", ("neg", "pos", "mid"), [[0.0, 2.0, 1.0]], 5, True)
    (item,) = body["data"]
    exps = [1.0, math.exp(2.0), math.exp(1.0)]
    assert item["probs"] == pytest.approx([e / sum(exps) for e in exps], abs=1e-12)
    assert (item["label"], item["num_classes"]) == ("pos", 3)
    raw = protocol.classify_response("m", ("neg", "pos", "mid"), [[0.0, 2.0, 1.0]], 5, False)
    assert raw["data"][0]["probs"] == [0.0, 2.0, 1.0]
    assert protocol.activate([0.0]) == [0.5]
    assert protocol.cross_encoder_scores([[2.0], [-1.0]], None) == pytest.approx(
        [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.0))])
    assert protocol.cross_encoder_scores([[2.0]], False) == [2.0]


def test_cross_encoder_inputs_put_each_pairs_token_ids_end_to_end() -> None:
    assert protocol.pair_inputs([[1, 2], [3], [4, 5]], num_left=1) == [(1, 2, 3), (1, 2, 4, 5)]
    assert protocol.pair_inputs([[1], [2], [3], [4]], num_left=2) == [(1, 3), (2, 4)]

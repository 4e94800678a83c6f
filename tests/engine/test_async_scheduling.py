"""The overlapped engine loop on the CPU path: order of work, tokens, waste and bookkeeping.

Outputs against transformers with the loop on are in test_engine_vs_hf.py and
test_engine_behaviour.py (their "on" cases); this file checks what is particular to it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from engine_outputs import drain, tokens
from tiny_models import build_tiny_model

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.sequence import PENDING_TOKEN, SequenceOutput
from meshserve.shared.errors import ConfigError
from meshserve.shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)


def make_engine(folder: Path, async_scheduling: str, **overrides: object) -> LLMEngine:
    cfg = {"model": str(folder), "dtype": "float32", "device": "cpu", "num_kv_blocks": 256,
           "max_model_len": 256, "async_scheduling": async_scheduling}
    cfg.update(overrides)
    return build_engine(EngineConfig(**cfg))  # type: ignore[arg-type]


class Recorder:
    """Records the order of launches and result reads of the engine's steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.events: list[tuple[str, int]] = []
        self.launched = 0
        runner_launch = engine.runner.launch

        def launch(out, previous=None):  # type: ignore[no-untyped-def]
            step = runner_launch(out, previous)
            number = self.launched
            self.launched += 1
            self.events.append(("launch", number))
            read = step.result

            def result():  # type: ignore[no-untyped-def]
                self.events.append(("read", number))
                return read()

            step.result = result  # type: ignore[method-assign]
            return step

        engine.runner.launch = launch  # type: ignore[method-assign]


def test_the_next_step_is_launched_before_the_last_one_is_read(folder: Path) -> None:
    engine = make_engine(folder, "on")
    recorder = Recorder(engine)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=5,
                                                         ignore_eos=True))
    first = engine.step()
    assert first == []  # the prefill's token is read by the next step, after it launches
    assert engine.has_unfinished_requests()
    drain(engine)
    # Step k is read only after step k + 1 has been queued; the last one is read alone.
    assert recorder.events == [("launch", 0), ("launch", 1), ("read", 0), ("launch", 2),
                               ("read", 1), ("launch", 3), ("read", 2), ("launch", 4),
                               ("read", 3), ("read", 4)]


def test_synchronous_loop_reads_each_step_before_the_next(folder: Path) -> None:
    engine = make_engine(folder, "off")
    recorder = Recorder(engine)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3,
                                                         ignore_eos=True))
    assert len(engine.step()) == 1
    drain(engine)
    assert recorder.events == [("launch", 0), ("read", 0), ("launch", 1), ("read", 1),
                               ("launch", 2), ("read", 2)]


def test_length_limits_waste_no_step_and_stops_waste_at_most_one(folder: Path) -> None:
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(folder, mode)
        recorder = Recorder(engine)
        engine.add_request("free", [9, 10, 11, 12], SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True))
        free = tokens(drain(engine)[("free", 0)])
        assert len(free) == 12
        length_launches = recorder.launched
        stop_at = free[4]
        engine.add_request("stop", [9, 10, 11, 12], SamplingParams(
            temperature=0.0, max_tokens=12, stop_token_ids=(stop_at,)))
        stopped = drain(engine)[("stop", 0)]
        results[mode] = (free, tokens(stopped), stopped[-1].finish_reason,
                         stopped[-1].num_output_tokens, length_launches,
                         recorder.launched - length_launches)
    off, on = results["off"], results["on"]
    assert on[:4] == off[:4]  # same tokens, finish reason and count
    assert off[2] == "stop" and off[3] == off[1].index(off[1][-1]) + 1
    assert on[4] == off[4] == 12  # a length limit is known before launching: no extra step
    assert on[5] - off[5] == 1  # a stop token is seen one step late: one discarded step


def test_pending_tokens_are_placeholders_until_read_and_never_hashed(folder: Path) -> None:
    engine = make_engine(folder, "on", block_size=8)
    # 7 prompt tokens: the first sampled token completes block 0 while still pending.
    engine.add_request("a", list(range(20, 27)), SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.step()
    seq = engine.sequences("a")[0]
    assert seq.output_token_ids == [PENDING_TOKEN] and seq.num_pending == 1
    assert seq.block_hashes == []  # block 0 holds a pending token: not hashed yet
    engine.step()  # launches the decode, then reads the prefill's token
    assert seq.num_pending == 1 and seq.output_token_ids[0] != PENDING_TOKEN
    assert len(seq.block_hashes) == 1  # block 0's ids are all known now
    out = drain(engine)
    assert len(tokens(out[("a", 0)])) == 5  # the first token was returned by the 2nd step
    # The finished sequence's first block is in the prefix cache under its real ids.
    again = make_engine(folder, "off", block_size=8)
    again.add_request("a", list(range(20, 27)), SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True))
    reference = drain(again)[("a", 0)]
    assert tokens(reference) == [seq.output_token_ids[0]] + tokens(out[("a", 0)])
    engine.add_request("b", list(range(20, 27)) + seq.output_token_ids[:3], SamplingParams(
        temperature=0.0, max_tokens=1))
    assert drain(engine)[("b", 0)][-1].num_cached_tokens == 8


def test_abort_while_a_step_is_on_the_device_frees_everything(folder: Path) -> None:
    engine = make_engine(folder, "on")
    baseline = engine.kv.num_free_blocks
    rng = random.Random(4)
    for i in range(4):
        engine.add_request(f"r{i}", [rng.randrange(3, 200) for _ in range(30)], SamplingParams(
            temperature=0.8, max_tokens=30, ignore_eos=True, n=2 if i == 0 else 1))
    outs: list[SequenceOutput] = []
    for _ in range(4):
        outs.extend(engine.step())
    aborted = engine.sequences("r0") + engine.sequences("r2")
    assert all(s.num_pending == 1 for s in aborted)  # each has a token on the device
    engine.abort_request("r0")
    engine.abort_request("r2")
    assert all(s.num_pending == 0 and PENDING_TOKEN not in s.output_token_ids for s in aborted)
    outs.extend(o for os in drain(engine).values() for o in os)
    finals = {(o.request_id, o.index): o for o in outs if o.finished}
    assert {k: o.finish_reason for k, o in finals.items()} == {
        ("r0", 0): "abort", ("r0", 1): "abort", ("r1", 0): "length", ("r2", 0): "abort",
        ("r3", 0): "length"}
    counts = {k: sum(len(o.new_token_ids) for o in outs if (o.request_id, o.index) == k)
              for k in finals}
    assert counts[("r1", 0)] == counts[("r3", 0)] == 30
    assert all(counts[k] == finals[k].num_output_tokens for k in finals)
    assert engine.kv.num_free_blocks == baseline
    assert not engine.has_unfinished_requests()


def test_penalised_sequences_wait_for_their_history(folder: Path) -> None:
    """Penalties need every output id on the host: such steps read the one before first,
    and the tokens equal the synchronous loop's."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            repetition_penalty=1.5, frequency_penalty=0.5)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = {}
    for mode in ("off", "on"):
        engine = make_engine(folder, mode)
        engine.add_request("pen", [7, 7, 8, 9], params)
        engine.add_request("plain", [7, 7, 8, 9], plain)
        out = drain(engine)
        got[mode] = (tokens(out[("pen", 0)]), tokens(out[("plain", 0)]))
    assert got["on"] == got["off"]
    assert got["on"][0] != got["on"][1]  # the penalties changed the output


def test_async_scheduling_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="sometimes")


def test_auto_is_off_on_the_cpu(folder: Path) -> None:
    assert make_engine(folder, "auto").async_scheduling is False

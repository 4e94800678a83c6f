"""A request's text state rebuilt on a new session (RequestText.resume), and the
vocabulary check of /detokenize.

The reference is the same request detokenized without a cut: for every position of the
cut, the text sent before it plus the text after it must equal the uncut text, with the
same stop string and token counts, whether the cut falls inside a multi-byte character
or inside a stop string.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from test_detokenizer import SAMPLE, build_byte_level_tokenizer

from meshserve.services.tokenizer.loader import Tokenizer, load_tokenizer
from meshserve.services.tokenizer.request_text import RequestText, SequenceUpdate
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(build_byte_level_tokenizer(tmp_path_factory.mktemp("bpe"))))


@pytest.fixture(scope="module")
def ids(tok: Tokenizer) -> list[int]:
    return tok.encode(SAMPLE, add_special_tokens=False)


def steps(text: RequestText, ids: Sequence[int], *, last: bool) -> list[SequenceUpdate]:
    """Feed `ids` one token a step (the final flag on the last one when `last`)."""
    return [text.update(0, [t], last and i == len(ids) - 1) for i, t in enumerate(ids)]


def joined(updates: list[SequenceUpdate]) -> str:
    return "".join(u.text for u in updates)


def cut_and_resume(tok: Tokenizer, params: SamplingParams, ids: list[int], cut: int
                   ) -> tuple[str, SequenceUpdate]:
    """The text of a request whose session broke after `cut` tokens, and its last update."""
    before = steps(RequestText(tok, params, 1, prompt_tails=[]), ids[:cut], last=False)
    sent = joined(before)
    if before and before[-1].stopped:
        return sent, before[-1]
    resumed = RequestText(tok, params, 1, prompt_tails=[])
    resumed.resume(0, ids[:cut], sent)
    after = steps(resumed, ids[cut:], last=True)
    assert resumed.done
    return sent + joined(after), after[-1]


def test_sample_splits_characters_across_tokens(tok: Tokenizer, ids: list[int]) -> None:
    # The cuts below fall inside characters only if some token holds part of one.
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert partial, "the sample must split some character over several tokens"


def test_every_cut_gives_the_uncut_text(tok: Tokenizer, ids: list[int]) -> None:
    params = SamplingParams(max_tokens=None)
    whole = steps(RequestText(tok, params, 1, prompt_tails=[]), ids, last=True)
    assert joined(whole) == tok.decode(ids)
    for cut in range(len(ids)):  # the last token comes after the cut
        text, last = cut_and_resume(tok, params, ids, cut)
        assert text == joined(whole), cut
        assert last.num_output_tokens == len(ids), cut


@pytest.mark.parametrize("stop", ["café", "世界!", "😀🎉", "fox.<|im_end|>東"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_across_the_cut(tok: Tokenizer, ids: list[int], stop: str,
                                           include: bool) -> None:
    params = SamplingParams(max_tokens=None, stop=[stop], include_stop_str_in_output=include,
                            skip_special_tokens=False)
    whole = steps(RequestText(tok, params, 1, prompt_tails=[]), ids, last=True)
    ended = next(u for u in whole if u.finished)
    assert ended.stopped and ended.stop_string == stop
    expected = joined(whole)
    assert expected.endswith(stop) == include
    for cut in range(len(ids)):  # the last token comes after the cut
        text, last = cut_and_resume(tok, params, ids, cut)
        assert text == expected, cut
        assert (last.stopped, last.stop_string, last.num_output_tokens) == (
            True, stop, ended.num_output_tokens), cut


@pytest.mark.parametrize("stop", [[], ["\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd!"]])
def test_a_chunked_run_resumes_answer_for_answer(tok: Tokenizer, stop: list[str]) -> None:
    # Ids mostly of stray bytes: the detokenizer holds them, then gives up past
    # its limit and emits U+FFFD, at points that depend on how the ids were grouped into
    # entries. Replayed in the old session's entries, every later answer is the uncut one.
    rng = random.Random(3)
    partial = [t for t in range(tok.vocab_size) if tok.decode([t]) == "\ufffd"]
    ids = [rng.choice(partial) if rng.random() < 0.8 else rng.randrange(tok.vocab_size)
           for _ in range(300)]
    sizes = [rng.randint(1, 12) for _ in range(60)]
    chunks, start = [], 0
    for size in sizes:
        if start < len(ids):
            chunks.append(ids[start:start + size])
            start += size
    params = SamplingParams(max_tokens=None, stop=stop)  # a stop string: fed a token at a time
    def run(text: RequestText, part: list[list[int]], last: bool) -> list[SequenceUpdate]:
        return [text.update(0, c, last and i == len(part) - 1) for i, c in enumerate(part)]
    whole = run(RequestText(tok, params, 1, prompt_tails=[]), chunks, True)
    assert "\ufffd" in joined(whole)
    for cut in range(1, len(chunks)):
        sent = joined(run(RequestText(tok, params, 1, prompt_tails=[]), chunks[:cut], False))
        resumed = RequestText(tok, params, 1, prompt_tails=[])
        resumed.resume(0, [t for c in chunks[:cut] for t in c], sent,
                       entry_sizes=[len(c) for c in chunks[:cut]])
        after = run(resumed, chunks[cut:], True)
        assert [u.text for u in after] == [u.text for u in whole[cut:]], cut
        assert after[-1].num_output_tokens == len(ids)


def test_bytes_given_up_on_at_the_cut_stay_given_up(tok: Tokenizer) -> None:
    # One entry of 20 stray bytes, the last three the start of an emoji: held past the
    # limit, the old session gave up on all of them at once (U+FFFD); the emoji's last
    # byte after the cut must not bring the emoji back, as it did not in the uncut run.
    by_bytes = {tok.token_bytes(t): t for t in range(tok.vocab_size)}
    emoji = [by_bytes[bytes([b])] for b in "😀".encode()]
    first, rest = [by_bytes[b"\x80"]] * 17 + emoji[:3], emoji[3:]
    params = SamplingParams(max_tokens=None)
    old = RequestText(tok, params, 1, prompt_tails=[])
    sent = old.update(0, first, False).text
    assert sent == "\ufffd" * 18
    expected = old.update(0, rest, True)
    resumed = RequestText(tok, params, 1, prompt_tails=[])
    resumed.resume(0, first, sent, entry_sizes=[len(first)])
    after = resumed.update(0, rest, True)
    assert (after.text, after.num_output_tokens) == (expected.text, 21)


def test_text_owed_by_the_old_session_comes_first(tok: Tokenizer, ids: list[int]) -> None:
    # The old session sent less than the replay yields (its steps held more back): the
    # rest of the replayed text opens the next answer.
    params = SamplingParams(max_tokens=None)
    head = ids[:20]
    replayed = joined(steps(RequestText(tok, params, 1, prompt_tails=[]), head, last=False))
    resumed = RequestText(tok, params, 1, prompt_tails=[])
    resumed.resume(0, head, replayed[:-3])
    after = steps(resumed, ids[20:], last=True)
    assert after[0].text.startswith(replayed[-3:])
    assert replayed[:-3] + joined(after) == tok.decode(ids)


def test_text_the_old_session_sent_ahead_is_not_sent_again(tok: Tokenizer,
                                                           ids: list[int]) -> None:
    # The old session sent more than the replay yields (a forced flush of a broken tail,
    # or bigger steps): that many characters of the next answers are left out.
    params = SamplingParams(max_tokens=None)
    head = ids[:20]
    full = tok.decode(ids)
    replayed = joined(steps(RequestText(tok, params, 1, prompt_tails=[]), head, last=False))
    sent = full[:len(replayed) + 4]
    resumed = RequestText(tok, params, 1, prompt_tails=[])
    resumed.resume(0, head, sent)
    assert sent + joined(steps(resumed, ids[20:], last=True)) == full


def test_a_finished_sequence_is_only_marked_ended(tok: Tokenizer, ids: list[int]) -> None:
    text = RequestText(tok, SamplingParams(max_tokens=None, n=2), 2, prompt_tails=[])
    text.resume(1, [], "", finished=True)
    assert not text.done
    assert text.update(0, ids, True).text == tok.decode(ids)
    assert text.done


def test_a_sequence_is_resumed_only_before_its_tokens(tok: Tokenizer, ids: list[int]) -> None:
    text = RequestText(tok, SamplingParams(max_tokens=None), 1, prompt_tails=[])
    text.update(0, ids[:3], False)
    with pytest.raises(InvalidRequestError, match="resumed twice, or after its first"):
        text.resume(0, ids[:3], tok.decode(ids[:3]))
    with pytest.raises(InvalidRequestError, match="sequence index 4 is out of range"):
        text.resume(4, [], "")
    fresh = RequestText(tok, SamplingParams(max_tokens=None), 1, prompt_tails=[])
    with pytest.raises(InvalidRequestError, match="add up to its 3 tokens") as caught:
        fresh.resume(0, ids[:3], tok.decode(ids[:3]), entry_sizes=[1, 1])
    assert caught.value.param == "resumed.entry_sizes"


def test_ids_outside_the_vocabulary_are_refused_when_asked(tok: Tokenizer) -> None:
    size = tok.vocab_size
    checked = RequestText(tok, SamplingParams(max_tokens=None), 1, prompt_tails=[],
                          vocab_size=size)
    with pytest.raises(InvalidRequestError,
                       match=f"^Token id {size + 5} is out of vocabulary$") as caught:
        checked.update(0, [1, size + 5, size], True)
    assert caught.value.param == "tokens"
    assert checked.update(0, [size - 1], True).finished  # the last id is in it
    unchecked = RequestText(tok, SamplingParams(max_tokens=None), 1, prompt_tails=[])
    assert unchecked.update(0, [size + 5], True).text == ""


"""Streaming detokenization (UTF-8 split across tokens) and stop strings split across pieces."""

import random

import pytest

from bubo.engine.detokenizer import IncrementalDetokenizer, StopMatcher

# A byte-level table: ids 0-255 are single bytes, then a few multi-byte tokens.
WORDS = [b"Hello", b" world", "🦉".encode()[:2], "🦉".encode()[2:], "猫".encode()]
TABLE = [bytes([b]) for b in range(256)] + WORDS
HELLO, WORLD, OWL_HEAD, OWL_TAIL, CAT = range(256, 261)


def token_bytes(token_id: int) -> bytes:
    return TABLE[token_id]


def stream(ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(token_bytes)
    return [detok.feed(t) for t in ids] + [detok.flush()]


def test_whole_tokens_come_out_at_once() -> None:
    assert stream([HELLO, WORLD, CAT]) == ["Hello", " world", "猫", ""]


def test_emoji_in_four_single_byte_tokens_waits_for_the_last_byte() -> None:
    assert stream(list("🦉".encode())) == ["", "", "", "🦉", ""]


def test_cjk_in_three_single_byte_tokens() -> None:
    ids = [ord("a"), *"猫".encode(), ord("b")]
    assert stream(ids) == ["a", "", "", "猫", "b", ""]


def test_multi_byte_pieces_in_multi_byte_tokens() -> None:
    assert stream([HELLO, OWL_HEAD, OWL_TAIL]) == ["Hello", "", "🦉", ""]
    assert stream([OWL_HEAD, *"🦉".encode()[2:]]) == ["", "", "🦉", ""]


def test_invalid_bytes_become_replacement_as_soon_as_certain() -> None:
    # 0xFF can never start a character: replaced at once.
    assert stream([ord("a"), 0xFF, ord("b")]) == ["a", "\ufffd", "b", ""]
    # A lead byte followed by ASCII can no longer complete: one U+FFFD, then the ASCII.
    assert stream([0xF0, ord("A")]) == ["", "\ufffdA", ""]
    # A stray continuation byte.
    assert stream([0x80, CAT]) == ["\ufffd", "猫", ""]


def test_flush_replaces_a_truncated_sequence() -> None:
    assert stream([ord("x"), *"猫".encode()[:2]]) == ["x", "", "", "\ufffd"]


def test_feed_accepts_several_ids() -> None:
    detok = IncrementalDetokenizer(token_bytes)
    assert detok.feed([HELLO, *"🦉".encode()[:3]]) == "Hello"
    assert detok.feed(["🦉".encode()[3]]) == "🦉"


def test_random_byte_streams_decode_like_the_whole_bytes() -> None:
    rng = random.Random(0)
    alphabet = list(range(256)) * 2 + list(range(256, len(TABLE))) * 40 + [*"é猫🦉".encode()] * 40
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
        pieces = stream(ids)
        expected = b"".join(TABLE[t] for t in ids).decode("utf-8", errors="replace")
        assert "".join(pieces) == expected


def run_stops(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stops)
    out = [matcher.feed(p) for p in pieces]
    if matcher.matched is None:
        out.append(matcher.flush())
    return out, matcher.matched


def test_stop_string_in_one_piece() -> None:
    assert run_stops(["STOP"], ["Hello STOP world"]) == (["Hello "], "STOP")


def test_stop_string_split_across_pieces_is_held_then_dropped() -> None:
    out, matched = run_stops(["STOP"], ["Hello S", "T", "OP", " more"])
    assert out == ["Hello ", "", "", ""] and matched == "STOP"


def test_held_prefix_is_released_when_it_stops_matching() -> None:
    assert run_stops(["STOP"], ["Hello ST", "ART"]) == (["Hello ", "START", ""], None)


def test_held_prefix_is_released_at_flush() -> None:
    assert run_stops(["</s>"], ["a</"]) == (["a", "</"], None)


def test_overlapping_candidate_keeps_the_longest_possible_prefix() -> None:
    assert run_stops(["abcd"], ["ababc", "d"]) == (["ab", ""], "abcd")


def test_earliest_stop_wins() -> None:
    assert run_stops(["world", "lo"], ["Hello world"]) == (["Hel"], "lo")


def test_stop_at_the_very_start() -> None:
    assert run_stops(["\n\n"], ["\n", "\nrest"]) == (["", ""], "\n\n")


def test_no_stops_passes_text_through() -> None:
    assert run_stops([], ["a", "b"]) == (["a", "b", ""], None)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def test_random_splits_agree_with_searching_the_whole_text() -> None:
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("ab猫 ") for _ in range(rng.randint(0, 25)))
        stops = [
            "".join(rng.choice("ab猫") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, matched = run_stops(stops, pieces)
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            assert matched is not None and "".join(out) == text[: min(hits)]
            assert text.startswith(matched, min(hits))
        else:
            assert matched is None and "".join(out) == text

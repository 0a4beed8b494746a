"""The streaming reasoning splitter: tags split anywhere, an opened block, no block at all."""

import pytest

from bubo.templates.reasoning import ReasoningSplitter


def split(pieces: list[str], **kwargs: bool) -> list[tuple[str, str]]:
    splitter = ReasoningSplitter(**kwargs)
    out = []
    for piece in pieces:
        out += splitter.feed(piece)
    out += splitter.flush()
    merged: list[tuple[str, str]] = []
    for channel, text in out:
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


TEXT = "<think>\nI should greet.\n</think>\n\nHello!"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, len(TEXT)])
def test_tags_split_across_pieces(size: int) -> None:
    pieces = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    assert split(pieces) == [("reasoning", "I should greet.\n"), ("content", "Hello!")]


def test_a_prompt_that_opened_the_block_starts_in_reasoning() -> None:
    assert split(["hmm", " ok</th", "ink>\n\nHi"], in_reasoning=True) == [
        ("reasoning", "hmm ok"),
        ("content", "Hi"),
    ]


def test_answer_text_first_means_no_reasoning_block() -> None:
    assert split(["Sure", ", <think>x</think>"]) == [("content", "Sure, <think>x</think>")]


def test_only_one_block_is_reasoning() -> None:
    assert split(["<think>a</think>b<think>c</think>"]) == [
        ("reasoning", "a"),
        ("content", "b<think>c</think>"),
    ]


def test_a_reasoning_cut_short_stays_reasoning() -> None:
    assert split(["<think>\nstill thinking</thi"]) == [("reasoning", "still thinking</thi")]


def test_leading_whitespace_before_the_tag_is_not_content() -> None:
    assert split(["\n", "<think>", "a</think>b"]) == [("reasoning", "a"), ("content", "b")]


def test_a_lone_partial_tag_at_the_end_is_content() -> None:
    assert split(["<thi"]) == [("content", "<thi")]

"""Tokenizer built from GGUF metadata, checked against transformers' own GGUF tokenizer conversion.

Real file: SmolLM2 (byte-level BPE, `smollm` pre-tokenizer). No Qwen or Llama GGUF is available offline, so
tiny vocabularies are trained here with `tokenizers` on a mixed corpus, written with `gguf.GGUFWriter` under
each `tokenizer.ggml.pre` we support (plus Qwen's special tokens), and read back by both sides.
"""

from __future__ import annotations

import inspect
import json
import pathlib
import textwrap

import gguf
import pytest
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from bubo.model.tokenizer import Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")


# What the comparisons run on: prose, code, scripts with and without spaces, combining marks, emoji (4-byte
# UTF-8 and ZWJ sequences), digit runs of every length, whitespace runs, contractions, special tokens inline.
SAMPLES = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "The capital of France is",
    "I'm sure they'll say we've done it, didn't they? IT'S FINE. She'D",
    "1",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "Pi is 3.14159265358979, e is 2.71828; 1,000,000 and 10^9.",
    "call 555-0123 or +1 (800) 123 4567",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    '<div class="x">&nbsp;</div>\r\n<br/>',
    "line one\nline two\n\n\nline five\r\n\r\n",
    "tabs\t\tand  double  spaces \t \n mixed",
    "\n\n\n",
    "    ",
    "中文测试：你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Русский текст, и ещё немного.",
    "Ελληνικά γράμματα",
    "مرحبا بالعالم",
    "עברית",
    "नमस्ते दुनिया, हिन्दी में लिखा गया वाक्य।",
    "ภาษาไทยไม่มีช่องว่าง",
    "naïve café résumé Ångström",
    "e\u0301 decomposed accent and cafe\u0301",
    "emoji 😀🎉 and flags 🇫🇷 and family 👨‍👩‍👧‍👦 and ❤️",
    "mixed: English中文Русский123abc",
    "'s 't ' quotes ‘smart’ “double”",
    "snake_case camelCase kebab-case CONSTANT_CASE",
    "https://example.com/path?q=1&r=two#frag",
    "a\u00a0non-breaking\u2009thin\u3000ideographic space",
    "\x00\x01 control\x7f bytes",
    "long " + "word" * 40,
]

SPECIAL_SAMPLES = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|endoftext|>",
    "x<|im_end|>y",
    "<|im_start|><|im_end|>",
    "not special: <|im_start |> <im_end> <|unknown|>",
]
QWEN_SPECIAL_SAMPLES = [
    "<think>\nreasoning here\n</think>\n\nanswer",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "<|fim_prefix|>def f(<|fim_suffix|>)\n<|fim_middle|>",
]


# ---------------------------------------------------------------------------------------------- helpers


def read_metadata(path: pathlib.Path) -> dict:
    """The metadata of a GGUF file as a dict of python values, read with gguf-py."""
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}


def reference_tokenizer(path: pathlib.Path):
    """transformers' tokenizer for the same file (its GGUF conversion)."""
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def corpus() -> list[str]:
    """Training text for the tiny vocabularies: the samples' kinds of text, repeated enough to get merges."""
    code = [inspect.getsource(json.decoder), inspect.getsource(textwrap)]
    prose = [
        "The quick brown fox jumps over the lazy dog. It's a test; we're testing, they'll see. " * 20,
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42 " * 20,
        "中文文本，你好世界，今天天气很好，我们在测试分词器。日本語のテキスト。한국어 문장입니다. " * 20,
        "Русский текст и немного греческого: Ελληνικά γράμματα. مرحبا بالعالم. עברית. " * 20,
        "नमस्ते दुनिया, हिन्दी में लिखा गया वाक्य। ภาษาไทยไม่มีช่องว่าง " * 20,
        "emoji 😀🎉 ❤️ 👍 " * 20,
        "    indented\n\tline\n\n  \n" * 20,
    ]
    return code + prose


# Qwen's added tokens: control ones, and the user-defined ones (not special in its tokenizer.json, so
# llama.cpp's converter writes them USER_DEFINED). llama.cpp pads the vocabulary to the embedding rows with
# UNUSED "[PAD{id}]" tokens.
QWEN_CONTROL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
QWEN_USER_DEFINED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
QWEN_PADDING = 6
LLAMA3_CONTROL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
]  # fmt: skip
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_byte_level(split_regex: str) -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens in id order, merges) trained with this split regex."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator(corpus(), trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def train_sentencepiece() -> tuple[list[str], list[float], list[gguf.TokenType]]:
    """A small SentencePiece-style BPE vocabulary laid out like Llama 2's (<unk>, <s>, </s>, 256 byte
    tokens, then pieces), with scores as SentencePiece writes them: the earlier a merge, the higher."""
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    hf = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    hf.train_from_iterator(
        corpus(), trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False)
    )
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    rank = {"".join(m if isinstance(m, list) else m.split(" ")): i for i, m in enumerate(model["merges"])}
    scores, types = [], []
    for index, token in enumerate(tokens):
        if index < len(specials):
            scores.append(0.0)
            types.append(
                gguf.TokenType.UNKNOWN
                if index == 0
                else gguf.TokenType.CONTROL
                if index < 3
                else gguf.TokenType.BYTE
            )
        else:
            scores.append(-float(rank.get(token, len(rank) + index)))
            types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


def write_gguf(path: pathlib.Path, arch: str, **tokenizer: object) -> pathlib.Path:
    """A GGUF with no tensors: tokenizer metadata plus the few hyperparameters transformers reads to build
    a config before it builds the tokenizer."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    for name, value in tokenizer.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen_style(path: pathlib.Path, pre: str, split_regex: str) -> pathlib.Path:
    tokens, merges = train_byte_level(split_regex)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += QWEN_CONTROL + QWEN_USER_DEFINED
    types += [gguf.TokenType.CONTROL] * len(QWEN_CONTROL) + [gguf.TokenType.USER_DEFINED] * len(
        QWEN_USER_DEFINED
    )
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(QWEN_PADDING)]
    types += [gguf.TokenType.UNUSED] * QWEN_PADDING
    return write_gguf(
        path,
        "qwen2",
        tokenizer_model="gpt2",
        tokenizer_pre=pre,
        token_list=tokens,
        token_types=types,
        token_merges=merges,
        bos_token_id=tokens.index("<|endoftext|>"),
        eos_token_id=tokens.index("<|im_end|>"),
        pad_token_id=tokens.index("<|endoftext|>"),
        add_bos_token=False,
    )


def write_llama3_style(path: pathlib.Path) -> pathlib.Path:
    tokens, merges = train_byte_level(LLAMA3_SPLIT)
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(LLAMA3_CONTROL)
    tokens += LLAMA3_CONTROL
    return write_gguf(
        path,
        "llama",
        tokenizer_model="gpt2",
        tokenizer_pre="llama-bpe",
        token_list=tokens,
        token_types=types,
        token_merges=merges,
        bos_token_id=tokens.index("<|begin_of_text|>"),
        eos_token_id=tokens.index("<|eot_id|>"),
        add_bos_token=True,
    )


def write_llama2_style(path: pathlib.Path) -> pathlib.Path:
    tokens, scores, types = train_sentencepiece()
    return write_gguf(
        path,
        "llama",
        tokenizer_model="llama",
        token_list=tokens,
        token_scores=scores,
        token_types=types,
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
    )


def assert_same_ids(ours: Tokenizer, reference, samples: list[str]) -> None:
    mismatches = []
    for text in samples:
        got = ours.encode(text, add_bos=False)
        want = reference.encode(text, add_special_tokens=False)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, "\n".join(f"{t!r}:\n  ours {g}\n  ref  {w}" for t, g, w in mismatches)


# ---------------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_path: pathlib.Path) -> tuple[Tokenizer, object, dict]:
    metadata = read_metadata(smollm2_path)
    return Tokenizer.from_gguf(metadata), reference_tokenizer(smollm2_path), metadata


def test_smollm2_ids_match_transformers(smollm2):
    ours, reference, _ = smollm2
    assert_same_ids(ours, reference, SAMPLES + SPECIAL_SAMPLES)


def test_smollm2_special_ids_and_stops(smollm2):
    ours, _, metadata = smollm2
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    assert ours.vocab_size == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)
    # no eot key in the file: found by its text, as llama.cpp does
    assert ours.eot_id == ours.token_to_id("<|im_end|>") == 2
    # <|endoftext|> and <|im_end|> by text; <reponame> is a FIM repo marker, which llama.cpp also stops on
    assert ours.stop_ids == {0, 2, 4}
    assert ours.add_bos is False
    assert ours.encode("Hi") == ours.encode("Hi", add_bos=False)
    assert ours.encode("Hi", add_bos=True)[0] == 1


def test_smollm2_digits_are_split_one_by_one(smollm2):
    ours, _, _ = smollm2
    ids = ours.encode("x 2024")
    assert [ours.token_bytes(i) for i in ids] == [b"x", b" ", b"2", b"0", b"2", b"4"]


def test_smollm2_special_tokens(smollm2):
    ours, _, _ = smollm2
    im_start, im_end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    literal = ours.encode("<|im_start|>user\nHi<|im_end|>", parse_special=False)
    assert im_start not in literal and im_end not in literal
    assert ours.decode(literal) == "<|im_start|>user\nHi<|im_end|>"
    assert ours.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert ours.decode(ids, skip_special=True) == "user\nHi"
    assert ours.is_special(im_end) and not ours.is_special(ids[1])
    assert ours.token_bytes(im_end) == b"<|im_end|>"


def test_smollm2_round_trip_and_token_bytes(smollm2):
    ours, _, _ = smollm2
    for text in SAMPLES:
        ids = ours.encode(text, parse_special=False)
        assert ours.decode(ids) == text
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
    assert ours.token_bytes(ours.token_to_id("Ġ")) == b" "
    assert ours.token_bytes(ours.token_to_id("Ċ")) == b"\n"
    # a token can be part of a UTF-8 character: the emoji is cut into bytes the decoder must rejoin
    parts = [ours.token_bytes(i) for i in ours.encode("😀")]
    assert b"".join(parts) == "😀".encode() and len(parts) > 1
    assert ours.decode(ours.encode("😀")[:1]) == "\ufffd"


def test_smollm2_decode_matches_transformers(smollm2):
    ours, reference, _ = smollm2
    for text in SAMPLES:
        ids = reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids)


# ---------------------------------------------------------------------------------------------- tiny files


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, pathlib.Path]:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as QWEN35_SPLIT

    folder = tmp_path_factory.mktemp("tokenizers")
    return {
        "qwen2": write_qwen_style(folder / "qwen2.gguf", "qwen2", QWEN2_SPLIT),
        "qwen35": write_qwen_style(folder / "qwen35.gguf", "qwen35", QWEN35_SPLIT),
        "llama-bpe": write_llama3_style(folder / "llama3.gguf"),
        "llama": write_llama2_style(folder / "llama2.gguf"),
    }


@pytest.fixture(scope="module")
def loaded(tiny_files) -> dict[str, tuple[Tokenizer, object, dict]]:
    result = {}
    for name, path in tiny_files.items():
        metadata = read_metadata(path)
        result[name] = (Tokenizer.from_gguf(metadata), reference_tokenizer(path), metadata)
    return result


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_qwen_ids_match_transformers(loaded, pre):
    ours, reference, metadata = loaded[pre]
    assert metadata["tokenizer.ggml.pre"] == pre
    assert_same_ids(ours, reference, SAMPLES + SPECIAL_SAMPLES + QWEN_SPECIAL_SAMPLES)


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_qwen_round_trip(loaded, pre):
    ours, reference, _ = loaded[pre]
    for text in SAMPLES + QWEN_SPECIAL_SAMPLES:
        ids = ours.encode(text, parse_special=False)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == reference.decode(ids)


def test_qwen_special_tokens_keep_ids_and_stop(loaded):
    ours, _, metadata = loaded["qwen2"]
    tokens = metadata["tokenizer.ggml.tokens"]
    assert ours.vocab_size == len(tokens)
    for text in QWEN_CONTROL + QWEN_USER_DEFINED:
        assert ours.token_to_id(text) == tokens.index(text)
        assert ours.encode(text) == [tokens.index(text)]
        assert ours.token_bytes(tokens.index(text)) == text.encode()
    endoftext, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.eot_id, ours.eom_id) == (
        endoftext,
        im_end,
        endoftext,
        im_end,
        None,
    )
    assert ours.add_bos is False
    fim_stops = {tokens.index(t) for t in ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")}
    assert ours.stop_ids == {endoftext, im_end} | fim_stops
    # the UNUSED padding is neither matched in text nor a stop
    padding = len(tokens) - 1
    assert ours.encode(tokens[padding]) != [padding]
    assert ours.token_bytes(padding) == tokens[padding].encode()


def test_qwen_parse_special(loaded):
    ours, _, metadata = loaded["qwen2"]
    tokens = metadata["tokenizer.ggml.tokens"]
    im_start, think = tokens.index("<|im_start|>"), tokens.index("<think>")
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHi"
    assert ours.encode(text)[0] == im_start
    literal = ours.encode(text, parse_special=False)
    assert im_start not in literal and ours.decode(literal) == text
    # user-defined tokens are words of the vocabulary, matched whole either way (llama.cpp, transformers)
    assert think in literal
    assert ours.is_special(im_start) and not ours.is_special(think)
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special=True) == "assistant\n<think>\nhmm\n</think>\n\nHi"


@pytest.mark.parametrize("pre", ["qwen2", "qwen35"])
def test_qwen_splits_every_digit(loaded, pre):
    ours, _, _ = loaded[pre]
    pieces = [ours.token_bytes(i) for i in ours.encode("x 1000 and 2024")]
    assert b"".join(pieces) == b"x 1000 and 2024"
    assert all(len(piece) == 1 for piece in pieces if piece.strip().isdigit())


def test_qwen35_keeps_combining_marks_in_words(loaded):
    """The same qwen35 file read as "qwen2" splits Devanagari at its vowel signs; read as "qwen35" it does
    not, so the two give different ids (and "qwen35" is the one matching transformers, checked above)."""
    ours, _, metadata = loaded["qwen35"]
    as_qwen2 = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": "qwen2"})
    text = "नमस्ते दुनिया"
    assert ours.encode(text) != as_qwen2.encode(text)
    assert ours.encode("plain English 123") == as_qwen2.encode("plain English 123")


def test_llama3_ids_match_transformers(loaded):
    ours, reference, _ = loaded["llama-bpe"]
    chat = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    assert_same_ids(ours, reference, [*SAMPLES, chat, "done<|eom_id|>"])
    for text in SAMPLES:
        assert ours.decode(ours.encode(text, add_bos=False)) == text


def test_llama3_bos_digits_and_stops(loaded):
    ours, _, metadata = loaded["llama-bpe"]
    tokens = metadata["tokenizer.ggml.tokens"]
    begin = tokens.index("<|begin_of_text|>")
    assert ours.add_bos and ours.encode("Hi")[0] == begin and ours.encode("Hi", add_bos=False)[0] != begin
    # llama.cpp adds BOS for this pre-tokenizer even when the file does not say
    without_flag = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_gguf(without_flag).add_bos
    # digits go in groups of up to three
    pieces = [ours.token_bytes(i) for i in ours.encode("12345678", add_bos=False)]
    ends = {len(b"".join(pieces[: n + 1])) for n in range(len(pieces))}
    assert {3, 6, 8} <= ends and all(len(piece) <= 3 for piece in pieces)
    eot, eom, end = (tokens.index(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"))
    assert (ours.eos_id, ours.eot_id, ours.eom_id) == (eot, eot, eom)
    assert ours.stop_ids == {eot, eom, end}


def test_sentencepiece_matches_transformers(loaded):
    ours, reference, _ = loaded["llama"]
    assert_same_ids(ours, reference, [*SAMPLES, "<s>text</s>", "a<s>b"])
    assert ours.add_bos and ours.encode("hello") == reference.encode("hello")
    for text in SAMPLES:
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True)
    # byte fallback: characters without a piece come back exactly from their <0xXX> tokens, and the
    # SentencePiece prefix space is not part of the text
    text = "ℵ₀ ∑ 🦉"
    assert ours.decode(ours.encode(text), skip_special=True) == text
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.stop_ids) == (1, 2, 0, {2})


# ---------------------------------------------------------------------------------------------- fallbacks


def test_unknown_pre_tokenizer_warns_and_uses_gpt2(loaded, caplog):
    _, _, metadata = loaded["qwen2"]
    gpt2 = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": "gpt-2"})
    without_pre = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.pre"}
    for broken in ({**metadata, "tokenizer.ggml.pre": "no-such-pre"}, without_pre):
        caplog.clear()
        with caplog.at_level("WARNING", logger="bubo.model.tokenizer"):
            fallback = Tokenizer.from_gguf(broken)
        assert "unknown pre-tokenizer" in caplog.text
        assert [fallback.encode(t) for t in SAMPLES] == [gpt2.encode(t) for t in SAMPLES]


def test_explicit_ids_win_over_text_detection(loaded):
    _, _, metadata = loaded["qwen2"]
    tokens = metadata["tokenizer.ggml.tokens"]
    endoftext = tokens.index("<|endoftext|>")
    ours = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.eot_token_id": endoftext})
    assert ours.eot_id == endoftext
    assert tokens.index("<|im_end|>") in ours.stop_ids  # still an end of generation by its text


def test_bad_metadata_raises():
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="no vocabulary"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(TokenizerError, match="duplicate"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "a"]})


def test_from_bubo_reader_metadata(tiny_files, loaded):
    """The runtime path: metadata as Bubo's own reader gives it builds the same tokenizer."""
    from bubo.gguf.reader import GGUFFile

    with GGUFFile(tiny_files["qwen2"]) as f:
        ours = Tokenizer.from_gguf(f.metadata)
    expected, _, _ = loaded["qwen2"]
    assert [ours.encode(t) for t in SAMPLES + SPECIAL_SAMPLES] == [
        expected.encode(t) for t in SAMPLES + SPECIAL_SAMPLES
    ]
    assert ours.stop_ids == expected.stop_ids

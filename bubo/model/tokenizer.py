"""Text <-> token ids from the vocabulary a GGUF file carries.

A GGUF file has no tokenizer.json. It stores the token strings, their types, the BPE merges and the special
token ids under llama.cpp's `tokenizer.ggml.*` keys, and names the pre-tokenizer (the regexes that cut text
into words before BPE) only by a short string, `tokenizer.ggml.pre`. This module rebuilds a Hugging Face
`tokenizers.Tokenizer` from that and follows llama.cpp (src/llama-vocab.cpp) for what the file leaves
implicit: which regexes a `pre` name stands for, whether BOS is added, which tokens end a generation.
The ids agree with transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(..., gguf_file=...)`).

Vocabulary kinds (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (SmolLM2, Qwen2/2.5/3/3.5, Llama 3). Tokens are spelled in GPT-2's byte alphabet.
- "llama": SentencePiece BPE (Llama 2, Mistral). The file has scores instead of merges, `▁` stands for a
  space and `<0xXX>` tokens cover bytes with no token of their own.

A `tokenizer.ggml.pre` this module does not know (or none) falls back to the GPT-2 regex with a warning,
as transformers does; llama.cpp refuses such files. The ids are then right for plain prose but can differ
on digit runs, newlines and non-Latin scripts, which is what the warning says.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

logger = logging.getLogger(__name__)

_K = Keys.Tokenizer

# Pre-tokenizer regexes as the models' tokenizer.json files write them. llama.cpp spells `(?i:'s|…)` as
# `(?:'[sS]|…)` because std::regex has no inline flags; Oniguruma (inside `tokenizers`) has them, and the
# original is what the models were trained with and what transformers runs.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's regex, except that every digit is a word of its own (\p{N} for \p{N}{1,3}).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's, with combining marks (\p{M}) kept inside words, so Devanagari or Thai words are not cut at every
# vowel sign.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """One llama.cpp LLAMA_VOCAB_PRE_TYPE_*: regexes applied in turn (each splits the pieces the one before
    left, unmatched text included), and the vocabulary flags llama.cpp sets along with it."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a word that is a token as a whole is taken whole (Llama 3's tokenizer.json)
    add_bos: bool = False  # the default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _PreTokenizer((_GPT2_SPLIT,))

# `tokenizer.ggml.pre` -> pre-tokenizer, grouped the way llama_vocab::impl::load groups the names.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    # LLAMA_VOCAB_PRE_TYPE_GPT2 / MPT / OLMO / JAIS
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), _GPT2),
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM / STARCODER / REFACT / COMMAND_R / …: every digit isolated first (their
    # tokenizer.json's `Digits(individual_digits=True)`), then GPT-2's regex.
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _PreTokenizer((r"\p{N}", _GPT2_SPLIT)),
    ),
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"),
        _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    ),
    # LLAMA_VOCAB_PRE_TYPE_DBRX / SMAUG: Llama 3's regex without its flags
    **dict.fromkeys(("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3_SPLIT,))),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2 / STABLELM2 (Qwen2, Qwen2.5, Qwen3 files all say "qwen2")
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _PreTokenizer((_QWEN2_SPLIT,))),
    # LLAMA_VOCAB_PRE_TYPE_QWEN35
    "qwen35": _PreTokenizer((_QWEN35_SPLIT,)),
}

# When the file gives no id for these, llama.cpp finds them by text ("auto-detect special tokens by text" in
# llama_vocab::impl::load); here the first text of the list present in the vocabulary wins.
_FOUND_BY_TEXT = {
    "eot": (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
        "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_ID_KEYS = {
    "bos": _K.BOS_ID, "eos": _K.EOS_ID, "eot": _K.EOT_ID, "eom": _K.EOM_ID, "pad": _K.PAD_ID, "unk": _K.UNK_ID,
    "fim_pre": _K.FIM_PRE_ID, "fim_suf": _K.FIM_SUF_ID, "fim_mid": _K.FIM_MID_ID,
    "fim_pad": _K.FIM_PAD_ID, "fim_rep": _K.FIM_REP_ID, "fim_sep": _K.FIM_SEP_ID,
}  # fmt: skip
# llama.cpp's special_eog_ids: these ids, plus every token whose text is in _EOG_TEXTS. A fill-in-the-middle
# completion is over when the model starts padding, another repository or another file.
_STOP_KINDS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip

# Special tokens: matched whole in the input only when parsing special tokens, hidden by skip_special.
_CONTROL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
# User-defined tokens (`<think>`, `<tool_call>`) are words the vocabulary gained after BPE training, so BPE
# cannot produce them: llama.cpp and transformers match them whole in every input.
_MATCHED_TYPES = _CONTROL_TYPES | {TokenType.USER_DEFINED}
_SPM_SPACE = "\u2581"


_TOKEN_TYPE_IDS = frozenset(int(t) for t in TokenType)
# Real SentencePiece pieces are a few dozen characters at most (Gemma's longest are runs of 31 spaces).
_MAX_PIECE_CHARS = 256


class TokenizerError(ValueError):
    """The metadata describes no tokenizer Bubo can build, or an encode asks for a token it lacks."""


def _typed_list(metadata: Mapping[str, Any], key: str, kind: type, described: str) -> list[Any] | None:
    """The array under `key` (None when absent), refused unless every element is a `kind` (an int counts
    as a float; a bool never counts)."""
    value = metadata.get(key)
    if value is None:
        return None
    kinds = (int, float) if kind is float else (kind,)
    if not isinstance(value, list) or not all(
        isinstance(item, kinds) and not isinstance(item, bool) for item in value
    ):
        raise TokenizerError(f"{key} should be an array of {described}")
    return value


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise TokenizerError(f"{key} should be a boolean, got {value!r}")
    return value


@functools.cache
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the others (controls,
    space, soft hyphen) are moved to U+0100 on, so every byte is one visible character of a token."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    moved = iter(range(256, 512))
    return tuple(chr(byte) if byte in printable else chr(next(moved)) for byte in range(256))


def _byte_token(text: str) -> int | None:
    """The byte a SentencePiece-style `<0xXX>` token stands for, if it is one."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _split_merge(merge: str) -> tuple[str, str]:
    # As llama.cpp splits them: at the first space after the first character, so a merge whose left part is a
    # space still splits right.
    at = merge.find(" ", 1)
    if at < 0:
        raise TokenizerError(f"malformed entry {merge!r} in {_K.MERGES}")
    return merge[:at], merge[at + 1 :]


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps scores, not merges: two pieces merge when together they are a token, the
    token's score being the priority. So every split of a token into two tokens is a merge, ranked by the
    token's score, then by longer left and right parts (transformers' `generate_merges` order, so that ties
    break the same way)."""
    merges = []
    for piece, index in vocab.items():
        halves = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        halves = sorted(
            ((left, right) for left, right in halves if left in vocab and right in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
        merges += [(scores[index], len(left), len(right), left, right) for left, right in halves]
    merges.sort(key=lambda merge: merge[:3], reverse=True)  # stable: equal ranks keep the order above
    return [(left, right) for *_, left, right in merges]


class Tokenizer:
    """A GGUF file's tokenizer: `encode`/`decode`, the exact bytes of each token, and the special ids."""

    def __init__(
        self,
        backend: _Backend,
        tokens: Sequence[str],
        token_types: Sequence[TokenType],
        token_bytes: Sequence[bytes],
        special_ids: Mapping[str, int | None],
        stop_ids: Iterable[int],
        add_bos: bool,
        add_eos: bool,
        strip_leading_space: bool = False,
    ) -> None:
        """Use `from_gguf`; this takes the parts it assembles."""
        self._backend = backend
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._bytes = list(token_bytes)
        self._ids = {text: index for index, text in enumerate(self._tokens)}
        self._strip_leading_space = strip_leading_space
        self.bos_id = special_ids.get("bos")
        self.eos_id = special_ids.get("eos")
        self.eot_id = special_ids.get("eot")
        self.eom_id = special_ids.get("eom")
        self.pad_id = special_ids.get("pad")
        self.unk_id = special_ids.get("unk")
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.stop_ids: frozenset[int] = frozenset(stop_ids)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer that a GGUF file's metadata (`GGUFFile.metadata`) describes."""
        kind = metadata.get(_K.MODEL)
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer {_K.MODEL}={kind!r}; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE)"
            )
        tokens, types = cls._vocabulary(metadata)
        special, found_by_text = cls._special_ids(metadata, kind, tokens)
        stops = {index for index, text in enumerate(tokens) if text in _EOG_TEXTS}
        found_by_text |= stops
        stops |= {special[name] for name in _STOP_KINDS if special[name] is not None}
        # llama.cpp makes every token it recognised by its text a control token (they are all markers), so
        # they are matched in the input only with parse_special and hidden by skip_special.
        for index in found_by_text:
            if types[index] not in _CONTROL_TYPES:
                types[index] = TokenType.CONTROL

        if kind == "gpt2":
            pre_name = metadata.get(_K.PRE)
            pre = _PRE_TOKENIZERS.get(pre_name) if isinstance(pre_name, str) else None
            if pre is None:
                logger.warning(
                    "unknown pre-tokenizer %s=%r: splitting text with GPT-2's regex; token ids may differ from "
                    "the model's own tokenizer on digits, newlines and non-Latin scripts",
                    _K.PRE,
                    metadata.get(_K.PRE),
                )
                pre = _GPT2
            backend, token_bytes = cls._byte_level(metadata, tokens, types, pre)
            add_bos_default = pre.add_bos
        else:
            backend, token_bytes = cls._sentencepiece(metadata, tokens, types)
            add_bos_default = True
        cls._add_matched_tokens(backend, tokens, types)
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise TokenizerError("the vocabulary has tokens that collide once spelled for BPE")

        add_bos = _flag(metadata, _K.ADD_BOS, add_bos_default)
        add_eos = _flag(metadata, _K.ADD_EOS, False)
        return cls(
            backend,
            tokens,
            types,
            token_bytes,
            special,
            stops,
            add_bos=add_bos and special["bos"] is not None,
            add_eos=add_eos and special["eos"] is not None,
            # SentencePiece's prefix space is not part of the text (transformers and llama.cpp drop it).
            strip_leading_space=kind == "llama" and _flag(metadata, _K.ADD_PREFIX, True),
        )

    @staticmethod
    def _vocabulary(metadata: Mapping[str, Any]) -> tuple[list[str], list[TokenType]]:
        tokens = _typed_list(metadata, _K.LIST, str, "strings") or []
        if not tokens:
            raise TokenizerError(f"the file has no vocabulary ({_K.LIST})")
        # llama.cpp names empty tokens this way; they could never be produced or matched anyway.
        tokens = [text or f"[EMPTY_{index}]" for index, text in enumerate(tokens)]
        if len(set(tokens)) != len(tokens):
            raise TokenizerError(f"{_K.LIST} has duplicate tokens")
        type_ids = _typed_list(metadata, _K.TOKEN_TYPE, int, "integers")
        if type_ids is None:
            type_ids = [TokenType.NORMAL] * len(tokens)
        if len(type_ids) != len(tokens):
            raise TokenizerError(f"{_K.TOKEN_TYPE} has {len(type_ids)} entries for {len(tokens)} tokens")
        bad = next((t for t in type_ids if t not in _TOKEN_TYPE_IDS), None)
        if bad is not None:
            raise TokenizerError(f"{_K.TOKEN_TYPE} holds {bad}, which is not a token type")
        return tokens, [TokenType(t) for t in type_ids]

    @staticmethod
    def _special_ids(
        metadata: Mapping[str, Any], kind: str, tokens: Sequence[str]
    ) -> tuple[dict[str, int | None], set[int]]:
        """The special ids the file names, the rest found by text; and which ones were found by text."""
        # Old SentencePiece files relied on LLaMA's fixed ids. For BPE llama.cpp defaults BOS and EOS to 11
        # (GPT-2's ","), which nothing should stop on, so those stay unset here.
        defaults = {"bos": 1, "eos": 2, "unk": 0} if kind == "llama" else {}
        special: dict[str, int | None] = {}
        for name, key in _ID_KEYS.items():
            value = metadata.get(key, defaults.get(name))
            if value is not None and (type(value) is not int or not 0 <= value < len(tokens)):
                logger.warning(
                    "%s=%s is outside the vocabulary of %d tokens; ignored", key, value, len(tokens)
                )
                value = None
            special[name] = None if value is None else int(value)
        ids = {text: index for index, text in enumerate(tokens)}
        found_by_text = set()
        for name, texts in _FOUND_BY_TEXT.items():
            if special[name] is None:
                special[name] = next((ids[text] for text in texts if text in ids), None)
                if special[name] is not None:
                    found_by_text.add(special[name])
        return special, found_by_text

    @staticmethod
    def _byte_level(
        metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[TokenType], pre: _PreTokenizer
    ) -> tuple[_Backend, list[bytes]]:
        merges = _typed_list(metadata, _K.MERGES, str, "strings")
        if merges is None:
            raise TokenizerError(f"byte-level BPE vocabulary without merges ({_K.MERGES})")
        alphabet = _byte_alphabet()
        byte_of = {char: byte for byte, char in enumerate(alphabet)}
        vocab: dict[str, int] = {}
        token_bytes: list[bytes] = []
        for index, (text, kind) in enumerate(zip(tokens, types, strict=True)):
            byte = _byte_token(text) if kind == TokenType.BYTE else None
            if byte is not None:
                token_bytes.append(bytes([byte]))
                vocab[text] = index
            elif kind in (TokenType.NORMAL, TokenType.BYTE) and all(char in byte_of for char in text):
                token_bytes.append(bytes(byte_of[char] for char in text))
                vocab[text] = index
            elif kind in (TokenType.NORMAL, TokenType.BYTE):
                # A normal token stored as plain text (some converters write added words so): spelled in the
                # byte alphabet, BPE can reach it, as in transformers.
                token_bytes.append(text.encode())
                vocab["".join(alphabet[b] for b in text.encode())] = index
            else:
                # Control, user-defined and unused tokens are stored as the text they stand for.
                token_bytes.append(text.encode())
                vocab[text] = index
        backend = _Backend(
            models.BPE(vocab=vocab, merges=[_split_merge(m) for m in merges], ignore_merges=pre.ignore_merges)
        )
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        return backend, token_bytes

    @staticmethod
    def _sentencepiece(
        metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[TokenType]
    ) -> tuple[_Backend, list[bytes]]:
        scores = _typed_list(metadata, _K.SCORES, float, "numbers")
        if scores is None:
            raise TokenizerError(f"SentencePiece vocabulary without scores ({_K.SCORES})")
        if len(scores) != len(tokens):
            raise TokenizerError(f"{_K.SCORES} has {len(scores)} entries for {len(tokens)} tokens")
        longest = max(tokens, key=len)
        if len(longest) > _MAX_PIECE_CHARS:
            # Every split of every piece is a candidate merge, so the work grows with the square of its length.
            raise TokenizerError(
                f"{_K.LIST} has a SentencePiece piece of {len(longest)} characters (at most {_MAX_PIECE_CHARS})"
            )
        vocab = {text: index for index, text in enumerate(tokens)}
        token_bytes = []
        for text, kind in zip(tokens, types, strict=True):
            byte = _byte_token(text) if kind == TokenType.BYTE else None
            if byte is not None:
                token_bytes.append(bytes([byte]))
            elif kind == TokenType.NORMAL:
                token_bytes.append(text.replace(_SPM_SPACE, " ").encode())
            else:
                token_bytes.append(text.encode())
        unk = next(
            (text for text, kind in zip(tokens, types, strict=True) if kind == TokenType.UNKNOWN), None
        )
        backend = _Backend(
            models.BPE(
                vocab=vocab,
                merges=_merges_from_scores(vocab, scores),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        # Spaces become ▁ and the whole text is one word. The prefix space goes before the start of the text
        # only, as in transformers' LlamaTokenizer; llama.cpp also puts one after each special token.
        scheme = "first" if _flag(metadata, _K.ADD_PREFIX, True) else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPM_SPACE, prepend_scheme=scheme, split=False
        )
        return backend, token_bytes

    @staticmethod
    def _add_matched_tokens(backend: _Backend, tokens: Sequence[str], types: Sequence[TokenType]) -> None:
        # Their text is in the BPE vocabulary under their own id, so adding them keeps the ids.
        matched = [(text, kind) for text, kind in zip(tokens, types, strict=True) if kind in _MATCHED_TYPES]
        backend.add_special_tokens(
            [
                AddedToken(text, normalized=False, special=True)
                for text, kind in matched
                if kind in _CONTROL_TYPES
            ]
        )
        backend.add_tokens(
            [AddedToken(text, normalized=False) for text, kind in matched if kind not in _CONTROL_TYPES]
        )

    @functools.cached_property
    def _literal_backend(self) -> _Backend:
        """A copy that leaves special tokens in the text alone, for parse_special=False. A copy rather than
        toggling `encode_special_tokens`, which is state on the backend, because requests encode concurrently."""
        backend = _Backend.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True, add_eos: bool | None = None
    ) -> list[int]:
        """Token ids for `text`; `add_bos`/`add_eos` None = as the file says. With parse_special, control
        tokens written in the text (`<|im_start|>`) become their ids; without it they are tokenized as plain
        text (a user's message must not inject them). User-defined tokens (`<think>`) are matched either way."""
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("BOS requested, but the vocabulary has no BOS token")
            ids.append(self.bos_id)
        backend = self._backend if parse_special else self._literal_backend
        # encode_batch lets go of the GIL while it works; encode holds it throughout (tokenizers 0.23), so
        # a long text (megabytes take seconds) would stop every other thread, the server's event loop
        # included, even when tokenized on a thread of its own. For one text both take the same time.
        ids += backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_eos if add_eos is None else add_eos:
            if self.eos_id is None:
                raise TokenizerError("EOS requested, but the vocabulary has no EOS token")
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`. Bytes that are not valid UTF-8 (a character cut short) become U+FFFD."""
        data = b"".join(self._bytes[i] for i in ids if not (skip_special and self.is_special(i)))
        text = data.decode("utf-8", errors="replace")
        return text[1:] if self._strip_leading_space and text.startswith(" ") else text

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (for special tokens, their text). A token can hold part of a UTF-8
        character: join the bytes of consecutive tokens before decoding."""
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a control token (`<|im_end|>`, BOS), which skip_special leaves out."""
        return self._types[token_id] in _CONTROL_TYPES

    def token_to_id(self, text: str) -> int | None:
        """The id of the token the file spells `text` (`"<|im_end|>"`, `"Ġthe"`), or None."""
        return self._ids.get(text)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"eot_id={self.eot_id}, stop_ids={sorted(self.stop_ids)})"
        )

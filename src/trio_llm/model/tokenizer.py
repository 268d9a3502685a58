"""The tokenizer a GGUF file describes, built on Hugging Face ``tokenizers``.

A GGUF stores no ``tokenizer.json``, only llama.cpp's ``tokenizer.ggml.*`` keys. This
module rebuilds from them the pipeline llama.cpp runs, out of ``tokenizers`` parts:

- ``gpt2`` (byte-level BPE: Llama 3, Qwen): the file's merges; text split by the
  regex that ``tokenizer.ggml.pre`` names (Llama 3 and Qwen 2 differ on digits), then
  spelled in GPT-2's byte alphabet. Llama 3 also matches whole words against the
  vocabulary before merging (``ignore_merges``), as llama.cpp does for that pre-type.
- ``llama`` (SentencePiece BPE: Llama 2, Mistral): no merges in the file. llama.cpp
  merges the adjacent pair whose *result* scores best, so the merges are rebuilt from
  the vocabulary: every split of every piece into two pieces, ranked by the score of
  the piece. Spaces become ``▁``, a space is prepended to each run of text (llama.cpp
  does this after every special token too, and even when the text starts with a
  space), characters outside the vocabulary fall back to the ``<0xNN>`` byte tokens,
  and nothing is pre-split at spaces. transformers' GGUF loader differs on those two
  points (it uses ``Metaspace``, which prepends only once and never to a space).
- ``gemma4`` (Gemma 4): BPE over the file's merges on raw UTF-8, not GPT-2's byte
  alphabet. Each run of text between special tokens has its spaces replaced by ``▁``
  and nothing prepended, is split only into runs of newlines and runs of anything else,
  and a run of newlines that is itself a token is that token (llama.cpp's "fix for
  gemma 4", done after the merges here: see `Tokenizer._join_newline_runs`).
  Characters the merges cannot reach fall back to ``<0xNN>`` tokens; BOS is always
  added (llama.cpp overrides ``add_bos_token = false``); ``tokenizer.ggml.pre`` is
  ignored (llama.cpp sets "gemma4" whatever the file says, and the converter writes none).

Special tokens follow llama.cpp: CONTROL and UNKNOWN tokens are recognised in text
only with ``parse_special`` (as llama-server does for prompts), USER_DEFINED tokens
(Qwen's ``<think>``) always. One known divergence: when two different splits of the
same piece overlap in a text (``ab|a`` vs ``a|ba`` for piece ``aba``), llama.cpp takes
the leftmost and ``tokenizers`` the better-ranked split; real vocabularies rarely meet it.
"""

from __future__ import annotations

import codecs
import operator
import threading
from collections.abc import Iterable
from typing import Any

import attrs
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from trio_llm.errors import InvalidRequest, TokenizerError
from trio_llm.model.vocab import (
    BYTE,
    CONTROL,
    LLAMA3_SPLIT,
    NORMAL,
    QWEN2_SPLIT,
    SPM_SPACE,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    gpt2_byte_chars,
)

#: ``tokenizer.ggml.pre`` names whose split regex we know, and that regex (None: GPT-2's)
_PRE_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT,
    "falcon3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "megrez": QWEN2_SPLIT,
}
_LLAMA3_LIKE = frozenset(k for k, v in _PRE_SPLITS.items() if v == LLAMA3_SPLIT)

#: control tokens that end a generation wherever they appear (llama.cpp's list, abridged)
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|end|>",
        "<end_of_turn>",
        "<EOT>",
        # llama.cpp also ends a generation at its fill-in-the-middle pad, repository and
        # file-separator tokens (Qwen vocabularies have all three)
        "<|fim_pad|>",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

#: llama.cpp's full list of token texts that end a generation, applied to gemma4
#: vocabularies: such a token becomes CONTROL whatever its type in the file (Gemma 4's
#: ``<|tool_response>`` is USER_DEFINED there)
_LLAMA_CPP_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)

#: token types that render as nothing when special tokens are skipped
_SKIPPABLE = frozenset({CONTROL, UNKNOWN, UNUSED})


@attrs.define(eq=False)
class Tokenizer:
    """Text ↔ token ids for one model. Thread-safe: encode/decode may run in worker threads."""

    model: str  # "gpt2", "llama" or "gemma4"
    bos_id: int | None
    eos_id: int
    eot_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: frozenset[int]
    _tokens: list[str]
    _types: list[int]
    _tk: tokenizers.Tokenizer  # recognises CONTROL tokens in text
    _tk_plain: tokenizers.Tokenizer | None = None  # reads them as text; made on first use
    _byte_decoder: dict[str, int] = attrs.Factory(dict)
    _pieces: dict[int, bytes] = attrs.Factory(dict)
    _lock: threading.Lock = attrs.Factory(threading.Lock)
    #: gemma4: the ids a run of newlines can come out of the merges as, and text → id
    _newline_ids: frozenset[int] = frozenset()
    _vocab: dict[str, int] = attrs.Factory(dict)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata as plain Python values; malformed → `TokenizerError`."""
        md = _Metadata(metadata)
        kind = md.str_("tokenizer.ggml.model")
        tokens = md.str_list("tokenizer.ggml.tokens")
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        types = md.int_list("tokenizer.ggml.token_type", n, default=NORMAL)
        extra: dict[str, Any] = {}
        if kind == "gpt2":
            tk, byte_decoder = _byte_level(md, tokens, types)
            defaults: dict[str, int | None] = {"bos": None, "eos": None, "unk": None}
            default_add_bos = md.opt_str("tokenizer.ggml.pre", "default") in _LLAMA3_LIKE
        elif kind == "llama":
            tk, byte_decoder = _sentencepiece(md, tokens, types), {}
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            default_add_bos = True
        elif kind == "gemma4":
            types = _gemma4_types(tokens, types)
            tk, byte_decoder = _gemma4(md, tokens, types), {}
            defaults = {"bos": None, "eos": None, "unk": None}
            default_add_bos = True
            vocab = _first_ids(tokens)
            extra = {"vocab": vocab, "newline_ids": _newline_ids(tokens, types, vocab)}
        else:
            raise TokenizerError(
                f"tokenizer.ggml.model {kind!r} is not supported"
                " (expected 'gpt2', 'llama' or 'gemma4')"
            )
        bos = md.token_id("tokenizer.ggml.bos_token_id", n, defaults["bos"])
        eos = md.token_id("tokenizer.ggml.eos_token_id", n, defaults["eos"])
        if eos is None:
            raise TokenizerError("tokenizer.ggml.eos_token_id is missing")
        eot = md.token_id("tokenizer.ggml.eot_token_id", n, None)
        add_bos = md.bool_("tokenizer.ggml.add_bos_token", default_add_bos)
        if kind == "gemma4":
            add_bos = True  # llama.cpp's "workaround for Gemma 4" overrides a false here
        if add_bos and bos is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is set but there is no BOS token")
        eog = {eos} | ({eot} if eot is not None else set())
        eog_texts = _LLAMA_CPP_EOG_TEXTS if kind == "gemma4" else _EOG_TEXTS
        eog |= {i for i, t in enumerate(tokens) if types[i] == CONTROL and t in eog_texts}
        return cls(
            model=kind,
            bos_id=bos,
            eos_id=eos,
            eot_id=eot,
            pad_id=md.token_id("tokenizer.ggml.padding_token_id", n, None),
            unk_id=md.token_id("tokenizer.ggml.unknown_token_id", n, defaults["unk"]),
            add_bos=add_bos,
            add_eos=md.bool_("tokenizer.ggml.add_eos_token", False),
            eog_ids=frozenset(eog),
            tokens=tokens,
            types=types,
            tk=tk,
            byte_decoder=byte_decoder,
            **extra,
        )

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    def is_eog(self, token_id: int) -> bool:
        """Whether `token_id` ends a generation (EOS, EOT, or an end-of-turn control token)."""
        return token_id in self.eog_ids

    def is_special(self, token_id: int) -> bool:
        """CONTROL, UNKNOWN and UNUSED tokens: the ones `skip_special` leaves out."""
        self._check_id(token_id)
        return self._types[token_id] in _SKIPPABLE

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it (``Ġthe``, ``▁the``, ``<|eot_id|>``)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`.

        `add_special` adds BOS (and EOS) when the model asks for them; `parse_special`
        turns the text of control tokens (``<|eot_id|>``) into those tokens, as
        llama-server does for prompts, instead of spelling them out.
        """
        tk = self._tk if parse_special else self._plain()
        # encode_batch_fast, not encode: only the batch calls release the GIL while
        # Rust works, and a server tokenizes on a worker thread so that its event loop
        # keeps running (a 5 MB prompt takes seconds; with the GIL held, /health
        # stalled); the fast one skips the offsets nobody reads
        try:
            ids: list[int] = tk.encode_batch_fast([text], add_special_tokens=False)[0].ids
        except (TypeError, ValueError, UnicodeError, OverflowError):
            if not isinstance(text, str):
                raise TypeError(f"encode() takes a str, not {type(text).__name__}") from None
            # Lone surrogates (JSON allows "\ud800") cannot cross into Rust; they become
            # U+FFFD, the character any UTF-8 reader would show for them.
            clean = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ids = tk.encode_batch_fast([clean], add_special_tokens=False)[0].ids
        if self._newline_ids:
            ids = self._join_newline_runs(ids)
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 (a character cut between tokens) shows as U+FFFD.

        For SentencePiece vocabularies the space the tokenizer prepended is removed, so
        ``decode(encode(text, add_special=False)) == text``.
        """
        ids = [int(i) for i in ids]  # numpy integers from a sampler do not cross into Rust
        for i in ids:
            self._check_id(i)
        if skip_special:
            ids = [i for i in ids if self._types[i] not in _SKIPPABLE]
        if self.model == "gemma4":
            # as llama-server's /detokenize: the pieces joined, nothing stripped
            return b"".join(self.token_to_piece(i) for i in ids).decode("utf-8", "replace")
        return str(self._tk.decode(ids, skip_special_tokens=False))

    def token_to_piece(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; may be part of a UTF-8 character."""
        piece = self._pieces.get(token_id)
        if piece is None:
            self._check_id(token_id)
            piece = self._piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def _join_newline_runs(self, ids: list[int]) -> list[int]:
        """llama.cpp's "fix for gemma 4": a run of newlines that is itself a token is
        that token, not what the merges make of it.

        The pre-tokenizer isolates each run of newlines, and only such a run can give
        newline-only tokens (no other run holds a newline; special tokens are never in
        `_newline_ids`), so each maximal stretch of them in the output is one run. This
        keeps the merges in ``tokenizers``: a ``tokenizers`` BPE can skip the merges for
        a whole word only for every word at once (``ignore_merges``), which llama.cpp
        does not do for the other runs.
        """
        nl = self._newline_ids
        if not any(i in nl for i in ids):
            return ids
        out: list[int] = []
        n = len(ids)
        i = 0
        while i < n:
            if ids[i] not in nl:
                out.append(ids[i])
                i += 1
                continue
            j = i
            while j < n and ids[j] in nl:
                j += 1
            whole = self._vocab.get("\n" * sum(len(self.token_to_piece(t)) for t in ids[i:j]))
            out += [whole] if whole is not None else ids[i:j]
            i = j
        return out

    def _piece(self, token_id: int) -> bytes:
        text, kind = self._tokens[token_id], self._types[token_id]
        if self.model == "gemma4":
            # llama.cpp's token_to_piece for a BPE vocabulary with escaped whitespace
            if kind in (CONTROL, UNKNOWN, USER_DEFINED):
                return text.encode("utf-8")
            if kind == NORMAL:
                return text.replace(SPM_SPACE, " ").encode("utf-8")
            if kind == BYTE:
                try:
                    return bytes([int(text[3:5], 16)])
                except ValueError:
                    return b""
            return b""  # UNUSED and unknown types render as nothing
        if self.model == "llama":
            if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])
            return text.replace(SPM_SPACE, " ").encode("utf-8")
        if kind in (NORMAL, BYTE) and all(c in self._byte_decoder for c in text):
            return bytes(self._byte_decoder[c] for c in text)
        return text.encode("utf-8")

    def _plain(self) -> tokenizers.Tokenizer:
        with self._lock:
            if self._tk_plain is None:
                plain = tokenizers.Tokenizer.from_str(self._tk.to_str())
                plain.encode_special_tokens = True
                self._tk_plain = plain
            return self._tk_plain

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise InvalidRequest(
                f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})"
            )


@attrs.define(eq=False)
class StreamDecoder:
    """Turns generated token ids, fed one at a time, into text that is always whole UTF-8.

    A token may carry part of a character (byte-level BPE splits an emoji over up to four
    tokens; SentencePiece falls back to ``<0xNN>`` bytes). `feed` holds such bytes back
    until the character completes, so a streamed chunk never contains half a character;
    bytes that can never form one come out as U+FFFD. Unlike `Tokenizer.decode` no
    leading space is stripped: generated text continues a prompt. With `skip_special`
    (the default, as llama-server without ``--special``) control tokens render as nothing.
    """

    _tokenizer: Tokenizer
    skip_special: bool = True
    _utf8: codecs.IncrementalDecoder = attrs.field(
        factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )

    def feed(self, token_id: int) -> str:
        """The text that `token_id` completes; "" while a character is still partial."""
        if self.skip_special and self._tokenizer.is_special(token_id):
            return ""
        return str(self._utf8.decode(self._tokenizer.token_to_piece(token_id)))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: bytes still held (an unfinished character) come out as U+FFFD."""
        return str(self._utf8.decode(b"", final=True))

    @property
    def pending(self) -> int:
        """How many bytes are held back waiting for the rest of a character."""
        buffered, _ = self._utf8.getstate()
        return len(buffered)


# --- building the pipelines ----------------------------------------------------------


def _byte_level(
    md: _Metadata, tokens: list[str], types: list[int]
) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    pre = md.opt_str("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise TokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(sorted(_PRE_SPLITS))})"
        )
    raw_merges = md.str_list("tokenizer.ggml.merges")
    merges: list[tuple[str, str]] = []
    for m in raw_merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise TokenizerError(f"tokenizer.ggml.merges: {m!r} is not 'left right'")
        merges.append((left, right))
    vocab = _first_ids(tokens)
    model = _bpe(vocab, merges, ignore_merges=pre in _LLAMA3_LIKE)
    tk = tokenizers.Tokenizer(model)
    split = _PRE_SPLITS[pre]
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tk.decoder = decoders.ByteLevel()
    _add_specials(tk, tokens, types)
    byte_decoder = {c: b for b, c in enumerate(gpt2_byte_chars())}
    return tk, byte_decoder


def _sentencepiece(md: _Metadata, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    scores = md.float_list("tokenizer.ggml.scores", len(tokens))
    vocab = _first_ids(tokens)
    unk = md.token_id("tokenizer.ggml.unknown_token_id", len(tokens), 0)
    model = _bpe(
        vocab,
        _merges_from_scores(tokens, types, scores, vocab),
        unk_token=tokens[unk] if unk is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    tk = tokenizers.Tokenizer(model)
    space_prefix = md.bool_("tokenizer.ggml.add_space_prefix", True)
    # A normalizer, not Metaspace: llama.cpp prepends the space even when the text
    # already starts with one, and to every run of text after a special token (the
    # normalizer runs once per run between added tokens); nothing is split at spaces.
    prefix = [normalizers.Prepend(SPM_SPACE)] if space_prefix else []
    tk.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPM_SPACE)])
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    _add_specials(tk, tokens, types)
    return tk


def _gemma4(md: _Metadata, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4 pipeline, in ``tokenizers`` parts.

    ``tokenizers``' BPE is llama.cpp's merge loop (lowest rank first, leftmost among
    equals) when every merge joins two vocabulary pieces into a third, which it checks.
    Its byte fallback replaces a character outside the vocabulary, llama.cpp's a final
    symbol outside it; with such merges that symbol can only be a lone character.
    """
    vocab = _first_ids(tokens)
    model = _bpe(vocab, _gemma4_merges(md), byte_fallback=True)
    tk = tokenizers.Tokenizer(model)
    # A normalizer runs once per run of text between added tokens, as llama.cpp's
    # escape_whitespaces does per fragment; nothing is prepended.
    tk.normalizer = normalizers.Replace(" ", SPM_SPACE)
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tk.decoder = decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    _add_specials(tk, tokens, types)
    return tk


def _gemma4_merges(md: _Metadata) -> list[tuple[str, str]]:
    """The merges as llama.cpp reads them: split at the first space after the first
    character; a pair listed twice keeps its first rank."""
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for m in md.str_list("tokenizer.ggml.merges"):
        cut = m.find(" ", 1)
        if cut < 0 or cut == len(m) - 1:
            raise TokenizerError(f"tokenizer.ggml.merges: {m!r} is not 'left right'")
        pair = (m[:cut], m[cut + 1 :])
        if pair not in seen:
            seen.add(pair)
            merges.append(pair)
    return merges


def _gemma4_types(tokens: list[str], types: list[int]) -> list[int]:
    """llama.cpp's overrides: a token in its end-of-generation list is CONTROL, unless
    it is ``</s>`` beside ``<|tool_response>`` (then NORMAL and no end)."""
    types = list(types)
    present = set(tokens)
    for i, t in enumerate(tokens):
        if t == "</s>" and "<|tool_response>" in present:
            types[i] = NORMAL
        elif t in _LLAMA_CPP_EOG_TEXTS:
            types[i] = CONTROL
    return types


def _newline_ids(tokens: list[str], types: list[int], vocab: dict[str, int]) -> frozenset[int]:
    """The tokens the merges can make of a run of newlines: newline-only NORMAL ones and
    the byte token ``<0x0A>`` (llama.cpp's fallback for a newline outside the vocabulary)."""
    ids = {i for i, t in enumerate(tokens) if types[i] == NORMAL and t and not t.strip("\n")}
    byte = vocab.get("<0x0A>")
    if byte is not None and types[byte] == BYTE:
        ids.add(byte)
    return frozenset(ids)


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, best-scoring result first.

    That order makes BPE's "apply the best-ranked merge" equal llama.cpp's "merge the
    pair whose concatenation has the highest score".
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for tid, piece in enumerate(tokens):
        if types[tid] not in (NORMAL, USER_DEFINED) or vocab.get(piece) != tid:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[tid], tid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **kwargs: Any) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **kwargs)
    except Exception as exc:  # the Rust side raises plain Exception on a bad merge table
        raise TokenizerError(f"cannot build the BPE model: {exc}") from exc


def _add_specials(tk: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (CONTROL, UNKNOWN) and t
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == USER_DEFINED and t
    ]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def _first_ids(tokens: list[str]) -> dict[str, int]:
    """token → id; a token listed twice keeps its first id, as llama.cpp's lookup does."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


@attrs.define
class _Metadata:
    """Typed reads of the ``tokenizer.*`` keys; any surprise is a `TokenizerError`."""

    raw: dict[str, Any]

    def _get(self, key: str) -> Any:
        if key not in self.raw:
            raise TokenizerError(f"{key} is missing")
        return self.raw[key]

    def str_(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise TokenizerError(f"{key} must be a string, not {type(value).__name__}")
        return value

    def opt_str(self, key: str, default: str) -> str:
        return self.str_(key) if key in self.raw else default

    def bool_(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if value not in (True, False):  # also numpy's bool_ and 0/1 from older writers
            raise TokenizerError(f"{key} must be a boolean, not {value!r}")
        return bool(value)

    def _list(self, key: str) -> list[Any]:
        value = self._get(key)
        if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
            raise TokenizerError(f"{key} must be an array, not {type(value).__name__}")
        return list(value)

    def str_list(self, key: str) -> list[str]:
        values = self._list(key)
        if not all(isinstance(v, str) for v in values):
            raise TokenizerError(f"{key} must be an array of strings")
        return values

    def int_list(self, key: str, n: int, *, default: int) -> list[int]:
        if key not in self.raw:
            return [default] * n
        try:
            values = [int(v) for v in self._list(key)]
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{key} must be an array of integers") from exc
        if len(values) != n:
            raise TokenizerError(f"{key} has {len(values)} entries for {n} tokens")
        return values

    def float_list(self, key: str, n: int) -> list[float]:
        try:
            values = [float(v) for v in self._list(key)]
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{key} must be an array of numbers") from exc
        if len(values) != n:
            raise TokenizerError(f"{key} has {len(values)} entries for {n} tokens")
        return values

    def token_id(self, key: str, n: int, default: int | None) -> int | None:
        value = self.raw.get(key, default)
        if value is None:
            return None
        try:
            value = operator.index(value)  # int, or a numpy integer from a raw reader
        except TypeError:
            raise TokenizerError(f"{key} must be an integer, not {type(value).__name__}") from None
        if not 0 <= value < n:
            # llama.cpp writes -1 / UINT32_MAX for "none"
            if value in (-1, 0xFFFFFFFF):
                return None
            raise TokenizerError(f"{key} = {value} is outside the vocabulary of {n} tokens")
        return value

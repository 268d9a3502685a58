"""Constrained decoding through llguidance: GBNF grammars, JSON schemas, forced tool calls.

llguidance (the library llama.cpp itself links optionally) compiles a grammar - GBNF
(converted to its Lark dialect), a JSON schema, or Lark - into a matcher that, after
every token, gives the set of tokens that keep the text inside the grammar. One
``Grammars`` per model holds the llguidance view of the vocabulary (built once, on
the first constrained request, in a worker thread: it reads every token's bytes);
``compile`` checks a request's grammar at the HTTP edge, so one that cannot compile
is a 400 before any slot is taken. Each constrained task gets its own ``Constraint``
(one matcher); the slots engine masks that slot's logits with it before sampling and
feeds it the sampled token. Masks are computed in the sampling worker thread, every
constrained slot's in parallel (``LLExecutor``), so unconstrained slots wait for
nothing they did not ask for beyond that one thread call.

End of generation: the matcher allows an end-of-generation token only where the
grammar may end, and only that once the grammar is complete, so a constrained answer
always ends as a whole sentence of its grammar (or at the token limit).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from trio_llm.errors import InvalidRequest


class _Vocabulary:
    """What ``llguidance.LLTokenizer`` reads of a tokenizer (its TokenizerWrapper shape)."""

    def __init__(self, tokenizer: Any) -> None:
        n = tokenizer.n_vocab
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [tokenizer.token_text(i).encode() if i in special else tokenizer.token_to_piece(i)
                       for i in range(n)]
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer
        self._special = special
        self._pieces: dict[bytes, int] | None = None

    def __call__(self, text: str | bytes) -> list[int]:
        """Tokens that spell exactly ``text``: llguidance relies on it. A SentencePiece
        vocabulary puts its dummy-prefix space before the first word; that first token
        is then replaced by the one spelling the word alone (or by byte tokens)."""
        raw = text if isinstance(text, bytes) else text.encode()
        ids = list(self._tokenizer.encode(raw.decode("utf-8", errors="replace"), add_special=False,
                                          parse_special=False))
        spelled = b"".join(self.tokens[i] for i in ids)
        if spelled == raw or not ids:
            return ids
        if spelled == b" " + raw:
            first = self.tokens[ids[0]][1:]
            fixed = [self._by_piece[first]] if first in self._by_piece else self._bytes(first)
            if fixed is not None:
                return fixed + ids[1:]
        whole = self._bytes(raw)
        return whole if whole is not None else ids

    def _bytes(self, data: bytes) -> list[int] | None:
        """Byte-fallback tokens (``<0xNN>``) for ``data``, where the vocabulary has them."""
        out = [self._by_piece.get(bytes([b])) for b in data]
        return None if any(t is None for t in out) else [t for t in out if t is not None]

    @property
    def _by_piece(self) -> dict[bytes, int]:
        if self._pieces is None:
            self._pieces = {}
            # a word's own token before a byte-fallback token (<0x61>) spelling the same
            order = sorted(range(len(self.tokens)), key=lambda i: self._tokenizer.token_text(i).startswith("<0x"))
            for i in order:
                if i not in self._special:
                    self._pieces.setdefault(self.tokens[i], i)
        return self._pieces


@attrs.define(eq=False)
class Grammars:
    """Grammar compilation for one model's vocabulary."""

    _tokenizer: Any
    _ll: Any = None
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def lltokenizer(self) -> Any:
        """Blocking (reads the whole vocabulary the first time): call from a worker thread."""
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer)),
                    n_vocab=self._tokenizer.n_vocab,
                    eos_token=sorted(self._tokenizer.eog_ids),
                )
            return self._ll

    def compile(self, grammar: str) -> str:
        """Check an llguidance grammar against the vocabulary; ``InvalidRequest`` names
        the problem. Blocking: call from a worker thread."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer())
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"the grammar cannot be compiled: {error}")
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the grammar cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self._tokenizer.n_vocab)


@attrs.define(eq=False)
class Constraint:
    """One task's matcher: the mask of allowed tokens now, and the tokens taken."""

    matcher: Any
    n_vocab: int

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def failed(self) -> str | None:
        return str(self.matcher.get_error()) if self.matcher.is_error() else None


def apply_masks(constraints: Sequence[Constraint], rows: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each row [n_vocab] with the tokens its constraint forbids set to -inf; the
    masks of all rows are computed in parallel (llguidance's executor)."""
    import llguidance.numpy as lln

    n_vocab = constraints[0].n_vocab
    bitmask = lln.allocate_token_bitmask(len(constraints), n_vocab)  # [B, ceil(n_vocab / 32)]
    if len(constraints) == 1:
        lln.fill_next_token_bitmask(constraints[0].matcher, bitmask, 0)
    else:
        lln.fill_next_token_bitmask_par(_executor(), [(c.matcher, i) for i, c in enumerate(constraints)], bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little").reshape(len(constraints), -1)  # [B, 32*w]
    out = []
    for i, row in enumerate(rows):
        allowed = bits[i, : row.shape[0]].astype(bool)  # [n_vocab]
        masked = np.where(allowed, row, -np.inf).astype(row.dtype, copy=False)
        out.append(masked)
    return out


_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


# ---------------------------------------------------------------------------
# request fields -> llguidance grammars


def from_gbnf(text: str) -> str:
    import llguidance

    try:
        return str(llguidance.grammar_from("gbnf", text))
    except ValueError as exc:
        raise InvalidRequest(f"'grammar' is not a valid GBNF grammar: {exc}") from None


#: JSON between tokens: what llama.cpp's json-schema-to-grammar allows (a space, or one or
#: two newlines and up to 20 spaces or tabs), so whitespace cannot run on forever
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": True, "whitespace_pattern": r"( |\n{1,2}[ \t]{0,20})?"}


def from_json_schema(schema: Mapping[str, Any] | bool) -> str:
    import llguidance

    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(f"the JSON schema cannot be used: {exc}") from None


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def tool_call_grammar(fmt: str, tools: Sequence[Mapping[str, Any]], name: str | None) -> str:
    """A grammar whose sentences are one call (of ``name``, or of any tool) in the
    model family's format: ``tool_choice`` "required" or a named function."""
    import llguidance

    chosen = [t for t in tools if t["function"]["name"] == name] if name else list(tools)
    if not chosen:
        raise InvalidRequest(f"'tool_choice' names {name!r}, which is not in 'tools'")

    def call_schema(tool: Mapping[str, Any], args_key: str) -> dict[str, Any]:
        fn = tool["function"]
        return {"type": "object", "properties": {
            "name": {"const": fn["name"]}, args_key: fn.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}

    if fmt == "qwen3_coder":
        alts = []
        for tool in chosen:
            fn = tool["function"]
            props = list(((fn.get("parameters") or {}).get("properties") or {}).keys())
            param = " | ".join(_lark_literal(p) for p in props) if props else '"value"'
            alts.append(f'"<function={fn["name"]}>\\n" (("<parameter=" ({param}) ">\\n" /[^<]*/ "\\n</parameter>\\n"))* '
                        f'"</function>"')
        lark = "start: \"<tool_call>\\n\" (" + " | ".join(alts) + ") \"\\n</tool_call>\"\n"
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    key = "parameters" if fmt == "llama3_json" else "arguments"
    schema: dict[str, Any] = {"anyOf": [call_schema(t, key) for t in chosen]}
    if fmt == "generic":
        schema = {"type": "object", "properties": {"tool_call": schema}, "required": ["tool_call"],
                  "additionalProperties": False}
    if fmt == "hermes":
        lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema | {"x-guidance": JSON_OPTIONS})}\n'
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))  # type: ignore[arg-type]

"""``/infill``: llama-server's fill-in-the-middle prompt (``format_prompt_infill``).

The request's ``input_prefix``, ``input_suffix``, optional ``input_extra`` (context
chunks ``{"filename", "text"}``) and ``prompt`` (the start of the middle) become one
prompt in the repo-level FIM layout (https://arxiv.org/pdf/2409.12186), which then runs
as a ``/completion`` prompt of token ids (streamed or not, with every sampling field):

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

(``--spm-infill``: the suffix part before the prefix part). The prefix keeps its last
``3/4`` of ``n_batch`` tokens, the suffix its first ``n_batch/4 - 2 - len(prompt)``,
the extra chunks the last ``n_ctx - n_batch - 2 n_predict`` tokens; without a FIM_SEP
token each chunk is introduced by ``\\n\\n--- snippet ---\\n\\n`` instead. The FIM
tokens are the vocabulary's: ``tokenizer.ggml.fim_*_token_id`` (or the deprecated
``prefix/suffix/middle_token_id``), else the token texts llama.cpp's vocabulary
loader recognises (Qwen's ``<|fim_prefix|>``, CodeLlama's ``<PRE>``, ...). A
vocabulary without prefix, suffix and middle tokens cannot infill (501, llama-server's
answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trio_llm.errors import InvalidRequest

#: llama.cpp's ``llama_vocab::impl::load`` token texts, by role (after the metadata ids)
FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_KEYS = {"pre": ("fim_pre", "prefix"), "suf": ("fim_suf", "suffix"), "mid": ("fim_mid", "middle"),
         "rep": ("fim_rep",), "sep": ("fim_sep",)}
#: ``\n\n--- snippet ---\n\n``: llama-server's chunk separator without a FIM_SEP token
SNIPPET = "\n\n--- snippet ---\n\n"


@attrs.frozen
class FimTokens:
    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None
    sep: int | None

    def missing(self) -> str:
        """llama-server's complaint, empty when infill is possible."""
        return "".join(f"{what} token is missing. " for what, t in
                       (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if t is None)


def fim_tokens(metadata: Mapping[str, Any]) -> FimTokens:
    """The vocabulary's FIM tokens: metadata ids first, then the known token texts."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    n = len(tokens)
    found: dict[str, int | None] = {}
    by_text: dict[str, int] | None = None
    for role, keys in _KEYS.items():
        tid = None
        for key in keys:
            value = metadata.get(f"tokenizer.ggml.{key}_token_id")
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
                tid = value
                break
        if tid is None:
            if by_text is None:
                wanted = {t for texts in FIM_TEXTS.values() for t in texts}
                by_text = {t: i for i, t in enumerate(tokens) if t in wanted}
            tid = next((by_text[t] for t in FIM_TEXTS[role] if t in by_text), None)
        found[role] = tid
    return FimTokens(**found)


def _str_field(body: Mapping[str, Any], key: str) -> Any:
    value = body[key]
    if isinstance(value, str) or (isinstance(value, list) and all(
            isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in value)):
        return value
    raise InvalidRequest(f'"{key}" must be a string')


def check_request(body: Any) -> tuple[Any, Any, list[dict[str, str]], str]:
    """llama-server's checks of an infill request: (prefix, suffix, extra, prompt)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise InvalidRequest('"prompt" must be a string')
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            raise InvalidRequest(f'"{key}" is required')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise InvalidRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise InvalidRequest('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise InvalidRequest('extra_context chunk\'s "filename" field must be a string')
    return _str_field(body, "input_prefix"), _str_field(body, "input_suffix"), extra, prompt


def _mixed(tok: Any, value: Any, n_vocab: int) -> list[int]:
    """llama-server's ``tokenize_mixed`` without specials (text or a list mixing ids)."""
    if isinstance(value, str):
        return list(tok.encode(value, add_special=False, parse_special=False))
    ids: list[int] = []
    for v in value:
        if isinstance(v, str):
            ids += tok.encode(v, add_special=False, parse_special=False)
        elif 0 <= v < n_vocab:
            ids.append(int(v))
        else:
            raise InvalidRequest(f"token {v} is outside the vocabulary of {n_vocab}")
    return ids


def infill_prompt(body: Any, tok: Any, fim: FimTokens, *, n_vocab: int, n_batch: int, n_predict: int,
                  n_ctx: int, spm: bool) -> list[int]:
    """The prompt's token ids (``format_prompt_infill``, see the module docstring)."""
    prefix, suffix, extra, prompt = check_request(body)
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None

    def plain(text: str) -> list[int]:
        return list(tok.encode(text, add_special=False, parse_special=False))

    tokens_prompt = list(tok.encode(prompt, add_special=False, parse_special=True))
    tokens_prefix = _mixed(tok, prefix, n_vocab)
    tokens_suffix = _mixed(tok, suffix, n_vocab)
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *plain("myproject\n")]
    for chunk in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep, *plain(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_tokens += plain(SNIPPET)
        extra_tokens += plain(chunk["text"])
    if fim.sep is not None:
        extra_tokens += [fim.sep, *plain("filename\n")]
    n_prefix_take = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(tokens_suffix), max(0, n_batch // 4 - (2 + len(tokens_prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim.pre, *tokens_prefix[len(tokens_prefix) - n_prefix_take:], *tokens_prompt]
    tail = [fim.suf, *tokens_suffix[:n_suffix_take]]
    first, second = (tail, head) if spm else (head, tail)
    if tok.add_bos and tok.bos_id is not None:
        first = [tok.bos_id, *first]
    taken: Sequence[int] = extra_tokens[len(extra_tokens) - n_extra_take:] if n_extra_take else []
    return [*taken, *first, *second, fim.mid]

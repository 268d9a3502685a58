"""Request bodies → validated task parameters: the HTTP edge's type checks.

Every field is checked for type and range here, once, with a message naming the
field, so that bad input is a 400 with a clear reason and never reaches an actor.
Unknown fields are ignored, as llama-server does (clients send OpenAI options we do
not implement, such as ``user``); so is ``model``, since one server runs one model.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from trio_llm.config import ServerConfig
from trio_llm.engine import constraint as C
from trio_llm.engine.reasoning_budget import BudgetSpec
from trio_llm.engine.sampling import DEFAULT_SEED, SamplingParams, sampler_names
from trio_llm.errors import ContextOverflow, InvalidRequest
from trio_llm.model import chat_output as CO
from trio_llm.model.chat_output import THINK_CLOSE, THINK_OPEN
from trio_llm.server import media as MD
from trio_llm.server.tasks import TaskParams

MAX_STOP_WORDS = 64
MAX_N_PROBS = 100
MAX_TOP_LOGPROBS = 20


class Encoder(Protocol):
    bos_id: int | None

    @property
    def eog_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


@attrs.frozen
class Limits:
    """What the running server allows (and the request's cancel event, for its images'
    encodes: ``media.run_sync_cancellable`` sets it)."""

    n_ctx: int  # positions per slot
    n_vocab: int
    n_slots: int
    defaults: ServerConfig
    media: Any = None  # trio_llm.server.media.MediaEncoder: with --mmproj only
    cancel: threading.Event | None = None  # set: the request is gone, stop encoding its images


_MISSING: Any = object()


def _get(body: Mapping[str, Any], key: str) -> Any:
    v = body.get(key, _MISSING)
    return _MISSING if v is None else v


def get_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{key}' must be a boolean")
    return v


def get_int(body: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{key}' must be an integer")
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{key}' must be between {lo} and {hi}, got {v}")
    return v


def get_float(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InvalidRequest(f"'{key}' must be a number")
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{key}' must be between {lo} and {hi}, got {v}")
    return float(v)


def get_stop(body: Mapping[str, Any], default: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The request's stop words; ``default`` (-r) when it gives none, or only empty
    ones (llama-server falls back to its command line's the same way)."""
    v = _get(body, "stop")
    if v is _MISSING:
        return default
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise InvalidRequest("'stop' must be a string or a list of strings")
    if len(words) > MAX_STOP_WORDS:
        raise InvalidRequest(f"'stop' holds at most {MAX_STOP_WORDS} strings")
    return tuple(w for w in words if w) or default


def _logit_bias(body: Mapping[str, Any], n_vocab: int, tok: Encoder | None = None) -> list[tuple[int, float]]:
    """OpenAI's ``{"token id": bias}`` or llama-server's ``[[id, bias], ...]``
    (``false`` as a bias bans the token); as llama-server, a token given as text
    (``[" Hello", -1]``, or a key that is not a number) biases every token of it."""
    v = _get(body, "logit_bias")
    if v is _MISSING:
        return []
    pairs: Iterable[Any]
    if isinstance(v, dict):
        pairs = v.items()
    elif isinstance(v, list):
        pairs = v
    else:
        raise InvalidRequest("'logit_bias' must be an object or a list of [token, bias] pairs")
    out = []
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise InvalidRequest("'logit_bias' entries must be [token, bias] pairs")
        key, bias = pair
        if bias is False:
            bias = -math.inf
        if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
            raise InvalidRequest("'logit_bias' values must be numbers")
        ids: list[int]
        if isinstance(key, str) and not key.strip().lstrip("-").isdigit():
            if tok is None:
                raise InvalidRequest(f"'logit_bias' names {key!r}, not a token id")
            ids = tok.encode(key, add_special=False, parse_special=False)
        elif isinstance(key, str) or (isinstance(key, int | float) and not isinstance(key, bool)
                                       and float(key).is_integer()):
            ids = [int(key)]
        else:
            raise InvalidRequest(f"'logit_bias' names {key!r}, not a token id")
        for t in ids:
            if not 0 <= t < n_vocab:
                raise InvalidRequest(f"'logit_bias' names token {t}, outside the vocabulary of {n_vocab}")
            out.append((t, float(bias)))
    return out


def sampling_params(
    body: Mapping[str, Any], limits: Limits, tok: Encoder, *, n_probs: int
) -> SamplingParams:
    d = limits.defaults
    if _get(body, "logit_bias") is _MISSING:  # -l: the server's, tokens of this vocabulary only
        bias = [(t, b) for t, b in d.logit_bias if 0 <= t < limits.n_vocab]
    else:
        bias = _logit_bias(body, limits.n_vocab, tok)
    if get_bool(body, "ignore_eos", d.ignore_eos):
        bias += [(t, -math.inf) for t in sorted(tok.eog_ids)]
    seed = get_int(body, "seed", d.seed, -1, (1 << 64) - 1)
    return SamplingParams(
        temperature=get_float(body, "temperature", d.temp, 0.0, 100.0),
        top_k=get_int(body, "top_k", d.top_k, -1, 1 << 31),
        top_p=get_float(body, "top_p", d.top_p, 0.0, 1.0),
        min_p=get_float(body, "min_p", d.min_p, 0.0, 1.0),
        typical_p=get_float(body, "typical_p", d.typical_p, 0.0, 1.0),
        repeat_penalty=get_float(body, "repeat_penalty", d.repeat_penalty, 1e-3, 100.0),
        repeat_last_n=get_int(body, "repeat_last_n", d.repeat_last_n, -1, 1 << 31),
        presence_penalty=get_float(body, "presence_penalty", d.presence_penalty, -2.0, 2.0),
        frequency_penalty=get_float(body, "frequency_penalty", d.frequency_penalty, -2.0, 2.0),
        seed=DEFAULT_SEED if seed < 0 else seed,
        n_probs=n_probs,
        logit_bias=tuple(bias),
        **_other_samplers(body, d),
    )


INT_MAX = (1 << 31) - 1
BIG = 1e30


def _other_samplers(body: Mapping[str, Any], d: Any) -> dict[str, Any]:
    """llama.cpp's samplers beyond the basic chain, by llama-server's field names and
    limits (``server-schema.cpp``); the server's flags are the defaults."""
    base = get_float(body, "dry_base", d.dry_base, -BIG, BIG)
    breakers = _get(body, "dry_sequence_breakers")
    if breakers is _MISSING:
        breakers = d.dry_sequence_breakers
    elif not isinstance(breakers, list) or not breakers or not all(isinstance(b, str) for b in breakers):
        raise InvalidRequest("'dry_sequence_breakers' must be a non-empty array of strings")
    samplers = _get(body, "samplers")
    if samplers is _MISSING:
        order = d.samplers
    elif isinstance(samplers, str) or (isinstance(samplers, list) and all(isinstance(x, str) for x in samplers)):
        order = sampler_names(samplers)
    else:
        raise InvalidRequest("'samplers' must be an array of sampler names or a string of sampler characters")
    out: dict[str, Any] = dict(
        top_n_sigma=get_float(body, "top_n_sigma", d.top_n_sigma, -BIG, BIG),
        xtc_probability=get_float(body, "xtc_probability", d.xtc_probability, 0.0, 1.0),
        xtc_threshold=get_float(body, "xtc_threshold", d.xtc_threshold, 0.0, 1.0),
        dynatemp_range=get_float(body, "dynatemp_range", d.dynatemp_range, -BIG, BIG),
        dynatemp_exponent=get_float(body, "dynatemp_exponent", d.dynatemp_exponent, -BIG, BIG),
        dry_multiplier=get_float(body, "dry_multiplier", d.dry_multiplier, 0.0, BIG),
        dry_base=base if base >= 1.0 else d.dry_base,  # llama-server: a base below 1 is the server's
        dry_allowed_length=get_int(body, "dry_allowed_length", d.dry_allowed_length, 0, INT_MAX),
        dry_penalty_last_n=get_int(body, "dry_penalty_last_n", d.dry_penalty_last_n, 0, INT_MAX),
        dry_sequence_breakers=tuple(breakers),
        mirostat=get_int(body, "mirostat", d.mirostat, 0, 2),
        mirostat_tau=get_float(body, "mirostat_tau", d.mirostat_tau, -BIG, BIG),
        mirostat_eta=get_float(body, "mirostat_eta", d.mirostat_eta, -BIG, BIG),
        min_keep=get_int(body, "min_keep", d.min_keep, 0, INT_MAX),
        adaptive_target=get_float(body, "adaptive_target", d.adaptive_target, -BIG, 1.0),
        adaptive_decay=get_float(body, "adaptive_decay", d.adaptive_decay, 0.0, 0.99),
    )
    if order is not None:
        out["samplers"] = tuple(order)
    return out


def encode_prompt(tok: Encoder, text: str, *, add_special: bool = True) -> list[int]:
    """Tokenize a prompt the way llama-server does (specials parsed), without the
    doubled BOS a template that writes its own ``bos_token`` would otherwise give."""
    ids = tok.encode(text, add_special=add_special, parse_special=True)
    if len(ids) >= 2 and tok.bos_id is not None and ids[0] == ids[1] == tok.bos_id:
        ids = ids[1:]
    return ids


def prompt_list(value: Any, tok: Encoder, limits: Limits, key: str = "prompt",
                media: dict[int, Any] | None = None) -> list[list[int]]:
    """OpenAI's prompt: one prompt, or a list of several (strings, token-id lists or
    multimodal objects), each in ``prompt_tokens``'s forms."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list | dict) for v in value):
        return [prompt_tokens(v, tok, limits, key, media) for v in value]
    return [prompt_tokens(value, tok, limits, key, media)]


def prompt_tokens(value: Any, tok: Encoder, limits: Limits, key: str = "prompt",
                  media: dict[int, Any] | None = None) -> list[int]:
    """A prompt as text, as token ids, as a list mixing both, or llama-server's
    multimodal object ``{"prompt_string": ..., "multimodal_data": [base64, ...]}``, one
    image per ``<__media__>`` marker (its rows go into ``media``: media id -> rows)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list | dict):
        value = value[0]  # a batch of one prompt
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list | dict) for v in value):
        raise InvalidRequest(
            f"'{key}' holds several prompts, which are not supported: send one request each"
        )
    if isinstance(value, dict):
        ids = _multimodal_prompt(value, tok, limits, media)
    elif isinstance(value, str) and limits.media is not None and limits.media.marker in value:
        ids = limits.media.tokenize(value, [], {})  # a marker without its image: refused as llama-server does
    elif isinstance(value, str):
        ids = encode_prompt(tok, value)
    elif isinstance(value, list) and value:
        ids = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                ids += encode_prompt(tok, part, add_special=(i == 0))
            elif isinstance(part, int) and not isinstance(part, bool):
                if not 0 <= part < limits.n_vocab:
                    raise InvalidRequest(f"'{key}' holds token {part}, outside the vocabulary of {limits.n_vocab}")
                ids.append(part)
            else:
                raise InvalidRequest(
                    f"'{key}' must be a string, a list of token ids, or one list mixing them "
                    "(several prompts in one request are not supported: send one request each)"
                )
    else:
        raise InvalidRequest(f"'{key}' must be a non-empty string or list of token ids")
    check_fits(ids, limits)
    return ids


def _multimodal_prompt(value: dict[str, Any], tok: Encoder, limits: Limits, media: dict[int, Any] | None) -> list[int]:
    text = value.get("prompt_string")
    if not isinstance(text, str):
        raise InvalidRequest("'prompt_string' must be a string")
    data = value.get("multimodal_data", [])
    if data and (limits.media is None or media is None):
        raise InvalidRequest("Multimodal data provided, but model does not support multimodal requests.")
    if not isinstance(data, list):
        raise InvalidRequest("'multimodal_data' must be an array of base64 strings")
    if limits.media is None or media is None:
        return encode_prompt(tok, text)
    images = [MD.decode_base64(d, "multimodal_data") for d in data]
    return list(limits.media.tokenize(text, images, media, cancel=limits.cancel))


def check_fits(ids: Sequence[int], limits: Limits) -> None:
    if not ids:
        raise InvalidRequest("the prompt is empty")
    if len(ids) >= limits.n_ctx:
        raise ContextOverflow(len(ids) + 1, limits.n_ctx)


def _n_predict(body: Mapping[str, Any], limits: Limits, *keys: str) -> int:
    n = limits.defaults.n_predict
    for key in keys:
        if _get(body, key) is not _MISSING:
            n = get_int(body, key, n, -1, 1 << 31)
            break
    return n


def grammar_of(body: Mapping[str, Any]) -> str | None:
    """llama-server's ``grammar`` (GBNF) and ``json_schema``, OpenAI's ``response_format``
    (``json_object``, optionally with ``schema``; ``json_schema``): an llguidance grammar,
    checked against the vocabulary later (``Grammars.compile``); None: unconstrained."""
    given = [k for k in ("grammar", "json_schema", "response_format") if _get(body, k) is not _MISSING]
    if len(given) > 1:
        raise InvalidRequest(f"only one of {', '.join(repr(g) for g in given)} can be given")
    if not given:
        return None
    value = body[given[0]]
    if given[0] == "grammar":
        if not isinstance(value, str):
            raise InvalidRequest("'grammar' must be a string (GBNF)")
        return C.from_gbnf(value) if value.strip() else None
    if given[0] == "json_schema":
        if not isinstance(value, dict | bool):
            raise InvalidRequest("'json_schema' must be a JSON schema object")
        return C.from_json_schema(value)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest("'response_format' must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise InvalidRequest("'response_format.schema' must be a JSON schema object")
        return C.from_json_schema(schema)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("'response_format.json_schema.schema' must be a JSON schema object")
        return C.from_json_schema(schema)
    raise InvalidRequest(f"'response_format.type' must be text, json_object or json_schema, not {kind!r}")


def _request_grammar(body: Mapping[str, Any], config: ServerConfig) -> str | None:
    """The request's grammar, else the server's (--grammar, --json-schema); a request's
    ``response_format`` of type ``text`` asks for none."""
    own = grammar_of(body)
    if own is not None:
        return own
    if any(_get(body, k) is not _MISSING for k in ("grammar", "json_schema", "response_format")):
        return None
    return config.grammar


def _tags(value: Any, key: str) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(f"'{key}' must be a string or a list of strings")
    return [v for v in value if v]


def reasoning_budget(body: Mapping[str, Any], tok: Encoder, config: ServerConfig, *,
                     chat: tuple[bool, bool] | None = None) -> BudgetSpec | None:
    """llama-server's thinking budget of a request, or None.

    ``/completion`` names everything itself: ``reasoning_budget_tokens`` (-1: none),
    ``reasoning_budget_start_tag``, ``reasoning_budget_end_tags`` (or ``_end_tag``),
    ``reasoning_budget_message``. A chat request (``chat``: whether the template thinks,
    and whether its prompt ends in an open ``<think>``) takes ``reasoning_budget_tokens``
    or ``thinking_budget_tokens``, else ``--reasoning-budget``, and the template's tags
    (``<think>``, ``</think>``), its message else ``--reasoning-budget-message``, as
    llama-server's chat handler fills them in."""
    control = get_bool(body, "reasoning_control", False)
    if control and chat is None:
        raise InvalidRequest("'reasoning_control' needs a chat request (/v1/chat/completions/control ends its "
                             "thought)")
    budget = get_int(body, "reasoning_budget_tokens", -1, -1, (1 << 31) - 1)
    if chat is not None:
        if budget < 0:
            budget = get_int(body, "thinking_budget_tokens", -1, -1, (1 << 31) - 1)
        if budget < 0:
            budget = config.reasoning_budget
        thinks, opened = chat
        if not thinks:
            return None
        start, ends = THINK_OPEN, [THINK_CLOSE]
        message = _get(body, "reasoning_budget_message")
        message = config.reasoning_budget_message if message is _MISSING else message
    else:
        start_v = _get(body, "reasoning_budget_start_tag")
        start = "" if start_v is _MISSING else start_v
        if not isinstance(start, str):
            raise InvalidRequest("'reasoning_budget_start_tag' must be a string")
        end_v = _get(body, "reasoning_budget_end_tags")
        key = "reasoning_budget_end_tags"
        if end_v is _MISSING:
            end_v, key = _get(body, "reasoning_budget_end_tag"), "reasoning_budget_end_tag"
        ends = [] if end_v is _MISSING else _tags(end_v, key)
        message = _get(body, "reasoning_budget_message")
        opened = False
    if message is _MISSING or message is None:
        message = ""
    if not isinstance(message, str):
        raise InvalidRequest("'reasoning_budget_message' must be a string")
    if not start or not ends or (budget < 0 and not control):
        return None
    if budget < 0:  # reasoning control alone: no count, the thought ends when asked
        budget = (1 << 31) - 1

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special=False, parse_special=True))

    end_ids = tuple(ids(e) for e in ends)
    forced = (ids(message) if message else ()) + end_ids[0]
    return BudgetSpec(budget, (ids(start),), end_ids, forced, prefill=ids(start) if opened else (), control=control)


def _task_params(body: Mapping[str, Any], limits: Limits, tok: Encoder, *, n_predict: int, n_probs: int,
                 grammar: str | None = None, chat: tuple[bool, bool] | None = None) -> TaskParams:
    refuse_unbuilt(body, limits.defaults)
    return TaskParams(
        grammar=grammar if grammar is not None else _request_grammar(body, limits.defaults),
        n_predict=n_predict,
        sampling=sampling_params(body, limits, tok, n_probs=n_probs),
        stop=get_stop(body, limits.defaults.reverse_prompt),
        cache_prompt=get_bool(body, "cache_prompt", limits.defaults.cache_prompt),
        id_slot=get_int(body, "id_slot", -1, -1, limits.n_slots - 1),
        stream=get_bool(body, "stream", False),
        return_progress=get_bool(body, "return_progress", False),
        timings_per_token=get_bool(body, "timings_per_token", False),
        n_cache_reuse=get_int(body, "n_cache_reuse", limits.defaults.cache_reuse, -(1 << 31), (1 << 31) - 1),
        post_sampling_probs=get_bool(body, "post_sampling_probs", False),
        reasoning=reasoning_budget(body, tok, limits.defaults, chat=chat),
        n_indent=get_int(body, "n_indent", 0, 0, (1 << 31) - 1),
        t_max_predict_ms=get_int(body, "t_max_predict_ms", -1, -1, (1 << 62)),
        response_fields=_response_fields(body),
        return_tokens=get_bool(body, "return_tokens", False),
        n_keep=get_int(body, "n_keep", limits.defaults.n_keep, -1, (1 << 31) - 1),
        n_discard=get_int(body, "n_discard", 0, 0, (1 << 31) - 1),
    )


def _response_fields(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = _get(body, "response_fields")
    if v is _MISSING:
        return ()
    if not isinstance(v, list) or not all(isinstance(f, str) for f in v):
        raise InvalidRequest("'response_fields' must be a list of strings")
    return tuple(v)


def lora_scales(value: Any, config: ServerConfig) -> dict[int, float]:
    """llama-server's ``lora`` list (``[{"id", "scale"}]``) as every adapter's scale: an
    adapter it leaves out has scale 0 (``construct_lora_list``)."""
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise InvalidRequest("'lora' must be an array of objects with 'id' and 'scale' fields")
    asked: dict[int, float] = {}
    for e in value:
        i, s = e.get("id", -1), e.get("scale", 0.0)
        if isinstance(i, bool) or not isinstance(i, int) or isinstance(s, bool) or not isinstance(s, int | float):
            raise InvalidRequest("'lora' entries need an integer 'id' and a number 'scale'")
        if not 0 <= i < len(config.lora):
            raise InvalidRequest(f"'lora': no adapter {i} (this server has {len(config.lora)})")
        asked[i] = float(s)
    return {i: asked.get(i, 0.0) for i in range(len(config.lora))}


def refuse_unbuilt(body: Mapping[str, Any], config: ServerConfig) -> None:
    """llama-server's request fields that change the answer and are not built here: a
    400 naming them, never a 200 that ignored them."""
    lora = _get(body, "lora")
    if lora is not _MISSING and lora != []:
        if lora_scales(lora, config) != {i: s for i, (_, s) in enumerate(config.lora)}:
            raise InvalidRequest("'lora': per-request adapter scales are not supported; this server's are "
                                 + (", ".join(f"{i}: {s:g}" for i, (_, s) in enumerate(config.lora)) or "none"))
    if get_bool(body, "grammar_lazy", False):
        raise InvalidRequest("'grammar_lazy': lazy grammars (grammar_triggers) are not supported")


def valid_filename(name: str) -> bool:
    """A plain file name for ``--slot-save-path``: no folder part, nothing hidden or
    special, printable (llama-server refuses the same)."""
    return (
        0 < len(name) <= 255 and name not in (".", "..") and not name.startswith(".")
        and "/" not in name and "\\" not in name and name.isprintable()
    )


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _get_n(body: Mapping[str, Any], limits: Limits) -> int:
    """OpenAI's ``n``: that many choices, each in its own slot at the same time (so at
    most the server's slots, as llama-server's limit), each with its own random stream.
    With ``id_slot`` every choice is pinned to that one slot and they run one after
    another there (llama-server serves that too)."""
    return get_int(body, "n", 1, 1, limits.n_slots)


def choice_params(params: TaskParams, n: int) -> list[TaskParams]:
    """The task parameters of each of ``n`` choices: a fixed seed becomes seed + i for
    choice i (the same seed would give n copies of one answer); a random seed is
    drawn per task anyway."""
    seed = params.sampling.seed
    if n == 1 or seed < 0 or seed == DEFAULT_SEED:
        return [params] * n
    return [attrs.evolve(params, sampling=attrs.evolve(params.sampling, seed=(seed + i) % DEFAULT_SEED))
            for i in range(n)]


@attrs.frozen
class CompletionRequest:
    prompt: tuple[int, ...]
    params: TaskParams
    n_logprobs: int = 0  # OpenAI logprobs/top_logprobs asked for (0: none)
    logprobs: bool = False  # chat: return the chosen tokens' logprobs
    include_usage: bool = False  # stream_options.include_usage
    prompt_text: str = ""  # chat: the rendered template
    n: int = 1  # OpenAI's choices per prompt
    more_prompts: tuple[tuple[int, ...], ...] = ()  # /v1/completions: prompts after the first

    def choices(self) -> list[tuple[tuple[int, ...], TaskParams]]:
        """(prompt, parameters) of every choice in OpenAI's order: the n choices of
        the first prompt, then those of the next."""
        each = choice_params(self.params, self.n)
        return [(p, params) for p in (self.prompt, *self.more_prompts) for params in each]


def parse_completion(body: Any, tok: Encoder, limits: Limits) -> CompletionRequest:
    """``POST /completion`` (llama-server native)."""
    body = _require_object(body)
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required")
    media: dict[int, Any] = {}
    prompts = prompt_list(body["prompt"], tok, limits, media=media)
    if len(prompts) > limits.n_slots:
        raise InvalidRequest(f"{len(prompts)} prompts need as many slots at once; this server has {limits.n_slots} (-np)")
    n_probs = get_int(body, "n_probs", 0, 0, MAX_N_PROBS)
    params = _task_params(body, limits, tok, n_predict=_n_predict(body, limits, "n_predict", "max_tokens"), n_probs=n_probs)
    if media:
        params = attrs.evolve(params, media=media)
    if len(prompts) > 1 and params.id_slot >= 0:
        raise InvalidRequest("'id_slot' pins one slot; it cannot serve several prompts")
    # llama-server's n_cmpl (alias n): completions of each prompt, all at once
    n = get_int(body, "n_cmpl", get_int(body, "n", 1, 1, limits.n_slots), 1, limits.n_slots)
    if len(prompts) * n > limits.n_slots:
        raise InvalidRequest(f"{len(prompts)} prompt(s) x {n} completions need as many slots at once; this server "
                             f"has {limits.n_slots} (-np)")
    if n > 1 and params.id_slot >= 0:
        raise InvalidRequest("'id_slot' pins one slot; it cannot serve several completions at once")
    return CompletionRequest(tuple(prompts[0]), params, more_prompts=tuple(tuple(p) for p in prompts[1:]), n=n)


def parse_oai_completion(body: Any, tok: Encoder, limits: Limits) -> CompletionRequest:
    """``POST /v1/completions`` (OpenAI legacy completions)."""
    body = _require_object(body)
    n = _get_n(body, limits)
    if get_bool(body, "echo", False):
        raise InvalidRequest("'echo' is not supported")
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required")
    media: dict[int, Any] = {}
    prompts = prompt_list(body["prompt"], tok, limits, media=media)
    if len(prompts) * n > limits.n_slots:
        raise InvalidRequest(
            f"{len(prompts)} prompts x 'n' {n} need {len(prompts) * n} slots at once; "
            f"this server has {limits.n_slots} (-np)"
        )
    if len(prompts) > 1 and get_int(body, "id_slot", -1, -1, limits.n_slots - 1) >= 0:
        raise InvalidRequest("'id_slot' pins one slot; it cannot serve several prompts")
    logprobs = get_int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS) if _get(body, "logprobs") is not _MISSING else -1
    params = _task_params(
        body, limits, tok, n_predict=_n_predict(body, limits, "max_tokens", "n_predict"),
        n_probs=max(logprobs, 1) if logprobs >= 0 else 0,
    )
    if media:
        params = attrs.evolve(params, media=media)
    return CompletionRequest(
        tuple(prompts[0]), params, n_logprobs=logprobs, logprobs=logprobs >= 0,
        include_usage=_include_usage(body), n=n, more_prompts=tuple(tuple(p) for p in prompts[1:]),
    )


def _include_usage(body: Mapping[str, Any]) -> bool:
    opts = _get(body, "stream_options")
    if opts is _MISSING:
        return False
    if not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object")
    return get_bool(opts, "include_usage", False)


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = _get(body, "messages")
    if msgs is _MISSING:
        raise InvalidRequest("'messages' is required")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise InvalidRequest("'messages' must be a non-empty list of objects")
    return msgs


def template_kwargs(body: Mapping[str, Any], config: ServerConfig) -> dict[str, Any]:
    """The chat template's extra variables: the server's (``--chat-template-kwargs``,
    ``--reasoning``, ``--reasoning-effort``) under the request's ``chat_template_kwargs``
    (and its ``reasoning_effort``), as llama-server merges them."""
    out = config.template_kwargs()
    kwargs = _get(body, "chat_template_kwargs")
    if kwargs is not _MISSING:
        if not isinstance(kwargs, dict):
            raise InvalidRequest("'chat_template_kwargs' must be an object")
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & kwargs.keys()
        if reserved:
            raise InvalidRequest(f"'chat_template_kwargs' cannot set {sorted(reserved)[0]!r}")
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise InvalidRequest('invalid type for "enable_thinking" (expected boolean)')
        out |= kwargs
    effort = _get(body, "reasoning_effort")
    if effort is not _MISSING:
        if not isinstance(effort, str):
            raise InvalidRequest("'reasoning_effort' must be a string")
        if effort == "none":  # OpenAI's "none": no thinking at all
            out["enable_thinking"] = False
            out.pop("reasoning_effort", None)
        elif effort:
            out["reasoning_effort"] = effort
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    tools = _get(body, "tools")
    if tools is _MISSING:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def _tool_choice(body: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """("auto" | "none" | "required", the function named by {"type": "function", ...})."""
    choice = _get(body, "tool_choice")
    if choice is _MISSING:
        return "auto", None
    if choice in ("auto", "none"):
        return str(choice), None
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise InvalidRequest("'tool_choice' asks for a tool call but 'tools' is empty")
        if choice == "required":
            return "required", None
        fn = choice.get("function") if isinstance(choice, dict) else None
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest("'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return "required", fn["name"]
    raise InvalidRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", ...}")


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as templates read them: ``arguments`` as an object where the
    client sent JSON text (llama.cpp does the same for the templates that need it)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        raise InvalidRequest("a tool call's 'arguments' must be JSON") from None
                    c = {**c, "function": {**fn, "arguments": args}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


@attrs.frozen
class ChatInputs:
    """What the chat template renders, and how the answer will be read."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    output: CO.OutputSpec
    grammar: str | None = None  # tool_choice "required" / named: the call's grammar
    add_generation_prompt: bool = True
    continue_final: bool = False  # the last message is the assistant's, to be continued


def _continuation(body: Mapping[str, Any]) -> bool:
    value = _get(body, "continue_final_message")
    return value is True or value in ("content", "reasoning_content")


def chat_inputs(body: Any, config: ServerConfig, template_source: str | None) -> ChatInputs:
    """A chat request's messages, template variables (tools, the thinking switch) and
    answer format. Tools reach a template that knows them; for one that does not they
    are described in a system message (llama.cpp's generic format)."""
    body = _require_object(body)
    messages = _template_messages(messages_of(body))
    if "<|channel|>" not in (template_source or ""):
        # llama.cpp's workaround: "developer" is "system" for every template but GPT-OSS's
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    kwargs = template_kwargs(body, config)
    tools = _tools(body)
    choice, named = _tool_choice(body, tools)
    fmt_ = _get(body, "reasoning_format")
    if fmt_ is _MISSING:
        fmt_ = config.reasoning_format
    elif fmt_ not in CO.REASONING_FORMATS:
        raise InvalidRequest(f"'reasoning_format' must be one of {', '.join(CO.REASONING_FORMATS)}")
    if config.skip_chat_parsing:
        fmt_ = "none"
    fmt: CO.Format | None = None
    if tools and choice != "none":
        fmt = CO.detect_format(template_source)
        if CO.template_handles_tools(template_source):
            kwargs["tools"] = tools
            kwargs["tool_choice"] = choice
        else:
            fmt = "generic"
            note = CO.generic_tool_prompt(tools)
            if messages and messages[0].get("role") == "system":
                messages = [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{note}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": note}, *messages]
    if config.skip_chat_parsing:
        fmt = None
    add_gen = get_bool(body, "add_generation_prompt", True)
    # vLLM's / transformers' explicit switch (llama-server reads it too): true, or the
    # part to continue ("content", "reasoning_content"); anything else means no
    explicit = _continuation(body)
    ends_assistant = bool(messages and messages[-1].get("role") == "assistant")
    continue_final = ends_assistant and (explicit or config.prefill_assistant)
    if explicit and add_gen:
        raise InvalidRequest("Cannot set both add_generation_prompt and continue_final_message to true.")
    if continue_final:
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise InvalidRequest("Cannot have 2 or more assistant messages at the end of the list.")
        if messages[-1].get("tool_calls"):
            raise InvalidRequest("Cannot continue an assistant message that contains tool calls.")
        add_gen = False
    if tools and choice != "none" and _get(body, "grammar") is not _MISSING:
        raise InvalidRequest("Cannot use custom grammar constraints with tools.")
    grammar = None
    if choice == "required":
        if fmt is None:
            raise InvalidRequest("'tool_choice' \"required\" needs the answer parsed (not --skip-chat-parsing)")
        grammar = C.tool_call_grammar(fmt, tools, named)
    return ChatInputs(messages, kwargs, CO.OutputSpec(fmt, str(fmt_), False, tuple(tools)), grammar, add_gen,
                      continue_final)


def parse_chat(body: Any, tok: Encoder, limits: Limits, rendered: str, grammar: str | None = None,
               images: Sequence[bytes] = (), thinking: tuple[bool, bool] = (False, False)) -> CompletionRequest:
    """``POST /v1/chat/completions``, once the messages are rendered by the template
    (their ``image_url`` parts written as markers, the images in ``images``);
    ``thinking``: whether the template thinks, and whether the prompt ends in an open
    ``<think>`` (the thinking budget's tags and its start)."""
    body = _require_object(body)
    n = _get_n(body, limits)
    logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
    media: dict[int, Any] = {}
    if limits.media is not None and (images or limits.media.marker in rendered):
        prompt = list(limits.media.tokenize(rendered, images, media, cancel=limits.cancel))
    else:
        prompt = encode_prompt(tok, rendered)
    check_fits(prompt, limits)
    params = _task_params(
        body, limits, tok,
        n_predict=_n_predict(body, limits, "max_completion_tokens", "max_tokens", "n_predict"),
        n_probs=max(top, 1) if logprobs else 0, grammar=grammar, chat=thinking,
    )
    if media:
        params = attrs.evolve(params, media=media)
    return CompletionRequest(
        tuple(prompt), params, n_logprobs=top, logprobs=logprobs,
        include_usage=_include_usage(body), prompt_text=rendered, n=n,
    )

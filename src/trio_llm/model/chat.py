"""Chat templates: the Jinja template a GGUF carries, rendered the way transformers does.

llama-server and transformers agree on the contract a template is written against, so
real templates work unchanged: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` (plus whatever the request passes, e.g. ``tools`` or
``enable_thinking``), the functions ``raise_exception`` and ``strftime_now``, and a
``tojson`` that writes plain JSON (Jinja's own escapes HTML characters).

A template usually writes BOS itself, and the tokenizer adds one too when the model
asks for it; like llama-server we drop the template's leading BOS text in that case
(and a trailing EOS text if the tokenizer appends EOS), so a prompt never starts with
two BOS tokens. A file without a template gets plain ChatML, llama-server's fallback.
``--chat-template NAME`` gives one of llama-server's built-in formats, written as Jinja
in ``builtin_templates`` (those keep the prompt as llama.cpp's legacy formatter writes
it: no BOS is dropped).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from trio_llm.errors import InvalidRequest, TemplateError
from trio_llm.model.builtin_templates import BUILTIN_TEMPLATES, LEGACY_SOURCES
from trio_llm.model.tokenizer import Tokenizer

#: used when the GGUF has no ``tokenizer.chat_template``
FALLBACK_TEMPLATE = BUILTIN_TEMPLATES["chatml"]


def _raise_exception(message: str) -> None:
    raise TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Undefined(jinja2.Undefined):
    """An undefined variable joined to a string is the empty string, as in llama.cpp's
    Jinja engine (the firefunction-v2 template adds ``functions`` to its system prompt
    whether or not any were given); every other use still fails."""

    def __add__(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if len(args) == 1 and isinstance(args[0], str):
            return args[0]
        return self._fail_with_undefined_error()

    def __radd__(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if len(args) == 1 and isinstance(args[0], str):
            return args[0]
        return self._fail_with_undefined_error()


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' mark of the assistant's
    tokens (for training masks); rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment(now: Callable[[], datetime.datetime]) -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag], undefined=_Undefined
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    return env


@attrs.define(eq=False)
class ChatTemplate:
    """A compiled chat template bound to one tokenizer's BOS/EOS text."""

    source: str | None  # the file's template text; None when the fallback is in use
    bos_token: str
    eos_token: str
    _template: jinja2.Template
    _strip_bos: bool
    _strip_eos: bool
    _now: Callable[[], datetime.datetime] = datetime.datetime.now
    #: one of llama-server's built-in formats (``--chat-template NAME``) but chatml: its
    #: legacy formatter keeps the prompt as written (a BOS it writes stays, and a last
    #: assistant message is rendered whole, not continued)
    legacy: bool = False

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        tokenizer: Tokenizer,
        *,
        now: Callable[[], datetime.datetime] = datetime.datetime.now,
    ) -> ChatTemplate:
        """The template under ``tokenizer.chat_template``, or the ChatML fallback."""
        source = metadata.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            raise TemplateError(
                f"tokenizer.chat_template must be a string, not {type(source).__name__}"
            )
        return cls.from_source(source or None, tokenizer, now=now)

    @classmethod
    def from_source(
        cls,
        source: str | None,
        tokenizer: Tokenizer,
        *,
        now: Callable[[], datetime.datetime] = datetime.datetime.now,
    ) -> ChatTemplate:
        """Compile `source` (None: the fallback); a syntax error is a `TemplateError`.

        `now` is the clock ``strftime_now`` reads (Llama 3.1 templates print today's
        date); tests pin it.
        """
        env = _environment(now)
        try:
            template = env.from_string(source if source is not None else FALLBACK_TEMPLATE)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template line {exc.lineno}: {exc.message}") from None
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id)
        legacy = source in LEGACY_SOURCES
        return cls(
            source=source,
            bos_token=bos,
            eos_token=eos,
            template=template,
            strip_bos=tokenizer.add_bos and bool(bos) and not legacy,
            strip_eos=tokenizer.add_eos and bool(eos) and not legacy,
            now=now,
            legacy=legacy,
        )

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages` (OpenAI chat format).

        Invalid messages → `InvalidRequest`; a template that fails (including one that
        calls ``raise_exception``) → `TemplateError` with its message. Extra keyword
        arguments become template variables (``tools``, ``enable_thinking``, ...).
        """
        # llama.cpp's extra context (common_chat_extra_context): today, in the two
        # spellings templates read (Llama 3.x's date_string, firefunction's datetime)
        today = self._now()
        context: dict[str, Any] = {"date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y")}
        context.update(kwargs)
        context.update(
            messages=normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            text = self._template.render(context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None
        except (
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            ArithmeticError,
        ) as exc:
            # errors raised by Python operations the template performs (adding a str to
            # a list, indexing past the end); the template is at fault, not the server
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        if self._strip_bos and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self._strip_eos and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Checked copies of OpenAI chat messages, with list-of-parts content joined to text.

    ``content`` may be a string, null (an assistant turn that only calls tools), or a
    list of ``{"type": "text", "text": ...}`` parts, joined with newlines. Other keys
    (``name``, ``tool_calls``, ``tool_call_id``, ...) pass through for the template.
    """
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be an array")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{where}.role must be a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(
                _part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content)
            )
        elif content is None:
            if role != "assistant" and "content" not in message:
                raise InvalidRequest(f"{where}.content is missing")
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string or an array of text parts")
        out.append({**message, "role": role, "content": content})
    return out


def _part_text(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequest(f"{where}: only text parts are supported, not {kind!r}")
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string")
    return text

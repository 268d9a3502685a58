"""llama-server's built-in chat templates (``--chat-template NAME``), written as Jinja.

llama.cpp formats these names with ``llm_chat_apply_template`` (``src/llama-chat.cpp``):
one C++ branch per format, no template engine. llama-server reaches it only under
``--no-jinja``; with ``--jinja`` (its default) a name other than ``chatml`` is taken as
template *text* and renders as itself, so the name is only useful the legacy way. Here
a name gives the Jinja below, which produces the same text as that function for the
same messages and ``add_generation_prompt``: one engine renders every prompt, and
``/props`` shows a template a user can read and copy. tests/test_builtin_templates.py
checks each name against llama.cpp itself (xllamacpp, ``/apply-template``).

What the C++ does that plain Jinja would not, and the templates therefore spell out:

- its ``trim`` strips the six C ``isspace`` characters only, where Jinja's ``trim``
  strips all Unicode whitespace (a no-break space, U+2003 ...): every trim passes
  ``_SPACE``;
- its upper-casing is ``toupper`` on bytes, ASCII only, where Python's ``upper`` also
  changes other letters (``ß`` to ``SS``): ``ascii_upper`` maps a-z and nothing else;
- several formats ignore ``add_generation_prompt`` (the llama2 and mistral families,
  orion, minicpm, rwkv-world, the hunyuan ones, deepseek-ocr) or drop roles they have
  no branch for (vicuna drops ``tool``, gigachat a second ``system``). The templates do
  the same rather than improve on it: a model tuned on a format is prompted as
  llama.cpp prompts it.

The legacy path also keeps the text as the formatter wrote it: no leading BOS is
removed and a last assistant message is rendered whole, end-of-turn included (it is
not continued). ``LEGACY_SOURCES`` lets ``ChatTemplate`` and the server tell these
templates apart for that; ``chatml`` is not among them, because llama-server renders
that name with its Jinja ChatML under ``--jinja``, its default.
"""

from __future__ import annotations

#: the characters C's ``isspace`` accepts, as a Jinja string literal (``trim``'s argument)
_SPACE = "' \\t\\n\\x0b\\x0c\\r'"

#: a message's content, and the same trimmed as the C++ ``trim`` does
C = "message['content']"
T = f"(message['content'] | trim({_SPACE}))"

#: upper-cases a-z only, as C's ``toupper`` does byte by byte
_ASCII_UPPER = (
    "{%- macro ascii_upper(text) %}"
    "{%- for ch in text %}{{- ch | upper if ch and ch in 'abcdefghijklmnopqrstuvwxyz' else ch }}{%- endfor %}"
    "{%- endmacro %}"
)


def _lit(text: str) -> str:
    """`text` as a Jinja string literal (Jinja unescapes literals like Python does)."""
    escapes = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "'" + "".join(escapes.get(ch, ch) for ch in text) + "'"


def _cat(*parts: str | tuple[str]) -> str:
    """A Jinja expression joining `parts`: a str is literal text, a 1-tuple an expression."""
    return " + ".join(p[0] if isinstance(p, tuple) else _lit(p) for p in parts)


def _e(expr: str) -> tuple[str]:
    """Mark `expr` as a Jinja expression for `_cat`."""
    return (expr,)


def _turns(
    cases: dict[str, str], *, other: str | None = None, gen: str | None = None, head: str = ""
) -> str:
    """The common shape: `head`, then per message the expression for its role (`other`
    for any role not in `cases`; None: the message is dropped), then `gen` when the
    generation prompt is asked for (None: the format has none)."""
    branches = []
    for i, (role, expr) in enumerate(cases.items()):
        branches.append(f"{{%- {'if' if i == 0 else 'elif'} message['role'] == {_lit(role)} %}}{{{{- {expr} }}}}")
    if other is not None:
        branches.append(f"{{%- else %}}{{{{- {other} }}}}" if branches else f"{{{{- {other} }}}}")
    body = "".join(branches) + ("{%- endif %}" if cases else "")
    out = head + "{%- for message in messages %}" + body + "{%- endfor %}"
    if gen is not None:
        out += f"{{%- if add_generation_prompt %}}{{{{- {_lit(gen)} }}}}{{%- endif %}}"
    return out


def _each(expr: str, gen: str | None) -> str:
    """Every message the same way, whatever its role."""
    return _turns({}, other=expr, gen=gen)


R = _e("message['role']")
CC = _e(C)
TT = _e(T)


def _llama2(*, system: bool, bos_inside: bool, strip: bool) -> str:
    """``[INST] ... [/INST]`` turns. A system message goes inside the first turn (in
    ``<<SYS>>`` markers where the variant has them); an assistant message closes a turn
    with ``</s>`` and the next message opens one (with ``<s>`` in the -bos variant)."""
    content = T if strip else C
    sys_expr = _cat("<<SYS>>\n", _e(content), "\n<</SYS>>\n\n") if system else _cat(_e(content), "\n")
    return (
        "{%- set ns = namespace(inside=true) %}"
        "{{- '[INST] ' }}"
        "{%- for message in messages %}"
        "{%- if not ns.inside %}{%- set ns.inside = true %}"
        f"{{{{- {_lit('<s>[INST] ' if bos_inside else '[INST] ')} }}}}"
        "{%- endif %}"
        f"{{%- if message['role'] == 'system' %}}{{{{- {sys_expr} }}}}"
        f"{{%- elif message['role'] == 'user' %}}{{{{- {_cat(_e(content), ' [/INST]')} }}}}"
        f"{{%- else %}}{{{{- {_cat(_e(content), '</s>')} }}}}{{%- set ns.inside = false %}}"
        "{%- endif %}"
        "{%- endfor %}"
    )


def _mistral(*, lead: str, trail: str, trim_assistant: bool) -> str:
    """v1/v3/v3-tekken: a turn opens with ``[INST]`` before its first message and an
    assistant message closes it with ``</s>``; v1 puts spaces before the markers,
    tekken none after them, v3 trims the assistant's text."""
    answer = T if trim_assistant else C
    return (
        "{%- set ns = namespace(inside=false) %}"
        "{%- for message in messages %}"
        "{%- if not ns.inside %}"
        f"{{{{- {_lit(lead + '[INST]' + trail)} }}}}{{%- set ns.inside = true %}}"
        "{%- endif %}"
        f"{{%- if message['role'] == 'system' %}}{{{{- {_cat(CC, chr(10) * 2)} }}}}"
        f"{{%- elif message['role'] == 'user' %}}{{{{- {_cat(CC, lead + '[/INST]')} }}}}"
        f"{{%- else %}}{{{{- {_cat(trail, _e(answer), '</s>')} }}}}{{%- set ns.inside = false %}}"
        "{%- endif %}"
        "{%- endfor %}"
    )


def _mistral_v7(space: str) -> str:
    return _turns(
        {
            "system": _cat("[SYSTEM_PROMPT]" + space, CC, "[/SYSTEM_PROMPT]"),
            "user": _cat("[INST]" + space, CC, "[/INST]"),
        },
        other=_cat(space, CC, "</s>"),
    )


#: system text is held back and put at the start of the next user turn (gemma trims
#: each part and joins them with nothing; orion joins them untrimmed)
_GEMMA = (
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    f"{{%- if message['role'] == 'system' %}}{{%- set ns.system = ns.system + {T} %}}"
    "{%- else %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if ns.system and role != 'model' %}{{- ns.system + '\\n\\n' }}{%- set ns.system = '' %}{%- endif %}"
    f"{{{{- {T} + '<end_of_turn>\\n' }}}}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

_ORION = (
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = ns.system + message['content'] %}"
    "{%- elif message['role'] == 'user' %}{{- 'Human: ' }}"
    "{%- if ns.system %}{{- ns.system + '\\n\\n' }}{%- set ns.system = '' %}{%- endif %}"
    "{{- message['content'] + '\\n\\nAssistant: </s>' }}"
    "{%- else %}{{- message['content'] + '</s>' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

#: the role with its first letter upper-cased (ASCII only, as ``toupper``)
_CAPITALIZED = (
    "(message['role'][:1] | upper if message['role'][:1] in 'abcdefghijklmnopqrstuvwxyz'"
    " else message['role'][:1]) + message['role'][1:]"
)

#: a leading system message is the preamble after ``<s>``; any other system message,
#: and roles other than user and assistant, are dropped
_GIGACHAT = (
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if has_system %}{{- '<s>' + messages[0]['content'] + '<|message_sep|>' }}{%- else %}{{- '<s>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and has_system) %}"
    "{%- if message['role'] == 'user' %}"
    "{{- 'user<|role_sep|>' + message['content'] + '<|message_sep|>available functions<|role_sep|>[]<|message_sep|>' }}"
    "{%- elif message['role'] == 'assistant' %}{{- 'assistant<|role_sep|>' + message['content'] + '<|message_sep|>' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant<|role_sep|>' }}{%- endif %}"
)

#: the generation prompt follows a *last user* message, whatever add_generation_prompt says
_RWKV_WORLD = _turns(
    {
        "system": _cat("System: ", TT, "\n\n"),
        "user": _cat("User: ", TT, "\n\n") + " + ('Assistant:' if loop.last else '')",
        "assistant": _cat("Assistant: ", TT, "\n\n"),
    }
)


def _bailing(*, think: bool) -> str:
    return (
        _ASCII_UPPER
        + _each("'<role>' + ('HUMAN' if message['role'] == 'user' else ascii_upper(message['role'])) + '</role>'"
                " + message['content']", gen=None)
        + f"{{%- if add_generation_prompt %}}{{{{- {_lit('<role>ASSISTANT</role>' + ('<think>' if think else ''))} }}}}"
        "{%- endif %}"
    )


_BAILING2 = (
    _ASCII_UPPER
    + "{%- if not (messages and messages[0]['role'] == 'system') %}"
    "{{- '<role>SYSTEM</role>detailed thinking off<|role_end|>' }}{%- endif %}"
    + _each("'<role>' + ('HUMAN' if message['role'] == 'user' else ascii_upper(message['role'])) + '</role>'"
            " + message['content'] + '<|role_end|>'", gen="<role>ASSISTANT</role>")
)

_GRANITE_4 = _turns(
    {"assistant_tool_call": _cat("<|start_of_role|>assistant<|end_of_role|><|tool_call|>", CC, "<|end_of_text|>\n")},
    other=_cat("<|start_of_role|>", R, "<|end_of_role|>", CC, "<|end_of_text|>\n"),
    gen="<|start_of_role|>assistant<|end_of_role|>",
)

_HY_ASSISTANT = "<\uff5chy_Assistant\uff5c>"
_HY_USER = "<\uff5chy_User\uff5c>"
_HY_HOLDER_2 = "<\uff5chy_place\u2581holder\u2581no\u25812\uff5c>"
_HY_HOLDER_3 = "<\uff5chy_place\u2581holder\u2581no\u25813\uff5c>"
_HY_BOS = "<\uff5chy_begin\u2581of\u2581sentence\uff5c>"
_DS_USER = "<\uff5cUser\uff5c>"
_DS_ASSISTANT = "<\uff5cAssistant\uff5c>"
_DS_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"

#: a first system message is a preamble; later ones are dropped
_HUNYUAN_DENSE = (
    "{%- for message in messages %}"
    f"{{%- if loop.first and message['role'] == 'system' %}}{{{{- {_cat(CC, _HY_HOLDER_3)} }}}}{{%- endif %}}"
    f"{{%- if message['role'] == 'assistant' %}}{{{{- {_cat(_HY_ASSISTANT, CC, _HY_HOLDER_2)} }}}}"
    f"{{%- elif message['role'] == 'user' %}}{{{{- {_cat(_HY_USER, CC, _HY_ASSISTANT)} }}}}"
    "{%- endif %}"
    "{%- endfor %}"
)

_HUNYUAN_VL = (
    f"{{{{- {_lit(_HY_BOS)} }}}}"
    "{%- for message in messages %}"
    f"{{%- if loop.first and message['role'] == 'system' %}}{{{{- {_cat(CC, _HY_HOLDER_3)} }}}}"
    f"{{%- elif message['role'] == 'user' %}}{{{{- {_cat(CC, _HY_USER)} }}}}"
    f"{{%- elif message['role'] == 'assistant' %}}{{{{- {_cat(CC, _HY_ASSISTANT)} }}}}"
    "{%- endif %}"
    "{%- endfor %}"
)

_PANGU = {"system": "系统", "user": "用户", "assistant": "助手", "tool": "工具", "function": "方法"}
_PANGU_EMBEDDED = (
    "{%- if messages and messages[0]['role'] != 'system' %}{{- '[unused9]系统：[unused10]' }}{%- endif %}"
    + _turns(
        {role: _cat(f"[unused9]{name}：", CC, "[unused10]") for role, name in _PANGU.items()},
        gen="[unused9]助手：",
    )
)

_KIMI_HEAD = {
    "system": "<|im_system|>system<|im_middle|>",
    "user": "<|im_user|>user<|im_middle|>",
    "assistant": "<|im_assistant|>assistant<|im_middle|>",
    "tool": "<|im_system|>tool<|im_middle|>",
}

#: name -> Jinja source, for every name llama-server's ``--chat-template`` accepts
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _each(_cat("<|im_start|>", R, "\n", CC, "<|im_end|>\n"), gen="<|im_start|>assistant\n"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(lead=" ", trail=" ", trim_assistant=False),
    "mistral-v3": _mistral(lead="", trail=" ", trim_assistant=True),
    "mistral-v3-tekken": _mistral(lead="", trail="", trim_assistant=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each(_cat("<|", R, "|>\n", CC, "<|end|>\n"), gen="<|assistant|>\n"),
    "phi4": _each(_cat("<|im_start|>", R, "<|im_sep|>", CC, "<|im_end|>"), gen="<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each(_cat("<|", R, "|>\n", CC, "\n"), gen="<|assistant|>\n"),
    "zephyr": _each(_cat("<|", R, "|>\n", CC, "<|endoftext|>\n"), gen="<|assistant|>\n"),
    "monarch": _each("('' if loop.first else '<s>') + " + _cat(R, "\n", CC, "</s>\n"), gen="<s>assistant\n"),
    "gemma": _GEMMA,
    "orion": _ORION,
    "openchat": _turns(
        {"system": _cat(CC, "<|end_of_turn|>")},
        other=_cat("GPT4 Correct ", _e(f"({_CAPITALIZED})"), ": ", CC, "<|end_of_turn|>"),
        gen="GPT4 Correct Assistant:",
    ),
    "vicuna": _turns(
        {"system": _cat(CC, "\n\n"), "user": _cat("USER: ", CC, "\n"), "assistant": _cat("ASSISTANT: ", CC, "</s>\n")},
        gen="ASSISTANT:",
    ),
    "vicuna-orca": _turns(
        {"system": _cat("SYSTEM: ", CC, "\n"), "user": _cat("USER: ", CC, "\n"),
         "assistant": _cat("ASSISTANT: ", CC, "</s>\n")},
        gen="ASSISTANT:",
    ),
    "deepseek": _turns(
        {"system": C, "user": _cat("### Instruction:\n", CC, "\n"),
         "assistant": _cat("### Response:\n", CC, "\n<|EOT|>\n")},
        gen="### Response:\n",
    ),
    "deepseek2": _turns(
        {"system": _cat(CC, "\n\n"), "user": _cat("User: ", CC, "\n\n"), "assistant": _cat("Assistant: ", CC, _DS_EOS)},
        gen="Assistant:",
    ),
    "deepseek3": _turns(
        {"system": _cat(CC, "\n\n"), "user": _cat(_DS_USER, CC), "assistant": _cat(_DS_ASSISTANT, CC, _DS_EOS)},
        gen=_DS_ASSISTANT,
    ),
    "deepseek-ocr": _each(C, gen=None),
    "command-r": _turns(
        {
            "system": _cat("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", TT, "<|END_OF_TURN_TOKEN|>"),
            "user": _cat("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", TT, "<|END_OF_TURN_TOKEN|>"),
            "assistant": _cat("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", TT, "<|END_OF_TURN_TOKEN|>"),
        },
        gen="<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
    "llama3": _each(_cat("<|start_header_id|>", R, "<|end_header_id|>\n\n", TT, "<|eot_id|>"),
                    gen="<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "chatglm3": "{{- '[gMASK]sop' }}" + _each(_cat("<|", R, "|>\n ", CC), gen="<|assistant|>"),
    "chatglm4": "{{- '[gMASK]<sop>' }}" + _each(_cat("<|", R, "|>\n", CC), gen="<|assistant|>\n"),
    "glmedge": _each(_cat("<|", R, "|>\n", CC), gen="<|assistant|>"),
    "minicpm": _turns({"user": _cat("<用户>", TT, "<AI>")}, other=T),
    "exaone3": _turns(
        {"system": _cat("[|system|]", TT, "[|endofturn|]\n"), "user": _cat("[|user|]", TT, "\n"),
         "assistant": _cat("[|assistant|]", TT, "[|endofturn|]\n")},
        gen="[|assistant|]",
    ),
    "exaone4": _turns(
        {"system": _cat("[|system|]", TT, "[|endofturn|]\n"), "user": _cat("[|user|]", TT, "\n"),
         "assistant": _cat("[|assistant|]", TT, "[|endofturn|]\n"), "tool": _cat("[|tool|]", TT, "[|endofturn|]\n")},
        gen="[|assistant|]",
    ),
    "exaone-moe": _turns(
        {role: _cat(f"<|{role}|>\n", TT, "<|endofturn|>\n") for role in ("system", "user", "assistant", "tool")},
        gen="<|assistant|>\n",
    ),
    "rwkv-world": _RWKV_WORLD,
    "granite": _each(
        _cat("<|start_of_role|>", R, "<|end_of_role|>")
        + " + ('<|tool_call|>' if message['role'] == 'assistant_tool_call' else '') + "
        + _cat(CC, "<|end_of_text|>\n"),
        gen="<|start_of_role|>assistant<|end_of_role|>",
    ),
    "granite-4.0": _GRANITE_4,
    "granite-4.1": _GRANITE_4,
    "gigachat": _GIGACHAT,
    "megrez": _each(_cat("<|role_start|>", R, "<|role_end|>", CC, "<|turn_end|>"),
                    gen="<|role_start|>assistant<|role_end|>"),
    "yandex": _turns(
        {"user": _cat(" Пользователь: ", CC, "\n\n"), "assistant": _cat(" Ассистент: ", CC, "\n\n")},
        gen=" Ассистент:[SEP]",
    ),
    "bailing": _bailing(think=False),
    "bailing-think": _bailing(think=True),
    "bailing2": _BAILING2,
    "llama4": _each(_cat("<|header_start|>", R, "<|header_end|>\n\n", TT, "<|eot|>"),
                    gen="<|header_start|>assistant<|header_end|>\n\n"),
    "smolvlm": "{{- '<|im_start|>' }}" + _turns(
        {"system": _cat(CC, "\n\n"), "user": _cat("User: ", CC, "<end_of_utterance>\n")},
        other=_cat("Assistant: ", CC, "<end_of_utterance>\n"),
        gen="Assistant:",
    ),
    "hunyuan-moe": _turns(
        {"system": _cat("<|startoftext|>", CC, "<|extra_4|>"), "assistant": _cat(CC, "<|eos|>")},
        other=_cat("<|startoftext|>", CC, "<|extra_0|>"),
    ),
    "gpt-oss": _each(
        _cat("<|start|>", R, "<|message|>", CC)
        + " + ('<|return|>' if message['role'] == 'assistant' else '<|end|>')",
        gen="<|start|>assistant",
    ),
    "hunyuan-dense": _HUNYUAN_DENSE,
    "hunyuan-vl": _HUNYUAN_VL,
    "kimi-k2": _turns({role: _cat(head, CC, "<|im_end|>") for role, head in _KIMI_HEAD.items()},
                      other=_cat(CC, "<|im_end|>"), gen="<|im_assistant|>assistant<|im_middle|>"),
    "seed_oss": _each(
        _cat("<seed:bos>", R, "\n") + f" + ({T} if message['role'] == 'assistant' else {C}) + '<seed:eos>'",
        gen="<seed:bos>assistant\n",
    ),
    "grok-2": _turns(
        {"system": _cat("System: ", TT, "<|separator|>\n\n"), "user": _cat("Human: ", TT, "<|separator|>\n\n"),
         "assistant": _cat("Assistant: ", CC, "<|separator|>\n\n")},
        gen="Assistant:",
    ),
    "pangu-embedded": _PANGU_EMBEDDED,
    "solar-open": _each(_cat("<|begin|>", R, "<|content|>", CC, "<|end|>"), gen="<|begin|>assistant"),
}

#: the built-in templates llama-server renders the legacy way (prompt kept as written)
LEGACY_SOURCES: frozenset[str] = frozenset(src for name, src in BUILTIN_TEMPLATES.items() if name != "chatml")

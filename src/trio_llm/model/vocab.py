"""Synthetic tokenizer vocabularies for `trio-llm make-model`.

A synthetic model needs a real tokenizer section: the server, the chat templates and the
comparison with transformers all read it exactly as they would read Llama 3's or Qwen's.
So the vocabularies here are trained, not invented: a byte-level BPE (the ``gpt2``
model of llama.cpp) or a SentencePiece-style BPE with byte fallback (the ``llama``
model), learned with the ``tokenizers`` trainer from a small English corpus embedded in
this module, so nothing is downloaded and every build is identical.

A few KB of text cannot teach 128k merges. Once the corpus runs dry the vocabulary is
filled with *synthetic merges*: each glues a word-start token to a word-piece token that
already exist, e.g. ``Ġriver`` + ``ing``. They are valid BPE merges (both halves exist,
the result is new), so the tokenizer behaves like a real large vocabulary -- large merge
tables, long tokens -- but they only fire on text that contains those made-up words.
Special-token layout follows the real families: Llama 3 keeps its last 256 ids (an
eighth of a small vocabulary) for ``<|begin_of_text|>`` ...
``<|reserved_special_token_N|>``, Qwen appends its ChatML
tokens after the BPE tokens (and pads to 151936 with ``[PADn]``), Llama 2 starts with
``<unk>``, ``<s>``, ``</s>`` and the 256 byte tokens ``<0x00>``..``<0xFF>``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Literal

import attrs
import gguf
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

Style = Literal["gpt2", "llama"]
Family = Literal["llama3", "chatml", "llama2", "gemma"]

NORMAL = int(gguf.TokenType.NORMAL)
UNKNOWN = int(gguf.TokenType.UNKNOWN)
CONTROL = int(gguf.TokenType.CONTROL)
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
UNUSED = int(gguf.TokenType.UNUSED)
BYTE = int(gguf.TokenType.BYTE)

#: SentencePiece's stand-in for a space
SPM_SPACE = "\u2581"

#: pre-tokenizer split patterns, by ``tokenizer.ggml.pre`` name (the regexes llama.cpp uses)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS: dict[str, str] = {
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
}

# The Llama 3 chat format: a header per message, <|eot_id|> after each, BOS once at the
# start. Written for this project; renders the same text as Meta's template.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# ChatML as Qwen uses it; `enable_thinking=false` (a chat_template_kwargs entry) writes the
# empty think block Qwen3 expects when reasoning is switched off.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Gemma's turns: "user" and "model" between <start_of_turn> and <end_of_turn>, a system
# prompt folded into the first user turn, strict alternation. Written for this project;
# renders the same text as Google's Gemma 3 template for text messages.
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set prefix = messages[0]['content'] + '\n\n' %}"
    "{%- set turns = messages[1:] %}"
    "{%- else %}"
    "{%- set prefix = '' %}"
    "{%- set turns = messages %}"
    "{%- endif %}"
    "{%- for message in turns %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}"
    "{{- message['content'] | trim }}"
    "{{- '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<start_of_turn>model\n' }}"
    "{%- endif %}"
)

# Llama 2's [INST] format: an optional system prompt folded into the first user turn,
# strict user/assistant alternation (anything else is an error, as in Meta's template).
LLAMA2_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = '<<SYS>>\\n' + messages[0]['content'] | trim + '\\n<</SYS>>\\n\\n' %}"
    "{%- set turns = messages[1:] %}"
    "{%- else %}"
    "{%- set system = '' %}"
    "{%- set turns = messages %}"
    "{%- endif %}"
    "{%- for message in turns %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- set text = (system if loop.first else '') + message['content'] | trim %}"
    "{{- bos_token + '[INST] ' + text + ' [/INST]' }}"
    "{%- else %}"
    "{{- ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}

#: Qwen2.5/Qwen3 added tokens in id order; the ones in `_QWEN_USER_DEFINED` are matched in
#: text but are not control tokens (llama.cpp marks them USER_DEFINED).
_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_QWEN_USER_DEFINED = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
#: where Qwen's real vocabulary ends and its [PADn] filler begins
_QWEN_REAL_SIZE = 151643 + len(_QWEN_SPECIALS)


@attrs.frozen
class VocabSpec:
    """A complete ``tokenizer.*`` section of a GGUF file, as plain values."""

    model: Style  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre: "llama-bpe", "qwen2" or "default"
    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    merges: list[str] | None  # "left right" pairs, gpt2 only
    scores: list[float] | None  # llama (SPM) only: higher merges first
    bos_id: int
    eos_id: int
    eot_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None  # SPM only: prepend "▁" to the text
    chat_template: str

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def write(self, writer: gguf.GGUFWriter) -> None:
        """Add every ``tokenizer.*`` key llama.cpp reads for this kind of vocabulary."""
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        if self.eot_id is not None:
            writer.add_eot_token_id(self.eot_id)
        if self.pad_id is not None:
            writer.add_pad_token_id(self.pad_id)
        if self.unk_id is not None:
            writer.add_unk_token_id(self.unk_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        writer.add_chat_template(self.chat_template)


def build_vocab(style: Style, n_vocab: int, family: Family) -> VocabSpec:
    """The vocabulary of `n_vocab` tokens for a tokenizer `style` and chat `family`.

    Supported pairs are the ones real models use: gpt2 with llama3 or chatml, llama
    (SentencePiece) with llama2. Deterministic: the same arguments give the same spec.
    """
    if style == "gpt2" and family == "llama3":
        return _llama3_vocab(n_vocab)
    if style == "gpt2" and family == "chatml":
        return _chatml_vocab(n_vocab)
    if style == "llama" and family == "llama2":
        return _llama2_vocab(n_vocab)
    if style == "llama" and family == "gemma":
        return _gemma_vocab(n_vocab)
    raise ValueError(f"no vocabulary for style {style!r} with chat family {family!r}")


def _llama3_vocab(n_vocab: int) -> VocabSpec:
    # Llama 3 reserves its last 256 ids; a small vocabulary keeps the same layout in
    # an eighth of its size so most of it still goes to real merges.
    n_special = min(256, n_vocab // 8)
    if n_special < len(_LLAMA3_NAMED) + 3 or n_vocab - n_special <= 256:
        raise ValueError(f"a llama3 vocabulary of {n_vocab} tokens is too small")
    tokens, merges = _byte_level_bpe("llama-bpe", n_vocab - n_special)
    base = len(tokens)
    reserved = iter(range(n_special))
    for i in range(n_special):
        name = _LLAMA3_NAMED.get(i) or f"<|reserved_special_token_{next(reserved)}|>"
        tokens.append(name)
    types = [NORMAL] * base + [CONTROL] * n_special
    return VocabSpec(
        model="gpt2",
        pre="llama-bpe",
        tokens=tokens,
        token_types=types,
        merges=merges,
        scores=None,
        bos_id=base + 0,
        eos_id=base + 1,
        eot_id=base + 9,
        pad_id=base + 4,
        unk_id=None,
        add_bos=True,
        add_eos=False,
        add_space_prefix=None,
        chat_template=LLAMA3_TEMPLATE,
    )


def _chatml_vocab(n_vocab: int) -> VocabSpec:
    n_pad = max(0, n_vocab - _QWEN_REAL_SIZE)
    n_normal = n_vocab - len(_QWEN_SPECIALS) - n_pad
    if n_normal <= 256:
        raise ValueError(
            f"a chatml vocabulary needs more than {256 + len(_QWEN_SPECIALS)} tokens, not {n_vocab}"
        )
    tokens, merges = _byte_level_bpe("qwen2", n_normal)
    types = [NORMAL] * n_normal
    for name in _QWEN_SPECIALS:
        tokens.append(name)
        types.append(USER_DEFINED if name in _QWEN_USER_DEFINED else CONTROL)
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
    endoftext = n_normal
    return VocabSpec(
        model="gpt2",
        pre="qwen2",
        tokens=tokens,
        token_types=types,
        merges=merges,
        scores=None,
        bos_id=endoftext,
        eos_id=endoftext + 2,  # <|im_end|>: instruct models stop on it
        eot_id=None,
        pad_id=endoftext,
        unk_id=None,
        add_bos=False,
        add_eos=False,
        add_space_prefix=None,
        chat_template=CHATML_TEMPLATE,
    )


def _llama2_vocab(n_vocab: int) -> VocabSpec:
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    n_pieces = n_vocab - len(head)
    if n_pieces <= 0:
        raise ValueError(f"a llama2 vocabulary needs more than {len(head)} tokens, not {n_vocab}")
    pieces = _spm_pieces(n_pieces)
    tokens = head + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    # Specials and bytes score 0 (never the result of a merge); pieces score -rank so
    # that llama.cpp's "merge the best-scoring pair" reproduces the learned merge order.
    scores = [0.0] * len(head) + [-float(rank) for rank in range(len(pieces))]
    return VocabSpec(
        model="llama",
        pre="default",
        tokens=tokens,
        token_types=types,
        merges=None,
        scores=scores,
        bos_id=1,
        eos_id=2,
        eot_id=None,
        pad_id=None,
        unk_id=0,
        add_bos=True,
        add_eos=False,
        add_space_prefix=True,
        chat_template=LLAMA2_TEMPLATE,
    )


#: Gemma's first ids (its real vocabulary has more reserved and multimodal tokens)
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
#: the image wrapping gemma3's projector uses (ids 255999 and 256000 in the real
#: vocabulary; the last two here)
_GEMMA_IMAGE = ("<start_of_image>", "<end_of_image>")


def _gemma_vocab(n_vocab: int) -> VocabSpec:
    head = list(_GEMMA_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    n_pieces = n_vocab - len(head) - len(_GEMMA_IMAGE)
    if n_pieces <= 0:
        raise ValueError(f"a gemma vocabulary needs more than {len(head) + len(_GEMMA_IMAGE)} tokens, not {n_vocab}")
    pieces = _spm_pieces(n_pieces)
    types = ([CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
             + [CONTROL] * len(_GEMMA_IMAGE))
    return VocabSpec(
        model="llama",
        pre="default",
        tokens=head + pieces + list(_GEMMA_IMAGE),
        token_types=types,
        merges=None,
        scores=[0.0] * len(head) + [-float(rank) for rank in range(len(pieces))] + [0.0] * len(_GEMMA_IMAGE),
        bos_id=2,
        eos_id=1,
        eot_id=_GEMMA_SPECIALS.index("<end_of_turn>"),
        pad_id=0,
        unk_id=3,
        add_bos=True,
        add_eos=False,
        add_space_prefix=False,
        chat_template=GEMMA_TEMPLATE,
    )


# --- training --------------------------------------------------------------------------


def _byte_level_bpe(pre: str, n_tokens: int) -> tuple[list[str], list[str]]:
    """`n_tokens` byte-level tokens (256 bytes + merges) and their merges, "a b" strings."""
    alphabet = _alphabet_gpt2_order()
    n_merges = n_tokens - len(alphabet)
    learned = _learned_byte_level_merges(pre)
    pairs = list(learned[:n_merges])
    known = set(alphabet) | {a + b for a, b in pairs}
    if len(pairs) < n_merges:
        words = [t for t in _merge_products(pairs) if t[0] == "Ġ" and t[1:].isalpha()]
        pieces = [t for t in _merge_products(pairs) if t.isalpha() and t.islower()]
        pairs += _synthetic_merges(words, pieces, known, n_merges - len(pairs))
    tokens = alphabet + [a + b for a, b in pairs]
    return tokens, [f"{a} {b}" for a, b in pairs]


def _spm_pieces(n_pieces: int) -> list[str]:
    """`n_pieces` SentencePiece pieces: learned merges best first, then the characters."""
    chars, learned = _learned_spm_merges()
    n_merged = n_pieces - len(chars)
    if n_merged < 0:
        raise ValueError(f"a llama2 vocabulary needs room for {len(chars)} characters")
    pairs = list(learned[:n_merged])
    known = set(chars) | {a + b for a, b in pairs}
    if len(pairs) < n_merged:
        products = _merge_products(pairs)
        words = [t for t in products if t[0] == SPM_SPACE and t[1:].isalpha()]
        pieces = [t for t in products if t.isalpha() and t.islower()]
        pairs += _synthetic_merges(words, pieces, known, n_merged - len(pairs))
    return [a + b for a, b in pairs] + list(chars)


def _merge_products(pairs: list[tuple[str, str]]) -> list[str]:
    return [a + b for a, b in pairs]


def _synthetic_merges(
    words: list[str], pieces: list[str], known: set[str], count: int
) -> list[tuple[str, str]]:
    """`count` new merges word-start + piece, in a fixed order, never repeating a token.

    Each round glues every word to one more piece; products join the word list for the
    next round, so the supply never runs out however large the vocabulary.
    """
    out: list[tuple[str, str]] = []
    if not words or not pieces:
        raise ValueError("the corpus yields no words to extend the vocabulary with")
    while len(out) < count:
        grown: list[str] = []
        for piece in pieces:
            for word in words:
                token = word + piece
                if token in known:
                    continue
                known.add(token)
                out.append((word, piece))
                grown.append(token)
                if len(out) == count:
                    return out
        words = words + grown
    return out


@functools.cache
def _learned_byte_level_merges(pre: str) -> tuple[tuple[str, str], ...]:
    """Every merge the corpus supports, in learned order (cached: a prefix serves any size)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tk.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tuple(tuple(m) for m in json.loads(tk.to_str())["model"]["merges"])  # type: ignore[misc]


@functools.cache
def _learned_spm_merges() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The corpus characters (sorted) and every SentencePiece-style merge, learned order."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000, min_frequency=1, show_progress=False, special_tokens=[]
    )
    tk.train_from_iterator(_corpus_lines(), trainer=trainer)
    model = json.loads(tk.to_str())["model"]
    merges = tuple(tuple(m) for m in model["merges"])
    products = {a + b for a, b in merges}
    chars = tuple(sorted(t for t in model["vocab"] if t not in products))
    return chars, merges  # type: ignore[return-value]


@functools.cache
def gpt2_byte_chars() -> tuple[str, ...]:
    """GPT-2's byte → character table, indexed by byte value.

    Byte-level BPE spells every token in these 256 printable characters: printable
    bytes stand for themselves, the others map, in byte order, to U+0100 onwards.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    chars: list[str] = []
    for b in range(256):
        chars.append(
            chr(b) if b in printable else chr(256 + sum(1 for x in range(b) if x not in printable))
        )
    return tuple(chars)


def _alphabet_gpt2_order() -> list[str]:
    """The 256 byte tokens in GPT-2's (and Llama 3's) id order: printable bytes first."""
    chars = gpt2_byte_chars()
    return [chars[b] for b in sorted(range(256), key=lambda b: (ord(chars[b]) >= 256, b))]


def _corpus_lines() -> Iterator[str]:
    # The trainer counts words per line; one paragraph per line keeps newlines in the
    # text so the byte-level merges learn them too.
    for paragraph in CORPUS.strip().split("\n\n"):
        yield paragraph.strip() + "\n"


# Written for this project. Plain English prose on varied topics plus a little code,
# numbers and non-English text, so the merges cover what tests throw at a tokenizer.
CORPUS = """
The river runs past the old mill and under the stone bridge before it turns toward the sea.
In the morning the fishermen walk down to the harbour, check their nets and talk about the
weather. Most days the wind comes from the west, and the boats leave early while the water
is still calm. By noon the market is full of people buying bread, cheese, apples and fresh
fish, and the children run between the stalls shouting at each other.

A computer program is a list of instructions that a machine can follow. The instructions
are written in a programming language, translated into machine code and then executed by
the processor. Good programs are easy to read, easy to test and easy to change. When a
program fails, the programmer reads the error message, finds the line that caused it and
writes a test so that the same mistake cannot happen again.

Language models read text as tokens. A tokenizer splits the text into pieces, looks each
piece up in its vocabulary and returns a sequence of numbers. The model predicts the next
token, the server turns that token back into text, and the user sees the answer appear one
word at a time. Streaming the answer this way makes a slow model feel much faster.

She asked him whether he had seen the letter. He said he hadn't, but that he'd look for it
after dinner. "It's on the table in the hall," she replied, "next to the keys you're always
losing." They both laughed, and for a moment the argument was forgotten.

Scientists measure temperature in degrees Celsius or Kelvin. Water freezes at 0 degrees and
boils at 100 degrees at sea level. The speed of light is about 299,792 kilometres per second,
and light from the Sun takes roughly 8 minutes and 20 seconds to reach the Earth. In 1969
two astronauts walked on the Moon; in 2024 more than 8 billion people lived on the planet.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i}: {fibonacci(i)}")

The kitchen smelled of garlic, onions and tomatoes. Her grandmother's recipe said to cook the
sauce slowly for three hours, stirring every twenty minutes, and to add the basil only at the
end. Nobody in the family ever followed the recipe exactly, yet every version tasted like home.

Questions and answers: What is the capital of France? The capital of France is Paris. How many
days are there in a week? There are seven days in a week. Which planet is the largest? Jupiter
is the largest planet in the solar system. Why is the sky blue? Sunlight is scattered by the
air, and blue light is scattered more than red light.

Every morning I make a cup of coffee, open the window and listen to the birds. Sometimes I
write a few lines in my notebook; sometimes I just watch the clouds move over the hills. These
quiet minutes are the best part of the day, before the emails, the meetings and the noise.

The committee will meet on Tuesday, 14 March, at 10:30 in room 204. Please send your comments
before Monday evening. The budget for the next year is 1,250,000 euros, an increase of 3.5 per
cent compared with last year. Questions about travel costs should go to the finance office.

Once upon a time there was a small dragon who was afraid of fire. The other dragons laughed at
him, so he went to live in a cave by the lake. There he learned to swim, to catch fish and to
sing, and when winter came and the other dragons were cold and hungry, they came to him for help.

Un café, s'il vous plaît. Der Zug nach Zürich fährt um acht Uhr. ¿Dónde está la estación?
東京は日本の首都です。 Москва — столица России. Ελληνικά γράμματα: α, β, γ, δ.
Emoji are text too: 😀 🚀 ❤️ 👍 — and so are symbols like €, £, ©, ™ and ±.

HTTP servers answer requests. A client sends GET /v1/models or POST /v1/chat/completions with
a JSON body such as {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}]} and
the server replies with status 200 and a JSON document, or with 400 when the request is wrong.
"""

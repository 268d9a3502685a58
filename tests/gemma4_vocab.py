"""A small Gemma 4 style vocabulary (``tokenizer.ggml.model = "gemma4"``) in a tiny
``llama`` model that llama.cpp loads, for the tokenizer agreement tests.

llama.cpp ties the vocabulary type to ``tokenizer.ggml.model`` only, never to the
architecture, so a one-layer llama with random f32 weights carries it. The vocabulary
is laid out as the converter writes Gemma 4's: specials first (``<pad> <eos> <bos>
<unk> <mask>``, the turn markers CONTROL, the chat parser's markers USER_DEFINED), the
256 ``<0xNN>`` byte tokens, then pieces learned by a small deterministic BPE over a
corpus with its spaces written as ``▁``, then newline runs: ``\\n\\n`` and
``\\n\\n\\n\\n`` reachable by merges, ``\\n\\n\\n`` only by llama.cpp's whole-run lookup.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np

from trio_llm.model.vocab import BYTE, CONTROL, NORMAL, UNUSED, USER_DEFINED

SPACE = "\u2581"

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Hello World! Hello there; the world is wide and the sea is deep.",
    "def hello(x):    return x + 1  # the answer",
    "    indented code with   several    spaces and\ttabs",
    "naïve café résumé Zürich — déjà vu",
    "東京は日本の首都です。東京 日本",
    "Москва и мир, мир и Москва",
    "I'm sure they'll've done it, isn't it? Yes, it is.",
    "numbers 12345 and 3.14159 and 2024-03-14",
]

SPECIALS = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", 2),  # UNKNOWN
    ("<mask>", CONTROL),
    ("<|turn>", CONTROL),
    ("<turn|>", CONTROL),
    ("<|channel>", USER_DEFINED),
    ("<channel|>", USER_DEFINED),
    ("<|tool_call>", USER_DEFINED),
    ("<tool_call|>", USER_DEFINED),
    ("<|tool_response>", USER_DEFINED),  # as the converter writes it; llama.cpp makes it an end
    ("<tool_response|>", USER_DEFINED),
    ("</s>", NORMAL),  # a plain token in Gemma 4 (llama.cpp's rule beside <|tool_response>)
    ("<unused0>", UNUSED),
]
BOS_ID, EOS_ID = 2, 1

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] | trim }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _train(lines: list[str], n_merges: int) -> tuple[list[str], list[str]]:
    """Characters and merges of a plain BPE: the most frequent pair first, ties by the
    pair's text; deterministic by construction."""
    seqs = [list(line.replace(" ", SPACE)) for line in lines]
    chars = sorted({c for s in seqs for c in s})
    merges: list[str] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for s in seqs:
            pairs.update(zip(s, s[1:], strict=False))
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(f"{a} {b}")
        for k, s in enumerate(seqs):
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[k] = out
    return chars, merges


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """tokens, token types, merges."""
    chars, merges = _train(CORPUS, 160)
    # some characters of the corpus left out: they can only come as bytes
    chars = [c for c in chars if c not in ("é", "本", "и", "ü")]
    merges = [m for m in merges if not any(c in m for c in ("é", "本", "и", "ü"))]
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in SPECIALS] + [BYTE] * 256
    pieces = chars + ["".join(m.split(" ")) for m in merges]
    pieces += ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
    merges += ["\n \n", "\n\n \n\n"]
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(NORMAL)
    return tokens, types, merges


def write_gemma4_llama(
    path: Path, *, add_bos: bool | None = False, merges: bool = True, pre: str | None = None
) -> Path:
    """The tiny llama with the gemma4 vocabulary; ``add_bos`` False as a file may say
    (llama.cpp overrides it), None to leave the key out."""
    tokens, types, merge_list = vocabulary()
    n_vocab, n_embd, n_ff, n_head = len(tokens), 32, 64, 2
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-gemma4-vocab")
    w.add_vocab_size(n_vocab)
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gemma4")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merge_list)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    t("token_embd.weight", n_vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    t("output.weight", n_vocab, n_embd)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        t(f"blk.0.{name}.weight", n_embd, n_embd)
    t("blk.0.ffn_gate.weight", n_ff, n_embd)
    t("blk.0.ffn_up.weight", n_ff, n_embd)
    t("blk.0.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

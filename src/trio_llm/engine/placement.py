"""``--n-cpu-moe N``: which expert tensors stay in host memory (llama-server's flag,
fractional as the reference fork's): the experts of the first ``floor(N)`` layers, and
of the next layer, for a fraction f, its gate (0 < f <= 0.5) or its gate and up
(f > 0.5); every down projection past the whole layers stays on the device. The Vulkan
backend reads the host tensors from host-visible memory (a one-time copy, never per
token); the numpy backend holds everything in host memory anyway.

Beside those, ``input_tensors``: what llama.cpp keeps with its input layer in host memory
whatever the flags and only gathers rows of (gemma4's per-layer token embeddings, about
2.8 B values in E4B); the Vulkan backend reads their rows from host-visible memory.
"""

from __future__ import annotations

import math

from trio_llm.errors import InvalidRequest
from trio_llm.model.config import ModelConfig

EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: tensors read only by row lookups that llama.cpp places with its input layer (host memory)
INPUT_TENSORS = ("per_layer_token_embd.weight",)


def input_tensors(names: frozenset[str] | set[str]) -> frozenset[str]:
    """Which of a model's tensors ``names`` stay in host memory on every device: the
    ``INPUT_TENSORS`` it has (llama.cpp's input layer; not ``token_embd``, which our
    Vulkan graphs also read as the tied output head)."""
    return frozenset(INPUT_TENSORS) & frozenset(names)


def cpu_moe_tensors(cfg: ModelConfig, n: float) -> frozenset[str]:
    """The tensor names ``--n-cpu-moe n`` keeps on the host (empty for 0)."""
    if not math.isfinite(n) or n < 0:
        raise InvalidRequest(f"--n-cpu-moe {n}: expected a layer count >= 0")
    if n == 0:
        return frozenset()
    if not cfg.n_expert:
        raise InvalidRequest(f"--n-cpu-moe {n:g}: {cfg.name} ({cfg.arch}) has no expert weights")
    if n > cfg.n_layer:
        raise InvalidRequest(f"--n-cpu-moe {n:g} exceeds the model's {cfg.n_layer} layers")
    whole = int(n)
    names = {f"blk.{il}.{m}.weight" for il in range(whole) for m in EXPERT_MATRICES}
    frac = n - whole
    if frac > 0:
        names |= {f"blk.{whole}.{m}.weight" for m in EXPERT_MATRICES[: 1 if frac <= 0.5 else 2]}
    return frozenset(names)

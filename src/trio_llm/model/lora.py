"""LoRA adapters (llama-server's ``--lora`` / ``--lora-scaled``): GGUF files of low-rank
deltas to a model's matrices, as llama.cpp's ``llama_adapter_lora`` reads them.

An adapter file has ``general.type`` "adapter", ``adapter.type`` "lora", the base
model's ``general.architecture`` and ``adapter.lora.alpha``; for a matrix ``W``
(``blk.0.attn_q.weight``) it holds ``W.lora_a`` ``[r, n_in]`` and ``W.lora_b``
``[n_out, r]``. A product ``W x`` then becomes ``W x + s B (A x)``, ``s`` the adapter's
scale times ``alpha / r`` (or the scale alone when alpha is 0), summed over the
adapters (llama.cpp's ``build_lora_mm``).

Here the adapters' tensors join the model's under the names ``lora<i>:<W>.lora_a``
and ``lora<i>:<W>.lora_b`` (adapter ``i`` of the command line; float32, the rank
padded with zeros to a multiple of 32 for the Vulkan products), and
``ModelConfig.lora`` lists each delta with its scale, which ``Graph.linear`` adds:
so both backends run an adapter as two more products, and a matrix the graph does not
reach through ``linear`` (an embedding, experts, a head-wise product) is refused at
load rather than silently left without its delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from trio_llm.errors import ModelLoadError, UnsupportedModelError

#: the prefix of adapter ``i``'s tensors among the model's
PREFIX = "lora{}:"


@attrs.frozen
class LoraDelta:
    """One adapter's delta to one matrix: ``scale * B (A x)`` added to ``W x``."""

    weight: str  # the model's matrix
    a: str  # its tensor names among the model's (after PREFIX)
    b: str
    scale: float


@attrs.define
class Adapter:
    path: Path
    scale: float
    alpha: float
    tensors: dict[str, Any]  # name (prefixed) -> TensorInfo
    handle: Any  # what keeps the file's mapping alive


#: the low rank is padded with zeros to a multiple of this: the Vulkan products take
#: inputs of whole 32-value blocks, and zeros add nothing to either product
RANK_ALIGN = 32


def _padded(pairs: list[tuple[str, Any, int, int]]) -> dict[str, Any]:
    """The tensors ``(name, info, rank, axis)`` as float32, their rank axis (0 for A, 1
    for B) padded with zeros to ``RANK_ALIGN``, all in one page-aligned buffer."""
    import numpy as np

    from trio_llm.model.gguf import f32_tensors

    arrays = {}
    for name, info, rank, axis in pairs:
        values = np.asarray(info.dequantize(), np.float32)
        widths = [(0, 0), (0, 0)]
        widths[axis] = (0, -rank % RANK_ALIGN)
        arrays[name] = np.pad(values, widths)
    return f32_tensors(arrays)


def load_adapters(specs: Sequence[tuple[str, float]], arch: str, model_tensors: dict[str, Any]) -> tuple[
        list[Adapter], tuple[LoraDelta, ...]]:
    """Read each (path, scale) adapter for a model of ``arch`` with ``model_tensors``;
    every file problem is a ``ModelLoadError`` naming the file."""
    from trio_llm.model.gguf import read_gguf

    adapters: list[Adapter] = []
    deltas: list[LoraDelta] = []
    for i, (name, scale) in enumerate(specs):
        path = Path(name)

        def check(md: dict[str, Any], path: Path = path) -> None:
            if md.get("general.type") != "adapter":
                raise ModelLoadError(path, f"expect general.type to be 'adapter', but got: {md.get('general.type')!r}")
            if md.get("adapter.type") != "lora":
                raise ModelLoadError(path, f"expect adapter.type to be 'lora', but got: {md.get('adapter.type')!r}")
            if md.get("general.architecture") != arch:
                raise ModelLoadError(path, f"model arch ({arch}) and LoRA arch "
                                           f"({md.get('general.architecture')}) mismatch")
            if "adapter.alora.invocation_tokens" in md:
                raise UnsupportedModelError(path, "activated LoRA (adapter.alora.invocation_tokens) is not supported")

        md, tensors, data = read_gguf(path, check)
        alpha = md.get("adapter.lora.alpha", 0.0)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise ModelLoadError(path, "adapter.lora.alpha is not a number")
        prefix = PREFIX.format(i)
        pairs: dict[str, dict[str, Any]] = {}
        for tname, info in tensors.items():
            for part in ("lora_a", "lora_b"):
                if tname.endswith("." + part):
                    pairs.setdefault(tname[: -len(part) - 1], {})[part] = info
                    break
            else:
                raise ModelLoadError(path, f"tensor {tname!r} is neither a lora_a nor a lora_b")
        todo: list[tuple[str, Any, int, int]] = []
        for weight, ab in sorted(pairs.items()):
            if set(ab) != {"lora_a", "lora_b"}:
                raise ModelLoadError(path, f"{weight}: lora_a and lora_b must come in pairs")
            if weight not in model_tensors:
                raise ModelLoadError(path, f"{weight}: no such tensor in the model (hint: another base model?)")
            w, a, b = model_tensors[weight].shape, ab["lora_a"].shape, ab["lora_b"].shape
            if len(w) != 2:
                raise UnsupportedModelError(path, f"{weight}: a LoRA on a {len(w)}-D tensor (experts) is not supported")
            if weight == "token_embd.weight":
                raise UnsupportedModelError(path, "a LoRA on the token embedding is not supported")
            if len(a) != 2 or len(b) != 2 or a[1] != w[1] or b[0] != w[0]:
                raise ModelLoadError(path, f"tensor {weight!r} has incorrect shape (hint: maybe wrong base model?)")
            if a[0] != b[1]:
                raise ModelLoadError(path, "lora_a tensor is not transposed (hint: adapter from \"finetune\" example "
                                           "is no longer supported)")
            rank = b[1]
            s = scale * float(alpha) / rank if alpha else scale
            an, bn = f"{prefix}{weight}.lora_a", f"{prefix}{weight}.lora_b"
            todo += [(an, ab["lora_a"], rank, 0), (bn, ab["lora_b"], rank, 1)]
            deltas.append(LoraDelta(weight, an, bn, s))
        adapters.append(Adapter(path, scale, float(alpha), _padded(todo), data))
    return adapters, tuple(deltas)

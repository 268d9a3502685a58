"""Control vectors (llama-server's ``--control-vector``, ``--control-vector-scaled``,
``--control-vector-layer-range``), as llama.cpp reads and applies them.

A control-vector file is a GGUF (llama.cpp's ``cvector-generator`` writes
``general.architecture`` "controlvector", ``controlvector.model_hint`` and
``controlvector.layer_count``, none of which llama.cpp reads) whose tensors are
``direction.N``: one F32 vector of ``n_embd`` values for layer ``N`` (from 1).
``common_control_vector_load`` multiplies each by its file's scale and sums them,
within a file (two tensors of one layer) and across files; the sum for layer ``il``
is then added to that layer's output, the residual stream after its feed-forward
(``llama_adapter_cvec::apply_to`` at each model's ``build_cvec``), for ``il`` in
``[start, end]`` (inclusive; a START or END of 0 or less is 1 or ``n_layer``).
Layer 0 never has one, and a layer the files do not name adds zeros.

Refused, each in one line naming the file (llama.cpp refuses the same, and then the
whole model): a tensor not named ``direction.N`` with ``N`` > 0, one that is not F32
or not one row, vectors of different sizes, a file without tensors, and a size other
than the model's ``n_embd``. ``N`` is read as C's ``stoi`` reads it (``direction.3.x``
is layer 3). A direction for a layer the model does not have is ignored, as there.

Here the sums join the model's tensors as ``cvec.<il>`` (float32, one page-aligned
buffer, ``gguf.f32_tensors``) for the layers in range whose vector is not all zeros
(adding zeros is the identity), and ``Graph.cvec`` adds the layer's to its output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trio_llm.errors import ModelLoadError
from trio_llm.graph import CVEC

_INT32 = 2**31


def _layer_index(name: str) -> int:
    """llama.cpp's reading of ``direction.N``: ``std::stoi`` of what follows the first
    dot (leading blanks, a sign, digits, anything after), else -1."""
    head, dot, rest = name.partition(".")
    if not dot or head != "direction":
        return -1
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", rest)
    if m is None:
        return -1
    n = int(m[1])
    return n if -_INT32 <= n < _INT32 else -1


def load_one(path: Path, scale: float) -> tuple[int, dict[int, np.ndarray]]:
    """One file's directions times ``scale``, by layer, and their size
    (``common_control_vector_load_one``)."""
    from trio_llm.model.gguf import read_gguf

    _md, tensors, _data = read_gguf(path)
    if not tensors:
        raise ModelLoadError(path, "no direction tensors found in the control vector")
    n_embd = -1
    out: dict[int, np.ndarray] = {}
    for name, info in tensors.items():
        il = _layer_index(name)
        if il < 0:
            raise ModelLoadError(path, f"invalid/unparsable direction tensor layer index ({name!r})")
        if il == 0:
            raise ModelLoadError(path, f"invalid (zero) direction tensor layer index ({name!r})")
        if info.ggml_type.name != "F32":
            raise ModelLoadError(path, f"invalid (non-F32) direction tensor type ({name!r} is "
                                       f"{info.ggml_type.name})")
        if any(d != 1 for d in info.shape[:-1]):
            raise ModelLoadError(path, f"invalid (non-1D) direction tensor shape ({name!r} is {list(info.shape)})")
        n = info.shape[-1]
        if n_embd == -1:
            n_embd = n
        elif n != n_embd:
            raise ModelLoadError(path, f"direction tensor {name!r} has {n} values, the ones before it {n_embd}")
        values = info.dequantize().reshape(-1) * np.float32(scale)  # [n_embd]
        out[il] = out[il] + values if il in out else values
    return n_embd, out


def load_control_vectors(specs: Sequence[tuple[str, float]], n_embd: int, n_layer: int,
                         layer_range: tuple[int, int] = (-1, -1)) -> dict[int, np.ndarray]:
    """The summed control vector of each layer ``il`` in ``layer_range`` (inclusive, a
    bound of 0 or less meaning 1 or ``n_layer``) that the files ``specs`` ((path,
    scale), in order) give one, not all zeros: ``[n_embd]`` float32 each. Every file
    problem is a ``ModelLoadError`` naming the file."""
    total: dict[int, np.ndarray] = {}
    size = -1
    for name, scale in specs:
        path = Path(name)
        n, dirs = load_one(path, scale)
        if size != -1 and n != size:
            raise ModelLoadError(path, f"control vectors of {n} values, the files before it {size}")
        size = n
        for il, v in dirs.items():
            total[il] = total[il] + v if il in total else v
    if size != n_embd:
        raise ModelLoadError(Path(specs[0][0]), f"control vector n_embd {size} does not match the model's {n_embd}")
    start, end = layer_range
    start = start if start > 0 else 1
    end = end if end > 0 else n_layer
    return {il: v for il, v in sorted(total.items()) if start <= il <= end and il < n_layer and v.any()}


def cvec_tensors(vectors: dict[int, np.ndarray]) -> dict[str, Any]:
    """The vectors as tensors ``cvec.<il>`` to join the model's."""
    from trio_llm.model.gguf import f32_tensors

    return f32_tensors({CVEC.format(il): v for il, v in vectors.items()})

"""One way to copy a GGUF file with some metadata or tensors changed, for the tests that
build a variant of a synthetic model (a bias copy for llama.cpp, a corrupt or unusual
key, a dropped tensor)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def copy_gguf(model: Path, out: Path, *, kv: Mapping[str, tuple[Any, gguf.GGUFValueType] | None] | None = None,
              drop: tuple[str, ...] = (), extra: Mapping[str, np.ndarray] | None = None) -> Path:
    """``model`` written again to ``out``: every key but those of ``kv`` (a key mapped to
    (value, type) is set, to None removed), every tensor as stored (quantized ones too)
    but those in ``drop``, then the float tensors ``extra``."""
    kv = kv or {}
    r = gguf.GGUFReader(model)
    w = gguf.GGUFWriter(path=None, arch=str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in kv:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, typed in kv.items():
        if typed is not None:
            w.add_key_value(key, typed[0], typed[1])
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(d) for d in reversed(t.shape)),
                         raw_dtype=t.tensor_type)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file(out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def uint32s(md: Mapping[str, Any]) -> dict[str, tuple[Any, gguf.GGUFValueType] | None]:
    """``copy_gguf``'s ``kv`` for keys set to unsigned integers (None: removed)."""
    return {k: None if v is None else (v, gguf.GGUFValueType.UINT32) for k, v in md.items()}

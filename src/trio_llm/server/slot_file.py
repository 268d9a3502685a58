"""The file of a saved slot (``POST /slots/{id}?action=save``): the tokens its KV cache
holds and the cache itself, in numpy's ``.npz`` format (read with ``allow_pickle``
off), with the model's shape beside them so that a restore into another model is
refused instead of computing garbage.

Arrays: ``tokens`` int32 [n]; ``kv`` float32 [n_layer, 2 (K, V), n, kv_dim];
``meta`` the UTF-8 JSON of ``{"format": 1, "model": {...}}``.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trio_llm.errors import InvalidRequest
from trio_llm.model.config import ModelConfig

FORMAT = 1


def model_shape(cfg: ModelConfig) -> dict[str, Any]:
    """What must match for a saved cache to mean the same in another process."""
    return {"arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head_kv": cfg.n_head_kv,
            "head_dim": cfg.head_dim, "n_vocab": cfg.n_vocab}


def save(path: Path, cfg: ModelConfig, tokens: Sequence[int], kv: np.ndarray) -> int:
    """Write the file (atomically: a temporary file renamed); returns its size."""
    meta = json.dumps({"format": FORMAT, "model": model_shape(cfg)}).encode()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, tokens=np.asarray(tokens, np.int32), kv=kv.astype(np.float32, copy=False),
                     meta=np.frombuffer(meta, np.uint8))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InvalidRequest(f"cannot write the slot file {path.name}: {exc.strerror or exc}") from None
    return path.stat().st_size


def load(path: Path, cfg: ModelConfig, n_ctx: int) -> tuple[list[int], np.ndarray]:
    """(tokens, kv) from a slot file, checked against this model and slot size."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            tokens = z["tokens"]
            kv = z["kv"]
    except FileNotFoundError:
        raise InvalidRequest(f"no slot file {path.name}") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{path.name} is not a slot file ({type(exc).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidRequest(f"{path.name}: unknown slot file format")
    if meta.get("model") != model_shape(cfg):
        raise InvalidRequest(f"{path.name} was saved by another model ({meta.get('model')})")
    n = int(tokens.shape[0]) if tokens.ndim == 1 else -1
    want = (cfg.n_layer, 2, n, cfg.n_head_kv * cfg.head_dim)
    if n < 0 or kv.shape != want or kv.dtype != np.float32 or tokens.dtype != np.int32:
        raise InvalidRequest(f"{path.name}: arrays of the wrong shape or type")
    if n >= n_ctx:
        raise InvalidRequest(f"{path.name} holds {n} tokens; a slot here holds {n_ctx - 1}")
    if n and (tokens.min() < 0 or tokens.max() >= cfg.n_vocab):
        raise InvalidRequest(f"{path.name}: a token outside the vocabulary")
    return [int(t) for t in tokens], kv

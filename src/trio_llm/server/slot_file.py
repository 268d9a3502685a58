"""The file of a saved slot (``POST /slots/{id}?action=save``): the tokens its KV cache
holds and the cache itself, in numpy's ``.npz`` format (read with ``allow_pickle``
off), with the model's shape beside them so that a restore into another model is
refused instead of computing garbage.

Arrays: ``tokens`` int32 [n]; ``kv`` float32 [n_layer, 2 (K, V), n, kv_dim], or
[n_layer, 1 (K), n, kv_dim] for a latent cache (``ModelConfig.kv_parts``: no V);
``meta`` the UTF-8 JSON of ``{"format": 1, "model": {...}}``; for a model with
recurrent layers (gated delta-net) also ``state`` float32 [n_state], the sequence's conv
and delta-rule state after its n tokens (``engine.memory.state_layout``), and the
model's shape names those layers, so that only the same kind of model restores it.

The folder (``--slot-save-path``) may be writable by others, so nothing in it is
trusted:

- a save writes a temporary file of its own, short name (``.slot-<random>.tmp``:
  hidden, so no request can name it, and never longer than the file system allows
  whatever the target's length), created ``O_CREAT|O_EXCL|O_NOFOLLOW`` mode 0600
  (a planted file or symlink of that name is refused, never followed or
  overwritten), written, fsync'd, then renamed over the target (a rename replaces
  a symlink, it does not write through it). The file holds the prompt's tokens, so
  it is readable by its owner only.
- a restore opens ``O_NOFOLLOW|O_NONBLOCK`` (a symlink is refused; a FIFO cannot
  block the open), accepts only a regular file of bounded size, and reads only a
  zip archive with exactly our three members, each bounded by the largest cache a
  slot can hold; anything else is an ``InvalidRequest`` (400).

Errors: a problem with the request's file (missing, foreign, too long a name) is an
``InvalidRequest``; a failure to write (a full disk, a read-only folder) is a
``TrioLLMError`` (500), with the old file left as it was and no temporary left behind.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trio_llm.errors import InvalidRequest, TrioLLMError
from trio_llm.model.config import ModelConfig

FORMAT = 1
MEMBERS = ("tokens.npy", "kv.npy", "meta.npy")
STATE = "state.npy"  # the fourth member of a hybrid model's file
#: room for the .npy headers and the meta JSON beyond the arrays themselves
OVERHEAD = 64 * 1024
#: errors that say the request named an unusable file, not that the server failed
_CLIENT_ERRNOS = {errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EINVAL}


def model_shape(cfg: ModelConfig) -> dict[str, Any]:
    """What must match for a saved cache to mean the same in another process."""
    shape: dict[str, Any] = {"arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
                             "n_head_kv": cfg.n_head_kv, "head_dim": cfg.head_dim, "n_vocab": cfg.n_vocab}
    if any(cfg.recurrent_layers):
        shape["recurrent"] = {"layers": [il for il, r in enumerate(cfg.recurrent_layers) if r],
                              "d_conv": cfg.ssm_d_conv, "n_k_heads": cfg.ssm_n_k_heads,
                              "n_v_heads": cfg.ssm_n_v_heads, "head_dim": cfg.ssm_head_dim}
    return shape


def max_bytes(cfg: ModelConfig, n_ctx: int, n_state: int = 0) -> int:
    """The largest slot file a slot of ``n_ctx`` positions can have."""
    kv = cfg.n_layer * cfg.kv_parts * n_ctx * cfg.n_head_kv * cfg.head_dim * 4
    return kv + 4 * n_ctx + 4 * n_state + 4 * OVERHEAD


def _write_error(name: str, exc: OSError) -> TrioLLMError:
    why = exc.strerror or str(exc)
    if exc.errno in _CLIENT_ERRNOS:
        return InvalidRequest(f"cannot write the slot file {name}: {why}")
    return TrioLLMError(f"cannot write the slot file {name}: {why}")


def save(path: Path, cfg: ModelConfig, tokens: Sequence[int], kv: np.ndarray,
         state: np.ndarray | None = None) -> int:
    """Write the file (atomically: a temporary file renamed); returns its size.
    ``state``: the recurrent state, for a model with recurrent layers."""
    extra: dict[str, Any] = {} if state is None or not any(cfg.recurrent_layers) else {"state": state.astype(np.float32, copy=False)}
    meta = json.dumps({"format": FORMAT, "model": model_shape(cfg)}).encode()
    tmp = f".slot-{secrets.token_hex(8)}.tmp"
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _write_error(path.name, exc) from None
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise _write_error(path.name, exc) from None
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, tokens=np.asarray(tokens, np.int32), kv=kv.astype(np.float32, copy=False),
                         meta=np.frombuffer(meta, np.uint8), **extra)
                f.flush()
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise _write_error(path.name, exc) from None
    finally:
        os.close(dir_fd)
    return size


def _open_regular(path: Path, limit: int) -> int:
    """An fd of ``path`` if it is a regular file of at most ``limit`` bytes."""
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidRequest(f"no slot file {name}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidRequest(f"{name} is a symbolic link, not a slot file") from None
        raise InvalidRequest(f"cannot read {name}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"{name} is not a regular file, not a slot file")
        if st.st_size > limit:
            raise InvalidRequest(f"{name} is larger ({st.st_size} bytes) than any slot file of this model")
    except BaseException:
        os.close(fd)
        raise
    return fd


def state_size(cfg: ModelConfig) -> int:
    """Values of one sequence's recurrent state (0 without recurrent layers)."""
    if not any(cfg.recurrent_layers):
        return 0
    from trio_llm.engine.memory import state_floats
    from trio_llm.models import build_graph, tensor_shapes

    return state_floats(build_graph(cfg, tensor_shapes(cfg)))


def load(path: Path, cfg: ModelConfig, n_ctx: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(tokens, kv, state) from a slot file, checked against this model and slot size
    (``state`` is empty for a model without recurrent layers)."""
    name = path.name
    n_state = state_size(cfg)
    limit = max_bytes(cfg, n_ctx, n_state)
    members = (*MEMBERS, STATE) if n_state else MEMBERS
    fd = _open_regular(path, limit)
    try:
        with os.fdopen(fd, "rb") as f, zipfile.ZipFile(f) as z:
            infos = {i.filename: i for i in z.infolist()}
            if sorted(infos) != sorted(members):
                if n_state and sorted(infos) == sorted(MEMBERS):
                    raise InvalidRequest(f"{name} holds no recurrent state; this model needs one")
                raise InvalidRequest(f"{name} is not a slot file (members {sorted(infos)[:5]})")
            if sum(i.file_size for i in infos.values()) > limit or infos["meta.npy"].file_size > OVERHEAD:
                raise InvalidRequest(f"{name} holds more than any slot file of this model")
            arrays = {}
            for member in members:
                with z.open(member) as m:
                    arrays[member] = np.lib.format.read_array(m, allow_pickle=False)
            meta = json.loads(bytes(arrays["meta.npy"]).decode())
            tokens, kv = arrays["tokens.npy"], arrays["kv.npy"]
            state = arrays.get(STATE, np.zeros(0, np.float32))
    except InvalidRequest:
        raise
    except (OSError, ValueError, KeyError, EOFError, TypeError, RecursionError, zipfile.BadZipFile) as exc:
        raise InvalidRequest(f"{name} is not a slot file ({type(exc).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidRequest(f"{name}: unknown slot file format")
    if meta.get("model") != model_shape(cfg):
        raise InvalidRequest(f"{name} was saved by another model ({meta.get('model')})")
    n = int(tokens.shape[0]) if tokens.ndim == 1 else -1
    want = (cfg.n_layer, cfg.kv_parts, n, cfg.n_head_kv * cfg.head_dim)
    if n < 0 or kv.shape != want or kv.dtype != np.float32 or tokens.dtype != np.int32:
        raise InvalidRequest(f"{name}: arrays of the wrong shape or type")
    if state.shape != (n_state,) or state.dtype != np.float32 or not np.isfinite(state).all():
        raise InvalidRequest(f"{name}: a recurrent state of the wrong shape or type")
    if n >= n_ctx:
        raise InvalidRequest(f"{name} holds {n} tokens; a slot here holds {n_ctx - 1}")
    if n and tokens.max() >= cfg.n_vocab:  # negative: an image's positions (server/media.py)
        raise InvalidRequest(f"{name}: a token outside the vocabulary")
    return [int(t) for t in tokens], kv, state

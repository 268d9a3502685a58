"""Read a GGUF file: metadata, tensor directory and memory-mapped tensor bytes.

Parsing is ``gguf.GGUFReader``'s (llama.cpp's own Python reader); this module turns
its output into plain values, checks that the file describes a model we can run, and
maps every failure to one typed, one-line error. Tensor bytes are never copied here:
``TensorInfo.raw`` is a view into the file's memory map, which also serves as the
host shadow of the weights when the device copy is released.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.model.config import ARCH_ROPE, ModelConfig

#: tensor types the backends implement (quantized ones are dequantized on the fly)
SUPPORTED_TYPES: frozenset[T] = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K})


@attrs.frozen(eq=False)
class TensorInfo:
    """One tensor of the file; ``raw`` is the memory-mapped bytes (no copy)."""

    name: str
    ggml_type: T
    shape: tuple[int, ...]  # numpy order: (n_out, n_in) for matrices, (n,) for vectors
    raw: np.ndarray  # [n_bytes] uint8, a view of the file's memory map
    n_bytes: int
    offset: int  # where the bytes start in the file (for readers that bypass the map)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 of ``shape`` (a fresh array; the file stays untouched)."""
        from trio_llm.model.quant import dequantize

        return dequantize(self.raw, self.ggml_type, self.shape)


@attrs.define(eq=False)
class GGUFModel:
    """A loaded GGUF: the config a forward pass needs, metadata, and the tensor map.

    Keep it open for as long as any ``TensorInfo.raw`` is in use: the arrays are views
    into the file's memory map.
    """

    path: Path
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _reader: gguf.GGUFReader | None = attrs.field(default=None, repr=False)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(self.path, f"no tensor named {name!r}") from None

    def weight_bytes(self) -> int:
        """Bytes of all tensor data, the amount a device copy of the weights needs."""
        return sum(t.n_bytes for t in self.tensors.values())

    def close(self) -> None:
        """Drop this object's references to the memory map.

        The map itself is unmapped by the garbage collector once no ``raw`` view is
        alive, so a caller that still holds a view keeps valid memory instead of a
        dangling pointer.
        """
        self._reader = None
        self.tensors = {}


def load_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open and validate ``path``; raise ``ModelLoadError`` (or its subclass
    ``UnsupportedModelError``) with one line naming the file and the problem."""
    path = Path(path)
    reader = _open_reader(path)
    metadata = _read_metadata(path, reader)
    tensors = _read_tensors(path, reader)
    config = _config_from(path, metadata, tensors)
    _check_tensors(path, config, tensors)
    return GGUFModel(path=path, config=config, metadata=metadata, tensors=tensors, reader=reader)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise ModelLoadError(path, "no such file")
    if path.is_dir():
        raise ModelLoadError(path, "is a directory, not a GGUF file")
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(path, "empty file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        # GGUFReader reads past the end of a truncated file as short arrays and fails
        # wherever that first bites (a header field, a tensor's reshape); all of it
        # means "corrupt or truncated".
        raise ModelLoadError(path, f"corrupt or truncated GGUF file ({_one_line(exc)})") from None
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read: {exc.strerror or exc}") from None
    return reader


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _field_value(field: Any) -> Any:
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # float32's shortest decimal, so 1e-5 reads back as 1e-05, not 9.99999974e-06
        return float(str(np.float32(value)))
    if isinstance(value, np.generic):
        return value.item()
    return value


def _read_metadata(path: Path, reader: gguf.GGUFReader) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _field_value(field)
        except (ValueError, UnicodeDecodeError, IndexError) as exc:
            raise ModelLoadError(path, f"metadata key {key!r} is malformed ({_one_line(exc)})") from None
    return metadata


def _read_tensors(path: Path, reader: gguf.GGUFReader) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for rt in reader.tensors:
        ggml_type = T(int(rt.tensor_type))
        if ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                path, f"tensor {rt.name!r} has type {ggml_type.name}, which trio-llm does not run"
            )
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        n_bytes = int(rt.n_bytes)
        start = int(rt.data_offset)
        # GGUFReader already failed (above, in _open_reader) if these bytes run past the end
        raw = reader.data[start : start + n_bytes]  # [n_bytes] uint8 view of the memmap
        tensors[rt.name] = TensorInfo(
            name=rt.name, ggml_type=ggml_type, shape=shape, raw=raw, n_bytes=n_bytes, offset=start
        )
    return tensors


def _get(path: Path, md: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = md.get(key, default)
    if value is None:
        raise ModelLoadError(path, f"missing metadata key {key!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ModelLoadError(path, f"metadata key {key!r} has {type(value).__name__}, expected {kind.__name__}")
    return value


def _config_from(path: Path, md: dict[str, Any], tensors: dict[str, TensorInfo]) -> ModelConfig:
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(path, "missing metadata key 'general.architecture'")
    if arch not in ARCH_ROPE:
        raise UnsupportedModelError(
            path, f"architecture {arch!r} is not supported (supported: {', '.join(ARCH_ROPE)})"
        )
    n_embd = _get(path, md, f"{arch}.embedding_length", int)
    n_head = _get(path, md, f"{arch}.attention.head_count", int)
    if n_head <= 0 or n_embd <= 0:
        raise ModelLoadError(path, "embedding_length and head_count must be positive")
    n_head_kv = _get(path, md, f"{arch}.attention.head_count_kv", int, n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ModelLoadError(path, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        n_vocab = len(tokens)
    elif "token_embd.weight" in tensors:
        # No tokenizer section: the embedding still tells the vocabulary size, and the
        # tokenizer raises its own error if anything needs one.
        n_vocab = tensors["token_embd.weight"].shape[0]
    else:
        raise ModelLoadError(path, "missing tensor 'token_embd.weight'")
    return ModelConfig(
        arch=arch,
        name=str(md.get("general.name", path.stem)),
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=_get(path, md, f"{arch}.block_count", int),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=_get(path, md, f"{arch}.attention.key_length", int, n_embd // n_head),
        n_ff=_get(path, md, f"{arch}.feed_forward_length", int),
        n_ctx_train=_get(path, md, f"{arch}.context_length", int),
        rope_theta=_get(path, md, f"{arch}.rope.freq_base", float, 10000.0),
        rms_eps=_get(path, md, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_mode=ARCH_ROPE[arch],
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        attn_bias="blk.0.attn_q.bias" in tensors,
        tied_embeddings="output.weight" not in tensors,
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``cfg`` must have, with its numpy-order shape.

    Used both to validate files and by ``synth`` to write them, so the two agree by
    construction.
    """
    e, q, kv, ff = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.n_vocab, e)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        shapes[b + "attn_q.weight"] = (q, e)
        shapes[b + "attn_k.weight"] = (kv, e)
        shapes[b + "attn_v.weight"] = (kv, e)
        if cfg.attn_bias:
            shapes[b + "attn_q.bias"] = (q,)
            shapes[b + "attn_k.bias"] = (kv,)
            shapes[b + "attn_v.bias"] = (kv,)
        if cfg.qk_norm:
            shapes[b + "attn_q_norm.weight"] = (cfg.head_dim,)
            shapes[b + "attn_k_norm.weight"] = (cfg.head_dim,)
        shapes[b + "attn_output.weight"] = (e, q)
        shapes[b + "ffn_norm.weight"] = (e,)
        shapes[b + "ffn_gate.weight"] = (ff, e)
        shapes[b + "ffn_up.weight"] = (ff, e)
        shapes[b + "ffn_down.weight"] = (e, ff)
    shapes["output_norm.weight"] = (e,)
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (cfg.n_vocab, e)
    return shapes


def _check_tensors(path: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    if cfg.arch == "qwen3" and not cfg.qk_norm:
        raise ModelLoadError(path, "missing tensor 'blk.0.attn_q_norm.weight' (qwen3 has QK-norm)")
    if cfg.arch == "qwen2" and not cfg.attn_bias:
        raise ModelLoadError(path, "missing tensor 'blk.0.attn_q.bias' (qwen2 has q/k/v biases)")
    for name, shape in expected_shapes(cfg).items():
        info = tensors.get(name)
        if info is None:
            raise ModelLoadError(path, f"missing tensor {name!r}")
        if info.shape != shape:
            raise ModelLoadError(path, f"tensor {name!r} has shape {info.shape}, expected {shape}")
        if len(shape) == 1 and info.ggml_type not in (T.F32, T.F16, T.BF16):
            raise UnsupportedModelError(
                path, f"vector tensor {name!r} has type {info.ggml_type.name}; expected F32/F16/BF16"
            )

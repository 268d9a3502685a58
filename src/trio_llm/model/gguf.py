"""Read a GGUF file: metadata, tensor directory and memory-mapped tensor bytes.

The header (metadata and tensor directory) is parsed here with ``struct`` over the
file's memory map, using ``gguf``'s constants for value types, tensor types and block
sizes. ``gguf.GGUFReader`` does the same job but builds a numpy view per array
element: on a Llama-3 vocabulary (128k tokens, 128k merges) it took 19 s to open a
file this parser opens in well under one, and start-up time is hand-off latency.
The tests check both agree on every key and tensor.

Every failure maps to one typed, one-line error naming the file. Tensor bytes are
never copied: ``TensorInfo.raw`` is a view into the file's memory map, which also
serves as the host shadow of the weights when the device copy is released.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType
from gguf import GGMLQuantizationType as T

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.model.config import ModelConfig

log = logging.getLogger(__name__)

#: tensor types the backends implement (quantized ones are dequantized on the fly)
SUPPORTED_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
})


@attrs.frozen(eq=False)
class TensorInfo:
    """One tensor of the file; ``raw`` is the memory-mapped bytes (no copy)."""

    name: str
    ggml_type: T
    shape: tuple[int, ...]  # numpy order: (n_out, n_in) for matrices, (n,) for vectors
    raw: np.ndarray  # [n_bytes] uint8, a read-only view of the file's memory map
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
    _map: np.ndarray | None = attrs.field(default=None, repr=False)
    #: the command line's settings over the file (``load_gguf``'s ``overrides``): a
    #: reload of the same file passes them again
    overrides: dict[str, Any] = attrs.field(factory=dict)
    #: LoRA adapters (``model/lora.py``) whose tensors are among ``tensors``: they hold
    #: their files' mappings
    adapters: list[Any] = attrs.field(factory=list)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(self.path, f"no tensor named {name!r}") from None

    def weight_bytes(self) -> int:
        """Bytes of the tensor data a device copy of the weights needs: every tensor but
        those of blocks past the trunk (a file's multi-token-prediction blocks, which no
        forward pass reads and the Vulkan backend leaves on disk)."""
        n_layer = self.config.n_layer
        return sum(t.n_bytes for name, t in self.tensors.items()
                   if not (name.startswith("blk.") and int(name.split(".", 2)[1]) >= n_layer))

    def close(self) -> None:
        """Drop this object's references to the memory map.

        The map itself is unmapped by the garbage collector once no ``raw`` view is
        alive, so a caller that still holds a view keeps valid memory instead of a
        dangling pointer.
        """
        self._map = None
        self.tensors = {}
        self.adapters = []


def load_gguf(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> GGUFModel:
    """Open and validate ``path``; raise ``ModelLoadError`` (or its subclass
    ``UnsupportedModelError``) with one line naming the file and the problem.
    ``overrides``: what the command line sets over the file's hyper-parameters
    (``trio_llm.models.Meta.over``: llama-server's ``--rope-*`` / ``--yarn-*``), its
    metadata (``kv``), LoRA adapters (``lora``: (path, scale) pairs) and control vectors
    (``cvec``: (path, scale) pairs; ``cvec_range``: (start, end), ``model/cvec.py``)."""
    path = Path(path)
    metadata, tensors, data = read_gguf(path)
    if overrides and overrides.get("kv"):
        metadata = _kv_overridden(path, metadata, overrides["kv"])
    config = _config_from(path, metadata, tensors, overrides or {})
    _check_tensors(path, config, tensors)
    adapters: list[Any] = []
    if overrides and overrides.get("lora"):  # --lora / --lora-scaled: their tensors join the model's
        from trio_llm.model.lora import load_adapters

        adapters, deltas = load_adapters(overrides["lora"], config.arch, tensors)
        tensors = dict(tensors)
        for adapter in adapters:
            tensors.update(adapter.tensors)
        config = attrs.evolve(config, lora=tuple((d.weight, d.a, d.b, d.scale) for d in deltas))
    if overrides and overrides.get("cvec"):  # --control-vector(-scaled): the sums join the model's tensors
        from trio_llm.model.cvec import cvec_tensors, load_control_vectors

        vectors = load_control_vectors(overrides["cvec"], config.n_embd, config.n_layer,
                                       overrides.get("cvec_range", (-1, -1)))
        tensors = {**tensors, **cvec_tensors(vectors)}
    return GGUFModel(path=path, config=config, metadata=metadata, tensors=tensors, map=data,
                     overrides=dict(overrides or {}), adapters=adapters)


def f32_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, TensorInfo]:
    """Float32 tensors that join a model's (a LoRA adapter's, the control vectors), as
    ``TensorInfo`` views of one page-aligned buffer: they are small, and one buffer keeps
    a Vulkan weight segment inside one allocation, whose host shadow an import can take
    (``vulkan/weights.py``), like a file's mapping."""
    values = [np.ascontiguousarray(a, np.float32) for a in arrays.values()]
    offsets, pos = [], 0
    for a in values:
        offsets.append(pos)
        pos += -(-a.nbytes // 256) * 256
    page = 4096
    # room for the page-aligned start and a whole last page: an imported shadow spans
    # whole pages from the first tensor on, and must not reach past this allocation
    block = np.zeros(-(-pos // page) * page + 2 * page, np.uint8)
    start = -int(block.ctypes.data) % page
    out: dict[str, TensorInfo] = {}
    for name, a, off in zip(arrays, values, offsets, strict=True):
        raw = block[start + off: start + off + a.nbytes]
        raw[:] = a.reshape(-1).view(np.uint8)
        out[name] = TensorInfo(name, T.F32, tuple(a.shape), raw, a.nbytes, 0)
    return out


def _kv_overridden(path: Path, md: dict[str, Any], kv: Mapping[str, Any]) -> dict[str, Any]:
    """``--override-kv``: the metadata with each override over the file's value, as
    llama.cpp's model loader reads it (everything that reads the metadata, the
    tokenizer and the chat template included, sees the new value). An override whose
    type is not the file's key's (int, float, bool, str) is ignored with a warning,
    as llama.cpp's ``validate_override`` does."""

    def kind(v: Any) -> str:
        return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else \
            "float" if isinstance(v, float) else "str" if isinstance(v, str) else type(v).__name__

    out = dict(md)
    for key, value in kv.items():
        if key in md and kind(md[key]) != kind(value):
            log.warning("%s: --override-kv %s: the file's value is %s, not %s: ignored", path, key, kind(md[key]),
                        kind(value))
            continue
        log.info("%s: metadata override %s = %r", path, key, value)
        out[key] = value
    return out


def read_gguf(path: Path, check: Callable[[dict[str, Any]], None] | None = None,
              ) -> tuple[dict[str, Any], dict[str, TensorInfo], np.ndarray]:
    """A GGUF file's metadata, tensors (views of the mapping) and the mapping itself,
    checked as far as the format goes (``ModelLoadError`` in one line); ``check`` sees
    the metadata before the tensors are read (what kind of file it is)."""
    data = _open_map(path)
    try:
        metadata, directory, data_start, alignment = _Header(data.data).parse()
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise ModelLoadError(path, f"truncated or corrupt GGUF file ({_one_line(exc)})") from None
    except _Corrupt as exc:
        raise ModelLoadError(path, str(exc)) from None
    if check is not None:
        check(metadata)
    return metadata, _read_tensors(path, data, directory, data_start, alignment), data


def _open_map(path: Path) -> np.ndarray:
    if not path.exists():
        raise ModelLoadError(path, "no such file")
    if path.is_dir():
        raise ModelLoadError(path, "is a directory, not a GGUF file")
    try:
        size = path.stat().st_size
        if size == 0:
            raise ModelLoadError(path, "empty file")
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read: {exc.strerror or exc}") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Corrupt(Exception):
    """A header inconsistency found by the parser (the message says which)."""


_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@attrs.define
class _Header:
    """GGUF v2/v3 header parser (little-endian) over a buffer.

    Layout: magic, version u32, n_tensors u64, n_kv u64; n_kv of (key string, type u32,
    value); n_tensors of (name string, n_dims u32, ne u64 x n_dims, type u32, offset
    u64); tensor data from the next ``general.alignment`` boundary. Strings are a u64
    length and UTF-8 bytes; arrays are an element type u32, a count u64, elements.
    """

    buf: memoryview  # of the memory map: slicing a memoryview is cheap, a memmap's is not
    pos: int = 0

    def parse(self) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int, int]:
        self.pos = 4  # magic, checked when the file was opened
        version = self._u32()
        if version & 0xFFFF == 0 and version != 0:
            raise _Corrupt("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise _Corrupt(f"GGUF version {version} is not supported (expected 2 or 3)")
        n_tensors, n_kv = self._u64(), self._u64()
        self._room(n_kv, 12, "metadata entries")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            if key in metadata:
                raise _Corrupt(f"metadata key {key!r} appears twice")
            metadata[key] = self._value(GGUFValueType(self._u32()))
        self._room(n_tensors, 28, "tensor entries")
        directory = []
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._u32()
            if not 1 <= n_dims <= 4:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
            ne = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
            self.pos += 8 * n_dims
            type_id, offset = self._u32(), self._u64()
            directory.append((name, tuple(reversed(ne)), type_id, offset))
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self.pos // alignment) * alignment
        return metadata, directory, data_start, alignment

    def _room(self, count: int, min_size: int, what: str) -> None:
        # a corrupt count must fail here, not after looping billions of times
        if count * min_size > len(self.buf) - self.pos:
            raise _Corrupt(f"truncated or corrupt: the header claims {count} {what}, more than the file holds")

    def _u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def _u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def _str(self) -> str:
        n = self._u64()
        end = self.pos + n
        if end > len(self.buf):
            raise _Corrupt("truncated or corrupt: a string runs past the end of the file")
        text = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return text

    def _strings(self, count: int) -> list[str]:
        # the hot loop of a load (a vocabulary is 100k+ strings): locals only
        buf, pos, unpack, out = self.buf, self.pos, _U64.unpack_from, []
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            out.append(str(buf[pos : pos + n], "utf-8"))
            pos += n
        if pos > len(buf):
            raise _Corrupt("truncated or corrupt: a string runs past the end of the file")
        self.pos = pos
        return out

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._str()
        if vtype == GGUFValueType.ARRAY:
            return self._array()
        fmt = _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        if vtype == GGUFValueType.FLOAT32:
            # float32's shortest decimal, so 1e-5 reads back as 1e-05, not 9.99999974e-06
            return float(str(np.float32(value)))
        return value

    def _array(self) -> list[Any]:
        etype = GGUFValueType(self._u32())
        count = self._u64()
        if etype == GGUFValueType.STRING:
            self._room(count, 8, "strings")
            return self._strings(count)
        if etype == GGUFValueType.ARRAY:
            self._room(count, 12, "arrays")
            return [self._array() for _ in range(count)]
        fmt = "<" + _SCALAR_FORMATS[etype]
        self._room(count, struct.calcsize(fmt), "array elements")
        values = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
        self.pos += values.nbytes
        return values.tolist()  # plain Python ints / floats / bools


def _read_tensors(
    path: Path,
    data: np.ndarray,
    directory: list[tuple[str, tuple[int, ...], int, int]],
    data_start: int,
    alignment: int,
) -> dict[str, TensorInfo]:
    file_size = int(data.shape[0])
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, rel_offset in directory:
        try:
            ggml_type = T(type_id)
        except ValueError:
            raise UnsupportedModelError(path, f"tensor {name!r} has unknown type id {type_id}") from None
        if ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                path, f"tensor {name!r} has type {ggml_type.name}, which trio-llm does not run"
            )
        if name in tensors:
            raise ModelLoadError(path, f"tensor {name!r} appears twice")
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block:
            raise ModelLoadError(path, f"tensor {name!r} rows of {shape[-1]} do not fill {ggml_type.name} blocks")
        n_bytes = math.prod(shape) // block * type_size  # Python ints: corrupt dims cannot wrap
        if rel_offset % alignment:
            raise ModelLoadError(path, f"tensor {name!r} data is not aligned to {alignment} bytes")
        start = data_start + rel_offset
        if start + n_bytes > file_size:
            raise ModelLoadError(
                path, f"truncated: tensor {name!r} ends at byte {start + n_bytes} of a {file_size}-byte file"
            )
        raw = data[start : start + n_bytes]  # [n_bytes] uint8 view of the read-only memmap
        tensors[name] = TensorInfo(
            name=name, ggml_type=ggml_type, shape=shape, raw=raw, n_bytes=n_bytes, offset=start
        )
    return tensors


def _config_from(path: Path, md: dict[str, Any], tensors: dict[str, TensorInfo],
                 overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    from trio_llm.models import load_config

    return load_config(path, md, tensors, overrides)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``cfg`` must have, with its numpy-order shape (from the
    architecture's file in ``trio_llm.models``). Used both to validate files and by
    ``synth`` to write them, so the two agree by construction."""
    from trio_llm.models import tensor_shapes

    return tensor_shapes(cfg)


def _check_tensors(path: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    from trio_llm.models import optional_shapes

    required = expected_shapes(cfg)
    optional = {n: sh for n, sh in optional_shapes(cfg).items() if n in tensors}
    for name, shape in {**required, **optional}.items():
        info = tensors.get(name)
        if info is None:
            raise ModelLoadError(path, f"missing tensor {name!r}")
        if info.shape != shape and not (name in optional and math.prod(info.shape) == math.prod(shape)):
            raise ModelLoadError(path, f"tensor {name!r} has shape {info.shape}, expected {shape}")
        if len(shape) == 1 and info.ggml_type not in (T.F32, T.F16, T.BF16):
            raise UnsupportedModelError(
                path, f"vector tensor {name!r} has type {info.ggml_type.name}; expected F32/F16/BF16"
            )

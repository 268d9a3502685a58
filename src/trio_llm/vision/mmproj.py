"""Load a multimodal projector file (llama-server's ``--mmproj``) for gemma-3.

The file is what llama.cpp's ``convert_hf_to_gguf.py --mmproj`` writes for
``Gemma3ForConditionalGeneration`` (class ``Gemma3VisionModel``): architecture
``clip``, ``clip.projector_type`` ``gemma3``, the ``clip.vision.*`` shape keys, a
SigLIP tower (``v.*``) and the projector (``mm.soft_emb_norm``,
``mm.input_projection``). The keys are read as ``clip_model_loader::load_hparams``
reads them (``tools/mtmd/clip.cpp``): the pool's kernel ``n_merge`` is 4 unless
``clip.vision.projector.scale_factor`` says otherwise (the converter writes it only
for test models); the activation is GELU if ``clip.use_gelu``, SiLU if
``clip.use_silu``, and otherwise llama.cpp's default, quick-GELU.

Only gemma3 projectors are accepted. Everything else (another projector type, an
audio-only file, a text model given as ``--mmproj``, missing keys or tensors, wrong
shapes, a truncated or non-GGUF file) is refused with one ``ModelLoadError`` line
naming the file, through the same header parser the text models use
(``trio_llm.model.gguf``).
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType as T

from trio_llm.errors import ModelLoadError, UnsupportedModelError
from trio_llm.model.gguf import TensorInfo, read_gguf
from trio_llm.vision import siglip
from trio_llm.vision.siglip import FfnOp, Hparams

#: llama.cpp's default pool kernel for gemma3 (every released model size)
DEFAULT_N_MERGE = 4
#: clip_hparams' default eps where the file has none
DEFAULT_EPS = 1e-6


@attrs.frozen(eq=False)
class Projector:
    """A loaded gemma3 projector: its shape, its preprocessing constants and its weights
    (views of the file's memory map; keep the object alive while encoding)."""

    path: Path
    hparams: Hparams
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    metadata: dict[str, Any] = attrs.field(repr=False)
    _tensors: dict[str, TensorInfo] = attrs.field(repr=False, alias="tensors")

    @property
    def image_size(self) -> int:
        return self.hparams.image_size

    @property
    def patch_size(self) -> int:
        return self.hparams.patch_size

    @property
    def n_merge(self) -> int:
        return self.hparams.n_merge

    @property
    def n_tokens(self) -> int:
        """Embeddings per image: ``((image_size / patch_size) / n_merge) ** 2``."""
        return self.hparams.n_tokens

    @property
    def n_embd_out(self) -> int:
        """The width of each embedding: the text model's ``n_embd``."""
        return self.hparams.n_embd_out

    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self._tensors.values())

    def encode(self, pixels: np.ndarray, *, cancel: threading.Event | None = None) -> np.ndarray:
        """A preprocessed image (``image.preprocess``: [3, S, S] float32) ->
        [n_tokens, n_embd_out] float32, the rows llama.cpp feeds the text model.
        Blocks (seconds for a real gemma-3 tower); run it in a worker thread. Setting
        ``cancel`` stops it early with ``EncodeCancelled``."""
        return siglip.encode(self.hparams, self._tensors, pixels, cancel=cancel)


class UnsupportedProjector(UnsupportedModelError):
    """A well-formed projector file of an encoder this server does not run (the server
    then serves text only); every other problem of the file is a ``ModelLoadError``."""


def load_projector(path: str | os.PathLike[str]) -> Projector:
    """Open and validate a gemma3 ``--mmproj`` file; raise ``ModelLoadError`` (or its
    subclass ``UnsupportedModelError``) with one line naming the file and the problem."""
    path = Path(path)
    md, tensors, _ = read_gguf(path, lambda md: _check_kind(path, md))
    hp = _hparams(path, md, tensors)
    _check_tensors(path, hp, tensors)
    mean = _triple(path, md, "clip.vision.image_mean")
    std = _triple(path, md, "clip.vision.image_std")
    if any(s == 0.0 for s in std):
        raise ModelLoadError(path, f"clip.vision.image_std {list(std)} has a zero")
    return Projector(path=path, hparams=hp, image_mean=mean, image_std=std, metadata=md,
                     tensors=tensors)


def _check_kind(path: Path, md: dict[str, Any]) -> None:
    arch = md.get("general.architecture")
    if arch != "clip":
        if arch is None:
            raise ModelLoadError(path, "not a multimodal projector: no general.architecture")
        raise ModelLoadError(
            path, f"not a multimodal projector: general.architecture is {arch!r}, expected 'clip' "
                  "(a text model given as --mmproj?)")
    if not md.get("clip.has_vision_encoder", False):
        what = "audio only" if md.get("clip.has_audio_encoder", False) else "no vision encoder"
        raise UnsupportedProjector(path, f"the projector has {what} (clip.has_vision_encoder is not set)")
    ptype = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if ptype is None:
        raise ModelLoadError(path, "missing metadata key 'clip.projector_type'")
    if ptype != "gemma3":
        raise UnsupportedProjector(
            path, f"projector type {ptype!r} is not supported (trio-llm runs gemma3 projectors only)")


def _key(path: Path, md: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = md.get(key, default)
    if value is None:
        raise ModelLoadError(path, f"missing metadata key {key!r}")
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, kind) and not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ModelLoadError(path, f"metadata key {key!r} is {value!r}, expected {kind.__name__}")
    return value


def _positive(path: Path, md: dict[str, Any], key: str, default: int | None = None) -> int:
    value = int(_key(path, md, key, int, default))
    if value <= 0:
        raise ModelLoadError(path, f"metadata key {key!r} is {value}, expected a positive integer")
    return value


def _triple(path: Path, md: dict[str, Any], key: str) -> tuple[float, float, float]:
    value = md.get(key)
    if value is None:
        raise ModelLoadError(path, f"missing metadata key {key!r}")
    if (not isinstance(value, list) or len(value) < 3
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value[:3])):
        raise ModelLoadError(path, f"metadata key {key!r} is {value!r}, expected three numbers")
    a, b, c = (float(x) for x in value[:3])
    return (a, b, c)


def _hparams(path: Path, md: dict[str, Any], tensors: dict[str, TensorInfo]) -> Hparams:
    image_size = _positive(path, md, "clip.vision.image_size")
    patch_size = _positive(path, md, "clip.vision.patch_size")
    n_embd = _positive(path, md, "clip.vision.embedding_length")
    n_head = _positive(path, md, "clip.vision.attention.head_count")
    n_ff = _positive(path, md, "clip.vision.feed_forward_length")
    n_layer = _positive(path, md, "clip.vision.block_count")
    n_merge = _positive(path, md, "clip.vision.projector.scale_factor", DEFAULT_N_MERGE)
    eps = float(_key(path, md, "clip.vision.attention.layer_norm_epsilon", float, DEFAULT_EPS))
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ModelLoadError(path, f"clip.vision.attention.layer_norm_epsilon is {eps}")
    use_gelu = bool(_key(path, md, "clip.use_gelu", bool, False))
    use_silu = bool(_key(path, md, "clip.use_silu", bool, False))
    if use_gelu and use_silu:
        raise ModelLoadError(path, "both clip.use_gelu and clip.use_silu are set")
    ffn_op: FfnOp = "gelu" if use_gelu else "silu" if use_silu else "gelu_quick"
    if image_size % patch_size:
        raise ModelLoadError(path, f"image size {image_size} is not a multiple of the patch size {patch_size}")
    n_side = image_size // patch_size
    if n_side % n_merge:
        raise ModelLoadError(path, f"{n_side} patches a side do not pool by {n_merge}")
    if n_embd % n_head:
        raise ModelLoadError(path, f"embedding length {n_embd} is not a multiple of {n_head} heads")
    n_head_kv = md.get("clip.vision.attention.head_count_kv", n_head)
    if n_head_kv != n_head:
        raise UnsupportedModelError(path, f"clip.vision.attention.head_count_kv {n_head_kv} != head_count {n_head}")
    proj = tensors.get("mm.input_projection.weight")
    if proj is None:
        raise ModelLoadError(path, "missing tensor 'mm.input_projection.weight'")
    if len(proj.shape) != 2:
        raise ModelLoadError(path, f"tensor 'mm.input_projection.weight' has shape {proj.shape}, expected 2-D")
    n_embd_out = int(proj.shape[1])
    dim = md.get("clip.vision.projection_dim")
    if dim is not None and dim != n_embd_out:
        raise ModelLoadError(
            path, f"clip.vision.projection_dim is {dim} but mm.input_projection.weight makes {n_embd_out}")
    return Hparams(image_size=image_size, patch_size=patch_size, n_embd=n_embd, n_head=n_head,
                   n_ff=n_ff, n_layer=n_layer, n_merge=n_merge, n_embd_out=n_embd_out, eps=eps,
                   ffn_op=ffn_op)


def _check_tensors(path: Path, hp: Hparams, tensors: dict[str, TensorInfo]) -> None:
    for name, shape in siglip.tensor_shapes(hp).items():
        info = tensors.get(name)
        if info is None:
            raise ModelLoadError(path, f"missing tensor {name!r}")
        if info.shape != shape:
            raise ModelLoadError(path, f"tensor {name!r} has shape {info.shape}, expected {shape}")
        if len(shape) == 1 and info.ggml_type not in (T.F32, T.F16, T.BF16):
            raise UnsupportedModelError(
                path, f"vector tensor {name!r} has type {info.ggml_type.name}; expected F32/F16/BF16")

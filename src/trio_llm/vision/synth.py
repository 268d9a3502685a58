"""Synthetic gemma-3 ``--mmproj`` files, written as llama.cpp's converter writes them.

``write_mmproj`` makes what ``convert_hf_to_gguf.py --mmproj`` makes of a
``Gemma3ForConditionalGeneration`` (``Gemma3VisionModel``), with random weights:
``general.architecture`` ``clip``, ``general.type`` ``mmproj``, the
``clip.has_vision_encoder`` / ``clip.projector_type`` keys, the ``clip.vision.*``
shape keys, ``clip.use_gelu``, the layer-norm eps, SigLIP's ``image_mean`` /
``image_std`` of 0.5, and ``clip.vision.projector.scale_factor`` only where the pool is
not the default 4 (the converter writes it only for test models). The tensors are
``siglip.tensor_shapes`` with the converter's types: the patch and position
embeddings F32 (its ``.embeddings.`` rule), ``mm.input_projection.weight`` F16 (its
rule for every output type), norms and biases F32, and the block matrices of
``wtype``.

Values are drawn per tensor from an RNG seeded by (seed, tensor name), so a file's
bytes depend only on its arguments. Matrices are N(0, 1/sqrt(n_in)) so activations
keep unit scale through the blocks, norms 1 + N(0, 0.02), biases N(0, 0.02), the
position embeddings N(0, 0.02) and the patch kernel N(0, 1/sqrt(3 p p)).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from trio_llm.model.quant import block_size, quantize
from trio_llm.model.synth import atomic_gguf
from trio_llm.vision.siglip import Hparams, tensor_shapes

WTYPES: dict[str, T] = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}
#: general.file_type the converter writes for each output type
FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
SMALL_STD = 0.02


def _rng(seed: int, name: str) -> np.random.Generator:
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, key]))


def _values(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    x = _rng(seed, name).standard_normal(shape, dtype=np.float32)
    if name.endswith("bias") or name == "v.position_embd.weight":
        x *= np.float32(SMALL_STD)
    elif len(shape) == 1:  # a norm's weight
        x *= np.float32(SMALL_STD)
        x += np.float32(1.0)
    elif name == "mm.input_projection.weight":  # [n_embd, n_embd_out], used as x @ W
        x *= np.float32(1.0 / np.sqrt(shape[0]))
    else:  # [n_out, n_in...]
        x *= np.float32(1.0 / np.sqrt(int(np.prod(shape[1:]))))
    return x


def _type_of(name: str, shape: tuple[int, ...], wtype: T) -> T:
    if len(shape) == 1 or name in ("v.patch_embd.weight", "v.position_embd.weight"):
        return T.F32
    if name == "mm.input_projection.weight":
        return T.F16
    if shape[-1] % block_size(wtype):
        return T.F16  # as the converter falls back for rows that do not fill a block
    return wtype


def write_mmproj(
    path: str | os.PathLike[str],
    *,
    n_embd_text: int,
    image_size: int,
    patch_size: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_layer: int,
    n_merge: int = 4,
    wtype: str = "f16",
    seed: int = 0,
    eps: float = 1e-6,
) -> Path:
    """Write a random gemma3 projector to ``path`` atomically; return the path."""
    if wtype not in WTYPES:
        raise ValueError(f"wtype must be one of {', '.join(WTYPES)}, got {wtype!r}")
    if image_size % patch_size or (image_size // patch_size) % n_merge or n_embd % n_head:
        raise ValueError("image_size / patch_size must divide by n_merge, n_embd by n_head")
    hp = Hparams(image_size=image_size, patch_size=patch_size, n_embd=n_embd, n_head=n_head,
                 n_ff=n_ff, n_layer=n_layer, n_merge=n_merge, n_embd_out=n_embd_text, eps=eps,
                 ffn_op="gelu")
    path = Path(path)
    writer = gguf.GGUFWriter(path=None, arch="clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name("trio-llm synthetic gemma3 mmproj")
    writer.add_file_type(int(FILE_TYPES[wtype]))
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(n_embd_text)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(n_embd)
    writer.add_vision_feed_forward_length(n_ff)
    writer.add_vision_block_count(n_layer)
    writer.add_vision_head_count(n_head)
    writer.add_vision_image_mean(list(SIGLIP_MEAN))
    writer.add_vision_image_std(list(SIGLIP_STD))
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(eps)
    writer.add_vision_use_gelu(True)
    if n_merge != 4:
        writer.add_vision_projector_scale_factor(n_merge)
    for name, shape in tensor_shapes(hp).items():
        ggml_type = _type_of(name, shape, WTYPES[wtype])
        data = quantize(_values(seed, name, shape), ggml_type)  # uint8 [..., row_bytes]
        writer.add_tensor(name, data, raw_dtype=ggml_type)
    with atomic_gguf(writer, path) as tmp:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return path

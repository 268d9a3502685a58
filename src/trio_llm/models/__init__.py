"""The model layer: one module per architecture, each written once for every backend.

An architecture module has three functions, the shape of llama.cpp's ``src/models/``:

- ``hparams(meta, tensors)``: the ``ModelConfig`` from the file's metadata;
- ``tensors(cfg)``: every tensor the model reads, with its numpy-order shape, and
  ``optional(cfg)``: those it reads only when the file has them;
- ``build(g, cfg)``: the forward pass as calls on a ``trio_llm.graph.Graph``, from the
  shared blocks of ``blocks.py``.

``load_config``, ``tensor_shapes`` and ``build_graph`` dispatch on the architecture
name; nothing else in the code base asks which architecture it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

from trio_llm.errors import GraphError, ModelLoadError, UnsupportedModelError
from trio_llm.graph import CVEC, Graph, Output
from trio_llm.model.config import ModelConfig


@attrs.frozen
class Meta:
    """Typed reads of one file's metadata, with errors that name the file and the key."""

    path: Path
    md: Mapping[str, Any]
    arch: str
    #: what the command line sets over the file (``load_gguf``'s ``overrides``): by
    #: llama-server's names without dashes: ``rope_freq_base``, ``rope_scaling``,
    #: ``rope_freq_scale``, ``yarn_orig_ctx``, ``yarn_ext_factor``, ``yarn_attn_factor``,
    #: ``yarn_beta_fast``, ``yarn_beta_slow``
    over: Mapping[str, Any] = attrs.field(factory=dict)

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.md.get(key, default)
        if value is None:
            raise ModelLoadError(self.path, f"missing metadata key {key!r}")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise ModelLoadError(self.path, f"metadata key {key!r} has {type(value).__name__}, expected {kind.__name__}")
        return value

    def arch_get(self, key: str, kind: type, default: Any = None) -> Any:
        """``{arch}.{key}``: the architecture's own keys."""
        return self.get(f"{self.arch}.{key}", kind, default)

    def positive(self, key: str, default: int | None = None) -> int:
        value: int = self.arch_get(key, int, default)
        if value <= 0:
            raise ModelLoadError(self.path, f"metadata key '{self.arch}.{key}' is {value}, expected > 0")
        return value


def _registry() -> dict[str, ModuleType]:
    from trio_llm.models import (
        deepseek2,
        gemma3,
        gemma4,
        gemma_embedding,
        llama,
        qwen3moe,
        qwen3next,
        qwen35,
        qwen35moe,
    )

    return {name: mod for mod in (llama, gemma3, gemma4, gemma_embedding, qwen3moe, qwen35, qwen35moe, qwen3next, deepseek2)
            for name in mod.ARCHS}


def architecture(arch: str, path: object = "<model>") -> ModuleType:
    archs = _registry()
    mod = archs.get(arch)
    if mod is None:
        raise UnsupportedModelError(path, f"architecture {arch!r} is not supported (supported: {', '.join(archs)})")
    return mod


def supported_architectures() -> tuple[str, ...]:
    return tuple(_registry())


def load_config(path: Path, md: Mapping[str, Any], tensors: Mapping[str, Any],
                overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The config of a file (``tensors``: name -> anything with ``.shape``), with the
    command line's ``overrides`` (``Meta.over``)."""
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(path, "missing metadata key 'general.architecture'")
    cfg: ModelConfig = architecture(arch, path).hparams(Meta(path, md, arch, dict(overrides or {})), tensors)
    return cfg


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of ``cfg`` must have, with its numpy-order shape (files are
    validated against it and ``make-model`` writes exactly it)."""
    shapes: dict[str, tuple[int, ...]] = architecture(cfg.arch).tensors(cfg)
    return shapes


def optional_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors the model reads when the file has them."""
    shapes: dict[str, tuple[int, ...]] = architecture(cfg.arch).optional(cfg)
    return shapes


def build_graph(cfg: ModelConfig, present: Mapping[str, tuple[int, ...]], output: Output = "logits") -> Graph:
    """The forward pass of ``cfg`` over the tensors a file has (``present``: name -> shape),
    ending in ``output``: logits, final-norm hidden states or rank scores. A rank graph
    of a file without a classifier is a ``GraphError`` naming the tensor."""
    lora: dict[str, tuple[tuple[str, str, float], ...]] = {}
    for weight, a, b, scale in cfg.lora:
        lora[weight] = (*lora.get(weight, ()), (a, b, scale))
    g = Graph(shapes=dict(present), output=output, lora=lora)
    architecture(cfg.arch).build(g, cfg)
    assert g.logits is not None, f"{cfg.arch}: the graph sets no logits"
    missed = sorted(set(lora) - g.lora_used)
    if missed:  # a matrix this model reads through another op than linear
        raise GraphError(f"a LoRA on {missed[0]} is not supported for {cfg.arch} (it is not a plain product here)")
    unread = sorted(il for il in range(cfg.n_layer) if CVEC.format(il) in present and il not in g.cvec_used)
    assert not unread, f"{cfg.arch}: no control vector added to layer {unread[0]}"  # an architecture without g.cvec
    return g


def n_block_tensors(arch: str) -> int:
    """The fewest tensors one block has, for a cheap sanity check of ``block_count``."""
    n: int = architecture(arch).MIN_BLOCK_TENSORS
    return n

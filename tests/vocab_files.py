"""Vocabulary-only GGUF files for the tokenizer and chat-template tests: written with
``gguf``'s writer and read back the way the model loader hands metadata over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from trio_llm.model.vocab import VocabSpec


def write_vocab_gguf(path: Path, spec: VocabSpec, arch: str) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("vocab-only")
    spec.write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_metadata(path: Path) -> dict[str, Any]:
    """The file's key/values as plain Python values, as the model loader hands them over."""
    out: dict[str, Any] = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        value = field.contents()
        out[key] = value.item() if isinstance(value, np.generic) else value
    return out

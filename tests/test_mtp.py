"""Files with multi-token-prediction blocks (llama.cpp's converter appends them to
Qwen3.5 and Qwen3-Next models by default: ``nextn_predict_layers`` blocks after the
trunk, counted in ``block_count``). A forward pass is the trunk's, as llama.cpp's
without an MTP context: the same logits as the file without them, on both backends,
the blocks never placed on the device, and llama.cpp's own continuation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llamacpp_ref import Reference, agree, our_greedy, server_piece
from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.reference import NumpyBackend
from trio_llm.model.gguf import load_gguf
from trio_llm.model.synth import MakeModelError, make_model
from trio_llm.model.tokenizer import Tokenizer

PRESETS = ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next"]
PROMPT = np.array([5, 77, 301, 12, 980, 44, 6, 250, 19, 3, 700, 81], np.int32)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("mtp")
    return {p: (make_model(p, "Q8_0", d / f"{p}.gguf", sharp=True),
                make_model(p, "Q8_0", d / f"{p}-mtp.gguf", sharp=True, mtp=1)) for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_the_trunk_is_the_model(files, preset: str) -> None:  # type: ignore[no-untyped-def]
    """block_count 5 with nextn_predict_layers 1: four layers, the fifth block's
    tensors in the file but neither in the graph nor in the weight bytes --fit and the
    arena count; numpy's logits equal the plain file's."""
    plain, mtp = (load_gguf(p) for p in files[preset])
    assert mtp.metadata["general.architecture"] == plain.config.arch
    assert mtp.config.n_layer == plain.config.n_layer == 4
    assert "blk.4.nextn.eh_proj.weight" in mtp.tensors and "blk.4.nextn.eh_proj.weight" not in plain.tensors
    assert mtp.weight_bytes() == plain.weight_bytes()  # what --fit and the arena count: the trunk's
    got, want = (NumpyBackend(m, n_ctx=64, n_seq=1).forward([SeqBatch(0, PROMPT, 0)]) for m in (mtp, plain))
    np.testing.assert_array_equal(got, want)


@pytest.mark.vulkan
@pytest.mark.parametrize("preset", PRESETS)
def test_vulkan_leaves_the_blocks_on_disk(files, preset: str) -> None:  # type: ignore[no-untyped-def]
    """The weight store places the graph's tensors only: the same tensors on the device
    as for the plain file (the byte totals differ by the segments' page rounding, the
    files' layouts being different), none of block 4, and the same logits."""
    from trio_llm.vulkan.backend import VulkanBackend

    out: list[np.ndarray] = []
    placed: list[set[str]] = []
    for path in files[preset]:
        be = VulkanBackend(load_gguf(path), n_ctx=64, n_seq=1)
        try:
            placed.append(set(be._weights.slots))
            out.append(be.forward([SeqBatch(0, PROMPT, 0)]))
        finally:
            be.close()
    assert placed[0] == placed[1] and not any(n.startswith("blk.4.") for n in placed[1])
    np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("preset", PRESETS)
def test_llamacpp_loads_it_and_agrees(files, preset: str) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp loads the file (its MTP blocks skipped) and its greedy continuation
    agrees with ours by test_llamacpp_agreement's rule."""
    path = files[preset][1]
    tok = Tokenizer.from_metadata(load_gguf(path).metadata)
    ref = Reference(path, n_ctx=64)
    backend = NumpyBackend(load_gguf(path), n_ctx=64, n_seq=1)
    try:
        v = agree(our_greedy(backend, PROMPT.tolist(), tok.is_eog), ref.greedy(PROMPT.tolist(), server_piece(tok)))
        assert v.ok, v.why
    finally:
        backend.close()
        ref.close()


def test_mtp_only_for_the_hybrids(tmp_path: Path) -> None:
    with pytest.raises(MakeModelError, match="no multi-token-prediction"):
        make_model("tiny", "Q8_0", tmp_path / "t.gguf", mtp=1)
    with pytest.raises(MakeModelError, match="mtp must be >= 0"):
        make_model("tiny-qwen35", "Q8_0", tmp_path / "t.gguf", mtp=-1)

"""Embedding rows as input (``SeqBatch.embd``) and non-causal entries (``causal=False``):
the text-model half of gemma-3's multimodal input (llama.cpp's ``llama_batch.embd`` with
``llama_set_causal_attn(ctx, false)`` for an image's batch).

- Injection: rows equal to the scaled token embeddings give the token entry's logits
  (gemma3 scales token embeddings, never injected rows), on both backends, in one pass
  and split over passes.
- Non-causal attention: numpy's against a direct float32 forward of tiny-gemma3 written
  here with its own masks (five sliding-window layers of 16 positions, an image of 24
  rows), and Vulkan's (attn_prefill.comp's NONCAUSAL form) against numpy at f16 and q8_0
  caches, each held to a quarter of the distance between causal and non-causal at most.
- Continuous batching: a causal text entry and a non-causal image entry of another
  sequence in one forward equal the two run alone (on Vulkan also cut into passes so that
  the image does not straddle two).
- Refusals: shapes, dtype, non-finite rows, a model whose graph takes no embeddings, a
  non-causal entry longer than a pass, decode, latent and recurrent memories.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from trio_llm.engine.backend import SeqBatch
from trio_llm.engine.devsample import DeviceChain
from trio_llm.engine.reference import NumpyBackend, apply_rope, attend, gelu, rms_norm, rope_angles
from trio_llm.errors import GraphError, InvalidRequest
from trio_llm.graph import Graph
from trio_llm.model.config import ModelConfig
from trio_llm.model.gguf import load_gguf

# the f32 decode path on Vulkan (tests/conftest.py f32_activations; nothing for numpy)
pytestmark = pytest.mark.usefixtures("f32_activations")

F32_KV = {"cache_type_k": "f32", "cache_type_v": "f32"}
N_CTX = 96
PREFIX = np.array([1, 17, 250, 3, 999, 42, 7, 7, 512, 100, 64, 9, 300, 11, 800, 5, 2, 90, 91, 92], np.int32)
SUFFIX = np.array([33, 44, 55], np.int32)
N_IMG = 24  # more rows than tiny-gemma3's window of 16


def image(n: int = N_IMG, seed: int = 0) -> np.ndarray:
    """Rows the size of the scaled token embeddings (tiny-gemma3's are ~N(0, 1) * 16)."""
    return (np.random.default_rng(seed).standard_normal((n, 256)) * 16.0).astype(np.float32)


@pytest.fixture(scope="module")
def gemma(model_path) -> str:  # type: ignore[no-untyped-def]
    return str(model_path("tiny-gemma3", "Q8_0"))


Make = Callable[..., object]


@pytest.fixture
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """A backend of the parametrized kind (``request.param``: "numpy" or "vulkan"),
    closed at the end."""
    made: list[object] = []

    def get(path: str, kind: str, **kw: object) -> object:
        model = load_gguf(path)
        if kind == "numpy":
            be: object = NumpyBackend(model, n_ctx=N_CTX, n_seq=2, **kw)  # type: ignore[arg-type]
        else:
            from trio_llm.vulkan.backend import VulkanBackend

            be = VulkanBackend(model, n_ctx=N_CTX, n_seq=2, **kw)  # type: ignore[arg-type]
        made.append(be)
        return be

    yield get
    for be in made:
        be.close()  # type: ignore[attr-defined]


KINDS = ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)]


def scaled_embeddings(path: str, ids: np.ndarray) -> np.ndarray:
    """``token_embd[ids] * sqrt(n_embd)``: what gemma3's graph makes of token ids."""
    model = load_gguf(path)
    try:
        w = np.asarray(model.tensor("token_embd.weight").dequantize(), np.float32)
        return (w[ids] * np.float32(math.sqrt(model.config.n_embd))).astype(np.float32)
    finally:
        model.close()


# -- injection ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_chunk", [512, 8])
def test_scaled_token_rows_give_the_token_logits(gemma: str, make: Make, kind: str, max_chunk: int) -> None:
    """Injected rows skip the sqrt(n_embd) scale: the scaled embeddings of the prompt's
    tokens, given as rows, give its logits (with 8-row passes, split over three)."""
    be = make(gemma, kind, max_chunk=max_chunk, **F32_KV)
    want = be.forward([SeqBatch(0, PREFIX, 0)])  # type: ignore[attr-defined]
    rows = scaled_embeddings(gemma, PREFIX)
    got = be.forward([SeqBatch(1, np.zeros(len(PREFIX), np.int32), 0, embd=rows)])  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))
    # and the cache they left is the token entry's: the next token continues alike
    nxt = [be.forward([SeqBatch(s, SUFFIX, len(PREFIX))]) for s in (0, 1)]  # type: ignore[attr-defined]
    np.testing.assert_allclose(nxt[1], nxt[0], rtol=0, atol=1e-6 * float(np.abs(nxt[0]).max()))


# -- non-causal attention ----------------------------------------------------------------


def direct_gemma3(path: str, x: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """tiny-gemma3's logits for every row of one sequence from position 0, from its input
    rows ``x`` [n, n_embd] (already scaled or injected), row i seeing the positions j with
    ``j <= hi[i]`` and, in a sliding-window layer, ``i - j < window``: written out here,
    not through the graph."""
    model = load_gguf(path)
    cfg: ModelConfig = model.config
    w = {name: np.asarray(t.dequantize(), np.float32) for name, t in model.tensors.items()}
    model.close()
    n, nh, nkv, hd, eps = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    pos = np.arange(n)
    for il in range(cfg.n_layer):
        b = f"blk.{il}."
        swa = cfg.is_swa(il)
        h = rms_norm(x, w[b + "attn_norm.weight"], eps)
        q = rms_norm((h @ w[b + "attn_q.weight"].T).reshape(n, nh, hd), w[b + "attn_q_norm.weight"], eps)
        k = rms_norm((h @ w[b + "attn_k.weight"].T).reshape(n, nkv, hd), w[b + "attn_k_norm.weight"], eps)
        v = (h @ w[b + "attn_v.weight"].T).reshape(n, nkv, hd)
        theta, fs = (cfg.rope_theta_swa, 1.0) if swa else (cfg.rope_theta, cfg.rope_freq_scale)
        cos, sin = rope_angles(hd, theta, n, None, fs)
        q, k = apply_rope(q, cos, sin, "neox"), apply_rope(k, cos, sin, "neox")
        seen = pos[None, :] <= hi[:, None]  # [n, n] (query, key)
        if swa:
            seen &= pos[:, None] - pos[None, :] < cfg.n_swa
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # [n, nh, hd]
        s = np.einsum("qhd,khd->hqk", q, k) * np.float32(cfg.kq_scale)
        s = np.where(seen[None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(n, nh * hd).astype(np.float32)
        x = x + rms_norm(o @ w[b + "attn_output.weight"].T, w[b + "post_attention_norm.weight"], eps)
        h = rms_norm(x, w[b + "ffn_norm.weight"], eps)
        h = (gelu(h @ w[b + "ffn_gate.weight"].T) * (h @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
        x = x + rms_norm(h, w[b + "post_ffw_norm.weight"], eps)
    out = w.get("output.weight", w["token_embd.weight"])
    return rms_norm(x, w["output_norm.weight"], eps) @ out.T  # type: ignore[no-any-return]


def image_turn(be: object, seq: int = 0, causal: bool = False, img: np.ndarray | None = None) -> np.ndarray:
    """A prompt, an image after it, text after that: the image's last row's logits and
    the text's, ``[2, n_vocab]``."""
    img = image() if img is None else img
    fwd = be.forward  # type: ignore[attr-defined]
    fwd([SeqBatch(seq, PREFIX, 0)])
    a = fwd([SeqBatch(seq, np.zeros(len(img), np.int32), len(PREFIX), embd=img, causal=causal)])
    b = fwd([SeqBatch(seq, SUFFIX, len(PREFIX) + len(img))])
    return np.concatenate([a, b])  # type: ignore[no-any-return]


def test_numpy_non_causal_equals_a_direct_forward(gemma: str) -> None:
    """numpy's non-causal image rows against the forward written out above: the image's
    last row and the text after it, with and without the image's later rows visible to
    its earlier ones (so that the check fails if the mask is the causal one)."""
    be = NumpyBackend(load_gguf(gemma), n_ctx=N_CTX, n_seq=2, **F32_KV)
    try:
        x = np.concatenate([scaled_embeddings(gemma, PREFIX), image(), scaled_embeddings(gemma, SUFFIX)])
        n0, n1 = len(PREFIX), len(PREFIX) + N_IMG
        rows = [n1 - 1, len(x) - 1]
        want = {}
        for causal in (False, True):
            hi = np.arange(len(x))
            if not causal:
                hi[n0:n1] = n1 - 1
            want[causal] = direct_gemma3(gemma, x, hi)[rows]
            got = image_turn(be, causal=causal)
            scale = float(np.abs(want[causal]).max())
            assert float(np.abs(got - want[causal]).max()) <= 1e-4 * scale, causal
        assert float(np.abs(want[True] - want[False]).max()) > 0.05 * scale
    finally:
        be.close()


def test_attend_non_causal_sees_its_entry_and_keeps_the_window() -> None:
    """``attend(causal=False)``: each query sees every key up to the entry's last
    position, and a window hides only keys ``window`` or more positions before it."""
    rng = np.random.default_rng(1)
    pos0, n, window = 5, 7, 4
    q = rng.standard_normal((n, 2, 16)).astype(np.float32)
    k = rng.standard_normal((pos0 + n, 1, 16)).astype(np.float32)
    v = rng.standard_normal((pos0 + n, 1, 16)).astype(np.float32)
    got = attend(q, k, v, pos0, window, causal=False)
    for i in range(n):
        p = pos0 + i
        keys = [j for j in range(pos0 + n) if p - j < window]  # after p: all of the entry's
        s = np.einsum("hd,kd->hk", q[i], k[keys, 0]) / np.float32(4.0)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        want = (e / e.sum(axis=1, keepdims=True)) @ v[keys, 0]
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


#: Vulkan against numpy, relative to the largest logit: f16 caches part by f32 order
#: noise plus f16 steps, q8_0 caches also by numpy's q8_0 rounding of q (docs/model-layer.md)
KV_TOL = {"f16": 2e-3, "q8_0": 2.5e-2}


@pytest.mark.vulkan
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("max_chunk", [512, 32])
def test_vulkan_non_causal_follows_numpy(gemma: str, make: Make, kv: str, max_chunk: int) -> None:
    """The image entry (24 rows, more than the 16-position window of five layers) on
    attn_prefill.comp's NONCAUSAL form against numpy, in a bucket of 32 rows with 512-row
    passes and alone in its pass with 32; then one-row images (the decode buckets'
    graphs, routed to the same kernel)."""
    cache = {"cache_type_k": kv, "cache_type_v": kv}
    ref = make(gemma, "numpy", max_chunk=max_chunk, **cache)
    vk = make(gemma, "vulkan", max_chunk=max_chunk, **cache)
    want, got = image_turn(ref), image_turn(vk)
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    causal = image_turn(ref, seq=1, causal=True)
    gap = float(np.abs(causal - want).max())
    # measured on lavapipe: 3.5e-4 (f16) and 8.9e-3 (q8_0) of the largest logit, where
    # the causal image lies 5.9e-2 and 6.2e-2 away
    assert diff <= KV_TOL[kv] * scale, (kv, diff, scale)
    assert diff <= gap / 4, (kv, diff, gap)
    for be in (ref, vk):  # the decode buckets: two image rows, then one
        be.forward([SeqBatch(1, PREFIX, 0)])  # type: ignore[attr-defined]
    one = [[be.forward([SeqBatch(1, np.zeros(m, np.int32), len(PREFIX) + a, embd=image(m, seed=a), causal=False)])  # type: ignore[attr-defined]
            for a, m in ((0, 2), (2, 1))] for be in (ref, vk)]
    for w_, g_ in zip(one[0], one[1], strict=True):
        assert float(np.abs(g_ - w_).max()) <= KV_TOL[kv] * float(np.abs(w_).max())


# -- continuous batching -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_chunk", [512, 32])
def test_batched_with_text_equals_alone(gemma: str, make: Make, kind: str, max_chunk: int) -> None:
    """seq 0's causal text and seq 1's non-causal image in one forward equal each run
    alone (with 32-row passes the 20 text rows and the 24 image rows cannot share one:
    the image goes to the next pass whole, never split)."""
    be = make(gemma, kind, max_chunk=max_chunk, **F32_KV)
    fwd = be.forward  # type: ignore[attr-defined]
    img = image()
    fwd([SeqBatch(1, SUFFIX, 0)])
    both = fwd([SeqBatch(0, PREFIX, 0), SeqBatch(1, np.zeros(N_IMG, np.int32), len(SUFFIX), embd=img, causal=False)])
    text = fwd([SeqBatch(0, PREFIX, 0)])
    fwd([SeqBatch(1, SUFFIX, 0)])
    alone = fwd([SeqBatch(1, np.zeros(N_IMG, np.int32), len(SUFFIX), embd=img, causal=False)])
    tol = 1e-5 * float(np.abs(both).max())
    np.testing.assert_allclose(both[0], text[0], rtol=0, atol=tol)
    np.testing.assert_allclose(both[1], alone[0], rtol=0, atol=tol)


@pytest.mark.vulkan
def test_vulkan_special_graphs_are_their_own_and_dropped_at_release(gemma: str, make: Make) -> None:
    """Steps with embeddings or a non-causal entry record graphs beside the buckets'
    (which stay those of text steps) and a release drops them."""
    from trio_llm.engine.backend import Level

    vk = make(gemma, "vulkan", **F32_KV)
    vk.forward([SeqBatch(0, PREFIX, 0)])  # type: ignore[attr-defined]
    before = vk.device_info()["graphs"]  # type: ignore[attr-defined]
    vk.forward([SeqBatch(0, np.zeros(4, np.int32), len(PREFIX), embd=image(4), causal=False)])  # type: ignore[attr-defined]
    vk.forward([SeqBatch(0, np.zeros(4, np.int32), len(PREFIX) + 4, embd=image(4))])  # type: ignore[attr-defined]
    assert vk.device_info()["graphs"] == before  # type: ignore[attr-defined]
    assert sorted(vk._special) == [(4, True, False), (4, True, True)]  # type: ignore[attr-defined]
    vk.release(Level.WEIGHTS)  # type: ignore[attr-defined]
    assert not vk._special  # type: ignore[attr-defined]
    vk.restore()  # type: ignore[attr-defined]
    vk.forward([SeqBatch(1, np.zeros(4, np.int32), 0, embd=image(4), causal=False)])  # type: ignore[attr-defined]


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_refusals(gemma: str, model_path, make: Make, kind: str) -> None:  # type: ignore[no-untyped-def]
    be = make(gemma, kind, max_chunk=8, **F32_KV)
    z = np.zeros(4, np.int32)
    bad = [
        (np.zeros((4, 255), np.float32), r"are \[4, 255\], expected \[4, 256\]"),
        (np.zeros((3, 256), np.float32), r"are \[3, 256\], expected \[4, 256\]"),
        (np.zeros((4, 256), np.float64), "must be a float32 array"),
        (np.full((4, 256), np.nan, np.float32), "not all finite"),
        (np.full((4, 256), np.inf, np.float32), "not all finite"),
    ]
    for rows, match in bad:
        with pytest.raises(InvalidRequest, match=match):
            be.forward([SeqBatch(0, z, 0), SeqBatch(1, z, 0, embd=rows)])  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest, match="non-causal entry of 9 rows .* exceeds this backend's pass of 8"):
        be.forward([SeqBatch(0, np.zeros(9, np.int32), 0, embd=image(9), causal=False)])  # type: ignore[attr-defined]
    be.forward([SeqBatch(0, np.zeros(9, np.int32), 0, embd=image(9))])  # type: ignore[attr-defined]  # causal: split
    be.forward([SeqBatch(0, np.zeros(8, np.int32), 0, embd=image(8), causal=False)])  # type: ignore[attr-defined]
    one = np.zeros(1, np.int32)
    for e in (SeqBatch(0, one, 9, embd=image(1)), SeqBatch(0, one, 9, causal=False)):
        with pytest.raises(InvalidRequest, match="decode takes causal token entries only"):
            be.decode([e], [DeviceChain.greedy()], np.zeros((1, 1), np.float32))  # type: ignore[attr-defined]
    llama = make(str(model_path("tiny", "Q8_0")), kind, **F32_KV)
    with pytest.raises(InvalidRequest, match="this model takes no embeddings input"):
        llama.forward([SeqBatch(0, z, 0, embd=image(4))])  # type: ignore[attr-defined]
    llama.forward([SeqBatch(0, z, 0, causal=False)])  # type: ignore[attr-defined]  # tokens: any attention model


@pytest.mark.parametrize("kind", ["numpy", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("preset, why", [("tiny-deepseek2", "latent cache"), ("tiny-qwen35", "recurrent state")])
def test_latent_and_recurrent_memories_refuse_non_causal(model_path, kind: str, preset: str, why: str) -> None:  # type: ignore[no-untyped-def]
    if kind == "vulkan":
        from trio_llm.vulkan.backend import VulkanBackend as backend
    else:
        backend = NumpyBackend  # type: ignore[assignment]
    be = backend(load_gguf(model_path(preset, "Q8_0")), n_ctx=32, n_seq=1)
    try:
        with pytest.raises(InvalidRequest, match=why):
            be.forward([SeqBatch(0, np.zeros(3, np.int32), 0, causal=False)])
        be.forward([SeqBatch(0, np.zeros(3, np.int32), 0)])
    finally:
        be.close()


def test_the_graph_takes_embeddings_once() -> None:
    g = Graph({"token_embd.weight": (10, 8)})
    x = g.get_rows(g.weight("token_embd.weight"), g.tokens())
    assert g.embd_width() == 0
    y = g.embd_rows(x)
    assert y.shape == x.shape and g.embd_width() == 8
    with pytest.raises(GraphError, match="once"):
        g.embd_rows(y)

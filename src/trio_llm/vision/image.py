"""Image bytes -> the pixels gemma-3's encoder takes, as llama.cpp's libmtmd makes them.

``decode_image`` stands in for ``mtmd_helper_bitmap_init_from_buf``'s
``stbi_load_from_memory(..., 3)``: the first frame, RGB, 8 bits a channel. Its
conversions are stb_image's: alpha dropped (not composited), grey replicated to three
channels, a palette expanded, 16-bit samples reduced to their high byte, EXIF
orientation ignored. Only the formats stb_image reads are accepted (JPEG, PNG, BMP,
GIF, TGA, PSD, PNM); anything else is llama-server's "failed to load image".

PNG (and BMP, TGA, PNM, GIF) decode to exactly stb_image's bytes. JPEG may not:
Pillow decodes with libjpeg(-turbo), whose IDCT and chroma upsampling are not
stb_image's own, so a pixel can differ by a value or two.

``preprocess`` is ``mtmd_image_preprocessor_fixed_size::preprocess``
(``tools/mtmd/mtmd-image.cpp``) with gemma3's settings from ``clip.cpp``
(``image_resize_algo = RESIZE_ALGO_BILINEAR``, the default ``image_resize_pad =
PAD_CEIL``, black padding): an image already ``S x S`` is copied; any other is scaled
to fit inside ``S x S`` keeping its aspect ratio (the longer side becomes ``S``, the
other ``ceil(side * scale)`` in float32, at most ``S``), resized with
``img_tool::resize_pillow``'s bilinear filter, and centred on a black ``S x S``
canvas (offsets ``(S - w) // 2``, ``(S - h) // 2``); then each channel becomes
``(v / 255 - mean) / std`` in float32.

``resize_pillow`` is Pillow's ``ImagingResample`` (``Resample.c``) rewritten in
llama.cpp: separable, horizontal pass first and vertical second, each skipped when
that side keeps its size; per output pixel a window of input pixels around the
centre ``(i + 0.5) * scale`` with the triangle filter ``1 - |x|`` widened by the
scale when shrinking (antialiased), weights normalised to sum 1 in double precision
and then rounded to 22-bit fixed point (``+-0.5`` then truncation); each pass
accumulates ``2**21 + sum(pixel * weight)`` in integers, shifts right by 22 and
clamps to 0..255, so the intermediate image is uint8. Here both passes are numpy
gathers over the window's taps, the weights computed exactly as llama.cpp's loop
does (same operation order), so the bytes are identical.
"""

from __future__ import annotations

import io

import numpy as np

from trio_llm.errors import InvalidRequest

#: Pillow's names for the formats stb_image decodes
STB_FORMATS = frozenset({"JPEG", "PNG", "BMP", "GIF", "TGA", "PSD", "PPM"})
PRECISION_BITS = 32 - 8 - 2


def decode_image(data: bytes) -> np.ndarray:
    """Encoded image bytes -> [H, W, 3] uint8 RGB; ``InvalidRequest`` if they are not an
    image llama.cpp can load."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            if fmt not in STB_FORMATS:
                raise InvalidRequest(f"failed to load image: {fmt} images are not supported")
            img.seek(0)
            img.load()
            return _to_rgb(img)
    except InvalidRequest:
        raise
    except UnidentifiedImageError:
        raise InvalidRequest("failed to load image: not a JPEG, PNG, BMP, GIF, TGA, PSD or PNM file") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequest(f"failed to load image: {reason}") from None


def _to_rgb(img) -> np.ndarray:  # type: ignore[no-untyped-def]
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":
        # 16-bit grey: stb_image keeps the high byte (Pillow's convert would clip)
        grey = np.asarray(img, dtype=np.uint32) >> 8  # [H, W]
        grey8 = np.clip(grey, 0, 255).astype(np.uint8)
        return np.repeat(grey8[:, :, None], 3, axis=2)
    if mode != "RGB":
        img = img.convert("RGB")  # drops alpha, replicates grey, expands a palette
    return np.array(img, dtype=np.uint8).reshape(img.height, img.width, 3)


def preprocess(img: np.ndarray, proj: object) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, S, S] float32 for ``proj`` (a ``Projector``: its
    ``image_size``, ``image_mean`` and ``image_std``)."""
    size = int(proj.image_size)  # type: ignore[attr-defined]
    mean = np.asarray(proj.image_mean, dtype=np.float32)  # type: ignore[attr-defined]
    std = np.asarray(proj.image_std, dtype=np.float32)  # type: ignore[attr-defined]
    resized = fit_to_square(img, size)  # [S, S, 3] uint8
    return normalize(resized, mean, std)


def normalize(img: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, H, W] float32: ``(v / 255 - mean[c]) / std[c]``."""
    x = img.astype(np.float32) / np.float32(255.0)  # [H, W, 3]
    x -= mean.astype(np.float32)
    x /= std.astype(np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def fit_to_square(img: np.ndarray, size: int) -> np.ndarray:
    """llama.cpp's ``img_tool::resize`` to ``size x size`` with ``PAD_CEIL`` and black
    padding: [H, W, 3] uint8 -> [size, size, 3] uint8."""
    img = np.asarray(img, dtype=np.uint8)
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise InvalidRequest(f"an image must be [H, W, 3] uint8 with H, W >= 1, got {list(img.shape)}")
    h, w = img.shape[:2]
    if (h, w) == (size, size):
        return img.copy()
    # float32 as the C++: scale = min(S / w, S / h); side = min(ceil(side * scale), S)
    s32 = np.float32(size)
    scale = min(s32 / np.float32(w), s32 / np.float32(h))
    new_w = min(int(np.ceil(np.float32(w) * scale)), size)
    new_h = min(int(np.ceil(np.float32(h) * scale)), size)
    resized = resize_bilinear_pillow(img, new_w, new_h)  # [new_h, new_w, 3]
    out = np.zeros((size, size, 3), dtype=np.uint8)
    ox, oy = (size - new_w) // 2, (size - new_h) // 2
    out[oy:oy + new_h, ox:ox + new_w] = resized
    return out


def resize_bilinear_pillow(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """``resize_pillow(..., RESIZE_ALGO_BILINEAR)``: [H, W, 3] uint8 -> [height, width, 3]."""
    h, w = img.shape[:2]
    if not (0 < width <= 65536 and 0 < height <= 65536):
        raise InvalidRequest(f"resize target {width}x{height} is out of range")
    out = img
    if width != w:
        idx, wts = _weights(w, width)  # [width, k]
        out = _apply(out, idx, wts, axis=1)
    if height != h:
        idx, wts = _weights(h, height)  # [height, k]
        out = _apply(out, idx, wts, axis=0)
    return np.ascontiguousarray(out)


def _triangle(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's ``precompute_coeffs`` for the triangle filter: for each output pixel the
    input indices of its window [out, ksize] (clamped in range where the weight is 0)
    and the fixed-point weights [out, ksize] int64."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = 1.0 * filterscale
    ksize = int(np.ceil(support)) * 2 + 1
    xx = np.arange(out_size, dtype=np.float64)
    center = (xx + 0.5) * scale  # [out]
    ss = 1.0 / filterscale
    # C's static_cast<int> truncates toward zero; negatives are clamped to 0 right after
    xmin = np.maximum(np.trunc(center - support + 0.5), 0.0).astype(np.int64)  # [out]
    xmax = np.minimum(np.trunc(center + support + 0.5), float(in_size)).astype(np.int64)
    count = xmax - xmin  # [out]
    taps = np.arange(ksize, dtype=np.int64)  # [k]
    live = taps[None, :] < count[:, None]  # [out, k]
    pos = xmin[:, None] + taps[None, :]  # [out, k] int
    w = np.where(live, _triangle((pos.astype(np.float64) - center[:, None] + 0.5) * ss), 0.0)
    ww = np.zeros(out_size, dtype=np.float64)
    for k in range(ksize):  # sequential, as the C loop sums
        ww += w[:, k]
    w = np.where(ww[:, None] != 0.0, w / np.where(ww == 0.0, 1.0, ww)[:, None], w)
    fixed = np.trunc(w * float(1 << PRECISION_BITS) + np.where(w < 0.0, -0.5, 0.5)).astype(np.int64)
    fixed[~live] = 0
    idx = np.minimum(pos, in_size - 1)
    return idx, fixed


def _apply(img: np.ndarray, idx: np.ndarray, wts: np.ndarray, axis: int) -> np.ndarray:
    """One pass along ``axis`` (1: horizontal, 0: vertical) of [H, W, 3] uint8."""
    n_out, ksize = idx.shape
    shape = list(img.shape)
    shape[axis] = n_out
    # int32 as the C++ (255 * 2**22 plus the bias stays below 2**31)
    acc = np.full(shape, 1 << (PRECISION_BITS - 1), dtype=np.int32)
    w32 = wts.astype(np.int32)
    for k in range(ksize):
        taps = np.take(img, idx[:, k], axis=axis).astype(np.int32)  # [.., n_out, .., 3]
        taps *= w32[:, k].reshape((1, n_out, 1) if axis == 1 else (n_out, 1, 1))
        acc += taps
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)

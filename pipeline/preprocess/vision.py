"""Images -> Qwen2-VL pixel patches and visual-token counts.

The same arithmetic as transformers' `Qwen2VLImageProcessorPil` (Pillow + numpy): `smart_resize`
to multiples of 28 pixels within [min_pixels, max_pixels], a bicubic resize, then patches of
14x14 pixels, repeated over 2 temporal frames, flattened channel-major. It is done here, not by
that class, because importing it imports torch (~3 s per process: every Ray worker and the cold
start of `serve`); tests/preprocess/test_vision.py and tests/client/test_pixels.py check it
against the class, byte for byte. An image of grid (t, h, w) becomes t*h*w patches of C*T*P*P
values and t*h*w / merge_size**2 visual tokens: the `<|image_pad|>` run that replaces the
template's single placeholder.

Patches are stored as `preprocess.pixel_dtype` says: `uint8` (default) keeps the resized pixels
raw and the trainer normalizes them on its device with `PIXEL_NORM` (a quarter of float32's
bytes); `bfloat16` (as uint16 bit patterns) and `float32` hold the normalized values.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np

from pipeline.config import PreprocessConfig
from pipeline.preprocess.records import ImageRef, RecordError
from pipeline.preprocess.sources import read_bytes, resolve_relative
from pipeline.quarantine import QuarantineReason as R
from trainer_client.pixels import PixelNorm, bfloat16_bits

# Qwen2VLImageProcessorPil's rescale factor and OpenAI CLIP mean/std: what uint8 patches need
# on the trainer (tests/client/test_pixels.py checks them against the class).
PIXEL_NORM = PixelNorm(rescale=1 / 255, mean=(0.48145466, 0.4578275, 0.40821073),
                       std=(0.26862954, 0.26130258, 0.27577711))
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2  # Qwen2-VL's vision encoder
PATCH_VALUES = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # one patch: C x T x P x P
PATCHES_PER_VISUAL_TOKEN = MERGE_SIZE * MERGE_SIZE
PIXEL_BYTES = {"uint8": 1, "bfloat16": 2, "float32": 4}  # a stored value, by pixel_dtype


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int,
                 factor: int = PATCH_SIZE * MERGE_SIZE) -> tuple[int, int]:
    """(height, width) as multiples of `factor` with their product within [min_pixels,
    max_pixels], keeping the aspect ratio as closely as possible (Qwen2-VL's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _patchify_into(chw: np.ndarray, out: np.ndarray) -> None:
    """[C, H, W] -> `out` [grid_h * grid_w, C * T * P * P] in Qwen2-VL's order (merge windows
    contiguous, each frame repeated T times): one copy, straight into the sample's buffer."""
    c, h, w = chw.shape
    gh, gw, m, p = h // PATCH_SIZE, w // PATCH_SIZE, MERGE_SIZE, PATCH_SIZE
    x = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    dst = out.view()
    dst.shape = (gh // m, gw // m, m, m, c, TEMPORAL_PATCH_SIZE, p, p)  # raises, never copies
    dst[...] = x[:, :, :, :, :, None]  # the same frame T times


def _normalized(chw: np.ndarray) -> np.ndarray:
    """uint8 [C, H, W] -> float32, rescaled and normalized in the image processor's order of
    operations (float64 rescale, float32 normalize), so float32 storage matches it exactly."""
    x = (chw.astype(np.float64) * PIXEL_NORM.rescale).astype(np.float32)
    mean = np.asarray(PIXEL_NORM.mean, np.float32)[:, None, None]
    std = np.asarray(PIXEL_NORM.std, np.float32)[:, None, None]
    return (x - mean) / std


def _rgb_view(im) -> np.ndarray:
    """An RGB PIL image as uint8 [H, W, 3]: a view of the image's own memory (Pillow keeps a
    pixel in 4 bytes, the 4th unused) through its Arrow export, which holds the image alive;
    a copy only where Pillow will not export it (an image in several memory blocks).
    `np.asarray(im)` copied the pixels twice (Pillow packs them into 64 KB pieces, then joins
    them): ~2 ms of a 1024 x 1024 image's ~20, and the patchify copies them anyway."""
    import pyarrow as pa

    try:
        values = pa.array(im).values  # fixed_size_list<uint8>[4] per pixel
    except (ValueError, TypeError, pa.ArrowException):
        return np.asarray(im, dtype=np.uint8)
    data = values.buffers()[1]
    if values.offset or data is None or data.size < im.height * im.width * 4:
        return np.asarray(im, dtype=np.uint8)
    view = np.frombuffer(data, np.uint8, count=im.height * im.width * 4)
    return view.reshape(im.height, im.width, 4)[:, :, :3]


def decode_image(ref: ImageRef, source_path: str):
    """ImageRef -> fully decoded RGB PIL image (truncated files fail here, not later)."""
    from PIL import Image, UnidentifiedImageError

    if ref.data is not None:
        data = ref.data
        where = "inline image"
    else:
        path = resolve_relative(source_path, ref.path or "")
        try:
            data = read_bytes(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise RecordError(R.MISSING_IMAGE, f"image not found: {ref.path}") from None
        except OSError as exc:
            raise RecordError(R.MISSING_IMAGE, f"image unreadable: {ref.path}: {exc}") from None
        where = ref.path
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()  # forces full decode: truncated data raises OSError here
            return im if im.mode == "RGB" else im.convert("RGB")  # convert copies, even to RGB
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as exc:
        raise RecordError(R.BAD_IMAGE, f"{where}: {exc}") from None


class VisionProcessor:
    def __init__(self, cfg: PreprocessConfig) -> None:
        self.min_pixels, self.max_pixels = cfg.image_min_pixels, cfg.image_max_pixels
        self.merge_size = MERGE_SIZE
        self.pixel_dtype = cfg.pixel_dtype

    def visual_tokens(self, grid_thw: np.ndarray) -> np.ndarray:
        """Per-image count of `<|image_pad|>` tokens for rows of (t, h, w)."""
        return (np.prod(grid_thw, axis=1) // (self.merge_size**2)).astype(np.int64)

    def process(self, images: Sequence, scales: Sequence[float] = ()):
        """-> (pixel_values [patches, C*T*P*P] in `pixel_dtype`, image_grid_thw int64 [n, 3]).

        Each image is resized, converted to the stored values (raw, normalized, bfloat16 bits:
        elementwise, so before the patches repeat it over the T frames) and patchified straight
        into its rows of the one output array."""
        from PIL import Image

        values, grids = [], []
        for i, im in enumerate(images):
            s = scales[i] if i < len(scales) else 1.0
            if s != 1.0:
                # Augmentation: rescale before the min/max-pixel resize, so the visual-token
                # count (the true cost) changes as it would in training.
                w, h = im.size
                im = im.resize((max(1, round(w * s)), max(1, round(h * s))),
                               Image.Resampling.BICUBIC)
            try:
                h, w = smart_resize(im.height, im.width, self.min_pixels, self.max_pixels)
            except ValueError as exc:  # e.g. extreme aspect ratios
                raise RecordError(R.BAD_IMAGE, f"image processor refused the image: {exc}"
                                  ) from None
            if im.mode != "RGB":
                im = im.convert("RGB")
            rgb = _rgb_view(im.resize((w, h), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
            if self.pixel_dtype == "uint8":
                values.append(rgb)
            elif self.pixel_dtype == "bfloat16":
                values.append(bfloat16_bits(_normalized(rgb)))
            else:
                values.append(_normalized(rgb))
            grids.append((1, h // PATCH_SIZE, w // PATCH_SIZE))
        rows = [g[1] * g[2] for g in grids]
        pv = np.empty((sum(rows), PATCH_VALUES), dtype=values[0].dtype)
        start = 0
        for v, n in zip(values, rows, strict=True):
            _patchify_into(v, pv[start : start + n])
            start += n
        return pv, np.asarray(grids, dtype=np.int64).reshape(-1, 3)

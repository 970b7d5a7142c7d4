"""Images -> Qwen2-VL pixel patches and visual-token counts.

`Qwen2VLImageProcessorPil` needs only Pillow + numpy (the default class needs torchvision).
An image of grid (t, h, w) becomes t*h*w patches of C*T*P*P values and t*h*w / merge_size**2
visual tokens: the `<|image_pad|>` run that replaces the template's single placeholder.

Patches are stored as `preprocess.pixel_dtype` says: `uint8` (default) keeps the processor's
resized pixels raw, with rescale and normalization off, and the trainer normalizes them on its
device with `PIXEL_NORM` (a quarter of float32's bytes); `bfloat16` (as uint16 bit patterns)
and `float32` hold the processor's normalized output.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from pipeline.config import PreprocessConfig
from pipeline.preprocess.records import ImageRef, RecordError
from pipeline.preprocess.sources import read_bytes, resolve_relative
from pipeline.quarantine import QuarantineReason as R
from trainer_client.pixels import PixelNorm, bfloat16_bits

# Qwen2VLImageProcessorPil's rescale factor and OpenAI CLIP mean/std: what uint8 patches need
# on the trainer. VisionProcessor refuses a processor that normalizes otherwise.
PIXEL_NORM = PixelNorm(rescale=1 / 255, mean=(0.48145466, 0.4578275, 0.40821073),
                       std=(0.26862954, 0.26130258, 0.27577711))


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
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as exc:
        raise RecordError(R.BAD_IMAGE, f"{where}: {exc}") from None


class VisionProcessor:
    def __init__(self, cfg: PreprocessConfig) -> None:
        from transformers import Qwen2VLImageProcessorPil

        self.processor = Qwen2VLImageProcessorPil(
            min_pixels=cfg.image_min_pixels, max_pixels=cfg.image_max_pixels
        )
        self.merge_size = int(self.processor.merge_size)
        self.pixel_dtype = cfg.pixel_dtype
        mine = PixelNorm(float(self.processor.rescale_factor), tuple(self.processor.image_mean),
                         tuple(self.processor.image_std))
        if mine != PIXEL_NORM:
            raise ValueError(f"the image processor normalizes with {mine}, but uint8 patches "
                             f"are sent with {PIXEL_NORM}")

    def visual_tokens(self, grid_thw: np.ndarray) -> np.ndarray:
        """Per-image count of `<|image_pad|>` tokens for rows of (t, h, w)."""
        return (np.prod(grid_thw, axis=1) // (self.merge_size**2)).astype(np.int64)

    def process(self, images: Sequence, scales: Sequence[float] = ()):
        """-> (pixel_values [patches, C*T*P*P] in `pixel_dtype`, image_grid_thw int64 [n, 3])."""
        from PIL import Image

        prepared = []
        for i, im in enumerate(images):
            s = scales[i] if i < len(scales) else 1.0
            if s != 1.0:
                # Augmentation: rescale before the processor's own min/max-pixel resize, so the
                # visual-token count (the true cost) changes as it would in training.
                w, h = im.size
                im = im.resize((max(1, round(w * s)), max(1, round(h * s))),
                               Image.Resampling.BICUBIC)
            prepared.append(im)
        raw = self.pixel_dtype == "uint8"
        try:
            out = self.processor(images=prepared, return_tensors="np", do_rescale=not raw,
                                 do_normalize=not raw)
        except ValueError as exc:  # e.g. extreme aspect ratios smart_resize refuses
            raise RecordError(R.BAD_IMAGE, f"image processor refused the image: {exc}") from None
        pv = out["pixel_values"]
        if raw:  # resized 8-bit pixels held as float32 by the processor: exact in uint8
            pv = pv.astype(np.uint8)
        elif self.pixel_dtype == "bfloat16":
            pv = bfloat16_bits(pv)
        else:
            pv = np.ascontiguousarray(pv, dtype=np.float32)
        return pv, np.ascontiguousarray(out["image_grid_thw"], dtype=np.int64)

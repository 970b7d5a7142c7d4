"""Images -> Qwen2-VL pixel patches and visual-token counts.

`Qwen2VLImageProcessorPil` needs only Pillow + numpy (the default class needs torchvision).
An image of grid (t, h, w) becomes t*h*w patches of C*T*P*P floats and t*h*w / merge_size**2
visual tokens: the `<|image_pad|>` run that replaces the template's single placeholder.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from pipeline.config import PreprocessConfig
from pipeline.preprocess.quarantine_reasons import QuarantineReason as R
from pipeline.preprocess.records import ImageRef, RecordError
from pipeline.preprocess.sources import read_bytes, resolve_relative


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

    def visual_tokens(self, grid_thw: np.ndarray) -> np.ndarray:
        """Per-image count of `<|image_pad|>` tokens for rows of (t, h, w)."""
        return (np.prod(grid_thw, axis=1) // (self.merge_size**2)).astype(np.int64)

    def process(self, images: Sequence, scales: Sequence[float] = ()):
        """-> (pixel_values float32 [patches, C*T*P*P], image_grid_thw int64 [n, 3])."""
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
        try:
            out = self.processor(images=prepared, return_tensors="np")
        except ValueError as exc:  # e.g. extreme aspect ratios smart_resize refuses
            raise RecordError(R.BAD_IMAGE, f"image processor refused the image: {exc}") from None
        return (np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
                np.ascontiguousarray(out["image_grid_thw"], dtype=np.int64))

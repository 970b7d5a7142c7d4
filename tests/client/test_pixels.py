"""Image bytes: raw uint8 patches, equal to the real Qwen2-VL processor's resized pixels,
travel a quarter of float32's bytes, and the client's normalization on the trainer side equals
the processor's float32 output.

Real pictures (scikit-image's bundled data, a grayscale one among them) go through the real
path: VisionProcessor -> Arrow row (rows.py) -> collate -> wire framing -> client decode ->
`to_model_inputs`.
"""

from __future__ import annotations

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image

from pipeline.config import PreprocessConfig
from pipeline.preprocess.rows import from_row, to_table
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.vision import PIXEL_NORM, VisionProcessor
from pipeline.service.collate import Piece, collate
from pipeline.service.wire_codec import batch_message_bytes
from trainer_client.decode import decode_batch
from trainer_client.pixels import PixelNorm, bfloat16_bits
from trainer_client.wire.odb.v1 import data_service_pb2 as pb

PICTURES = ["astronaut", "chelsea", "coffee", "camera", "rocket"]
MAX_PIXELS = 224 * 224


def images(names: list[str]) -> list[Image.Image]:
    return [Image.fromarray(getattr(skimage.data, n)()).convert("RGB") for n in names]


def processor(pixel_dtype: str) -> VisionProcessor:
    return VisionProcessor(PreprocessConfig(image_max_pixels=MAX_PIXELS, pixel_dtype=pixel_dtype))


def library(**kw):
    """transformers' own Qwen2-VL image processor: the reference VisionProcessor follows."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(max_pixels=MAX_PIXELS, **kw)


def reference(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The processor's own float32 output (rescale and normalize on)."""
    out = library()(images=images(names), return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def through_the_wire(pixel_dtype: str, names: list[str], kind: str):
    """Preprocess, store as an Arrow row, collate, frame, decode: what a trainer receives."""
    pv, grid = processor(pixel_dtype).process(images(names))
    ids = np.arange(1, 9, dtype=np.int32)
    sample = ProcessedSample("img:0", "img", 0, ids, ids.copy(), pixel_values=pv,
                             image_grid_thw=grid)
    (stored,) = [from_row(r) for r in to_table([sample]).to_pylist()]
    arrays = collate([Piece(stored)], "padded")
    raw = batch_message_bytes(pb.Batch(step=0, collate="padded"), arrays)
    return decode_batch(pb.ServerMessage.FromString(raw).batch, kind), pv


def test_pixel_norm_is_the_processor_s():
    p = library()
    assert PixelNorm(p.rescale_factor, tuple(p.image_mean), tuple(p.image_std)) == PIXEL_NORM


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_uint8_patches_normalize_to_the_processor_s_float32_output(kind):
    expected, grid = reference(PICTURES)
    batch, stored = through_the_wire("uint8", PICTURES, kind)
    assert stored.dtype == np.uint8 and stored.shape == expected.shape
    assert batch["pixel_values"].dtype in (torch.uint8, np.uint8)
    assert stored.nbytes * 4 == expected.nbytes  # a quarter of float32's bytes
    assert batch.pixel_norm == PIXEL_NORM
    inputs = batch.to_model_inputs()
    got = np.asarray(inputs["pixel_values"])
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
    assert np.asarray(inputs["image_grid_thw"]).tolist() == grid.tolist()


def test_normalization_in_bfloat16_rounds_the_float32_values():
    expected, _ = reference(PICTURES[:2])
    batch, _ = through_the_wire("uint8", PICTURES[:2], "torch")
    got = batch.to_model_inputs(dtype=torch.bfloat16)["pixel_values"]
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.float().numpy(), expected, rtol=2**-8, atol=1e-6)


def test_bfloat16_storage_is_the_processor_output_rounded_like_torch():
    expected, _ = reference(PICTURES[:2])
    batch, stored = through_the_wire("bfloat16", PICTURES[:2], "torch")
    torch_bits = torch.from_numpy(expected).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(stored.view(np.int16), torch_bits)
    assert np.array_equal(bfloat16_bits(expected), stored)
    assert batch["pixel_values"].dtype == torch.bfloat16 and batch.pixel_norm is None
    np.testing.assert_array_equal(batch.to_model_inputs()["pixel_values"].numpy(),
                                  torch.from_numpy(expected).to(torch.bfloat16).float().numpy())
    numpy_batch, _ = through_the_wire("bfloat16", PICTURES[:2], "numpy")
    np.testing.assert_array_equal(numpy_batch.to_model_inputs()["pixel_values"],
                                  torch.from_numpy(expected).to(torch.bfloat16).float().numpy())


def test_float32_storage_is_the_processor_output_exactly():
    expected, _ = reference(PICTURES[:1])
    batch, _ = through_the_wire("float32", PICTURES[:1], "numpy")
    assert np.array_equal(batch.to_model_inputs()["pixel_values"], expected)


@pytest.mark.parametrize(("lo", "hi"), [(56 * 56, 224 * 224), (56 * 56, 1024 * 1024),
                                        (128 * 128, 160 * 160)])
def test_raw_patches_are_the_library_s_resized_pixels_byte_for_byte(lo, hi):
    """Our resize and patch order is transformers' Qwen2VLImageProcessorPil's (rescale and
    normalize off), on real pictures of many sizes and aspect ratios, grayscale included."""
    from transformers import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi)
    ours = VisionProcessor(PreprocessConfig(image_min_pixels=lo, image_max_pixels=hi))
    pics = images([*PICTURES, "page", "text", "horse", "coins"])
    pics += [p.crop((0, 0, max(29, p.width // 3), p.height)) for p in pics[:3]]  # tall, odd
    for pic in pics:
        want = ref(images=[pic], return_tensors="np", do_rescale=False, do_normalize=False)
        got, grid = ours.process([pic])
        assert grid.tolist() == want["image_grid_thw"].tolist()
        assert got.dtype == np.uint8
        assert np.array_equal(got, want["pixel_values"].astype(np.uint8))
        assert np.array_equal(want["pixel_values"], got.astype(np.float32))  # exact in uint8

"""decode_image: JPEGs through torchvision's public decode_jpeg give Pillow's pixels, without warnings; everything
it refuses goes to Pillow, whose errors are one line."""

import io
import warnings

import numpy as np
import pytest
from PIL import Image

from ropekit.data import decode_image, decode_rgb
from ropekit.data._common import DataFileError


def _jpeg(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_jpeg_pixels_match_pillow_and_no_warning_escapes(seed, mode):
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 40)), int(rng.integers(1, 40))) + ((3,) if mode == "RGB" else ())
    data = _jpeg(rng.integers(0, 256, shape, dtype=np.uint8), mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchvision's per-call codec deprecation notice included
        out = decode_image(data, name="x.jpg")
    ref = np.asarray(decode_rgb(data, name="x.jpg"))  # Pillow, converted to RGB
    assert out.dtype.is_floating_point is False and tuple(out.shape) == (3,) + shape[:2]
    # both decoders are libjpeg(-turbo) with the same IDCT: the pixels agree to one grey level at most
    assert np.abs(out.permute(1, 2, 0).numpy().astype(int) - ref.astype(int)).max() <= 1


def test_truncated_and_fake_jpegs_fail_in_one_line():
    data = _jpeg(np.zeros((16, 16, 3), np.uint8), "RGB")
    for bad in (data[: len(data) // 3], b"\xff\xd8\xff" + b"not a jpeg"):
        with pytest.raises(DataFileError, match=r"^bad\.jpg: not a readable image") as e:
            decode_image(bad, name="bad.jpg")
        assert "\n" not in str(e.value)

"""Decoding one image file (or its bytes) into an 8-bit RGB tensor or ``PIL.Image``, and one depth map, with
one-line errors.

Shape legend: ``H, W`` the image's size. :func:`decode_image` gives uint8 ``(3, H, W)``: JPEGs through
torchvision's public ``decode_jpeg``, everything else through Pillow (:func:`decode_rgb`, which converts every
mode to RGB). :func:`decode_depth` gives float32 ``(1, H, W)`` metres from a ``.npy`` file's bytes.
"""

from __future__ import annotations

import functools
import io
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ._common import DataFileError, PathLike

__all__ = ["decode_rgb", "decode_image", "decode_depth", "depth_path", "has_depth_beside", "read_depth_beside",
           "DEPTH_KEY"]

#: The sample entry (and the file suffix beside an image) that holds an RGB-D sample's depth map: ``<key>.depth.npy``.
DEPTH_KEY = "depth.npy"

_WIDE = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}


def decode_rgb(source: Union[PathLike, bytes], name: Optional[str] = None) -> Any:
    """Open and decode one image into an 8-bit RGB ``PIL.Image``.

    Conversions: ``L`` / ``1`` / ``P`` / ``CMYK`` / ``YCbCr`` / ... by Pillow's ``convert("RGB")``; images with
    alpha (``RGBA``, ``LA``, ``P`` with transparency) drop the alpha channel and keep their colours (as
    torchvision's ``ImageFolder`` does); 16-bit and 32-bit integer greyscale (``I;16*``, ``I``) are scaled by
    255 / 65535 (rounded, values above 65535 clip), float greyscale (``F``) taken as [0, 1]: scaled, not clipped
    to 255.

    Args:
        source: a file path, or the encoded bytes (then ``name`` names them in errors).
        name: what to call the image in an error message (default: the path).

    Raises:
        DataFileError: not an image Pillow can decode (corrupt, truncated, another format), one line naming it.
    """
    from PIL import Image

    label = name if name is not None else str(source)
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as img:
            img.load()  # decode now: a truncated file fails here
            if img.mode in _WIDE:
                arr = np.asarray(img, dtype=np.float64) * (255.0 / _WIDE[img.mode])
                return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L").convert("RGB")
            if img.mode == "P" and "transparency" in img.info:
                img = img.convert("RGBA")
            return img.convert("RGB")
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError, ... on bad files
        raise DataFileError(label, f"not a readable image ({type(e).__name__}: {_without_reprs(e)})") from e


_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _without_reprs(e: BaseException) -> str:
    """``e``'s message without object reprs (Pillow names the in-memory buffer it read: ``<_io.BytesIO object at
    0x7f...>``; the file is named by the error itself)."""
    return _OBJECT_REPR.sub("", str(e)).strip() or type(e).__name__


def _to_tensor(img: Any) -> Tensor:
    """PIL RGB → uint8 ``(3, H, W)``."""
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()


_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_image(source: Union[PathLike, bytes], name: Optional[str] = None) -> Tensor:
    """Decode one image into uint8 ``(3, H, W)`` RGB: what the streams hand their transform.

    JPEG files are decoded by ``torchvision.io.decode_jpeg`` straight into a tensor (libjpeg-turbo, the same
    pixels as Pillow's, without Pillow's copies: about 40 % less time on a 256² JPEG) where torchvision still
    has it; everything else, and a JPEG that it refuses, goes through :func:`decode_rgb` (whose conversions and
    errors apply).

    Raises:
        DataFileError: not a decodable image, one line naming it.
    """
    label = name if name is not None else str(source)
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise DataFileError(label, f"cannot be read ({type(e).__name__}: {e})") from None
    decoder = _jpeg_decoder() if data[:3] == _JPEG_MAGIC else None
    if decoder is not None:
        try:
            return decoder(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except RuntimeError:
            pass  # Pillow decodes it or names the problem
    return _to_tensor(decode_rgb(data, name=label))


#: The deprecation notice torchvision 0.29 gives on every call of its image codecs (in favour of TorchCodec).
_CODEC_DEPRECATION = r"The image decoding and encoding capabilities of TorchVision are deprecated"


@functools.lru_cache(maxsize=None)
def _jpeg_decoder() -> Optional[Callable[[Tensor], Tensor]]:
    """``torchvision.io.decode_jpeg`` to RGB (no EXIF rotation, as Pillow's default), or ``None`` where torchvision
    is missing. Where torchvision was built without its image codecs the call raises ``RuntimeError`` and
    :func:`decode_image` hands the file to Pillow. The call silences only torchvision's per-call deprecation notice
    of its codecs."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None

    def decode(data: Tensor) -> Tensor:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_CODEC_DEPRECATION)
            return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=False)

    return decode


def decode_depth(source: Union[PathLike, bytes], name: Optional[str] = None,
                 shape: Optional[Tuple[int, int]] = None) -> Tensor:
    """Read one depth map: a ``.npy`` file (or its bytes) holding a numeric ``(H, W)`` array of metres (``0`` or
    NaN: invalid), as float32 ``(1, H, W)`` (a float32 or float16 file is kept bit for bit; float64 rounds to
    float32, integers convert exactly up to 2^24).

    Args:
        source: a file path, or the ``.npy`` bytes (then ``name`` names them in errors).
        name: what to call the depth map in an error message (default: the path).
        shape: ``(H, W)`` of its image, which the array must have.

    Raises:
        DataFileError: not a ``.npy`` array (pickled objects are refused), not numeric, not 2-D, or not of
            ``shape``; one line naming it.
    """
    label = name if name is not None else str(source)
    try:
        data = bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
        d = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataFileError(label, f"depth entry {DEPTH_KEY} is not a NumPy array ({type(e).__name__}: "
                                   f"{_without_reprs(e)})") from None
    if d.ndim != 2 or d.dtype.kind not in "fiu" or (shape is not None and d.shape != tuple(shape)):
        want = f"(H, W) = {tuple(shape)}" if shape is not None else "(H, W)"
        raise DataFileError(label, f"depth entry {DEPTH_KEY} must be a numeric {want} array, got {d.dtype} {d.shape}")
    return torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32))[None]


def depth_path(image: PathLike) -> Path:
    """The depth map beside an image of an RGB-D folder: ``a/b/0001.png`` → ``a/b/0001.depth.npy``."""
    image = Path(image)
    return image.with_name(image.stem + "." + DEPTH_KEY)


def has_depth_beside(image: PathLike) -> bool:
    """Whether ``image`` has its depth map beside it (:func:`depth_path`). A folder is RGB-D when its first image
    (sorted class folder, sorted file) has one; then every image needs one, and without it none may have one."""
    return depth_path(image).is_file()


def read_depth_beside(image: PathLike, shape: Tuple[int, int]) -> Tuple[bytes, Tensor]:
    """The depth map beside ``image`` in an RGB-D folder (:func:`depth_path`), checked against the image's
    ``(H, W)``: its file bytes (to copy as they are) and :func:`decode_depth`'s float32 ``(1, H, W)``.

    Raises:
        DataFileError: no depth map beside the image (in a folder whose first image has one, every image needs
            one), or one :func:`decode_depth` refuses; one line naming it.
    """
    path = depth_path(image)
    if not path.is_file():
        raise DataFileError(image, f"has no depth map {path.name} beside it (the folder's first image has one, so "
                                   "every image needs one)")
    data = path.read_bytes()
    return data, decode_depth(data, name=str(path), shape=shape)

"""Image parts of a chat request, whatever their dialect: where the bytes come from, and decoding them.

Each dialect turns its image part (OpenAI chat's `image_url`, Responses' `input_image`, Anthropic's
`image` block) into an `ImagePart` while it reads the body, without looking at the bytes yet: a model
without a vision tower refuses every image part with the same 400 whatever is inside. A model with one
gets the bytes (`part_bytes`: a data: URL or base64 source decoded here, an http(s) URL fetched by
bubo/server/image_fetch.py when the server allows it) and decodes them with Pillow (`decode_image`),
within byte and pixel limits. Every failure is a 400 that names the part's path in the request.
"""

import base64
import binascii
import hashlib
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from bubo.engine.chat_messages import ImagePart
from bubo.server.errors import ApiError
from bubo.vision.image_patches import to_rgb

__all__ = [
    "DecodedImage",
    "ImageLimits",
    "decode_image",
    "image_error",
    "image_size",
    "inline_bytes",
]

# The formats Pillow may open: the ones clients send photos and screenshots in. Others (PSD, EPS, …)
# bring large parsers and nothing a chat needs.
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    """The most an image may take: bytes as sent (after base64) and pixels once decoded, and the most
    images one request may hold. The pixel limit is checked from the header, before the pixels are
    decoded (a small file can hold a huge image)."""

    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000
    max_images: int = 32


@dataclass(frozen=True)
class DecodedImage:
    """An image's decoded pixels and the sha256 of its bytes (what the prompt cache compares)."""

    image: Image.Image
    digest: str

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def image_error(where: str, message: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, code, f"{where}: {message}", param=where)


def inline_bytes(part: ImagePart, limits: ImageLimits) -> bytes:
    """The bytes of a part that carries them (a data: URL, a base64 source); 400 when it is neither
    that nor an http(s) URL, when they are not valid base64 or larger than the limit."""
    if part.data is not None:
        text, where = part.data, part.where
    else:
        assert part.url is not None
        header, comma, text = part.url.partition(",")
        where = part.where
        if not header.lower().startswith("data:"):
            raise image_error(where, "must be a data: URL (data:image/png;base64,...) or an http(s) URL")
        if not comma or not header.endswith(";base64"):
            raise image_error(where, "a data: URL must be data:image/...;base64,<data>")
    # base64 grows bytes by 4/3: a text this long decodes to more than the limit.
    if len(text) > (limits.max_bytes + 2) // 3 * 4 + 4:
        raise _too_large(where, limits)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise image_error(where, "is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise _too_large(where, limits)
    return data


def _too_large(where: str, limits: ImageLimits) -> ApiError:
    return image_error(
        where, f"the image is larger than the {limits.max_bytes >> 20} MiB allowed", "image_too_large"
    )


# How each EXIF orientation is undone (as ImageOps.exif_transpose does); 5 to 8 swap the sides.
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _open(data: bytes, where: str, limits: ImageLimits) -> Image.Image:
    """The image in `data`, its header read and its pixels not yet decoded; 400 when it is empty, too
    many bytes, not an image of the formats taken, or too many pixels."""
    if not data:
        raise image_error(where, "the image is empty")
    if len(data) > limits.max_bytes:
        raise _too_large(where, limits)
    with warnings.catch_warnings():
        # Pillow warns about large images; the pixel limit below answers them.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data), formats=_FORMATS)
    width, height = image.size
    if width * height > limits.max_pixels:
        raise image_error(
            where,
            f"the image is {width}x{height} pixels, more than the {limits.max_pixels} allowed",
            "image_too_large",
        )
    if width < 1 or height < 1:
        raise image_error(where, f"the image is {width}x{height} pixels")
    return image


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation the header gives (1: upright). A PNG's EXIF after its pixel data is only
    found by decoding them, so a PNG counts as upright unless its header says otherwise."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    orientation = image.getexif().get(0x0112, 1)
    return orientation if orientation in _UPRIGHT else 1


def _upright_size(image: Image.Image, orientation: int) -> tuple[int, int]:
    width, height = image.size
    return (height, width) if orientation >= 5 else (width, height)


def _readable(where: str, error: BaseException) -> ApiError:
    if isinstance(error, Image.DecompressionBombError):
        return image_error(where, "the image has too many pixels", "image_too_large")
    return image_error(where, f"not a readable PNG, JPEG, WebP, GIF or BMP image ({error})")


_UNREADABLE = (Image.DecompressionBombError, OSError, ValueError, SyntaxError, EOFError)


def image_size(data: bytes, where: str, limits: ImageLimits) -> tuple[int, int]:
    """The (width, height) the image in `data` has upright, from its header alone (nothing decoded);
    400 as `decode_image` would give."""
    try:
        image = _open(data, where, limits)
        return _upright_size(image, _orientation(image))
    except _UNREADABLE as error:
        raise _readable(where, error) from None


def decode_image(
    data: bytes,
    where: str,
    limits: ImageLimits,
    target: Callable[[int, int], tuple[int, int]] | None = None,
) -> DecodedImage:
    """The image in `data` decoded and turned upright (EXIF orientation, as transformers' load_image
    does); 400 invalid_image when Pillow cannot read it, 400 image_too_large when it has more pixels
    than the limit (known from the header, before decoding).

    With `target` (the size the vision tower takes an upright image of a given size at), the decoded
    pixels are at once made RGB and scaled to that size, then turned upright: what is kept is the small
    image, and turning it costs a copy of the small one, not of the full one."""
    try:
        image = _open(data, where, limits)
        orientation = _orientation(image)
        image.load()
        if target is not None:
            width, height = target(*_upright_size(image, orientation))
            size = (height, width) if orientation >= 5 else (width, height)
            rgb = to_rgb(image)
            del image  # the full-size pixels go as soon as the RGB copy exists
            image = rgb if rgb.size == size else rgb.resize(size, resample=Image.Resampling.BICUBIC)
        if orientation in _UPRIGHT:
            image = image.transpose(_UPRIGHT[orientation])
    except _UNREADABLE as error:
        raise _readable(where, error) from None
    return DecodedImage(image, hashlib.sha256(data).hexdigest())

"""Image bytes and URLs (bubo/server/image_input.py, bubo/server/image_fetch.py): base64 and data: URLs,
Pillow decoding within byte and pixel limits (a decompression bomb is refused from its header), and the
URL fetch's guard against private and loopback addresses, with a resolver double for the host names."""

import asyncio
import base64
import hashlib
import io
import ipaddress
from collections.abc import Iterator

import numpy as np
import pytest
from aiohttp import web
from PIL import Image, ImageFile

from bubo.engine.chat_messages import ImagePart
from bubo.server.errors import ApiError
from bubo.server.image_fetch import fetch_image, is_public_address
from bubo.server.image_input import ImageLimits, decode_image, image_size, inline_bytes
from bubo.vision.image_patches import to_rgb
from tests.fixtures.vision_doubles import png

LIMITS = ImageLimits()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _error(call: object) -> ApiError:
    assert isinstance(call, ApiError)
    return call


def test_a_png_decodes_with_the_digest_of_its_bytes() -> None:
    data = png(40, 20)
    image = decode_image(data, "where", LIMITS)
    assert image.size == (40, 20)
    assert image.digest == hashlib.sha256(data).hexdigest()


def test_jpeg_webp_and_gif_decode() -> None:
    for fmt in ("JPEG", "WEBP", "GIF"):
        buffer = io.BytesIO()
        Image.new("RGB", (9, 7), (1, 2, 3)).save(buffer, format=fmt)
        assert decode_image(buffer.getvalue(), "where", LIMITS).size == (9, 7)


def test_an_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turned 90 degrees clockwise
    buffer = io.BytesIO()
    Image.new("RGB", (30, 10), (9, 9, 9)).save(buffer, format="JPEG", exif=exif)
    assert decode_image(buffer.getvalue(), "where", LIMITS).size == (10, 30)


def _noisy_jpeg(width: int, height: int, orientation: int = 1) -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", exif=exif)
    return buffer.getvalue()


def test_a_target_size_scales_the_decoded_image_at_once_as_the_tower_would() -> None:
    """Scaled to the tower's size as it is decoded: the very pixels patchify makes of the full image."""
    data = _noisy_jpeg(300, 200)
    full = decode_image(data, "where", LIMITS)
    small = decode_image(data, "where", LIMITS, target=lambda w, h: (w // 3, h // 4))
    assert small.size == (100, 50) and small.image.mode == "RGB"
    expected = to_rgb(full.image).resize((100, 50), resample=Image.Resampling.BICUBIC)
    assert np.array_equal(np.asarray(small.image), np.asarray(expected))
    assert small.digest == full.digest


def test_an_exif_orientation_is_applied_to_the_scaled_image() -> None:
    data = _noisy_jpeg(300, 200, orientation=6)
    seen: list[tuple[int, int]] = []

    def target(width: int, height: int) -> tuple[int, int]:
        seen.append((width, height))
        return width // 4, height // 2

    assert image_size(data, "where", LIMITS) == (200, 300)
    small = decode_image(data, "where", LIMITS, target=target)
    assert seen == [(200, 300)] and small.size == (50, 150)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "invalid_image"),
        (b"not an image at all", "invalid_image"),
        (png(40, 20)[:60], "invalid_image"),  # truncated inside the pixel data
        (b"%PDF-1.4\n", "invalid_image"),
    ],
)
def test_corrupt_images_are_400(data: bytes, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        decode_image(data, "messages[0].content[1].image_url.url", LIMITS)
    assert caught.value.status == 400 and caught.value.code == code
    assert caught.value.message.startswith("messages[0].content[1].image_url.url: ")


def test_more_bytes_than_the_limit_are_400_image_too_large() -> None:
    with pytest.raises(ApiError) as caught:
        decode_image(png(64, 64), "where", ImageLimits(max_bytes=100))
    assert (caught.value.status, caught.value.code) == (400, "image_too_large")


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buffer, format="PNG")  # 81 MP in a few KB
    bomb = buffer.getvalue()
    assert len(bomb) < 100_000

    def never(self: Image.Image) -> None:
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    with pytest.raises(ApiError) as caught:
        decode_image(bomb, "where", LIMITS)
    assert (caught.value.status, caught.value.code) == (400, "image_too_large")
    assert "9000x9000" in caught.value.message


def test_inline_sources_decode_and_bad_ones_are_400() -> None:
    data = png(8, 8)
    url = ImagePart("m.url", "m", "image_url", url=_data_url(data))
    source = ImagePart("m.source.data", "m", "image", data=base64.b64encode(data).decode())
    assert inline_bytes(url, LIMITS) == data == inline_bytes(source, LIMITS)
    for part, code in [
        (ImagePart("m.url", "m", "image_url", url="data:image/png;base64,!!!"), "invalid_image"),
        (ImagePart("m.url", "m", "image_url", url="data:image/png,rawbytes"), "invalid_image"),
        (ImagePart("m.url", "m", "image_url", url="file:///etc/passwd"), "invalid_image"),
        (ImagePart("m.url", "m", "image_url", url="x"), "invalid_image"),
        (ImagePart("m.source.data", "m", "image", data="QUJD" * 100), "image_too_large"),
    ]:
        with pytest.raises(ApiError) as caught:
            inline_bytes(part, ImageLimits(max_bytes=200))
        assert (caught.value.status, caught.value.code) == (400, code), part
        assert caught.value.message.startswith(part.where)


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("93.184.215.14", True),
        ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # shared address space
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
    ],
)
def test_only_public_addresses_are_fetched_from(address: str, public: bool) -> None:
    assert is_public_address(ipaddress.ip_address(address)) is public


def _lookup(table: dict[str, list[str]]):
    async def lookup(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"no such host {host}")
        return table[host]

    return lookup


@pytest.mark.parametrize(
    ("url", "table"),
    [
        ("http://127.0.0.1/cat.png", {}),
        ("http://[::1]/cat.png", {}),
        ("http://images.example/cat.png", {"images.example": ["127.0.0.1"]}),
        ("https://images.example/cat.png", {"images.example": ["10.0.0.7"]}),
        ("http://metadata.example/latest", {"metadata.example": ["169.254.169.254"]}),
        # One private address among public ones is enough to refuse: the connection could go there.
        ("http://images.example/cat.png", {"images.example": ["93.184.215.14", "192.168.0.2"]}),
        ("ftp://images.example/cat.png", {"images.example": ["93.184.215.14"]}),
    ],
)
def test_private_and_loopback_hosts_are_refused(url: str, table: dict[str, list[str]]) -> None:
    with pytest.raises(ApiError) as caught:
        asyncio.run(fetch_image(url, "m.url", LIMITS, lookup=_lookup(table)))
    assert (caught.value.status, caught.value.code) == (400, "image_url_not_allowed")
    assert caught.value.message.startswith("m.url: ")


def test_an_unresolvable_host_is_400() -> None:
    with pytest.raises(ApiError) as caught:
        asyncio.run(fetch_image("http://nowhere.example/a.png", "m.url", LIMITS, lookup=_lookup({})))
    assert (caught.value.status, caught.value.code) == (400, "image_fetch_failed")


class _ImageHost:
    """A local HTTP server standing in for a public image host (the tests' policy lets its loopback
    address through, and only it)."""

    def __init__(self) -> None:
        self.image = png(16, 16)
        self.port = 0
        self.hits: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(request.path)
        if request.path == "/cat.png":
            return web.Response(body=self.image, content_type="image/png")
        if request.path == "/to-cat":
            raise web.HTTPFound("/cat.png")
        if request.path == "/to-internal":
            raise web.HTTPFound("http://internal.example/secret.png")
        if request.path == "/big.png":
            return web.Response(body=b"\0" * 5000, content_type="image/png")
        if request.path == "/slow.png":
            await asyncio.sleep(5)
        return web.Response(status=404)

    async def fetch(self, path: str, limits: ImageLimits = LIMITS, seconds: float = 10.0) -> bytes:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        lookup = _lookup({"images.example": ["127.0.0.1"], "internal.example": ["10.0.0.9"]})
        try:
            return await fetch_image(
                f"http://images.example:{self.port}{path}",
                "m.url",
                limits,
                lookup=lookup,
                allowed=lambda a: a == ipaddress.ip_address("127.0.0.1"),
                seconds=seconds,
            )
        finally:
            await runner.cleanup()


@pytest.fixture
def host() -> Iterator[_ImageHost]:
    yield _ImageHost()


def test_an_allowed_host_is_fetched_and_redirects_followed(host: _ImageHost) -> None:
    assert asyncio.run(host.fetch("/cat.png")) == host.image
    assert asyncio.run(host.fetch("/to-cat")) == host.image


def test_a_redirect_to_a_private_host_is_refused(host: _ImageHost) -> None:
    with pytest.raises(ApiError) as caught:
        asyncio.run(host.fetch("/to-internal"))
    assert caught.value.code == "image_url_not_allowed"
    assert "10.0.0.9" in caught.value.message


@pytest.mark.parametrize(
    ("path", "limits", "seconds", "code"),
    [
        ("/missing.png", LIMITS, 10.0, "image_fetch_failed"),
        ("/big.png", ImageLimits(max_bytes=1000), 10.0, "image_too_large"),
        ("/slow.png", LIMITS, 0.5, "image_fetch_failed"),
    ],
)
def test_fetch_failures_are_400(
    host: _ImageHost, path: str, limits: ImageLimits, seconds: float, code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        asyncio.run(host.fetch(path, limits, seconds))
    assert (caught.value.status, caught.value.code) == (400, code)

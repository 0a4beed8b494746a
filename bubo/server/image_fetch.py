"""Fetching an image part's http(s) URL (`--allow-image-urls`) without letting a client reach the
server's own network (server-side request forgery).

The host is resolved first and every address it resolves to must be a public one (not loopback,
private, link-local, shared, reserved, multicast or unspecified); the connection then goes to those
checked addresses (the connector's resolver answers with them, so a second lookup cannot return
another one). Redirects are followed by hand, each target checked the same way. The whole fetch has a
time limit and the body a size limit. Any failure is a 400 naming the part.
"""

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from bubo.server.image_input import ImageLimits, image_error

__all__ = ["Lookup", "fetch_image", "is_public_address", "system_lookup"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# A host name and port to the addresses it resolves to.
Lookup = Callable[[str, int], Awaitable[list[str]]]

_MAX_REDIRECTS = 3
_FETCH_SECONDS = 10.0
_CHUNK = 64 << 10


def is_public_address(address: IPAddress) -> bool:
    """Whether `address` is on the public internet: `is_global` rules out loopback, private, link-local,
    shared (100.64/10), reserved and unspecified ranges; an IPv4-mapped IPv6 address is judged by the
    IPv4 address it carries."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def system_lookup(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives for `host`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _PinnedResolver(AbstractResolver):
    """Answers the one host already resolved and checked with its checked addresses."""

    def __init__(self, host: str, addresses: list[IPAddress]) -> None:
        self.host = host
        self.addresses = addresses

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        if host != self.host:  # the fetch follows redirects itself, so this is never asked
            raise OSError(f"{host} was not checked")
        return [
            ResolveResult(
                hostname=host,
                host=str(address),
                port=port,
                family=socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for address in self.addresses
        ]

    async def close(self) -> None:
        pass


async def fetch_image(
    url: str,
    where: str,
    limits: ImageLimits,
    *,
    lookup: Lookup = system_lookup,
    allowed: Callable[[IPAddress], bool] = is_public_address,
    seconds: float = _FETCH_SECONDS,
) -> bytes:
    """The body of `url`, following up to three redirects, each to a checked host; 400 when a host is
    not public, the server answers other than 200, the body is over the limit or time runs out."""
    try:
        async with asyncio.timeout(seconds):
            for _ in range(_MAX_REDIRECTS + 1):
                host, port = _host_and_port(url, where)
                addresses = await _checked_addresses(host, port, where, lookup, allowed)
                data, location = await _get(url, host, addresses, where, limits)
                if location is None:
                    assert data is not None
                    return data
                url = urljoin(url, location)
    except TimeoutError:
        raise image_error(
            where, f"fetching the image took longer than {seconds:g} s", "image_fetch_failed"
        ) from None
    raise image_error(where, f"more than {_MAX_REDIRECTS} redirects", "image_fetch_failed")


def _host_and_port(url: str, where: str) -> tuple[str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise image_error(where, "is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise image_error(where, "the image URL must be http(s)://host/...", "image_url_not_allowed")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


async def _checked_addresses(
    host: str, port: int, where: str, lookup: Lookup, allowed: Callable[[IPAddress], bool]
) -> list[IPAddress]:
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in await lookup(host, port)]
        except (OSError, ValueError) as error:
            raise image_error(where, f"cannot resolve {host}: {error}", "image_fetch_failed") from None
    if not addresses:
        raise image_error(where, f"{host} resolves to no address", "image_fetch_failed")
    refused = [a for a in addresses if not allowed(a)]
    if refused:
        raise image_error(
            where,
            f"{host} resolves to {refused[0]}, a private, loopback or reserved address: image URLs must "
            "point to public hosts",
            "image_url_not_allowed",
        )
    return addresses


async def _get(
    url: str, host: str, addresses: list[IPAddress], where: str, limits: ImageLimits
) -> tuple[bytes | None, str | None]:
    """The body, or the Location of a redirect."""
    connector = aiohttp.TCPConnector(resolver=_PinnedResolver(host, addresses), use_dns_cache=False)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, trust_env=False) as session,
            session.get(url, allow_redirects=False, headers={"Accept": "image/*"}) as response,
        ):
            if response.status in (301, 302, 303, 307, 308):
                location = response.headers.get("Location")
                if not location:
                    raise image_error(where, "a redirect without a Location", "image_fetch_failed")
                return None, location
            if response.status != 200:
                raise image_error(where, f"the image URL answered {response.status}", "image_fetch_failed")
            return await _body(response, where, limits), None
    except aiohttp.ClientError as error:
        raise image_error(where, f"cannot fetch the image: {_reason(error)}", "image_fetch_failed") from None


async def _body(response: Any, where: str, limits: ImageLimits) -> bytes:
    if (response.content_length or 0) > limits.max_bytes:
        raise image_error(
            where, f"the image is larger than the {limits.max_bytes >> 20} MiB allowed", "image_too_large"
        )
    data = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        data += chunk
        if len(data) > limits.max_bytes:
            raise image_error(
                where, f"the image is larger than the {limits.max_bytes >> 20} MiB allowed", "image_too_large"
            )
    return bytes(data)


def _reason(error: aiohttp.ClientError) -> str:
    return str(error) or type(error).__name__

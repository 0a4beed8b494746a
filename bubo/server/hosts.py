"""What a listening address reaches: a module of its own so that `bubo serve` can check its flags
before it imports the server."""

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether `host` (a --host value) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

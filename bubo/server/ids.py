"""Ids for requests and answers, OpenAI-like."""

import secrets

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    """An id like OpenAI's: prefix plus 24 random lowercase letters and digits."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(24))

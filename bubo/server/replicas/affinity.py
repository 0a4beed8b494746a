"""Where a request should go, in Ray Serve's terms (ranks of replicas, best first) but without Ray: to
the replica named, else to the one that was sent the longest prefix of its prompt (its prompt cache
holds it) before the others, else to any, which Ray resolves as the least loaded."""

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from bubo.server.replicas.forwarding import Forwarded

__all__ = ["BLOCK_CHARS", "PrefixIndex", "ranks"]

# Characters hashed together: a prompt's prefix is known in whole blocks, about 16 tokens each.
BLOCK_CHARS = 64


class PrefixIndex:
    """Which replica each routed prefix went to last, one entry per block; each key hashes the whole
    prefix up to its block, so a key found means that whole prefix was seen. Past `capacity` entries
    the least recently used go."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    @staticmethod
    def keys(text: str) -> list[int]:
        keys = []
        chained = 0
        for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
            chained = hash((chained, text[start : start + BLOCK_CHARS]))
            keys.append(chained)
        return keys

    def owner(self, keys: Sequence[int], among: Iterable[str]) -> str | None:
        """The replica, of `among`, that was sent the longest of these prefixes."""
        allowed = set(among)
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner in allowed:
                return owner
        return None

    def record(self, keys: Sequence[int], replica: str) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        for key in [key for key, owner in self._owner.items() if owner == replica]:
            del self._owner[key]


def ranks(replicas: Sequence[str], request: Forwarded | None, index: PrefixIndex) -> list[list[str]]:
    """`replicas` (ids) ranked for `request`. A replica named but not among them (one still loading)
    counts as none named: the caller sees which replica answered."""
    if request is not None and request.replica in replicas:
        return [[request.replica]]
    if request is not None and request.prompt:
        owner = index.owner(PrefixIndex.keys(request.prompt), replicas)
        if owner is not None:
            rest = [replica for replica in replicas if replica != owner]
            return [[owner], rest] if rest else [[owner]]
    return [list(replicas)]

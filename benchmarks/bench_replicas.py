"""Throughput of one replica against two behind Ray Serve (`bubo serve --replicas N`), side by side.

Starts a local Ray cluster in this process, deploys the replicas application (bubo.cli.replicas_app, what
a Ray Serve config file builds) with one replica, measures, scales the same application to two (the
first replica stays; one more loads) and measures again. Each measurement: `--clients` clients, each
sending llama-server /completion requests of `--tokens` tokens (end-of-sequence ignored) one after
another for `--seconds`, every prompt different so that routing is by load alone. Prints requests/s,
generated tokens/s and the requests each replica answered, for each count of replicas. Each replica runs
`--threads` threads (default 1).

    python benchmarks/bench_replicas.py [--clients 4] [--tokens 32] [--seconds 10] [--threads 1] [--model FILE]
"""

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.servers import free_port  # noqa: E402
from bubo.cli import replicas_app  # noqa: E402


def _client(url: str, client: int, tokens: int, until: float, done: list[tuple[float, int, str]]) -> None:
    with httpx.Client(timeout=300) as http:
        n = 0
        while time.monotonic() < until:
            body = {
                "prompt": f"Client {client}, request {n}: a story about",
                "n_predict": tokens,
                "ignore_eos": True,
            }
            response = http.post(url + "/completion", json=body)
            done.append(
                (time.monotonic(), response.json()["tokens_predicted"], response.headers["x-bubo-replica"])
            )
            n += 1


def measure(url: str, clients: int, tokens: int, seconds: float) -> tuple[float, float, list[int]]:
    """(requests/s, generated tokens/s, requests each replica answered) over the window."""
    started = time.monotonic()
    until = started + seconds
    done: list[tuple[float, int, str]] = []
    threads = [threading.Thread(target=_client, args=(url, c, tokens, until, done)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = max(t for t, _, _ in done) - started
    shares = sorted(Counter(replica for _, _, replica in done).values(), reverse=True)
    return len(done) / elapsed, sum(n for _, n, _ in done) / elapsed, shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    # Imported here: `--help` answers without the serve extra installed.
    import ray
    from ray import serve

    flags = f"--threads {args.threads}" + (f" --model {args.model}" if args.model else "")
    port = free_port()
    ray.init(logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        rows = []
        for replicas in (1, 2):
            serve.run(
                replicas_app({"serve": f"{flags} --replicas {replicas}"}), name="bubo", route_prefix="/"
            )
            httpx.post(url + "/completion", json={"prompt": "warm up", "n_predict": 4}, timeout=300)
            rows.append((replicas, *measure(url, args.clients, args.tokens, args.seconds)))
        print(f"{args.clients} clients, {args.tokens} tokens a request, {args.threads} thread(s) a replica")
        print(f"{'replicas':>8} {'requests/s':>11} {'tokens/s':>9}  requests per replica")
        for replicas, requests, tokens, shares in rows:
            print(f"{replicas:>8} {requests:>11.2f} {tokens:>9.1f}  {' / '.join(map(str, shares))}")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

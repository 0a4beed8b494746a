"""`bubo serve --replicas 2` on a local Ray cluster: two replicas of the default model, one thread each,
behind the Ray Serve ingress. Chats that share a system prompt stay on one replica and reuse its prompt
cache; streams pass through in every dialect; /metrics has each replica's; a replica killed mid-stream
ends its stream with replica_lost, the next request is served, and Ray Serve replaces the replica.

The cluster starts once for the module (about a minute on two cores, most of it two model loads)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.live_server import free_port

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are a careful assistant who answers every question in one short sentence. " * 6
START_SECONDS = 300


@dataclass
class Cluster:
    url: str
    address: str
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    def replica_ids(self) -> list[str]:
        prefix = "SERVE_REPLICA::bubo#BuboReplica#"
        return sorted(
            actor["name"][len(prefix) :]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith(prefix)
        )


def _read(process: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("bubo: ready:") or line.startswith("bubo: error"):
            ready.set()
    ready.set()


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path) -> Iterator[Cluster]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bubo",
            "serve",
            "--replicas",
            "2",
            "--threads",
            "1",
            "--port",
            str(port),
            "--model",
            str(smollm2_path),
            "--temp",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    lines: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_read, args=(process, lines, ready), daemon=True).start()
    try:
        ready.wait(START_SECONDS)
        assert any(line.startswith("bubo: ready:") for line in lines), "".join(lines[-40:])
        address = next(line.split()[-1] for line in lines if line.startswith("bubo: ray cluster at "))
        # "auto" (the cluster started last on this machine: the one just started, as the check below
        # makes sure) rather than the address: joined so, Ray sends the token the new cluster asks for.
        ray.init(address="auto", logging_level="ERROR")
        assert ray.get_runtime_context().gcs_address == address
        yield Cluster(f"http://127.0.0.1:{port}", address, process, lines)
    finally:
        ray.shutdown()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def test_a_config_files_builder_takes_bubo_serves_flags(smollm2_path: Path) -> None:
    from bubo.cli import replicas_app

    app = replicas_app({"serve": f"--model {smollm2_path} --threads 2 --parallel 3 --replicas 4"})
    # The ingress is bound to the replica deployment (Ray's bound-application objects, read as is).
    replica = app._bound_deployment.init_args[0]._bound_deployment
    assert replica.num_replicas == 4
    assert replica.ray_actor_options["num_cpus"] == 2
    assert replica.max_ongoing_requests == 4 * 3
    settings, _ = replica.init_args
    assert (settings.model_path, settings.threads, settings.parallel) == (smollm2_path, 2, 3)


def _chat(question: str) -> dict:
    return {
        "model": "bubo",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


def test_chats_sharing_a_system_prompt_stay_on_one_replica_and_reuse_its_cache(cluster: Cluster) -> None:
    replicas, cached = set(), []
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        for question in ("Name a colour.", "Name a fruit.", "Name a city.", "Name a river."):
            response = client.post("/v1/chat/completions", json=_chat(question))
            assert response.status_code == 200, response.text
            replicas.add(response.headers["x-bubo-replica"])
            usage = response.json()["usage"]
            cached.append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
    assert len(replicas) == 1
    assert cached[0][0] == 0
    # Every later chat reuses the system prompt (all but its own question and the turn markup).
    assert all(hit > prompt - 20 for hit, prompt in cached[1:]), cached


def test_streams_pass_through_the_ingress_in_each_dialect(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="bubo", max_tokens=6, stream=True, messages=[{"role": "user", "content": "Say hello."}]
        )
    )
    assert len(chunks) > 3
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()

    claude = anthropic.Anthropic(base_url=cluster.url, api_key="none", max_retries=0)
    with claude.messages.stream(
        model="bubo", max_tokens=6, messages=[{"role": "user", "content": "Say hello."}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.stop_reason == "max_tokens"

    with httpx.stream(
        "POST",
        cluster.url + "/completion",
        json={"prompt": "Once upon a time", "n_predict": 5, "stream": True},
        timeout=60,
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 5


def test_metrics_has_each_replicas_own(cluster: Cluster) -> None:
    served = httpx.post(cluster.url + "/v1/chat/completions", json=_chat("Name a tree."), timeout=120)
    replica = served.headers["x-bubo-replica"]
    text = httpx.get(cluster.url + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    prompt_tokens = {s.labels["replica"]: s.value for s in families["llamacpp:prompt_tokens"].samples}
    assert sorted(prompt_tokens) == cluster.replica_ids()
    assert len(prompt_tokens) == 2
    assert prompt_tokens[replica] > 0


def test_a_killed_replica_ends_its_stream_with_replica_lost_and_is_replaced(cluster: Cluster) -> None:
    body = {"prompt": "Count: one, two, three,", "n_predict": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/completion", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "content" in json.loads(first[6:])
        killed = response.headers["x-bubo-replica"]
        ray.kill(ray.get_actor(f"SERVE_REPLICA::bubo#BuboReplica#{killed}", namespace="serve"))
        started = time.monotonic()
        last = [line for line in lines if line.startswith("data: ")][-1]
    assert time.monotonic() - started < 30
    error = json.loads(last[6:])["error"]
    assert error["code"] == "replica_lost" and error["type"] == "server_error"

    # The survivor serves at once; Ray Serve starts a replica in the lost one's place.
    answer = httpx.post(cluster.url + "/v1/chat/completions", json=_chat("Name a bird."), timeout=120)
    assert answer.status_code == 200 and answer.headers["x-bubo-replica"] != killed
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ids = cluster.replica_ids()
        if len(ids) == 2 and killed not in ids:
            text = httpx.get(cluster.url + "/metrics", timeout=60).text
            labels = {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples}
            if labels == set(ids):
                return
        time.sleep(2)
    pytest.fail(f"no replacement replica serving after 180 s: {cluster.replica_ids()}")

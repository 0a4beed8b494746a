"""The replicas' routing, error and metrics pieces that need no Ray: the routing text of each dialect's
body, the ranking by prompt prefix, the lost-replica answers, the merged /metrics."""

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bubo.server.replicas.affinity import BLOCK_CHARS, PrefixIndex, ranks
from bubo.server.replicas.forwarding import ROUTING_TEXT_LIMIT, Forwarded, routing_text
from bubo.server.replicas.lost import CutStream, replica_lost
from bubo.server.replicas.merged_metrics import merge_metrics

SYSTEM = "You are a careful assistant. " * 10


def _chat(*turns: str) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return json.dumps({"model": "bubo", "max_tokens": 4, "messages": messages}).encode()


def _request(body: bytes, replica: str | None = None) -> Forwarded:
    return Forwarded("POST", "/v1/chat/completions", (), body, prompt=routing_text(body), replica=replica)


def test_a_conversations_next_turn_starts_with_the_text_of_its_last() -> None:
    first = routing_text(_chat("Name a colour."))
    second = routing_text(_chat("Name a colour.", "Red.", "Another?"))
    shared = len(first) - 1  # all but the closing bracket of the messages
    assert second[:shared] == first[:shared]
    # The sampling fields play no part; key order does not either.
    reordered = json.dumps({"messages": json.loads(_chat("Name a colour."))["messages"], "temperature": 0})
    assert routing_text(reordered.encode()) == first


@pytest.mark.parametrize(
    ("body", "starts"),
    [
        ({"system": "S", "messages": [{"role": "user", "content": "u"}]}, '"S"[{'),  # Anthropic
        ({"instructions": "I", "input": "x"}, '"I""x"'),  # Responses
        ({"prompt": "Once upon"}, '"Once upon"'),  # completions, llama-server
        ({"tools": [{"name": "t"}], "messages": []}, '[{"name": "t"}][]'),
    ],
)
def test_each_dialect_routes_by_its_prompt_fields(body: dict, starts: str) -> None:
    assert routing_text(json.dumps({"model": "bubo", **body}).encode()).startswith(starts)


def test_no_prompt_no_routing_text_and_the_text_is_bounded() -> None:
    assert routing_text(b"") == ""
    assert routing_text(b"[1, 2]") == ""
    assert routing_text(b"\xff not json") == ""
    huge = json.dumps({"prompt": "x" * (ROUTING_TEXT_LIMIT * 2)}).encode()
    assert len(routing_text(huge)) == ROUTING_TEXT_LIMIT


def test_a_shared_prefix_goes_to_the_replica_that_holds_it_before_the_others() -> None:
    index = PrefixIndex(capacity=1000)
    assert ranks(["a", "b"], _request(_chat("Name a colour.")), index) == [["a", "b"]]
    index.record(PrefixIndex.keys(_request(_chat("Name a colour.")).prompt), "b")
    # Another chat with the same system prompt, and the same chat's next turn.
    assert ranks(["a", "b"], _request(_chat("Name a fruit.")), index) == [["b"], ["a"]]
    assert ranks(["a", "b"], _request(_chat("Name a colour.", "Red.", "More?")), index) == [["b"], ["a"]]
    # A different system prompt shares too little: any replica, the least loaded.
    other = json.dumps({"messages": [{"role": "system", "content": "Be terse. " * 30}]}).encode()
    assert ranks(["a", "b"], _request(other), index) == [["a", "b"]]


def test_the_longest_prefix_wins_and_a_replica_gone_is_forgotten() -> None:
    index = PrefixIndex(capacity=1000)
    short, long = "p" * (BLOCK_CHARS * 2), "p" * (BLOCK_CHARS * 2) + "q" * (BLOCK_CHARS * 2)
    index.record(PrefixIndex.keys(short), "a")
    index.record(PrefixIndex.keys(long), "b")
    assert index.owner(PrefixIndex.keys(long + "r" * BLOCK_CHARS), ["a", "b"]) == "b"
    # Each block has one owner, the replica sent it last: the short prefix's blocks went to b with the
    # long one, so a, though it was sent them first, is not found.
    assert index.owner(PrefixIndex.keys(long), ["a"]) is None
    index.record(PrefixIndex.keys(short), "a")
    assert index.owner(PrefixIndex.keys(long), ["a"]) == "a"
    assert index.owner(PrefixIndex.keys(long), ["a", "b"]) == "b"
    index.forget("b")
    assert index.owner(PrefixIndex.keys(long), ["a", "b"]) == "a"
    index.forget("a")
    assert index.owner(PrefixIndex.keys(long), ["a", "b"]) is None
    # Under one block nothing is known.
    assert PrefixIndex.keys("p" * (BLOCK_CHARS - 1)) == []


def test_the_index_keeps_at_most_its_capacity_newest_first() -> None:
    index = PrefixIndex(capacity=4)
    index.record(PrefixIndex.keys("a" * BLOCK_CHARS * 3), "old")
    index.record(PrefixIndex.keys("b" * BLOCK_CHARS * 3), "new")
    assert len(index) == 4
    assert index.owner(PrefixIndex.keys("b" * BLOCK_CHARS * 3), ["old", "new"]) == "new"
    assert index.owner(PrefixIndex.keys("a" * BLOCK_CHARS), ["old", "new"]) is None


def test_a_named_replica_gets_the_request_unless_it_is_not_running() -> None:
    index = PrefixIndex(capacity=1000)
    body = _chat("Hi")
    index.record(PrefixIndex.keys(routing_text(body)), "a")
    assert ranks(["a", "b"], _request(body, replica="b"), index) == [["b"]]
    assert ranks(["a", "b"], _request(b"", replica="loading"), index) == [["a", "b"]]
    assert ranks(["a", "b"], None, index) == [["a", "b"]]


def _events(stream: bytes) -> list[tuple[str | None, dict]]:
    events = []
    for block in stream.decode().strip().split("\n\n"):
        lines = block.split("\n")
        name = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
        events.append((name, json.loads(lines[-1].removeprefix("data: "))))
    return events


def test_a_lost_replica_ends_each_dialect_as_its_failures_end() -> None:
    error = replica_lost("ActorDiedError")
    assert (error.status, error.code, error.type) == (503, "replica_lost", "server_error")
    assert error.headers == {"Retry-After": "1"}

    [(name, body)] = _events(CutStream("/v1/chat/completions", "req_1").end(error))
    assert name is None and body["error"]["code"] == "replica_lost"
    assert body["error"]["type"] == "server_error"
    [(name, body)] = _events(CutStream("/completion", "req_1").end(error))
    assert name is None and body["error"]["code"] == "replica_lost"
    [(name, body)] = _events(CutStream("/v1/messages", "req_1").end(error))
    assert name == "error" and body["type"] == "error" and body["request_id"] == "req_1"
    assert body["error"] == {"type": "overloaded_error", "message": error.message, "code": "replica_lost"}


def test_a_lost_replica_fails_a_responses_stream_with_what_it_had_streamed() -> None:
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "error": None}
    item = {"type": "message", "id": "msg_1", "status": "completed", "content": []}
    stream = CutStream("/v1/responses", "req_1")
    for event in (
        {"type": "response.created", "sequence_number": 0, "response": created},
        {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0, "item": item},
        {"type": "response.output_item.done", "sequence_number": 2, "output_index": 0, "item": item},
    ):
        stream.saw(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    (first, error_event), (last, failed) = _events(stream.end(replica_lost("ActorDiedError")))
    assert first == "error" and error_event["sequence_number"] == 3 and error_event["code"] == "replica_lost"
    assert last == "response.failed" and failed["sequence_number"] == 4
    assert failed["response"]["id"] == "resp_1" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "replica_lost"
    assert failed["response"]["output"] == [item]


def test_metrics_of_every_replica_in_one_exposition_labelled_by_replica() -> None:
    text = (
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        "llamacpp:prompt_tokens_total {}\n"
        "# HELP llamacpp:requests_processing Number of requests processing.\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        'llamacpp:requests_processing{{slot="0"}} 1.0\n'
    )
    merged = merge_metrics({"r1": text.format("12.0"), "r2": text.format("30.0")}).decode()
    assert merged.count("# TYPE llamacpp:prompt_tokens_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    tokens = {s.labels["replica"]: s.value for s in families["llamacpp:prompt_tokens"].samples}
    assert tokens == {"r1": 12.0, "r2": 30.0}
    processing = families["llamacpp:requests_processing"].samples
    assert {(s.labels["replica"], s.labels["slot"]) for s in processing} == {("r1", "0"), ("r2", "0")}

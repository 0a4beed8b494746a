"""Speculative decoding behind the server: on by default for a model with an MTP block, the same
greedy answers as without it, and the draft counts in the OpenAI `usage`, llama-server `timings` and
`/metrics` (for qwen4exp's block too). `--spec-draft` / `--mtp-weights` at start-up: a model without
an MTP block is refused, a checkpoint's block is attached."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.ngram_drafter import DEFAULT_NGRAM_DRAFT, NgramDrafter
from bubo.engine.sampler import SamplingParams
from bubo.engine.speculative import DEFAULT_SPEC_DRAFT, MTPDrafter
from bubo.model.mtp_weights import MTPWeightsError
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from tests.fixtures.gguf_writer import write_gguf
from tests.fixtures.mtp_models import OracleDrafter, mtp_model
from tests.fixtures.qwen4exp_mtp import qwen4exp_mtp_model
from tests.server.live_server import LiveServer, serve_loaded

MAIN = ["linear_attention", "full_attention"] * 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = "speculate about this"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny hybrid qwen35 with its MTP block in the GGUF; the same model without it, and the block
    as a checkpoint shard."""
    folder = tmp_path_factory.mktemp("spec")
    reference, with_mtp = mtp_model("qwen35", MAIN, folder / "with_mtp.gguf")
    without = write_gguf(reference.main, folder / "without_mtp.gguf")
    save_file(reference.checkpoint_tensors(), folder / "mtp.safetensors")
    return {"with_mtp": with_mtp, "without": without, "shard": folder / "mtp.safetensors"}


@pytest.fixture(scope="module")
def model(files: dict[str, Path]) -> LoadedModel:
    return load_model(files["with_mtp"])


@pytest.fixture
def servers() -> Iterator[list[LiveServer]]:
    started: list[LiveServer] = []
    yield started
    for server in started:
        server.stop()


def _serve(servers: list[LiveServer], model: LoadedModel, **settings: object) -> LiveServer:
    server = serve_loaded(model, defaults=GREEDY, **settings)
    servers.append(server)
    return server


def _metrics(server: LiveServer) -> dict[str, float]:
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return {n: float(v) for n, v in (line.split() for line in lines if line and not line.startswith("#"))}


def test_on_by_default_with_an_mtp_block(servers: list[LiveServer], model: LoadedModel) -> None:
    drafter = _serve(servers, model).state.slots.slots[0].drafter
    assert isinstance(drafter, MTPDrafter) and drafter.max_draft == DEFAULT_SPEC_DRAFT
    assert _serve(servers, model, spec_draft=0).state.slots.slots[0].drafter is None
    assert _serve(servers, model, spec_draft=3).state.slots.slots[0].drafter.max_draft == 3


def test_counts_reach_usage_timings_and_metrics(servers: list[LiveServer], model: LoadedModel) -> None:
    plain = _serve(servers, model, spec_draft=0)
    server = _serve(servers, model, spec_draft=1)
    # A drafter that proposes what the model will pick: every draft is accepted.
    server.state.slots.slots[0].drafter = OracleDrafter(model.model, 2)
    expected = httpx.post(plain.url + "/completion", json={"prompt": PROMPT}, timeout=60).json()
    assert expected["timings"]["draft_n"] == 0

    before = _metrics(server)
    llama = httpx.post(server.url + "/completion", json={"prompt": PROMPT}, timeout=60).json()
    middle = _metrics(server)
    body = {"model": "bubo", "messages": [{"role": "user", "content": PROMPT}]}
    chat = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    after = _metrics(server)

    assert llama["content"] == expected["content"]
    timings = llama["timings"]
    # 8 tokens: the first from the prompt, then rounds of 2 accepted drafts + 1 (4, 7), then the 8th
    # alone (no drafts past the limit)
    assert timings["predicted_n"] == 8 and timings["draft_n"] == timings["draft_n_accepted"] == 4
    usage = chat["usage"]
    assert usage["draft_tokens"] == usage["draft_tokens_accepted"] > 0
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == usage["draft_tokens"]
    assert usage["completion_tokens_details"]["rejected_prediction_tokens"] == 0
    drafted = (
        after["llamacpp:spec_decode_num_draft_tokens_total"]
        - before["llamacpp:spec_decode_num_draft_tokens_total"]
    )
    accepted = (
        after["llamacpp:spec_decode_num_accepted_tokens_total"]
        - before["llamacpp:spec_decode_num_accepted_tokens_total"]
    )
    assert drafted == accepted == 4 + usage["draft_tokens"]
    # llama-server's newer names count the same, with the verify passes that checked a draft: the two
    # rounds of /completion.
    assert after["llamacpp:draft_tokens_total"] == after["llamacpp:spec_decode_num_draft_tokens_total"]
    assert (
        after["llamacpp:draft_tokens_accepted_total"]
        == after["llamacpp:spec_decode_num_accepted_tokens_total"]
    )
    assert middle["llamacpp:draft_verify_steps_total"] - before["llamacpp:draft_verify_steps_total"] == 2
    steps = after["llamacpp:draft_verify_steps_total"]
    assert after["llamacpp:draft_acceptance_rate"] == 1.0
    assert after["llamacpp:draft_mean_accept_len"] == pytest.approx(
        1 + after["llamacpp:draft_tokens_accepted_total"] / steps
    )
    # Decode passes, not tokens: the 7 decoded tokens of /completion took 3 passes (2 + 1, 2 + 1, 1).
    passes = after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"]
    decoded = timings["predicted_n"] - 1 + usage["completion_tokens"] - 1
    assert passes == decoded - accepted
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == decoded + 2


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny qwen4exp with its MTP block (tests/fixtures/qwen4exp_mtp.py)."""
    _, path = qwen4exp_mtp_model(tmp_path_factory.mktemp("q4exp") / "qwen4exp-mtp.gguf")
    return load_model(path)


def test_qwen4exp_drafts_with_its_block_by_default_and_counts(
    servers: list[LiveServer], qwen4exp: LoadedModel
) -> None:
    plain = _serve(servers, qwen4exp, spec_draft=0)
    server = _serve(servers, qwen4exp)
    drafter = server.state.slots.slots[0].drafter
    assert isinstance(drafter, MTPDrafter) and drafter.max_draft == DEFAULT_SPEC_DRAFT
    expected = httpx.post(plain.url + "/completion", json={"prompt": PROMPT}, timeout=60).json()

    before = _metrics(server)
    llama = httpx.post(server.url + "/completion", json={"prompt": PROMPT}, timeout=60).json()
    body = {"model": "bubo", "prompt": PROMPT}
    openai = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    after = _metrics(server)

    assert llama["content"] == expected["content"]
    timings = llama["timings"]
    assert timings["predicted_n"] == 8 and timings["draft_n"] > 0
    assert timings["draft_n_accepted"] <= timings["draft_n"]
    usage = openai["usage"]
    assert usage["draft_tokens"] == timings["draft_n"]  # the same prompt and answer, the same rounds
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == usage["draft_tokens_accepted"]
    assert details["rejected_prediction_tokens"] == usage["draft_tokens"] - usage["draft_tokens_accepted"]
    drafted, accepted = (
        after[f"llamacpp:spec_decode_num_{kind}_tokens_total"]
        - before[f"llamacpp:spec_decode_num_{kind}_tokens_total"]
        for kind in ("draft", "accepted")
    )
    assert drafted == timings["draft_n"] + usage["draft_tokens"]
    assert accepted == timings["draft_n_accepted"] + usage["draft_tokens_accepted"]


def test_the_mtp_drafter_gives_the_same_answers(servers: list[LiveServer], model: LoadedModel) -> None:
    plain, spec = _serve(servers, model, spec_draft=0), _serve(servers, model, spec_draft=2)
    for prompt in (PROMPT, "another one", "x"):
        a = httpx.post(plain.url + "/completion", json={"prompt": prompt}, timeout=60).json()
        b = httpx.post(spec.url + "/completion", json={"prompt": prompt}, timeout=60).json()
        assert b["content"] == a["content"] and b["timings"]["draft_n"] > 0
        assert 0 <= b["timings"]["draft_n_accepted"] <= b["timings"]["draft_n"]


def test_spec_draft_without_an_mtp_block_is_refused(files: dict[str, Path]) -> None:
    state = ServerState(ServerSettings(model_path=files["without"], spec_draft=2))
    with pytest.raises(ValueError, match="no MTP block to draft with"):
        state.preflight()
    off = ServerState(ServerSettings(model_path=files["without"]))
    off.preflight()
    off.load()
    assert off.slots is not None and off.slots.slots[0].drafter is None


def test_mtp_weights_attach_the_checkpoint_block(files: dict[str, Path]) -> None:
    state = ServerState(ServerSettings(model_path=files["without"], mtp_weights=files["shard"], spec_draft=2))
    state.preflight()
    state.load()
    assert state.loaded is not None and state.loaded.model.mtp is not None
    assert (
        isinstance(state.slots.slots[0].drafter, MTPDrafter) and state.slots.slots[0].drafter.max_draft == 2
    )
    twice = ServerState(ServerSettings(model_path=files["with_mtp"], mtp_weights=files["shard"]))
    with pytest.raises(MTPWeightsError, match="already holds an MTP block"):
        twice.preflight()


def test_mtp_weights_attach_qwen4exps_checkpoint_block(tmp_path: Path) -> None:
    reference, without = qwen4exp_mtp_model(tmp_path / "qwen4exp.gguf", with_block=False)
    save_file(reference.checkpoint_tensors(), tmp_path / "mtp.safetensors")
    state = ServerState(ServerSettings(model_path=without, mtp_weights=tmp_path / "mtp.safetensors"))
    state.preflight()
    state.load()
    assert state.loaded is not None and state.loaded.model.mtp is not None and state.slots is not None
    drafter = state.slots.slots[0].drafter
    assert isinstance(drafter, MTPDrafter) and drafter.max_draft == DEFAULT_SPEC_DRAFT


def test_ngram_drafting_needs_no_mtp_block(files: dict[str, Path]) -> None:
    for settings, draft in (({}, DEFAULT_NGRAM_DRAFT), ({"spec_draft": 4, "parallel": 2}, 4)):
        state = ServerState(ServerSettings(model_path=files["without"], spec_type="ngram-simple", **settings))
        state.preflight()
        state.load()
        assert state.slots is not None
        for slot in state.slots.slots:
            assert isinstance(slot.drafter, NgramDrafter) and slot.drafter.max_draft == draft
        # One drafter a slot: each holds its own sequence's n-grams.
        assert len({id(slot.drafter) for slot in state.slots.slots}) == len(state.slots.slots)


def test_ngram_drafting_gives_the_same_answers(servers: list[LiveServer], model: LoadedModel) -> None:
    plain = _serve(servers, model, spec_draft=0)
    spec = _serve(servers, model, spec_type="ngram-simple", spec_draft=3, spec_ngram_size=1)
    assert isinstance(spec.state.slots.slots[0].drafter, NgramDrafter)
    for prompt in ("a b a b a b a b a b", PROMPT):
        body = {"prompt": prompt, "n_predict": 16}
        a = httpx.post(plain.url + "/completion", json=body, timeout=60).json()
        b = httpx.post(spec.url + "/completion", json=body, timeout=60).json()
        assert b["content"] == a["content"] and b["tokens_predicted"] == 16
        assert 0 <= b["timings"]["draft_n_accepted"] <= b["timings"]["draft_n"]


@pytest.mark.parametrize(
    ("model_file", "flags", "message"),
    [
        ("without", ["--spec-draft", "2"], "no MTP block to draft with"),
        ("without", ["--spec-type", "mtp"], "--spec-type mtp: this model has no MTP block"),
        (
            "without",
            ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "0"],
            "size-n must be >= 1",
        ),
        ("without", ["--spec-draft", "-1"], "--spec-draft must be >= 0"),
        ("without", ["--mtp-weights", "absent.safetensors"], "can't read absent.safetensors"),
        ("with_mtp", ["--mtp-weights", "shard"], "already holds an MTP block"),
    ],
)
def test_bad_speculation_flags_are_one_line(
    files: dict[str, Path], model_file: str, flags: list[str], message: str
) -> None:
    flags = [str(files["shard"]) if flag == "shard" else flag for flag in flags]
    command = [sys.executable, "-m", "bubo", "serve", "--model", str(files[model_file]), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and message in lines[0], result.stderr


def test_the_prompt_cache_works_alongside(servers: list[LiveServer], model: LoadedModel) -> None:
    """The verify passes take DeltaNet snapshots of their own; the prompt cache's turn-end snapshots
    are still taken and restored."""
    plain, spec = _serve(servers, model, spec_draft=0), _serve(servers, model, spec_draft=2)
    spec.state.slots.slots[0].drafter = OracleDrafter(model.model, 2)
    body = {"model": "bubo", "messages": [{"role": "user", "content": PROMPT}]}
    expected = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60).json()
    replies = [httpx.post(spec.url + "/v1/chat/completions", json=body, timeout=60).json() for _ in range(2)]
    content = expected["choices"][0]["message"]["content"]
    assert [r["choices"][0]["message"]["content"] for r in replies] == [content, content]
    options = replies[1]["usage"]["gufo"]["options"]
    assert options["cache_hit"] is True and replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert replies[1]["usage"]["draft_tokens_accepted"] > 0


def test_bubo_generate_speculates_too(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from bubo import cli

    argv = ["generate", "--prompt", PROMPT, "--max-tokens", "10", "--temperature", "0", "--stats"]
    outputs = []
    for model_file, flags in (("with_mtp", ["--spec-draft", "0"]), ("without", ["--mtp-weights", "shard"])):
        flags = [str(files["shard"]) if flag == "shard" else flag for flag in flags]
        assert cli.main([*argv, "--model", str(files[model_file]), *flags]) == 0
        outputs.append(capsys.readouterr())
    assert outputs[1].out == outputs[0].out
    assert "drafted" not in outputs[0].err and "| drafted " in outputs[1].err


def test_slots_say_whether_the_slot_speculates(servers: list[LiveServer], model: LoadedModel) -> None:
    # llama-server's `speculative`: whether the slot drafts tokens (MTP here), in /slots and /props.
    on, off = _serve(servers, model), _serve(servers, model, spec_draft=0)
    assert [s["speculative"] for s in httpx.get(on.url + "/slots").json()] == [True]
    assert [s["speculative"] for s in httpx.get(off.url + "/slots").json()] == [False]
    props = httpx.get(on.url + "/props").json()
    assert props["default_generation_settings"]["speculative"] is True

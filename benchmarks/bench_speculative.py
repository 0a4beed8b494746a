"""Speculative decoding on a small random model with an MTP block: decode tokens/s and the acceptance
rate with and without it, and whether the greedy output is identical.

Two models, written with the test fixture writers, random weights: `--model qwen35` (default), a qwen35
of 8 layers (Gated DeltaNet ×3 then gated attention, hidden 512, vocab 4096) plus one MTP layer; and
`--model qwen4exp`, spec 7.1's tiny qwen4exp (8 layers, 4 hyper-connected streams, QSA, PLE, 3-of-8
MoE) widened to hidden 256 and vocab 4096, plus its MTP block (bubo/model/hyper_connected_mtp.py).
Random MTP weights make drafts that are almost never right: the MTP rows measure the cost of drafting
and verifying when nothing is accepted. A trained MTP head's hit rate can't be measured offline, so
replay drafters stand in for it: they propose the model's own greedy continuation (known from the
plain run) and are right with probability 1.0 or 0.7 per token (seeded), at no drafting cost — the
speed the verify/rollback machinery gives at that acceptance rate (for qwen4exp, a rejected draft
costs a second pass: its QSA indexer and PLE states are restored and the kept tokens rerun).

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --model qwen4exp --threads 2 --repeats 5 --tokens 128
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from bubo.engine.generate import GenerationResult, generate  # noqa: E402
from bubo.engine.sampler import SamplingParams  # noqa: E402
from bubo.engine.speculative import Draft, Drafter, DrawDraft, MTPDrafter  # noqa: E402
from bubo.gguf.config import config_from_gguf  # noqa: E402
from bubo.gguf.reader import GGUFFile  # noqa: E402
from bubo.model.decoder import Decoder  # noqa: E402
from bubo.model.loader import load_decoder  # noqa: E402
from tests.fixtures.mtp_models import mtp_model  # noqa: E402
from tests.fixtures.qwen4exp_mtp import qwen4exp_mtp_model  # noqa: E402

LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 2
SIZES = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,  # the fixture's mRoPE sections rotate 4 pairs: half of 16
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
}


# spec 7.1's tiny qwen4exp, wider (the PLE width must equal hidden)
QWEN4EXP_SIZES = {
    "hidden_size": 256,
    "ple_embed_dim": 256,
    "vocab_size": 4096,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}


class NoStops:
    """A tokenizer stub: generation runs to the token limit; the text is not what is measured."""

    stop_ids: frozenset[int] = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"

    def is_special(self, token_id: int) -> bool:
        return False


class ReplayDrafter:
    """Proposes the known greedy continuation, each token right with probability `accuracy`."""

    needs_hidden = False

    def __init__(self, expected: Sequence[int], accuracy: float, max_draft: int, vocab: int) -> None:
        self.expected, self.accuracy, self.max_draft, self.vocab = list(expected), accuracy, max_draft, vocab
        self.rng = random.Random(0)

    def start(self, max_len: int) -> None:
        self.rng.seed(0)

    def propose(self, context: Sequence[int], hidden: torch.Tensor, n: int, draw_draft: DrawDraft) -> Draft:
        tokens = []
        for position in range(len(context), len(context) + n):
            right = self.expected[position] if position < len(self.expected) else 0
            tokens.append(right if self.rng.random() < self.accuracy else (right + 1) % self.vocab)
        return Draft(tokens)


def run(
    model: Decoder, prompt: list[int], tokens: int, drafter: Drafter | None
) -> tuple[GenerationResult, float]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    cache = model.new_cache(max_len=len(prompt) + tokens)
    started = time.perf_counter()
    result = list(generate(model, NoStops(), prompt, params, cache=cache, drafter=drafter))[-1]
    assert isinstance(result, GenerationResult)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("qwen35", "qwen4exp"), default="qwen35")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as folder:
        if args.model == "qwen4exp":
            _, path = qwen4exp_mtp_model(Path(folder) / "spec.gguf", **QWEN4EXP_SIZES)
            vocab = QWEN4EXP_SIZES["vocab_size"]
            title = f"qwen4exp, 8 layers + MTP, hidden {QWEN4EXP_SIZES['hidden_size']} x 4 streams"
        else:
            _, path = mtp_model("qwen35", LAYERS, Path(folder) / "spec.gguf", **SIZES)
            vocab = SIZES["vocab_size"]
            title = f"qwen35 hybrid, {len(LAYERS)} layers + MTP, hidden {SIZES['hidden_size']}"
        f = GGUFFile(path)
        model = load_decoder(f, config_from_gguf(f))
    prompt = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    reference, _ = run(model, prompt, args.tokens, None)
    expected = prompt + reference.token_ids

    setups: list[tuple[str, object]] = [("off", None)]
    setups += [(f"MTP head, N={n}", ("mtp", n)) for n in (1, 2)]
    setups += [(f"replay {a:.0%} right, N={n}", ("replay", n, a)) for a in (1.0, 0.7) for n in (1, 2, 3)]

    def drafter_for(setup: object) -> Drafter | None:
        if setup is None:
            return None
        if setup[0] == "mtp":
            return MTPDrafter(model, setup[1])
        return ReplayDrafter(expected, setup[2], setup[1], vocab)

    rates: dict[str, list[float]] = {name: [] for name, _ in setups}
    outcome: dict[str, GenerationResult] = {}
    for _ in range(args.repeats):  # interleaved, so load swings hit every setup alike
        for name, setup in setups:
            result, _ = run(model, prompt, args.tokens, drafter_for(setup))
            rates[name].append(result.timings.decode_tokens_per_second)
            outcome[name] = result

    base = statistics.median(rates["off"])
    print(
        f"{title}, vocab {vocab}; {args.prompt} prompt + {args.tokens} generated tokens, greedy, "
        f"{args.threads} thread(s), median of {args.repeats}"
    )
    print("| drafter | decode tok/s [min–max] | speed-up | drafted | accepted | acceptance | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, _ in setups:
        r = outcome[name]
        median = statistics.median(rates[name])
        acceptance = f"{r.draft_accepted / r.draft_tokens:.0%}" if r.draft_tokens else "–"
        print(
            f"| {name} | {median:.1f} [{min(rates[name]):.1f}–{max(rates[name]):.1f}] | {median / base:.2f}x "
            f"| {r.draft_tokens} | {r.draft_accepted} | {acceptance} | {r.token_ids == reference.token_ids} |"
        )


if __name__ == "__main__":
    main()

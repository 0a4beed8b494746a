"""Which drafter speculative decoding uses (`--spec-type`, `--spec-draft`, `--spec-ngram-simple-size-n`):
the model's MTP block (bubo/engine/speculative.py) or the context's own n-grams
(bubo/engine/ngram_drafter.py)."""

from torch import nn

from bubo.engine.ngram_drafter import DEFAULT_NGRAM_DRAFT, DEFAULT_NGRAM_SIZE, NgramDrafter
from bubo.engine.runner import runner_for
from bubo.engine.speculative import DEFAULT_SPEC_DRAFT, Drafter, DraftModel, mtp_drafter

__all__ = ["SPEC_TYPES", "check_mtp_block", "drafter_for", "prepare_drafting"]

# llama-server's names for the two kinds (`--spec-type`), and "none".
SPEC_TYPES = ("mtp", "ngram-simple", "none")


def drafter_for(
    model: DraftModel,
    spec_type: str | None,
    spec_draft: int | None,
    ngram_size: int = DEFAULT_NGRAM_SIZE,
) -> Drafter | None:
    """A new drafter (one per sequence: it holds that sequence's state) of `spec_type` drafting
    `spec_draft` tokens a round (None: the kind's default; 0: no drafter). Without a type, the MTP block
    drafts when the model has one. ValueError for an unknown type, a negative count, or MTP drafting on a
    model without a block."""
    if spec_type not in (None, *SPEC_TYPES):
        raise ValueError(f"--spec-type must be one of {', '.join(SPEC_TYPES)}, got {spec_type!r}")
    if spec_draft is not None and spec_draft < 0:
        raise ValueError(f"--spec-draft must be >= 0 (0 = off), got {spec_draft}")
    if spec_type == "none" or spec_draft == 0:
        return None
    if spec_type == "ngram-simple":
        if ngram_size < 1:
            raise ValueError(f"--spec-ngram-simple-size-n must be >= 1, got {ngram_size}")
        return NgramDrafter(DEFAULT_NGRAM_DRAFT if spec_draft is None else spec_draft, ngram_size)
    if spec_type == "mtp" and spec_draft is None:
        spec_draft = DEFAULT_SPEC_DRAFT
    return mtp_drafter(model, spec_draft)


def check_mtp_block(spec_type: str | None, spec_draft: int | None, has_block: bool) -> None:
    """ValueError, naming the flags, when they ask the MTP block to draft (`--spec-type mtp`, or a
    `--spec-draft` count without a type) and the model has none: checked from the file's config before
    the model loads."""
    wants_block = spec_draft != 0 and (spec_type == "mtp" or (spec_type is None and spec_draft is not None))
    if wants_block and not has_block:
        flags = [f"--spec-type {spec_type}"] if spec_type is not None else []
        flags += [f"--spec-draft {spec_draft}"] if spec_draft is not None else []
        raise ValueError(
            f"{' '.join(flags)}: this model has no MTP block to draft with "
            "(give its checkpoint's with --mtp-weights PATH, or use --spec-draft 0)"
        )


def prepare_drafting(model: nn.Module, drafter: Drafter | None) -> None:
    """Compile the compiled step's passes of 2 .. max_draft + 1 tokens, where `drafter`'s rounds are
    verified through it (a drafter without hidden states, on a model the step covers), so that the
    first rounds of a first request don't wait for them."""
    if drafter is not None and not drafter.needs_hidden:
        runner_for(model).prepare_passes(drafter.max_draft + 1)

"""Sampling parameters and the sampler that turns one row of logits into the next token.

The chain follows llama.cpp's default (common/sampling.cpp): logit bias → penalties → top-k → top-p →
min-p → temperature → draw. Everything runs on the logits' device with a seeded torch.Generator, so the
same seed gives the same tokens and nothing forces a host sync until the caller reads the token id.
"""

import math
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

# torch.Generator.manual_seed takes any uint64.
_MAX_SEED = 2**64 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop, with llama-server's names and defaults.

    `seed` None (or -1, llama-server's spelling) draws a random seed; `max_tokens` None (or -1) means
    "until the context is full"; `repeat_last_n` -1 means the whole context and 0 turns penalties off;
    `temperature` <= 0 is greedy; `top_k` 0, `top_p` 1 and `min_p` 0 turn those filters off.
    A `logit_bias` of -inf bans a token. `ignore_eos` bans the end-of-generation tokens, as
    llama-server does, rather than sampling them and carrying on.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is unusable."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "repeat_last_n"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            raise ValueError(f"repeat_penalty must be > 0 (1 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n}")
        if self.seed is not None and (not _is_int(self.seed) or not -1 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be None, -1 or an integer in [0, 2**64), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < -1):
            raise ValueError(f"max_tokens must be None, -1 or >= 0, got {self.max_tokens!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias must be a dict {{token_id: bias}}, got {type(self.logit_bias).__name__}"
            )
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            # +inf would make softmax NaN; -inf is the documented way to ban a token.
            if not _is_real(bias) or bias == math.inf:
                raise ValueError(f"logit_bias[{token}] must be a number or -inf, got {bias!r}")
        if isinstance(self.stop, str) or not isinstance(self.stop, list | tuple):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        for s in self.stop:
            # An empty stop string would match before the first token.
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def token_limit(self) -> int | None:
        """max_tokens with -1 folded into None."""
        return None if self.max_tokens is None or self.max_tokens < 0 else self.max_tokens


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, repeat: float, frequency: float, presence: float
) -> torch.Tensor:
    """llama.cpp's penalties for tokens seen in the window (`counts[t]` = occurrences of token t).

    The repeat penalty pushes a seen token's logit toward "less likely" whatever its sign (divide a
    positive logit, multiply a non-positive one); frequency and presence are subtracted.
    """
    seen = counts > 0
    if repeat != 1.0:
        penalized = torch.where(logits > 0, logits / repeat, logits * repeat)
        logits = torch.where(seen, penalized, logits)
    return logits - counts * frequency - seen.to(logits.dtype) * presence


def top_p_mask(sorted_logits: torch.Tensor, p: float) -> torch.Tensor:
    """True for the tokens outside the nucleus of logits sorted in descending order.

    Keeps the shortest prefix whose probability reaches p: a token stays if the mass before it is < p.
    """
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    mass_before = torch.cat([cumulative.new_zeros(1), cumulative[:-1]])
    return mass_before >= p


def min_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """True for tokens whose probability is below p times the top token's (compared in log space)."""
    return logits < logits.max() + math.log(p)


class Sampler:
    """Samples token ids from logits rows, one step at a time, remembering the history for penalties.

    `history` is what came before the first sampled token (the prompt): llama-server feeds the prompt
    into its penalty window too, so a penalty applies to words the prompt already used.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        device: torch.device | str = "cpu",
        history: Iterable[int] = (),
        banned: Iterable[int] = (),
    ) -> None:
        params.validate()
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # A drawn seed is uint32 like llama.cpp's, and is kept so a client can be told what reproduces a run.
        self.seed = secrets.randbits(32) if params.seed is None or params.seed == -1 else params.seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)

        bias = dict(params.logit_bias)
        for token in banned:
            bias[token] = -math.inf
        out_of_range = [t for t in bias if t >= vocab_size]
        if out_of_range:
            raise ValueError(
                f"logit_bias token ids {out_of_range} are outside the vocabulary (size {vocab_size})"
            )
        self._bias_ids = torch.tensor(list(bias), dtype=torch.long, device=self.device)
        self._bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=self.device)

        p = params
        self._penalize = p.repeat_last_n != 0 and (
            p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )
        # Occurrence counts live on the device and are updated one token at a time, so applying the
        # penalties never copies the window to the device.
        self._window: deque[int] = deque()
        self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
        for token in history:
            self.accept(token)

    def accept(self, token_id: int) -> None:
        """Record a token (prompt or sampled) in the penalty window."""
        if not self._penalize:
            return
        self._window.append(token_id)
        self._counts[token_id] += 1
        if self.params.repeat_last_n > 0 and len(self._window) > self.params.repeat_last_n:
            self._counts[self._window.popleft()] -= 1

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after bias and penalties: what greedy decoding takes the argmax of."""
        logits = logits.float()
        if len(self._bias_ids):
            logits = logits.index_add(0, self._bias_ids, self._bias_values)
        if self._penalize:
            p = self.params
            logits = apply_penalties(
                logits, self._counts, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
        return logits

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Pick the next token from a [vocab] logits row; returns a 0-d int64 tensor on the device."""
        logits = self.process(logits)
        if self.params.greedy:
            return logits.argmax()
        probs, ids = self._truncated(logits)
        choice = draw(probs, self.generator)
        return choice if ids is None else ids[choice]

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution `sample` draws from, over the whole vocabulary [vocab] (one-hot when
        greedy): what speculative decoding's acceptance test compares a draft against."""
        logits = self.process(logits)
        if self.params.greedy:
            return torch.zeros_like(logits).scatter_(0, logits.argmax().view(1), 1.0)
        probs, ids = self._truncated(logits)
        return probs if ids is None else torch.zeros_like(logits).scatter_(0, ids, probs)

    def _truncated(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Processed logits -> probabilities after top-k, top-p, min-p and temperature, and the token
        ids they belong to (None: the whole vocabulary in order)."""
        p = self.params
        # Candidates in descending order only when a filter needs the order; top-k's topk() already
        # sorts and shrinks the work for top-p to k entries, like llama.cpp's candidate list.
        ids: torch.Tensor | None = None
        if 0 < p.top_k < logits.numel():
            logits, ids = logits.topk(p.top_k)
        elif p.top_p < 1.0:
            logits, ids = logits.sort(descending=True)
        if p.top_p < 1.0:
            logits = logits.masked_fill(top_p_mask(logits, p.top_p), -math.inf)
        if p.min_p > 0.0:
            logits = logits.masked_fill(min_p_mask(logits, p.min_p), -math.inf)
        # A temperature past the dtype's range (1e308 is a valid float) would make it inf, and the
        # filtered -inf logits NaN: at the range's end every survivor is equally likely already.
        temperature = min(p.temperature, torch.finfo(logits.dtype).max)
        return (logits / temperature).softmax(-1), ids


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An index drawn from the (not necessarily normalised) weights `probs`, as a 0-d tensor.

    argmax(p_i / E_i) with E_i ~ Exp(1) is an exact draw (the exponential-race trick); unlike
    torch.multinomial it never syncs with the host. The clamp keeps 0-weight entries at 0.
    """
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)
    return (probs / race).argmax()

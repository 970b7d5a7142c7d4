"""A refill request and the rule that prices it.

A request is one preprocessed sample seen as a generation job: its prompt is the sample's
tokens up to its last assistant answer (the generation prompt the chat template renders), and its
planned generation tokens come from a per-job rule (`generation_tokens: N`), a per-record field
(`generation_tokens_field: name`), or the length of the record's reference answer. Its cost is
what it occupies in a consumer at most: prompt tokens plus planned generation tokens (the KV
cache / token slots it holds until it finishes).

A job of `epochs: N` makes one request per sample and epoch, each completed once: the request
of epoch 0 is named by its sample id, a later epoch's by `<sample id>@<epoch>`. Arrival order
runs through the epochs (`arrival_seq`): every row of an epoch comes after every row of the
epochs before it, so an epoch's requests are admitted before the next epoch's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.modes import OverBudgetPolicy

EPOCH_ROWS = 2**32  # source rows per epoch in arrival order (`arrival_seq`); the Lua uses it too


def arrival_seq(epoch: int, row: int) -> int:
    """A request's place in arrival order: epoch by epoch, then source row."""
    return epoch * EPOCH_ROWS + row


def request_id(sample_id: str, epoch: int) -> str:
    """The request of `sample_id` in `epoch` (epoch 0: the sample id itself)."""
    return sample_id if epoch == 0 else f"{sample_id}@{epoch}"


@dataclass(frozen=True)
class RefillRequest:
    """What admission sees: identity, cost and arrival order (the payload stays elsewhere)."""

    request_id: str
    prompt_tokens: int
    generation_tokens: int
    seq: int  # arrival order: lower waited longer (a re-admitted request keeps its seq)
    over_budget: bool = False  # larger than any consumer's capacity, emitted alone (policy)

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.generation_tokens

    @property
    def epoch(self) -> int:
        return self.seq // EPOCH_ROWS

    @property
    def sample_id(self) -> str:
        return self.request_id.removesuffix(f"@{self.epoch}") if self.epoch else self.request_id


@dataclass(frozen=True)
class Priced:
    """The cost rule's verdict on one sample: a request, or why it is set aside."""

    request: RefillRequest | None
    reason: str | None = None  # a QuarantineReason value when `request` is None
    detail: str = ""


def price(request_id: str, seq: int, prompt_tokens: int, generation_tokens: int,
          max_request_tokens: int | None, over_budget: OverBudgetPolicy) -> Priced:
    """Apply the over-budget policy to a sample of `prompt_tokens` that plans
    `generation_tokens`: `quarantine` sets a request over `max_request_tokens` aside,
    `truncate` lowers its planned generation to fit (quarantined if the prompt alone does not),
    `alone` keeps it whole, flagged, for a consumer with nothing else in flight."""
    if prompt_tokens <= 0 or generation_tokens <= 0:
        return Priced(None, "invalid_size", f"prompt_tokens={prompt_tokens}, "
                      f"generation_tokens={generation_tokens}: both must be > 0")
    cost = prompt_tokens + generation_tokens
    if max_request_tokens is None or cost <= max_request_tokens:
        return Priced(RefillRequest(request_id, prompt_tokens, generation_tokens, seq))
    detail = (f"cost {cost} (prompt {prompt_tokens} + generation {generation_tokens}) > "
              f"max_request_tokens {max_request_tokens}")
    if over_budget == OverBudgetPolicy.ALONE:
        return Priced(RefillRequest(request_id, prompt_tokens, generation_tokens, seq,
                                    over_budget=True))
    if over_budget == OverBudgetPolicy.TRUNCATE and prompt_tokens < max_request_tokens:
        return Priced(RefillRequest(request_id, prompt_tokens,
                                    max_request_tokens - prompt_tokens, seq))
    return Priced(None, "over_budget", detail)

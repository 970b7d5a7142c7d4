"""A rank stream's flow control: how many batches and how many bytes its client allows in flight.

The client grants a step window (`Open.credits`: batches) and a byte window
(`Open.prefetch_bytes`: tensor bytes) and returns both in its Acks as the trainer takes batches
(`Ack.credits`, `Ack.credit_bytes`). The bytes the client holds are those of the batches sent to
it (or held from an earlier call of the stream: `Open.held_bytes`) that it has not returned.

A batch may go while a step credit is left and its bytes fit the byte window beside what the
client holds, or when the client holds nothing at all: a batch larger than the whole window
would otherwise never go, and the rank would wait forever. So a client holds at most
max(window, one batch) of batches it has not taken, plus the batch its trainer works on.

Pure and synchronous: the rank stream asks `may_send`, then reports `sent` and `returned`; a
client that returns what it never held gets a `CreditError` (INVALID_ARGUMENT).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import BadRequest


class CreditError(BadRequest):
    """A client's credits do not add up (negative, or more bytes returned than it held)."""


@dataclass
class CreditWindow:
    steps: int  # batches that may still be sent
    window_bytes: int  # the client's byte window; 0 = no byte limit
    held_bytes: int = 0  # tensor bytes sent (or held from an earlier call) and not returned

    @classmethod
    def opened(cls, credits: int, prefetch_bytes: int, held_bytes: int) -> CreditWindow:
        """The window an Open grants; CreditError names a negative field."""
        for name, value in (("credits", credits), ("prefetch_bytes", prefetch_bytes),
                            ("held_bytes", held_bytes)):
            if value < 0:
                raise CreditError(f"Open.{name} must be >= 0, got {value}")
        return cls(steps=credits, window_bytes=prefetch_bytes, held_bytes=held_bytes)

    def may_send(self, nbytes: int) -> bool:
        """Whether a batch of `nbytes` tensor bytes may be sent now."""
        if self.steps <= 0:
            return False
        return (not self.window_bytes or self.held_bytes == 0
                or self.held_bytes + nbytes <= self.window_bytes)

    def sent(self, nbytes: int) -> None:
        """A batch of `nbytes` went out (its first message, for a chunked one), as `may_send`
        allowed."""
        self.steps -= 1
        self.held_bytes += nbytes

    def returned(self, credits: int, credit_bytes: int) -> None:
        """An Ack gave back `credits` batch slots and `credit_bytes` bytes."""
        if credits < 0 or credit_bytes < 0:
            raise CreditError(f"Ack credits must be >= 0, got credits={credits} "
                              f"credit_bytes={credit_bytes}")
        if credit_bytes > self.held_bytes:
            raise CreditError(f"Ack returned {credit_bytes} credit bytes, but the client holds "
                              f"only {self.held_bytes} (the tensor bytes of the batches it was "
                              "sent and has not returned)")
        self.steps += credits
        self.held_bytes -= credit_bytes

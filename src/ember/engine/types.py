"""What crosses the engine boundary: prepared items, the adapter protocol, results."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class PreparedItem:
    """One unit of work, ready for a forward.

    `payload` is whatever the adapter needs (token ids, text, a pair); `cost` is
    its size in tokens after truncation (1 for an image); `index` is its place
    in its request, so results come back in input order.
    """

    payload: Any
    cost: int
    index: int


class Adapter(Protocol):
    """A model as the worker sees it.

    Both methods run in the worker's single forward thread, never on the
    event loop. `params` is the request's hashable parameter group: every item
    of one forward shares it (R6).
    """

    def forward(self, items: Sequence[PreparedItem], params: Hashable) -> Sequence[Any]:
        """Run one forward; return one result per item, in the order given."""
        ...

    def set_lora(self, name: str | None) -> None:
        """Make `name` (None: the base model) active for the next forwards."""
        ...


@dataclass(slots=True)  # not frozen: one is made a request, and frozen init costs 3x
class RequestResult:
    """What a submitted request's future resolves to."""

    values: list[Any]
    queue_ms: float
    inference_ms: float
    forwards: int

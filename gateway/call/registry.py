"""The calls in progress on this replica, by call id (both transports)."""

from __future__ import annotations

from collections.abc import Iterator

from gateway.call.session import Call
from gateway.metrics import Metrics

__all__ = ["CallRegistry"]


class CallRegistry:
    """Calls in progress; counts them in ``gateway_calls_total`` / ``gateway_calls_active``."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._calls: dict[str, Call] = {}
        self._metrics = metrics

    def add(self, call: Call) -> None:
        if call.call_id in self._calls:
            raise ValueError(f"call {call.call_id} is already registered")
        self._calls[call.call_id] = call
        if self._metrics is not None:
            self._metrics.calls_total.labels(call.transport_name, call.line).inc()
            self._metrics.calls_active.labels(call.transport_name, call.line).inc()

    def remove(self, call: Call) -> bool:
        """Forget a finished call; False if it was not registered (already removed)."""
        if self._calls.get(call.call_id) is not call:
            return False
        del self._calls[call.call_id]
        if self._metrics is not None:
            self._metrics.calls_active.labels(call.transport_name, call.line).dec()
        return True

    def get(self, call_id: str) -> Call | None:
        return self._calls.get(call_id)

    def __getitem__(self, call_id: str) -> Call:
        return self._calls[call_id]

    def count(self, transport: str | None = None) -> int:
        """Calls in progress, on one transport or all."""
        if transport is None:
            return len(self._calls)
        return sum(1 for call in self._calls.values() if call.transport_name == transport)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[Call]:
        return iter(list(self._calls.values()))

    def items(self) -> list[tuple[str, Call]]:
        return list(self._calls.items())

    def values(self) -> list[Call]:
        return list(self._calls.values())

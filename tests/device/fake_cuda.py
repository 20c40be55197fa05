"""A stand-in for the torch.cuda calls of ``CudaCopier``, so its code runs on CPU tensors.

Streams record what they waited for; ``current_stream`` follows ``use_stream``
like torch.cuda's does; events complete at once (``auto``) or when the test
says so, which lets tests observe work that is still "on the device".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from chunkstore.device import CudaRuntime


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[Any] = []
        """Streams and events this stream was told to wait for, in order."""
        self.synchronized = 0
        """Times the host waited for all of this stream's work."""

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        self.synchronized += 1

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, runtime: FakeRuntime, timing: bool) -> None:
        self.runtime = runtime
        self.timing = timing
        self.stream: FakeStream | None = None
        self.complete = False

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.complete = self.runtime.auto_complete
        self.runtime.events.append(self)

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing, "elapsed_time needs timing events at both ends"
        return 2.5  # milliseconds


class FakeRuntime(CudaRuntime):
    """CPU tensors, fake streams and events; ``pinned`` decides what ``is_pinned`` says."""

    def __init__(self, *, pinned: bool = True, auto_complete: bool = True) -> None:
        super().__init__(torch.device("cpu"))
        self.pinned = pinned
        self.auto_complete = auto_complete
        self.compute = FakeStream("compute")
        self.side: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self._stack: list[FakeStream] = []
        self.pinned_allocs = 0

    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"side{len(self.side)}")
        self.side.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return self._stack[-1] if self._stack else self.compute

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(self, timing)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return self.pinned

    def pinned_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        self.pinned_allocs += 1
        return torch.empty(shape, dtype=torch.uint8)

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def complete_all(self) -> None:
        for event in self.events:
            event.complete = True

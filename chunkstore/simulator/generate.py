"""Seeded synthetic request traces for the workloads operators run, in Mooncake format.

Each workload builds prompts out of *segments*, each an id and a token count.
A segment is a system prompt, a document, a user turn or a tool result.
Every prompt becomes prefix-chained block ids, exactly as a serving engine keys its KV.
Block ``i`` of a prompt is identified by its parent block and the segment pieces it covers.
So two prompts share block ids precisely as far as they share tokens.
A partial last block that later fills up becomes a new block.

Workloads, see :data:`WORKLOADS`:

* ``chat``: multi-turn conversations.
  After a think time, each turn re-sends the whole conversation.
  It adds the previous answer and a new question.
* ``system-prompts``: many short conversations under a few long shared system prompts.
  The prompts have Zipf popularity. Each conversation has one or two turns.
* ``rag``: a system prompt, then a few documents, then the question.
  The documents are drawn from a pool with Zipf popularity.
* ``agent``: tool definitions shared by every agent, then a loop.
  Its transcript grows by a tool call and its result at every step.

The same seed and parameters always give the same trace, using ``random.Random`` only.
:func:`write_trace` writes it as JSON Lines.
:func:`load_trace` reads those like any Mooncake trace.
"""

from __future__ import annotations

import heapq
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from chunkstore.errors import ConfigError

Segment = tuple[int, int]
"""(segment id, tokens): a run of prompt tokens with one identity."""


@dataclass(frozen=True, slots=True)
class GeneratedRequest:
    """One request of a generated trace (the fields of a Mooncake line)."""

    timestamp: int
    """Arrival time in milliseconds."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Tokens the engine generates."""
    hash_ids: tuple[int, ...]
    """Prefix-chained block ids, one per started block of the prompt, as in Mooncake traces
    (the trace reader drops a partial last one: the engine never caches it)."""

    def to_json(self) -> str:
        """One Mooncake JSON line (without the newline)."""
        return json.dumps(
            {
                "timestamp": self.timestamp,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


class _BlockKeyer:
    """Interns (parent block, block contents) pairs into small integer block ids."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def blocks(self, segments: list[Segment]) -> tuple[tuple[int, ...], int]:
        """Block ids of a prompt made of ``segments``, and its length in tokens."""
        size = self.block_tokens
        ids: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        room = size
        for segment_id, tokens in segments:
            offset = 0
            while offset < tokens:
                take = min(room, tokens - offset)
                pieces.append((segment_id, offset, take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._intern(parent, pieces)
                    ids.append(parent)
                    pieces, room = [], size
        if pieces:
            ids.append(self._intern(parent, pieces))
        return tuple(ids), sum(tokens for _, tokens in segments)

    def _intern(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), len(self._ids))


@dataclass(frozen=True, slots=True)
class _Pending:
    """A request waiting for its arrival time, with what follows it."""

    timestamp: float
    segments: list[Segment]
    output_length: int
    follow_up: Callable[[float], _Pending | None] | None


class _Workload(ABC):
    """Shared machinery: seeded randomness, fresh segment ids, arrivals in time order."""

    def __init__(self, rng: random.Random, sessions_per_second: float) -> None:
        self.rng = rng
        self.rate = sessions_per_second
        self._next_segment = 0
        self._zipf_weights: dict[tuple[int, float], list[float]] = {}

    def segment(self, mean_tokens: float, minimum: int = 16) -> Segment:
        """A fresh segment (new content) of about ``mean_tokens`` tokens (log-normal)."""
        self._next_segment += 1
        tokens = max(minimum, int(self.rng.lognormvariate(0.0, 0.6) * mean_tokens))
        return self._next_segment, tokens

    def zipf(self, population: int, exponent: float) -> int:
        """An index in ``range(population)``; index 0 is the most popular."""
        weights = self._weights(population, exponent)
        return self.rng.choices(range(population), cum_weights=weights)[0]

    def _weights(self, population: int, exponent: float) -> list[float]:
        cache = self._zipf_weights
        key = (population, exponent)
        if key not in cache:
            total, cumulative = 0.0, []
            for rank in range(1, population + 1):
                total += rank**-exponent
                cumulative.append(total)
            cache[key] = cumulative
        return cache[key]

    def think(self, mean_seconds: float) -> float:
        """A user's or a tool's pause before the next request, in seconds."""
        return self.rng.expovariate(1.0 / mean_seconds)

    def growing(
        self,
        prompt: list[Segment],
        at: float,
        remaining: int,
        *,
        reply: float,
        added: float,
        think: float,
    ) -> _Pending:
        """A request whose ``remaining`` follow-ups each extend the prompt before it.

        A follow-up re-sends the prompt, the reply (about ``reply`` tokens) and a
        new segment (about ``added``) after a pause of about ``think`` seconds:
        a chat turn, or an agent step with its tool result.
        """
        answer = self.segment(reply)

        def follow_up(now: float) -> _Pending | None:
            if remaining == 0:
                return None
            following = [*prompt, answer, self.segment(added)]
            pause = self.think(think)
            return self.growing(
                following, now + pause, remaining - 1, reply=reply, added=added, think=think
            )

        return _Pending(at, prompt, answer[1], follow_up)

    @abstractmethod
    def session(self, start: float) -> _Pending:
        """The first request of a new session arriving at ``start`` (seconds)."""

    def requests(self, count: int) -> Iterator[_Pending]:
        """``count`` requests in arrival order: sessions start as a Poisson process."""
        queue: list[tuple[float, int, _Pending]] = []
        order = 0
        next_session = 0.0
        emitted = 0
        while emitted < count:
            if not queue or next_session <= queue[0][0]:
                first = self.session(next_session)
                heapq.heappush(queue, (first.timestamp, order, first))
                order += 1
                next_session += self.rng.expovariate(self.rate)
                continue
            _, _, pending = heapq.heappop(queue)
            yield pending
            emitted += 1
            if pending.follow_up is not None:
                following = pending.follow_up(pending.timestamp)
                if following is not None:
                    heapq.heappush(queue, (following.timestamp, order, following))
                    order += 1


class _Chat(_Workload):
    """Multi-turn chat: a handful of system prompts, turns after a think time."""

    def __init__(self, rng: random.Random, sessions_per_second: float = 0.5) -> None:
        super().__init__(rng, sessions_per_second)
        self.system_prompts = [self.segment(1500) for _ in range(4)]

    def session(self, start: float) -> _Pending:
        system = self.system_prompts[self.zipf(len(self.system_prompts), 1.0)]
        turns = 1 + min(int(self.rng.expovariate(1 / 5.0)), 30)
        return self.growing(
            [system, self.segment(300)], start, turns - 1, reply=400, added=200, think=60.0
        )


class _SystemPrompts(_Workload):
    """Many short conversations under a few long shared system prompts."""

    def __init__(self, rng: random.Random, sessions_per_second: float = 4.0) -> None:
        super().__init__(rng, sessions_per_second)
        self.system_prompts = [self.segment(4000) for _ in range(8)]

    def session(self, start: float) -> _Pending:
        system = self.system_prompts[self.zipf(len(self.system_prompts), 1.2)]
        question = self.segment(250)
        answer = self.segment(300)
        second_turn = self.rng.random() < 0.3

        def follow_up(now: float) -> _Pending | None:
            if not second_turn:
                return None
            prompt = [system, question, answer, self.segment(150)]
            return _Pending(now + self.think(30.0), prompt, 300, None)

        return _Pending(start, [system, question], answer[1], follow_up)


class _Rag(_Workload):
    """Retrieval-augmented generation over a document pool with Zipf popularity."""

    def __init__(self, rng: random.Random, sessions_per_second: float = 2.0) -> None:
        super().__init__(rng, sessions_per_second)
        self.system_prompt = self.segment(800)
        self.documents = [self.segment(2500) for _ in range(400)]

    def session(self, start: float) -> _Pending:
        count = self.rng.randint(1, 4)
        chosen = [self.documents[self.zipf(len(self.documents), 1.1)] for _ in range(count)]
        prompt = [self.system_prompt, *chosen, self.segment(120)]
        return _Pending(start, prompt, int(self.rng.lognormvariate(5.0, 0.5)), None)


class _Agent(_Workload):
    """Agent loops: shared tool definitions, a transcript growing by one tool call per step."""

    def __init__(self, rng: random.Random, sessions_per_second: float = 0.3) -> None:
        super().__init__(rng, sessions_per_second)
        self.tool_sets = [self.segment(3000) for _ in range(3)]

    def session(self, start: float) -> _Pending:
        tools = self.tool_sets[self.zipf(len(self.tool_sets), 1.0)]
        steps = 2 + min(int(self.rng.expovariate(1 / 10.0)), 60)
        return self.growing(
            [tools, self.segment(400)], start, steps - 1, reply=120, added=900, think=4.0
        )


WORKLOADS: dict[str, Callable[[random.Random], _Workload]] = {
    "chat": _Chat,
    "system-prompts": _SystemPrompts,
    "rag": _Rag,
    "agent": _Agent,
}
"""Workload names :func:`generate_trace` accepts."""


def generate_trace(
    workload: str, *, requests: int = 3000, seed: int = 0, block_tokens: int = 512
) -> list[GeneratedRequest]:
    """``requests`` requests of ``workload`` in arrival order (same arguments, same trace)."""
    if workload not in WORKLOADS:
        raise ConfigError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if requests < 1:
        raise ConfigError(f"a trace needs at least 1 request, got {requests}")
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
    source = WORKLOADS[workload](random.Random(f"{workload}:{seed}"))
    keyer = _BlockKeyer(block_tokens)
    out = []
    for pending in source.requests(requests):
        ids, tokens = keyer.blocks(pending.segments)
        out.append(
            GeneratedRequest(round(pending.timestamp * 1000), tokens, pending.output_length, ids)
        )
    return out


def write_trace(requests: list[GeneratedRequest], path: str | Path) -> Path:
    """Write ``requests`` as Mooncake JSON Lines; returns the path."""
    out = Path(path)
    try:
        with open(out, "w", encoding="utf-8") as handle:
            for request in requests:
                handle.write(request.to_json() + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write trace {out}: {exc.strerror}") from None
    return out

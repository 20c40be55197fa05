"""Cache sizing by trace replay: the host cache's real policies plus Belady's optimum.

``load_trace`` reads Mooncake or token JSONL traces, ``simulate`` replays
them at several capacities, ``plot_simulation`` draws the result
(``chunkstore simulate`` is the command-line front end).
"""

from chunkstore.simulator.belady import belady_hits, next_uses
from chunkstore.simulator.replay import (
    SIMULATED_POLICIES,
    PolicyResult,
    Simulation,
    default_capacities,
    simulate,
)
from chunkstore.simulator.trace import Trace, TraceError, TraceRequest, load_trace, parse_trace

__all__ = [
    "SIMULATED_POLICIES",
    "PolicyResult",
    "Simulation",
    "Trace",
    "TraceError",
    "TraceRequest",
    "belady_hits",
    "default_capacities",
    "load_trace",
    "next_uses",
    "parse_trace",
    "plot_simulation",
    "simulate",
]


def __getattr__(name: str) -> object:
    # Plotting pulls in matplotlib's import machinery only when asked for.
    if name == "plot_simulation":
        from chunkstore.simulator.plot import plot_simulation

        return plot_simulation
    raise AttributeError(f"module 'chunkstore.simulator' has no attribute {name!r}")

"""Hit ratio against cache capacity, one line per policy (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from chunkstore.errors import ConfigError, MissingDependency
from chunkstore.simulator.replay import Simulation

_STYLE = {
    "arc": ("ARC", "tab:blue", "o"),
    "lru": ("LRU", "tab:orange", "s"),
    "belady": ("Belady (offline optimum)", "tab:green", "^"),
}


def plot_simulation(
    simulation: Simulation, path: str | Path, *, block_bytes: int | None = None
) -> Path:
    """Draw block hit ratio (and tokens not recomputed) against capacity into a PNG/SVG/PDF.

    With ``block_bytes`` the capacity axis is labelled in GiB of host memory.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependency(
            "plotting needs matplotlib: pip install 'chunkstore[plot]'"
        ) from None
    out = Path(path)
    scale = (block_bytes / 2**30) if block_bytes else 1.0
    unit = "GiB of host memory" if block_bytes else "blocks"
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for policy in simulation.policies:
        label, color, marker = _STYLE.get(policy, (policy, None, "x"))
        xs = [c * scale for c in simulation.capacities]
        hits = [simulation.result(policy, c).hit_ratio * 100 for c in simulation.capacities]
        saved = [
            simulation.result(policy, c).tokens_saved_ratio * 100 for c in simulation.capacities
        ]
        left.plot(xs, hits, marker=marker, color=color, label=label)
        right.plot(xs, saved, marker=marker, color=color, label=label)
    trace = simulation.trace
    for axis, title in ((left, "Block hit ratio"), (right, "Prompt tokens not recomputed")):
        axis.set_xscale("log")
        axis.set_xlabel(f"cache capacity ({unit})")
        axis.set_ylabel("%")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.axvline(trace.unique_blocks * scale, color="grey", linestyle=":", linewidth=1)
    left.legend(loc="lower right")
    figure.suptitle(
        f"{Path(trace.source).name}: {len(trace.requests)} requests, "
        f"{trace.accesses} block lookups, "
        f"{trace.unique_blocks} unique blocks (dotted) of {trace.block_tokens} tokens",
        fontsize=9,
    )
    try:
        figure.savefig(out, dpi=110)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot write plot {out}: {exc}") from None
    finally:
        plt.close(figure)
    return out

"""Hit ratio and tokens saved against cache capacity, one line per policy (matplotlib, optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chunkstore.errors import ConfigError, MissingDependency
from chunkstore.simulator.replay import Simulation

_STYLE = {
    "parc": ("prefix-aware ARC (parc)", "tab:red", "D"),
    "arc": ("ARC", "tab:blue", "o"),
    "lru": ("LRU", "tab:orange", "s"),
    "belady": ("Belady MIN (offline, block hits)", "tab:green", "^"),
}


def plot_simulation(
    simulation: Simulation, path: str | Path, *, block_bytes: int | None = None
) -> Path:
    """Draw block hit ratio (and tokens not recomputed) against capacity into a PNG/SVG/PDF.

    With ``block_bytes`` the capacity axis is labelled in GiB of host memory.
    """
    plt = _pyplot()
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
    return _save(plt, figure, out)


def plot_tokens_saved(simulations: Sequence[Simulation], path: str | Path) -> Path:
    """Tokens saved against capacity (% of each trace's unique blocks), one panel per trace."""
    plt = _pyplot()
    out = Path(path)
    columns = min(3, len(simulations)) or 1
    rows = -(-len(simulations) // columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(4.6 * columns, 3.6 * rows), constrained_layout=True, squeeze=False
    )
    for axis, simulation in zip(axes.flat, simulations):
        unique = simulation.trace.unique_blocks
        xs = [c / unique * 100 for c in simulation.capacities]
        for policy in simulation.policies:
            label, color, marker = _STYLE.get(policy, (policy, None, "x"))
            saved = [
                simulation.result(policy, c).tokens_saved_ratio * 100 for c in simulation.capacities
            ]
            axis.plot(xs, saved, marker=marker, markersize=4, color=color, label=label)
        axis.set_xscale("log")
        axis.set_xlabel("capacity (% of unique blocks)")
        axis.set_ylabel("prompt tokens saved (%)")
        axis.set_title(Path(simulation.trace.source).name, fontsize=9)
        axis.grid(True, which="both", alpha=0.3)
    for axis in list(axes.flat)[len(simulations) :]:
        axis.set_visible(False)
    axes.flat[0].legend(loc="lower right", fontsize=7)
    return _save(plt, figure, out)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependency(
            "plotting needs matplotlib: pip install 'chunkstore[plot]'"
        ) from None
    return plt


def _save(plt: Any, figure: Any, out: Path) -> Path:
    try:
        figure.savefig(out, dpi=110)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot write plot {out}: {exc}") from None
    finally:
        plt.close(figure)
    return out

"""Where the best strategy changes with the job's size (crossover points), and a plot of every
strategy's simulated overhead against ranks, one panel per MTBF. Local."""
from __future__ import annotations

from pathlib import Path

CLIP = 1.0
"""Overheads above 100 % (jobs that barely progress) are drawn at the top of the axis."""


def crossovers(tables: list[dict]) -> list[dict]:
    """For each MTBF, the neighbouring sizes between which the best strategy changes. Local."""
    out = []
    for mtbf in dict.fromkeys(t["mtbf"] for t in tables):
        rows = sorted((t for t in tables if t["mtbf"] == mtbf), key=lambda t: t["ranks"])
        for a, b in zip(rows, rows[1:]):
            if a["best"] != b["best"]:
                out.append({"mtbf": mtbf, "from_ranks": a["ranks"], "to_ranks": b["ranks"],
                            "from": a["best"], "to": b["best"]})
    return out


def plot(tables: list[dict], path: str | Path) -> None:
    """Overhead (%) against ranks for every strategy, the best marked at each size, crossovers
    shaded. Local."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mtbfs = list(dict.fromkeys(t["mtbf"] for t in tables))
    fig, axes = plt.subplots(1, len(mtbfs), figsize=(7 * len(mtbfs), 5), squeeze=False)
    for ax, mtbf in zip(axes[0], mtbfs):
        rows = sorted((t for t in tables if t["mtbf"] == mtbf), key=lambda t: t["ranks"])
        ranks = [t["ranks"] for t in rows]
        for name in rows[0]["rows"]:
            ys = [min(_mean(t["rows"][name]["overhead"]), CLIP) * 100 for t in rows]
            auto = name == "auto"
            ax.plot(ranks, ys, "k--" if auto else "o-", lw=2.2 if auto else 1.0, ms=3,
                    label=name, zorder=3 if auto else 2)
        for t in rows:
            if t["best"]:
                y = min(_mean(t["rows"][t["best"]]["overhead"]), CLIP) * 100
                ax.plot(t["ranks"], y, "*", ms=14, mfc="none", mec="red", zorder=4)
        for c in crossovers(rows):
            ax.axvspan(c["from_ranks"], c["to_ranks"], color="0.9", zorder=0)
            ax.annotate(f"{c['from']} -> {c['to']}", xy=(c["to_ranks"], CLIP * 100),
                        fontsize=7, ha="right", va="top", rotation=90)
        ax.set(xscale="log", yscale="log", xlabel="ranks (8 per node)",
               ylabel="failure-related overhead (%)", ylim=(None, CLIP * 100 * 1.5),
               title=f"node MTBF {mtbf} (red star: best; shaded: best changes)")
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.grid(True, which="major", lw=0.3)
    axes[0][0].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean(e) -> float:
    """An Estimate, or its JSON form."""
    return e["mean"] if isinstance(e, dict) else e.mean

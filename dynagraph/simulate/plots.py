"""The simulation's PNG plots (matplotlib, no display needed).

``ttft_cdf.png``: the TTFT distribution of completed requests; ``workers.png``: workers
alive and workers holding requests, per simulated second; ``hit_rate.png``: the share of
admitted prompt tokens found in the prefix cache, per arrival bin.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

TTFT_CDF = "ttft_cdf.png"
WORKERS = "workers.png"
HIT_RATE = "hit_rate.png"


def write_plots(out: Path, *, title: str, ttfts_ms: Sequence[float],
                workers: Sequence[tuple[float, int, int]],
                hit_rate: Sequence[tuple[float, float]], bin_s: float) -> list[Path]:
    """Write the three plots into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    v = sorted(ttfts_ms)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))])
        ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, which="both", alpha=0.3)
    paths.append(_save(fig, out / TTFT_CDF))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if workers:
        t = [w[0] for w in workers]
        ax.step(t, [w[1] for w in workers], where="post", label="alive")
        ax.step(t, [w[2] for w in workers], where="post", label="holding requests")
        ax.legend()
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("workers")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Workers over time: {title}")
    ax.grid(True, alpha=0.3)
    paths.append(_save(fig, out / WORKERS))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if hit_rate:
        ax.plot([h[0] for h in hit_rate], [100 * h[1] for h in hit_rate], marker=".")
    ax.set_xlabel(f"arrival time (s, bins of {bin_s:g} s)")
    ax.set_ylabel("prompt tokens from the prefix cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Cache hit rate over time: {title}")
    ax.grid(True, alpha=0.3)
    paths.append(_save(fig, out / HIT_RATE))
    return paths


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path

"""PNG plots of a replay (matplotlib, Agg backend, no display needed).

- ``<prefix>_latency_cdf.png``: empirical CDFs of TTFT, per-request mean ITL and E2E of
  the successful requests, SLO bounds marked.
- ``<prefix>_ttft_timeline.png``: each request's TTFT at its due time (failed requests
  marked at the top), the TTFT SLO, and the arrival rate per window on a second axis.
- ``<prefix>_goodput.png``: per window, arrival rate, throughput and goodput (req/s), and
  SLO attainment on a second axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.traces.replay import RequestResult  # noqa: E402
from benchmarks.traces.report import Slo  # noqa: E402


def _ecdf(ax: Any, values_ms: Sequence[float], label: str, slo_ms: float | None) -> None:
    xs = sorted(values_ms)
    if xs:
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"n={len(xs)}")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if xs and xs[-1] > 0 and xs[-1] / max(xs[0], 1e-3) > 50:
        ax.set_xscale("log")
    ax.legend(loc="lower right", fontsize=8)


def _legend_above(ax: Any, twin: Any) -> None:
    """One legend above the plot for the lines of ``ax`` and its twin axis."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower left", bbox_to_anchor=(0.0, 1.0),
              ncol=len(l1 + l2), fontsize=8, frameon=False)


def _save(fig: Any, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ttft_ms(r: RequestResult) -> float:
    return (r.ttft_s or 0.0) * 1000.0


def latency_cdf(results: Sequence[RequestResult], slo: Slo, path: Path, title: str) -> Path:
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _ecdf(axes[0], [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], "TTFT", slo.ttft_ms)
    _ecdf(axes[1], [r.mean_itl_s * 1000 for r in ok if r.mean_itl_s is not None],
          "mean ITL per request", slo.itl_ms)
    _ecdf(axes[2], [r.e2e_s * 1000 for r in ok if r.e2e_s is not None], "E2E latency", None)
    return _save(fig, title, path)


def ttft_timeline(results: Sequence[RequestResult], wins: Sequence[dict[str, Any]], slo: Slo,
                  path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    good = [r for r in ok if slo.met_by(r)]
    late = [r for r in ok if not slo.met_by(r)]
    ax.scatter([r.scheduled_s for r in good], [_ttft_ms(r) for r in good],
               s=8, color="tab:blue", label="met both SLOs")
    ax.scatter([r.scheduled_s for r in late], [_ttft_ms(r) for r in late],
               s=8, color="tab:orange", label="missed an SLO")
    failed = [r for r in results if not r.ok]
    top = max([_ttft_ms(r) for r in ok] + [slo.ttft_ms]) * 1.1
    if failed:
        ax.scatter([r.scheduled_s for r in failed], [top] * len(failed), marker="x",
                   color="red", label=f"failed ({len(failed)})")
    ax.axhline(slo.ttft_ms, color="red", linestyle="--", linewidth=1,
               label=f"TTFT SLO {slo.ttft_ms:g} ms")
    ax.set_xlabel("due time (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, alpha=0.3)
    rate = ax.twinx()
    xs = [w["start_s"] for w in wins]
    width = xs[1] - xs[0] if len(xs) > 1 else 1.0
    rate.step([*xs, xs[-1] + width] if xs else [], [w["arrival_rps"] for w in wins]
              + ([wins[-1]["arrival_rps"]] if wins else []), where="post", color="gray",
              alpha=0.7, label="arrival rate")
    rate.set_ylabel("arrivals (req/s)")
    rate.set_ylim(bottom=0)
    _legend_above(ax, rate)
    return _save(fig, title, path)


def goodput_timeline(wins: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(12, 4.5))
    xs = [w["start_s"] for w in wins]
    width = xs[1] - xs[0] if len(xs) > 1 else 1.0
    mids = [x + width / 2 for x in xs]
    ax.plot(mids, [w["arrival_rps"] for w in wins], marker="o", ms=3, label="arrivals")
    ax.plot(mids, [w["throughput_rps"] for w in wins], marker="o", ms=3,
            label="throughput (completions)")
    ax.plot(mids, [w["goodput_rps"] for w in wins], marker="o", ms=3, label="goodput")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("req/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    att = ax.twinx()
    att.plot(mids, [w["slo_attainment"] if w["slo_attainment"] is not None else float("nan")
                    for w in wins], color="black", linestyle=":", label="SLO attainment")
    att.set_ylabel("SLO attainment (of requests due)")
    att.set_ylim(0, 1.05)
    _legend_above(ax, att)
    return _save(fig, title, path)


def plot_all(results: Sequence[RequestResult], wins: Sequence[dict[str, Any]], slo: Slo,
             prefix: Path, title: str) -> list[Path]:
    """Write the three PNGs next to ``prefix`` (``<prefix>_<name>.png``)."""
    return [
        latency_cdf(results, slo, prefix.with_name(prefix.name + "_latency_cdf.png"), title),
        ttft_timeline(results, wins, slo,
                      prefix.with_name(prefix.name + "_ttft_timeline.png"), title),
        goodput_timeline(wins, prefix.with_name(prefix.name + "_goodput.png"), title),
    ]

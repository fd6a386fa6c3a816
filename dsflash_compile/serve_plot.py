"""The serve benchmark's plot (`dsflash bench plot serve-<preset>-<date>.json`): throughput per GPU against
tokens/s per user for each configuration, and TTFT against throughput. Needs matplotlib (the `test` extra);
kept apart from serve_bench so a machine without it still runs the benchmark and plots later."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from .serve_bench import curve, ratio_bound


def plot(result: dict | str | Path, png: str | Path | None = None) -> Path:
    """Write the PNG for `result` (the results dict or its JSON file); default path: the JSON's with .png.
    Log axes: day-zero and optimized differ by orders of magnitude."""
    import matplotlib

    matplotlib.use("Agg")  # files only; the GPU machine has no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if not isinstance(result, dict):
        png = png or Path(result).with_suffix(".png")
        result = json.loads(Path(result).read_text())
    if png is None:
        raise ValueError("plot(): give the PNG path when passing the results as a dict")
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(13, 5))
    for name, entry in result["configs"].items():
        points = curve(entry)
        if not points:
            continue
        ttft = [entry["concurrency"][str(c)]["ttft_s"]["p50"] for c, _, _ in points]
        line, = speed.plot([u for _, u, _ in points], [g for _, _, g in points], "o-", label=name)
        latency.plot([g for _, _, g in points], ttft, "o-", color=line.get_color(), label=name)
        for (c, user, gpu), first in zip(points, ttft):
            speed.annotate(f"C={c}", (user, gpu), textcoords="offset points", xytext=(4, 4), fontsize=8)
            latency.annotate(f"C={c}", (gpu, first), textcoords="offset points", xytext=(4, 4), fontsize=8)
    head = result.get("headline") or {}
    if head.get("tokens_s_per_user_constraint"):
        speed.axvline(head["tokens_s_per_user_constraint"], color="grey", linestyle="--", linewidth=1,
                      label=f"{head['tokens_s_per_user_constraint']:.1f} tokens/s per user")
    speed.set(xscale="log", yscale="log", xlabel="tokens/s per user (p50)", ylabel="tokens/s per GPU",
              title="throughput vs per-user speed")
    latency.set(xscale="log", yscale="log", xlabel="tokens/s per GPU", ylabel="TTFT p50 (s)",
                title="time to first token vs throughput")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 20, not 2 x 10^1
    # minor ticks labelled at 2 and 5 x 10^n only: every one (0.06 0.07 0.08 0.09) overlaps its neighbours
    sparse = FuncFormatter(lambda value, _: f"{value:g}" if f"{value:e}"[0] in "25" else "")
    for axes in (speed, latency):
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        for axis in (axes.xaxis, axes.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(sparse)
    ratio = head.get("throughput_ratio_at_constraint")
    summary = f"; optimized / day-zero at that speed: {ratio:.2f}x{ratio_bound(head)}" if ratio else ""
    fig.suptitle(f"dsflash bench serve: {result['preset']} on {result['device']}, {result['date']}{summary}\n"
                 + textwrap.fill(result["batching"], 160), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print("wrote", png)
    return Path(png)

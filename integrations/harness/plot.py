"""Plots of a replay (`--plot`) and of a capacity sweep (`--sweep`), drawn with matplotlib.

matplotlib is the optional extra `plot` (`pip install -e '.[plot]'`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvhal[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def check_plot_path(path: str | os.PathLike) -> None:
    """Fail before a replay, not after it, if `path` cannot take a plot.

    Raises:
        RuntimeError: matplotlib is missing.
        ValueError: the folder of `path` does not exist, or its suffix is not an image format
            matplotlib writes (the message names `path` and lists the formats).
    """
    _pyplot()
    from matplotlib.figure import Figure  # not pyplot's: nothing to close

    formats = Figure().canvas.get_supported_filetypes()
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot: folder {folder!r} does not exist")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(f"--plot: {os.fspath(path)!r} is not an image file name; use one of "
                         f".{', .'.join(sorted(formats))}")


def plot_timeline(path: str | os.PathLike, time_s: np.ndarray, input_tokens: np.ndarray,
                  hit_tokens: np.ndarray, ttft_saved_s: np.ndarray, title: str) -> None:
    """Draw cumulative hit ratio and cumulative modeled TTFT saved over the trace timeline.

    Args:
        path: Output image (format from the suffix, e.g. .png).
        time_s: float64, shape (n,), each request's trace timestamp in seconds.
        input_tokens, hit_tokens: int64, shape (n,), per request.
        ttft_saved_s: float64, shape (n,), modeled TTFT saved per request, seconds.
        title: Figure title.
    """
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ratio = np.cumsum(hit_tokens) / np.maximum(np.cumsum(input_tokens), 1)
    ax1.plot(time_s, ratio)
    ax1.set_ylabel("cumulative hit ratio")
    ax1.set_ylim(0, 1)
    ax1.grid(True, alpha=0.3)
    ax2.plot(time_s, np.cumsum(ttft_saved_s))
    ax2.set_ylabel("cumulative TTFT saved (s)")
    ax2.set_xlabel("trace time (s)")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_sweep(path: str | os.PathLike, what: str, capacities: Sequence[int],
               hit_ratios: Sequence[float], reference_ratio: float, title: str) -> None:
    """Draw hit ratio against the capacity of `what` (e.g. "host"), with the unlimited-capacity
    reference as a dashed line. Capacities are bytes, plotted in GiB on a log2 axis (sweeps
    usually double)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gib = np.asarray(capacities, dtype=np.float64) / (1 << 30)
    ax.plot(gib, hit_ratios, marker="o", label="replay")
    ax.set_xscale("log", base=2)
    ax.axhline(reference_ratio, linestyle="--", color="gray",
               label=f"unlimited capacity ({reference_ratio:.4f})")
    ax.set_xlabel(f"{what} capacity (GiB)")
    ax.set_ylabel("hit ratio (hit tokens / input tokens)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_lines(path: str | os.PathLike, x_label: str,
               panels: Sequence[tuple[str, dict[str, tuple[Sequence[float], Sequence[float]]]]],
               title: str) -> None:
    """Draw panels side by side, each with one line per name (x on a log2 axis: sweeps usually
    double; ticks at the x values).

    Args:
        path: Output image (format from the suffix, e.g. .png).
        x_label: The x axis of every panel.
        panels: (y label, {line name: (xs, ys)}) per panel; a y of None leaves a gap.
        title: Figure title.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (y_label, lines) in zip(axes[0], panels):
        for name, (xs, ys) in lines.items():
            ax.plot(xs, [np.nan if y is None else y for y in ys], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for xs, _ in lines.values() for x in xs})
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bars(path: str | os.PathLike,
              panels: Sequence[tuple[str, dict[str, dict[str, float | None]]]],
              title: str) -> None:
    """Draw panels side by side, each a grouped bar chart: one group per x category, one bar
    per name in each group (a value of None leaves the bar out).

    Args:
        path: Output image (format from the suffix, e.g. .png).
        panels: (y label, {category: {bar name: value}}) per panel; bar names keep their
            first-seen order and colour across groups and panels.
        title: Figure title.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (y_label, groups) in zip(axes[0], panels):
        names = list(dict.fromkeys(n for bars in groups.values() for n in bars))
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
            ys = [np.nan if bars.get(name) is None else bars[name] for bars in groups.values()]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_ylabel(y_label)
        ax.grid(True, axis="y", alpha=0.3)
        if names:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_soak_timeline(path: str | os.PathLike, done_s: Sequence[float],
                       cached_tokens: Sequence[int], prompt_tokens: Sequence[int],
                       verdicts: Sequence[str],
                       faults: Sequence[tuple[float, float, str]], title: str,
                       hits: tuple[Sequence[float], dict[str, Sequence[float]]] | None = None
                       ) -> None:
    """Draw a soak on one time axis: requests/s (10 s bins), hit tokens/s by source (with
    `hits`), each request's cached share of its prompt (marked by verdict), and every fault as
    a shaded span labelled by kind.

    Args:
        path: Output image (format from the suffix, e.g. .png).
        done_s: Seconds after the load started each request ended.
        cached_tokens, prompt_tokens: Per request (vLLM's `cached_tokens`, prompt length).
        verdicts: Per request: "ok", "near_tie", "wrong" or "failed".
        faults: (start s, end s, kind) per fault applied.
        title: Figure title.
        hits: (bin starts in seconds, {source: hit tokens/s per bin}), e.g. from
            `soak.report.hit_rates`; None leaves that panel out.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(3 if hits else 2, 1, sharex=True, figsize=(11, 9 if hits else 6))
    ax1, ax2 = axes[0], axes[-1]
    if hits:
        starts, by_source = hits
        for source, rate in sorted(by_source.items()):
            axes[1].step(starts, rate, where="post", label=source)
        axes[1].set_ylabel("hit tokens/s by source")
        if by_source:
            axes[1].legend(fontsize=8, loc="upper right")
    t = np.asarray(done_s, dtype=float)
    end = max(float(t.max()) if len(t) else 0.0, max((f[1] for f in faults), default=0.0))
    bins = np.arange(0.0, end + 10.0, 10.0)
    counts, edges = np.histogram(t, bins=bins)
    ax1.step(edges[:-1], counts / 10.0, where="post")
    ax1.set_ylabel("requests/s")
    share = np.asarray(cached_tokens, float) / np.maximum(np.asarray(prompt_tokens, float), 1)
    for verdict, marker in (("ok", "."), ("near_tie", "x"), ("wrong", "X"), ("failed", "v")):
        sel = np.asarray([v == verdict for v in verdicts], dtype=bool)
        if sel.any():
            ax2.scatter(t[sel], share[sel], marker=marker, label=verdict, s=16)
    ax2.set_ylabel("cached share of prompt")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_xlabel("seconds since the load started")
    for ax in axes:
        for start, stop, kind in faults:
            ax.axvspan(start, max(stop, start + 0.5), color="tab:red", alpha=0.15)
        ax.grid(True, alpha=0.3)
    for start, _, kind in faults:
        ax1.annotate(kind, (start, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                     fontsize=7, va="top")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

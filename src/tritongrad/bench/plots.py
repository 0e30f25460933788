"""One PNG per op: achieved GB/s against bytes moved, a line per provider, one panel per mode and dtype,
with the copy bandwidth measured in the same run drawn as the ceiling."""

from __future__ import annotations

from pathlib import Path


def _bytes_label(value: float, _pos) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def plot(doc: dict, out: Path, name: str) -> list[Path] | str:
    """The paths written, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        return "matplotlib is not importable: no plots (pip install 'tritongrad[bench]')"

    meta, rows = doc["meta"], [r for r in doc["results"] if r["status"] == "ok"]
    ceiling = doc["copy"]["GBps"]
    providers = list(doc["providers"])
    paths = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        dtypes = list(dict.fromkeys(r["dtype"] for r in mine))
        fig, axes = plt.subplots(
            len(modes), len(dtypes), figsize=(max(8, 5 * len(dtypes)), 3.4 * len(modes)), squeeze=False, sharex=True
        )
        for i, mode in enumerate(modes):
            for j, dtype in enumerate(dtypes):
                ax = axes[i][j]
                for p in providers:
                    points = sorted(
                        (r["bytes"], r["GBps"]) for r in mine if (r["mode"], r["dtype"], r["provider"]) == (mode, dtype, p)
                    )
                    if points:
                        ax.plot(*zip(*points), marker="o", markersize=4, label=p)
                ax.axhline(ceiling, linestyle="--", color="black", linewidth=1, label="copy bandwidth")
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(FuncFormatter(_bytes_label))
                ax.xaxis.set_minor_formatter(NullFormatter())
                ax.set_title(f"{mode}, {dtype}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
                if i == len(modes) - 1:
                    ax.set_xlabel("bytes moved (op's formula)")
                if j == 0:
                    ax.set_ylabel("GB/s")
        legend = {}  # a provider may be missing from some panels: gather labels from all of them
        for ax in axes.flat:
            legend.update(zip(*reversed(ax.get_legend_handles_labels())))
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 6), frameon=False)
        fig.suptitle(
            f"{op}: achieved GB/s against bytes moved\n"
            f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['git_sha']}, {meta['date']}",
            fontsize=10,
        )
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        path = out / f"{name}-{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

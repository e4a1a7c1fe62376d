"""The report's plots (OUT/*.png): acceptance length and speedup against K, and per-position
acceptance at the largest K."""

from __future__ import annotations

from pathlib import Path

from report.common import PROMPT_SETS

STYLE = {"P-EAGLE": "tab:blue", "EAGLE-3": "tab:orange", "DFlash": "tab:green"}  # a head without rows: no line
CURVES = (
    ("acceptance_length", "acceptance length vs K (greedy)", "acceptance_length_vs_k.png"),
    ("speedup", "speedup over plain decoding vs K (measured; dotted: cost model)", "speedup_vs_k.png"),
)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve_axis(ax, results: dict, dataset: str, key: str) -> None:
    """Every head's `key` against K on one prompt set, a line per batch size."""
    batches = results["settings"]["batches"]
    for head, color in STYLE.items():
        for batch, line in zip(batches, ("-", "--", "-.", ":")):
            sel = sorted(
                (r for r in results["results"] if (r["head"], r["dataset"], r["batch"]) == (head, dataset, batch)),
                key=lambda r: r["k"],
            )
            if not sel:
                continue
            ks = [r["k"] for r in sel]
            ax.plot(ks, [r[key] for r in sel], line, marker="o", color=color, label=f"{head} b={batch}")
            if key == "speedup" and batch == min(batches):
                ax.plot(ks, [r["model_speedup"] for r in sel], ":", color=color, alpha=0.6)
    if key == "speedup":
        ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(title=dataset, xlabel="K", ylabel=key.replace("_", " "))
    ax.legend(fontsize=8)


def per_position_axis(ax, results: dict, dataset: str, batch: int, k_top: int) -> None:
    for head, color in STYLE.items():
        for r in results["results"]:
            if (r["head"], r["dataset"], r["batch"], r["k"]) == (head, dataset, batch, k_top):
                ax.plot(range(1, k_top + 1), r["per_position_acceptance"], marker="o", color=color, label=head)
    ax.set(title=f"{dataset}, K={k_top}, batch {batch}", xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1))
    ax.legend(fontsize=8)


def plots(results: dict, folder: Path) -> list[str]:
    """Writes the plots into `folder`; their file names."""
    plt = pyplot()
    names = []
    for key, title, fname in CURVES:
        fig, axes = plt.subplots(1, len(PROMPT_SETS), figsize=(10, 4), squeeze=False)
        for ax, dataset in zip(axes[0], PROMPT_SETS):
            curve_axis(ax, results, dataset, key)
        save(plt, fig, title, folder / fname)
        names.append(fname)
    k_top, batch = max(results["settings"]["ks"]), min(results["settings"]["batches"])
    fig, axes = plt.subplots(1, len(PROMPT_SETS), figsize=(10, 4), squeeze=False)
    for ax, dataset in zip(axes[0], PROMPT_SETS):
        per_position_axis(ax, results, dataset, batch, k_top)
    save(plt, fig, "per-position acceptance", folder / "per_position_acceptance.png")
    return names + ["per_position_acceptance.png"]

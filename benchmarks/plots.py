"""PNG plots of the measured benchmark results (median bars, min-max whiskers).

    python benchmarks/plots.py --results /tmp/mcore_dpo_bench --img docs/img

Reads ref_cost.json, vs_trl.json, dp_scaling.json and vpp_measured.json from --results
(whichever exist; `--results docs/results` draws docs/img/vpp_measured.png from the recorded
file). The simulated reference-cost plot is written by `ref_cost.py --plot`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _bars(ax, labels: list[str], stats: list[dict], *, ylabel: str, title: str) -> None:
    medians = [s["median"] for s in stats]
    low = [s["median"] - s["min"] for s in stats]
    high = [s["max"] - s["median"] for s in stats]
    ax.bar(labels, medians, yerr=[low, high], capsize=4, color="#4c78a8")
    for x, (m, top) in enumerate(zip(medians, (s["max"] for s in stats))):
        ax.annotate(f"{m:.0f}" if m >= 100 else f"{m:.2f}", (x, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)


def _vpp(plt, cells: list[dict], path: Path) -> None:
    """benchmarks/vpp.py --measure: step time against --vpp 1 per mode, measured (median, per-round
    min-max) beside the simulated ratio with the measured op costs and the ratio of the busier
    rank's CPU seconds per step, over the microbatch count."""
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    fig, axes = plt.subplots(1, len(modes), figsize=(3.4 * len(modes), 3.4), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for v, colour in ((2, "#4c78a8"), (4, "#f58518")):
            sub = sorted((c for c in cells if c["mode"] == mode and c["vpp"] == v and "vs_vpp1" in c),
                         key=lambda c: c["m"])
            if not sub:
                continue
            ms = [c["m"] for c in sub]
            low = [c["vs_vpp1"] - c["round_vs_vpp1"]["min"] for c in sub]
            high = [c["round_vs_vpp1"]["max"] - c["vs_vpp1"] for c in sub]
            ax.errorbar(ms, [c["vs_vpp1"] for c in sub], yerr=[[max(x, 0) for x in low], [max(x, 0) for x in high]],
                        fmt="o-", color=colour, capsize=3, label=f"vpp {v} measured")
            key = "simulated_vs_vpp1_measured" if "simulated_vs_vpp1_measured" in sub[0] else "simulated_vs_vpp1_unit"
            ax.plot(ms, [c[key] for c in sub], "--", color=colour, alpha=0.7, label=f"vpp {v} simulated")
            if "cpu_vs_vpp1" in sub[0]:
                ax.plot(ms, [c["cpu_vs_vpp1"] for c in sub], "x:", color=colour, alpha=0.8,
                        label=f"vpp {v} CPU s, busier rank")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c["m"] for c in cells}), [str(m) for m in sorted({c["m"] for c in cells})])
        ax.set_title(mode, fontsize=9)
        ax.set_xlabel("microbatches")
    axes[0][0].set_ylabel("step time / vpp 1 (pp 2, CPU)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="/tmp/mcore_dpo_bench")
    parser.add_argument("--img", default="docs/img")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, img = Path(args.results), Path(args.img)
    img.mkdir(parents=True, exist_ok=True)
    written = []
    if (results / "ref_cost.json").exists():
        modes = json.loads((results / "ref_cost.json").read_text())["measured"]["modes"]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        _bars(ax, list(modes), [m["step_time_s"] for m in modes.values()], ylabel="step time (s)",
              title="CPU, tp 1, pp 2, 8 microbatches (balanced stages): step time by mode")
        fig.tight_layout()
        written.append(img / "ref_cost_measured.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    panels = []
    if (results / "vs_trl.json").exists():
        pairs = json.loads((results / "vs_trl.json").read_text())["pairs"]
        labels, stats = [], []
        for mode, p in pairs.items():
            labels += [f"ours\n{mode}", f"TRL\n{'precompute' if mode == 'precomputed' else 'per batch'}"]
            stats += [p["ours_tokens_per_s"], p["trl_tokens_per_s"]]
        panels.append((labels, stats, "vs TRL DPOTrainer (tp=pp=dp=1)"))
    if (results / "dp_scaling.json").exists():
        dps = json.loads((results / "dp_scaling.json").read_text())["dp"]
        panels.append(([f"dp {d}" for d in dps], [e["tokens_per_s"] for e in dps.values()], "data-parallel scaling"))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
        for ax, (labels, stats, title) in zip(axes[0], panels):
            _bars(ax, labels, stats, ylabel="tokens/s", title=title)
        fig.tight_layout()
        written.append(img / "throughput.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if (results / "vpp_measured.json").exists():
        written.append(img / "vpp_measured.png")
        _vpp(plt, json.loads((results / "vpp_measured.json").read_text())["cells"], written[-1])
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()

"""PNG curves of a run from its metrics.jsonl: loss, rewards/accuracies, rewards/margins,
tokens/s and each objective's own (objective/registry.py) against the step, each with its eval/
counterpart drawn on the same axes (as markers) where the run has one, plus an overview of them
all. The last step's tokens/s of an interleaved run is left out (it computes no next-batch
reference, so it spikes; docs/GUIDE.md).

    python -m mcore_dpo.plot RUN_DIR          # writes RUN_DIR/plots/*.png

Bad input (no such directory, no or empty metrics.jsonl, a line that is not a JSON object
with an integer "step") ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# (metric key, file stem, axis label); eval curves use "eval/" + key.
CURVES: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss", "loss"),
    ("rewards/accuracies", "rewards_accuracies", "reward accuracy"),
    ("rewards/margins", "rewards_margins", "reward margin"),
    ("tokens/s", "tokens_per_s", "tokens/s"),
)


class PlotError(ValueError):
    """Unusable run directory or metrics file; str() is one line naming the file (and line)."""


def read_metrics(path: Path) -> list[dict]:
    """Records of metrics.jsonl in file order; blank lines are allowed, anything else not a
    JSON object with an integer "step" is an error naming the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlotError(f"{path}: not found (is this a run directory?)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PlotError(f"{path}: cannot read ({error})") from None
    records = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PlotError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise PlotError(f"{path}:{line_number}: missing or non-integer 'step'")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: no metrics records (empty file)")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; records without it are left out, non-numbers are NaN
    (a gap in the curve)."""
    steps, values = [], []
    for record in records:
        if key not in record:
            continue
        value = record[key]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        steps.append(record["step"])
        values.append(float(value) if is_number else math.nan)
    return steps, values


def plot_run(run_dir: str) -> list[str]:
    """Write RUN_DIR/plots/<metric>.png for each curve the run has, and overview.png; returns
    the paths written."""
    directory = Path(run_dir)
    if not directory.is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    records = _without_uneven_throughput(read_metrics(directory / "metrics.jsonl"), directory)
    present = [c for c in _curves() if series(records, c[0])[0] or series(records, "eval/" + c[0])[0]]
    if not present:
        names = ", ".join(c[0] for c in CURVES)
        raise PlotError(f"{directory / 'metrics.jsonl'}: none of the plotted metrics ({names}) appear in it")

    import matplotlib

    matplotlib.use("Agg")  # files only; no display on clusters and CI
    import matplotlib.pyplot as plt

    out_dir = directory / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for key, stem, label in present:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        _draw(ax, records, key=key, label=label)
        ax.set_title(f"{label} ({directory.name})")
        path = out_dir / f"{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))

    columns = 2
    rows = (len(present) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(11, 3.6 * rows), squeeze=False)
    for ax, (key, _stem, label) in zip(axes.flat, present):
        _draw(ax, records, key=key, label=label)
        ax.set_title(label)
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    fig.suptitle(directory.name)
    fig.tight_layout()
    path = out_dir / "overview.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(str(path))
    return written


def _curves() -> list[tuple[str, str, str]]:
    """CURVES, then each objective's own (objective/registry.py), once per metric."""
    from mcore_dpo.objective.registry import OBJECTIVES

    curves = list(CURVES)
    for entry in OBJECTIVES.values():
        curves += [c for c in entry.curves if c[0] not in {k for k, _, _ in curves}]
    return curves


def _without_uneven_throughput(records: list[dict], directory: Path) -> list[dict]:
    """The records, without tokens/s of the run's last step when the reference forward of the
    next batch runs inside each step (--ref-mode interleaved, the default): the last step has
    no next batch, so it does a reference forward less and its tokens/s spikes. Read from the
    run's config.yaml; without one, nothing is left out."""
    try:
        import yaml

        config = yaml.safe_load((directory / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, ValueError, ImportError):
        return records
    if not isinstance(config, dict) or config.get("ref_mode", "interleaved") != "interleaved":
        return records
    last = config.get("max_steps")
    return [{k: v for k, v in r.items() if not (k == "tokens/s" and r["step"] == last)} for r in records]


def _draw(ax, records: list[dict], *, key: str, label: str) -> None:
    from matplotlib.ticker import MaxNLocator

    steps, values = series(records, key)
    if steps:
        ax.plot(steps, values, label="train", linewidth=1.2)
    eval_steps, eval_values = series(records, "eval/" + key)
    if eval_steps:
        # Evaluations are sparse points, not a curve: markers, joined by a faint line only.
        ax.plot(eval_steps, eval_values, label="eval", marker="o", markersize=6, linestyle=":", linewidth=0.8)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    if steps and eval_steps:
        ax.legend()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("error: usage: python -m mcore_dpo.plot RUN_DIR", file=sys.stderr)
        return 2
    try:
        paths = plot_run(args[0])
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

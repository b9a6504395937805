"""mcore_dpo.plot: PNG curves from a synthetic metrics.jsonl, and one-line errors (exit 2)
for unusable run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import pytest

from mcore_dpo.plot import PlotError, main, plot_run, read_metrics, series
from tests.helpers.cli import run_python

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, steps: int = 20, eval_every: int = 10, with_tokens: bool = True) -> Path:
    """A metrics.jsonl shaped like the driver's: step 0 holds eval/ metrics only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "eval/loss": 0.6931, "eval/rewards/accuracies": 0.0, "eval/rewards/margins": 0.0}]
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "loss": 0.6931 * math.exp(-0.05 * step),
            "rewards/accuracies": min(1.0, 0.5 + 0.03 * step),
            "rewards/margins": 0.02 * step,
            "grad_norm": 1.0 / step,
        }
        if with_tokens:
            record["tokens/s"] = 1000.0 + 10 * step
        if step % eval_every == 0:
            record.update({"eval/loss": 0.69 - 0.01 * step, "eval/rewards/accuracies": 0.6, "eval/rewards/margins": 0.1})
        lines.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def test_plot_run_writes_one_png_per_curve_and_an_overview(tmp_path: Path):
    run_dir = write_run(tmp_path / "run")
    paths = plot_run(str(run_dir))
    names = sorted(Path(p).name for p in paths)
    assert names == ["loss.png", "overview.png", "rewards_accuracies.png", "rewards_margins.png", "tokens_per_s.png"]
    for path in paths:
        assert Path(path).parent == run_dir / "plots"
        assert Path(path).read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0.01  # something was drawn, not a blank canvas


def test_missing_metric_gets_no_plot(tmp_path: Path):
    paths = plot_run(str(write_run(tmp_path / "run", with_tokens=False)))
    assert "tokens_per_s.png" not in {Path(p).name for p in paths}
    assert "loss.png" in {Path(p).name for p in paths}


def test_series_keeps_steps_of_the_metric_only(tmp_path: Path):
    records = read_metrics(write_run(tmp_path / "run", steps=20, eval_every=10) / "metrics.jsonl")
    steps, values = series(records, "loss")
    assert steps == list(range(1, 21))
    assert values[0] == pytest.approx(0.6931 * math.exp(-0.05))
    eval_steps, eval_values = series(records, "eval/loss")
    assert eval_steps == [0, 10, 20]
    assert eval_values == pytest.approx([0.6931, 0.59, 0.49])


def test_non_numbers_become_gaps(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.7}\n{"step": 2, "loss": NaN}\n{"step": 3, "loss": "x"}\n')
    steps, values = series(read_metrics(run_dir / "metrics.jsonl"), "loss")
    assert steps == [1, 2, 3] and values[0] == 0.7 and math.isnan(values[1]) and math.isnan(values[2])
    assert [Path(p).name for p in plot_run(str(run_dir))] == ["loss.png", "overview.png"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "metrics.jsonl: not found"),
        ("", "no metrics records (empty file)"),
        ("\n\n", "no metrics records (empty file)"),
        ('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": \n', "metrics.jsonl:2: not valid JSON"),
        ('[1, 2]\n', "metrics.jsonl:1: expected a JSON object, got list"),
        ('{"loss": 0.5}\n', "metrics.jsonl:1: missing or non-integer 'step'"),
        ('{"step": "3", "loss": 0.5}\n', "metrics.jsonl:1: missing or non-integer 'step'"),
        ('{"step": 1, "grad_norm": 0.5}\n', "none of the plotted metrics"),
    ],
)
def test_bad_metrics_raise_one_line_errors(tmp_path: Path, content: str | None, expected: str):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if content is not None:
        (run_dir / "metrics.jsonl").write_text(content)
    with pytest.raises(PlotError) as info:
        plot_run(str(run_dir))
    assert expected in str(info.value)
    assert "\n" not in str(info.value)
    assert not (run_dir / "plots").exists() or not any((run_dir / "plots").iterdir())


def test_cli_bad_input_is_one_stderr_line_and_exit_2(tmp_path: Path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run directory" in err
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_cli_module_writes_plots(tmp_path: Path):
    run_dir = write_run(tmp_path / "run")
    result = run_python(["-m", "mcore_dpo.plot", str(run_dir)], timeout=120)
    assert result.returncode == 0, result.stderr
    assert (run_dir / "plots" / "loss.png").is_file()
    assert str(run_dir / "plots" / "overview.png") in result.stdout.splitlines()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text("{not json\n")
    result = run_python(["-m", "mcore_dpo.plot", str(broken)], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "metrics.jsonl:1: not valid JSON" in result.stderr

"""What a run prints and plots: a first line that says what starts, megatron-core's known-harmless
warnings filtered (and only those), one number format, an ETA without the first step's warm-up,
`verify` printing its result line only, plots that show evaluations as markers and leave out
the last step's uneven throughput, and output streams whose reader went away (driver/console.py)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

from mcore_dpo.driver import console, metrics_log, ray_workers, run
from mcore_dpo.parallel import platform
from mcore_dpo.train import main
from tests.helpers.cli import REPO, command_env, run_python


def test_known_harmless_warnings_are_named_justified_and_the_only_ones_filtered():
    names = [name for name, *_ in platform.KNOWN_HARMLESS_WARNINGS]
    assert len(set(names)) == len(names)
    assert all(len(why) > 40 for *_, why in platform.KNOWN_HARMLESS_WARNINGS)
    seen = [  # as megatron-core 0.16 and torch 2.13 word them
        ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning),
        ("Apex is not installed. Falling back to Torch Norm", UserWarning),
        ("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", UserWarning),
        ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
         "`torch.distributed.reduce_scatter_single` instead.", FutureWarning),
        ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
         "`torch.distributed.all_gather_single` instead.", FutureWarning),
        ("When using async grad allreduce it is recommended to set the environment variable "
         "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning),
    ]
    others = [("Transformer Engine is slow today", UserWarning), ("full scope is deprecated.", DeprecationWarning),
              ("`torch.distributed.broadcast` is deprecated.", FutureWarning)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        platform.quiet_known_warnings()
        for message, category in seen + others:
            warnings.warn(message, category)
    assert [str(w.message) for w in caught] == [message for message, _ in others]


def test_numbers_keep_one_format_and_the_eta_leaves_out_the_first_step(monkeypatch, tmp_path, capsys):
    assert metrics_log.format_value("loss", 0) == "0.0000"
    assert metrics_log.format_value("rewards/accuracies", 0.5) == "0.5000"
    assert metrics_log.format_value("loss", 123456.0) == "123456.0000"  # never 1.235e+05
    assert metrics_log.format_value("tokens/s", 15712.6) == "15713"
    assert [metrics_log.format_duration(s) for s in (0, 59.4, 61, 3725)] == ["0s", "59s", "1m01s", "1h02m"]
    clock = iter([100.0, 101.0, 102.0])  # step 1 ends after a 100 s warm-up; then 1 s a step
    monkeypatch.setattr(metrics_log.time, "monotonic", lambda: next(clock))
    log = metrics_log.MetricsLog(tmp_path, total_steps=10)
    for step in (1, 2, 3):
        log.write(step, {"loss": 0.5, "tokens/s": 1000.0})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("eta ?") and lines[2].endswith("eta 7s"), lines  # 7 steps left at 1 s each
    assert lines[1] == "step 2/10 loss=0.5000 tokens/s=1000 eta 8s"
    assert not any("\x1b" in line for line in lines)  # not a terminal: plain lines


def test_a_stop_message_starts_its_own_line_after_a_terminal_progress_line(monkeypatch, tmp_path, capsys):
    import io
    import signal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    log = metrics_log.MetricsLog(tmp_path, total_steps=10)
    log.write(1, {"loss": 0.5, "tokens/s": 1000.0})
    assert not terminal.getvalue().endswith("\n")  # the progress line stays open for its next update
    stop = run._StopRequest(before_print=log.end_line)
    try:
        stop._handle(signal.SIGINT, None)
    finally:
        stop.restore()
    assert terminal.getvalue().endswith("\n")  # ended before the message went out
    assert capsys.readouterr().out == "SIGINT: stopping after this step (a checkpoint is written first)\n"
    log.close()
    assert not terminal.getvalue().endswith("\n\n")  # closing adds no second newline


def test_the_first_line_says_what_starts_and_what_is_loaded(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray_workers, "connect", lambda **_: False)
    monkeypatch.setattr(ray_workers, "disconnect", lambda started: None)
    monkeypatch.setattr(run, "_attempt", lambda prep, *, out, log: None)
    assert main(["--tp", "2", "--pp", "2", "--max-steps", "1", "--output-dir", str(tmp_path / "run")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("preparing 4 workers (tp 2 x pp 2 x dp 1) on a local Ray cluster; "
                     "loading the tiny default model and the default preference data")


def test_verify_prints_its_result_and_nothing_else(tmp_path):
    from checkpoint_convert.__main__ import main as convert
    from mcore_dpo.driver import defaults

    model = defaults.ensure_default_model()
    assert convert(["hf-to-mcore", "--hf-dir", model, "--out", str(tmp_path / "m")]) == 0
    env = command_env(PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    done = run_python(["-m", "checkpoint_convert", "verify", "--hf-dir", model, "--mcore-dir", str(tmp_path / "m")],
                      cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [done.stdout.strip()] and done.stdout.startswith("verify tp=1 pp=1: max |dlogit| ")
    assert "Warning" not in done.stderr and "\r" not in done.stderr, done.stderr[-3000:]
    # its progress goes to stderr, one line per phase
    assert [line.split(" ")[1] for line in done.stderr.splitlines()] == ["building", "megatron", "HF"], done.stderr


def _run_dir(tmp_path: Path, *, ref_mode: str) -> Path:
    out = tmp_path / ref_mode
    out.mkdir()
    rows = [{"step": 0, "eval/loss": 0.69}] + [{"step": s, "loss": 0.7 - s / 100, "tokens/s": 1000.0 + (900 * (s == 4))}
                                               for s in range(1, 5)]
    rows[-1]["eval/loss"] = 0.6
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "config.yaml").write_text(f"max_steps: 4\nref_mode: {ref_mode}\n")
    return out


@pytest.mark.parametrize("ref_mode", ["interleaved", "sequential"])
def test_plots_leave_out_the_last_interleaved_steps_throughput_and_mark_evaluations(tmp_path, monkeypatch, ref_mode):
    from mcore_dpo import plot

    drawn = {}
    original = plot._draw

    def spy(ax, records, *, key, label):
        original(ax, records, key=key, label=label)
        drawn[key] = {line.get_label(): (list(line.get_xdata()), line.get_marker()) for line in ax.get_lines()}

    monkeypatch.setattr(plot, "_draw", spy)
    plot.plot_run(str(_run_dir(tmp_path, ref_mode=ref_mode)))
    assert drawn["tokens/s"]["train"][0] == ([1, 2, 3] if ref_mode == "interleaved" else [1, 2, 3, 4])
    assert drawn["loss"]["train"][0] == [1, 2, 3, 4]
    assert drawn["loss"]["eval"] == ([0, 4], "o")


def test_the_first_line_comes_before_the_slow_imports(tmp_path):
    """The command line says what starts before torch, megatron-core, transformers or Ray load
    (they take seconds): the first print sees none of them imported."""
    probe = (
        "import builtins, os, sys\n"
        "from mcore_dpo.train import main\n"
        "def first(*args, **kwargs):\n"
        "    heavy = [m for m in ('torch', 'megatron.core', 'transformers', 'ray') if m in sys.modules]\n"
        "    sys.stdout.write(' '.join(map(str, args)) + '\\n' + 'loaded: ' + ','.join(heavy) + '\\n')\n"
        "    sys.stdout.flush()\n"
        "    os._exit(0)\n"
        "builtins.print = first\n"
        f"main(['--tp', '2', '--max-steps', '1', '--output-dir', {str(tmp_path / 'run')!r}])\n"
    )
    done = run_python(["-c", probe], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, loaded = done.stdout.splitlines()[:2]
    assert first.startswith("preparing 2 workers (tp 2 x pp 1 x dp 1) on a local Ray cluster"), first
    assert loaded == "loaded: ", loaded
    assert not (tmp_path / "run").exists()


def test_a_stream_whose_reader_went_away_takes_every_write_and_other_errors_still_raise(tmp_path):
    """The wrapped stream of a pipe whose reading end is closed: the write that meets EPIPE, the
    text buffered before it and every later write succeed (the descriptor now points at
    /dev/null); an error that is not EPIPE or EIO (a full disk) still raises."""
    import errno

    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = console._Survivor(os.fdopen(write_end, "w", encoding="utf-8", buffering=1))
    try:
        assert stream.write("buffered, then the pipe breaks\n") > 0
        stream.flush()
        assert os.path.samefile(f"/proc/self/fd/{write_end}", os.devnull)
        print("a later line", file=stream, flush=True)
    finally:
        stream.close()

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as caught:
        console._Survivor(FullDisk()).write("x")
    assert caught.value.errno == errno.ENOSPC


def test_the_run_log_keeps_the_lines_before_the_run_directory_and_appends(tmp_path):
    shown = []
    log = console.RunLog(shown.append)
    log("first")
    log.note("the file only")
    log.open(tmp_path)
    log("after")
    assert shown == ["first", "after"]
    assert (tmp_path / console.LOG_FILE).read_text() == "first\nthe file only\nafter\n"
    again = console.RunLog(shown.append)  # a resumed run adds to the same file
    again.open(tmp_path)
    again("resumed")
    assert (tmp_path / console.LOG_FILE).read_text().splitlines()[-2:] == ["after", "resumed"]

"""Run output for humans and tools: metrics.jsonl (one object per step), TensorBoard events,
Weights & Biases when asked (`wandb_project`, from --wandb), and a progress display
(a bar on a terminal, plain lines otherwise)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from checkpoint_convert import durable


# What a step must keep finite (as Megatron-LM's --check-for-nan-in-loss-and-grad checks): the
# loss, and the gradient norm the optimizer step used.
FINITE_METRICS = ("loss", "grad_norm")


def first_non_finite(metrics: dict, *, keys: tuple[str, ...] = FINITE_METRICS) -> tuple[str, float] | None:
    """(name, value) of the first of `keys` in `metrics` that is NaN or infinite, else None."""
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return key, float(value)
    return None


class MetricsLog:
    def __init__(self, out_dir: Path, *, total_steps: int, keep_up_to_step: int = 0, wandb_project: str | None = None,
                 run_config: dict | None = None, note=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self._start(keep_up_to_step)
        self.total_steps = total_steps
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))
        except Exception as error:  # tensorboard is optional at run time
            print(f"tensorboard: disabled ({error})", file=sys.stderr)
        self._wandb = None
        if wandb_project is not None:  # only when asked (--wandb), whatever the environment holds
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(out_dir), config=run_config)
        self._tty = sys.stderr.isatty()
        self._line_open = False  # a terminal's progress line waits for its next update (no newline yet)
        self._note = note  # each progress line, also as a plain line (the run's log file)
        self._timed_from: tuple[int, float] | None = None  # (step, time) the ETA counts from

    def _eta(self, step: int) -> str:
        """Time left at the pace of the steps after this process's first one: the first step
        carries the warm-up (allocation, first reference forwards), so it is left out."""
        now = time.monotonic()
        if self._timed_from is None:
            self._timed_from = (step, now)
        first_step, first_time = self._timed_from
        if step == first_step:
            return "?" if step < self.total_steps else format_duration(0)
        return format_duration((now - first_time) / (step - first_step) * (self.total_steps - step))

    def _start(self, keep_up_to_step: int) -> None:
        """On resume, drop the lines of steps after the checkpoint (they will run again): the
        kept lines go to a new file renamed over the old one, so a kill leaves one or the other.
        Without a checkpoint the run starts over: an earlier metrics.jsonl is renamed to the
        first free metrics.jsonl.N, never emptied."""
        if not self.path.is_file():
            return
        if keep_up_to_step <= 0:
            if self.path.stat().st_size > 0:
                n = 1
                while self.path.with_name(f"{self.path.name}.{n}").exists():
                    n += 1
                durable.move(self.path, self.path.with_name(f"{self.path.name}.{n}"))
            return
        lines = self.path.read_text().splitlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= keep_up_to_step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a torn last line from a killed run
        if len(kept) < len(lines) or not self.path.read_text().endswith("\n"):
            durable.replace_file(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        self._progress(step, metrics)

    def _progress(self, step: int, metrics: dict[str, float]) -> None:
        if step == 0:
            line = "eval at start: " + _fmt(metrics, ("eval/loss", "eval/rewards/accuracies"))
        else:
            line = (f"step {step}/{self.total_steps} " + _fmt(metrics, ("loss", "rewards/accuracies", "tokens/s"))
                    + f" eta {self._eta(step)}")
            if "eval/rewards/accuracies" in metrics:
                line += " | " + _fmt(metrics, ("eval/loss", "eval/rewards/accuracies"))
        if self._tty:
            width = 24
            done = int(width * step / max(1, self.total_steps))
            sys.stderr.write("\r[" + "#" * done + "." * (width - done) + "] " + line + "\x1b[K")
            self._line_open = step != self.total_steps
            if not self._line_open:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            print(line, flush=True)
        if self._note is not None:
            self._note(line)

    def end_line(self) -> None:
        """End a terminal's open progress line, so that what is printed next starts a line of its own."""
        if self._line_open:
            self._line_open = False
            sys.stderr.write("\n")
            sys.stderr.flush()

    def close(self) -> None:
        self.end_line()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value):
    return float(value) if isinstance(value, (int, float)) else value


def format_value(key: str, value) -> str:
    """One format per kind of number, whatever its size: counts and rates as integers,
    everything else with four decimals."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if key.endswith("tokens/s") else f"{value:.4f}"


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _fmt(metrics: dict[str, float], keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={format_value(k, metrics[k])}" for k in keys if k in metrics)

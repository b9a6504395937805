"""What the command-line parity tests of an objective share (tests/test_reward_parity.py,
tests/helpers/trl_parity.py): text pairs of the parity tokenizer's words, the parity tests'
optimizer settings and the command line of a short fp32 run with them."""

from __future__ import annotations

import random
from pathlib import Path

# tests/test_parity_losses.py's optimizer settings
LR, CLIP, WD, ADAM_EPS = 1e-3, 1.0, 0.1, 1e-4


def text_pairs(num: int, *, seed: int) -> list[dict]:
    """Text pairs of the parity tokenizer's words (w3..w99): 1-8 prompt words, 1-8 words per completion."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(3, 100)}" for _ in range(n))

    return [{"prompt": words(rng.randint(1, 8)), "chosen": " " + words(rng.randint(1, 8)),
             "rejected": " " + words(rng.randint(1, 8))} for _ in range(num)]


def run_argv(*, model: Path, data: Path, out: Path, objective: str, layout: tuple[int, ...], steps: int,
             global_batch: int, micro_batch: int, adam_eps: float = ADAM_EPS) -> list[str]:
    """A short fp32 run of `objective` at `layout` (tp, pp, dp) or (tp, pp, dp, ep) in file order,
    exported to OUTPUT/hf, with no evaluation and no checkpoint but the last step's."""
    tp, pp, dp, *ep = layout
    return ["--model", str(model), "--data", str(data), "--output-dir", str(out), "--objective", objective,
            "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--ep", str(ep[0] if ep else 1), "--no-shuffle",
            "--max-steps", str(steps), "--global-batch-size", str(global_batch), "--micro-batch-size",
            str(micro_batch), "--dtype", "float32", "--lr", str(LR), "--adam-eps", str(adam_eps), "--clip-grad",
            str(CLIP), "--weight-decay", str(WD), "--eval-interval", "0", "--save-interval", "0",
            "--save-interval-min", "0", "--export-hf"]

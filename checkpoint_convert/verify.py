"""`verify`: run the HF model and the Megatron checkpoint on the same token ids and compare logits.

This module is the converter's side: the random token batch, the HF logits, the comparison and
the report. The Megatron side, building the checkpoint's model at its own tp x pp, loading its
shards and running the forward, belongs to a trainer, so it is a *runner* that this package
finds and never imports by name. A runner is a callable

    runner(mcore_dir: Path, tokens: torch.Tensor, *, hf_config_dir: Path) -> torch.Tensor

given the checkpoint directory (either format), the token ids [batch, seq] (int64) and the HF
directory whose config.json reads a torch_dist checkpoint that carries none of its own; it
returns fp32 logits [batch, seq, vocab_size] (the unpadded vocabulary), computed on the CPU so
that the comparison measures the conversion, not the precision. A runner may carry a `check`
attribute, `check(mcore_dir, *, hf_config_dir)`, that raises ConversionError for a checkpoint it
cannot run: verify calls it before the runner starts anything. Any other failure of the runner
or of the HF side is one line too (ConversionError). `find_runner` takes, in order:

1. the runner registered in this process with `register_runner` (in-process callers, tests);
2. the first entry point, by name, of the group `checkpoint_convert.megatron_runners` that
   loads (mcore_dpo registers `mcore_dpo.tools.verify_runner:megatron_logits` there, setup.py);

and without one, verify stops with one line that says to install mcore_dpo.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

import torch

from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir

RUNNER_GROUP = "checkpoint_convert.megatron_runners"
NO_RUNNER = "verify needs a Megatron model runner; install mcore_dpo alongside checkpoint_convert"


class MegatronRunner(Protocol):
    def __call__(self, mcore_dir: Path, tokens: torch.Tensor, *, hf_config_dir: Path) -> torch.Tensor: ...


def _one_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


_registered: MegatronRunner | None = None


def register_runner(runner: MegatronRunner | None) -> MegatronRunner | None:
    """Make `runner` the one verify uses in this process, ahead of any entry point (None: back to
    the entry points). Returns the runner registered before, so a caller can put it back."""
    global _registered
    previous, _registered = _registered, runner
    return previous


def find_runner() -> MegatronRunner:
    """The registered runner, else the first entry point of RUNNER_GROUP (by name) that loads;
    raises ConversionError (one line, NO_RUNNER) when there is none."""
    if _registered is not None:
        return _registered
    failed = []
    for entry in sorted(entry_points(group=RUNNER_GROUP), key=lambda e: e.name):
        try:
            return entry.load()
        except ImportError as error:  # installed metadata, but the package is not importable here
            failed.append(f"{entry.value}: {error}")
    raise ConversionError(NO_RUNNER + (f" (could not import {'; '.join(failed)})" if failed else ""))


@dataclass(frozen=True)
class VerifyReport:
    max_abs_diff: float  # largest |logit_hf - logit_mcore| over the batch
    argmax_agreement: float  # fraction of positions whose argmax token agrees
    num_positions: int
    tp: int
    pp: int

    def passes(self, *, atol: float) -> bool:
        return self.max_abs_diff <= atol and self.argmax_agreement == 1.0

    def summary(self) -> str:
        return (
            f"verify tp={self.tp} pp={self.pp}: max |dlogit| {self.max_abs_diff:.3e}, "
            f"argmax agreement {self.argmax_agreement:.2%} over {self.num_positions} positions"
        )


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # verify prints its result line, not a loading bar
    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            return model(input_ids=tokens).logits.float()
    except Exception as error:  # transformers raises many types here
        raise ConversionError(f"{hf_dir}: transformers cannot run the HF model ({_one_line(error)})") from None


def _same_model(hf_spec, mcore_spec) -> bool:
    ignore = {"torch_dtype"}
    return all(getattr(hf_spec, f.name) == getattr(mcore_spec, f.name) for f in fields(hf_spec) if f.name not in ignore)


def verify(
    hf_dir: str | os.PathLike, mcore_dir: str | os.PathLike, *, batch_size: int = 2, seq_len: int = 16, seed: int = 0,
    log: Callable[[str], None] = print,
) -> VerifyReport:
    """Compare HF logits with Megatron logits on one random batch of token ids; `log` gets a
    line as each phase starts (the inputs are checked, and a runner found, before the first)."""
    hf = open_hf_dir(hf_dir)
    if hf.spec.num_labels:
        raise ConversionError(f"{hf.dir / 'config.json'}: field 'architectures' is {hf.spec.architecture!r}, a reward model; "
                              "verify compares a causal LM's logits")
    # A torch_dist checkpoint without an HF config of its own is read with the HF model's.
    checkpoint = open_mcore_dir(mcore_dir, hf_config_dir=hf.dir)
    meta = checkpoint.meta
    if not _same_model(hf.spec, meta.spec):
        raise ConversionError(f"{checkpoint.dir}: hf_config describes a different model than {hf.dir / 'config.json'}")
    if batch_size < 1 or not 1 <= seq_len <= meta.spec.max_position_embeddings:
        raise ConversionError(
            f"verify: --seq-len must be in [1, {meta.spec.max_position_embeddings}] and --batch-size >= 1"
        )
    runner = find_runner()
    check = getattr(runner, "check", None)
    if check is not None:  # the runner's refusals, before it starts its ranks
        check(Path(checkpoint.dir), hf_config_dir=Path(hf.dir))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, meta.spec.vocab_size, (batch_size, seq_len), generator=generator)
    world_size = meta.tp * meta.pp
    started = time.monotonic()
    log(f"verify: building the megatron model at tp={meta.tp} pp={meta.pp} from {checkpoint.dir} "
        f"({world_size} CPU rank{'s' if world_size > 1 else ''}) and running {batch_size} x {seq_len} random tokens")
    try:
        mcore_logits = runner(Path(checkpoint.dir), tokens, hf_config_dir=Path(hf.dir))
    except ConversionError:
        raise
    except Exception as error:  # a runner's own bug or an I/O failure: one line, no traceback
        raise ConversionError(f"verify: the megatron runner failed on {checkpoint.dir} ({_one_line(error)})") from None
    log(f"verify: megatron logits done ({time.monotonic() - started:.1f} s); loading the HF model from {hf.dir}")
    started = time.monotonic()
    hf_logits = _hf_logits(hf.dir, tokens)
    log(f"verify: HF logits done ({time.monotonic() - started:.1f} s); comparing logits")
    if mcore_logits.shape != hf_logits.shape:
        raise ConversionError(
            f"verify: logits shapes differ (hf {list(hf_logits.shape)}, megatron {list(mcore_logits.shape)})"
        )
    diff = (hf_logits - mcore_logits).abs().max().item()
    agreement = (hf_logits.argmax(-1) == mcore_logits.argmax(-1)).float().mean().item()
    return VerifyReport(
        max_abs_diff=diff, argmax_agreement=agreement, num_positions=tokens.numel(), tp=meta.tp, pp=meta.pp
    )

"""Where a policy rank's reference log-probs come from, and every piece of state that keeps them.

One object per policy rank, given to the step, the evaluator and the checkpointer:

- the reference model of this rank's layers (`model`): a frozen shard, the policy's
  adapter-off view (LoRA), the shard TR-DPO moves toward the policy, or None (a reference
  group of its own, `--ref-mode separate`; after `precompute`; reference-free runs);
- interleaved runs: the next batch's log-probs computed in this step's bubbles, whether they
  are ready for the next step, and the reference activations this stage carries into it;
- `--ref-mode precomputed`: the log-prob tables of the data set and of the held-out pairs.

`rows` answers "the reference log-probs of these pairs" for the loss, whichever of these holds
them; `open_step` / `close_step` hand the carried state to a step's executor context and take
it back.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_dpo.checkpoint import reference_tables
from mcore_dpo.objective.logprobs import SequenceLogps, table_rows


@dataclass(frozen=True)
class StepReference:
    """What one step's plan computes of the reference."""

    plan_mode: str  # the plan's ref_mode ("none" when nothing runs in the plan)
    current: bool  # this batch's reference forwards (the first interleaved step, after a restart)
    next: bool  # the next batch's reference forwards, in this step's bubbles


class ReferenceSource:
    """The reference side of one policy rank (module docstring)."""

    def __init__(self, *, model: torch.nn.Module | None, ref_mode: str, device: torch.device):
        self.model = model
        self.ref_mode = ref_mode
        self.device = device
        self._next: dict[int, SequenceLogps] = {}  # the next batch's reference, by microbatch
        self._next_ready = False  # whether the last step computed it (the same on every stage)
        self.carried = False  # whether the last step's plan carried reference forwards into the next
        self._kept_acts: dict[int, torch.Tensor] = {}  # the reference activations this stage carries
        self.table: torch.Tensor | None = None  # precomputed: [num_pairs, 2] on the last stage
        self.eval_table: torch.Tensor | None = None  # the same for the held-out pairs

    # ------------------------------------------------------------------ the step
    def plan(self, *, has_next_batch: bool, sync_now: bool) -> StepReference:
        """The reference forwards of this step's plan. TR-DPO: a step that ends with a reference
        sync does not compute the next batch's reference (it would be the old one); the next
        step computes it, as the first step does."""
        if self.model is None:
            return StepReference(plan_mode="none", current=False, next=False)
        if self.ref_mode != "interleaved":
            return StepReference(plan_mode=self.ref_mode, current=False, next=False)
        return StepReference(plan_mode="interleaved", current=not self._next_ready,
                             next=has_next_batch and not sync_now)

    def stored(self, mb: int) -> SequenceLogps | None:
        """The log-probs of this batch's microbatch `mb` that the previous step computed."""
        return self._next.get(mb)

    def open_step(self, *, computed: dict[tuple[int, int], SequenceLogps]) -> dict:
        """What this step's executor context starts from (its `kept_in` and `ref_logps`): the
        activations carried in, this batch's log-probs computed last step (batch offset 0), and
        any computed by a pass before the plan (`computed`, the pre-pass)."""
        ref_logps = {(0, mb): logps for mb, logps in self._next.items()}
        ref_logps.update(computed)
        kept_in, self._kept_acts, self._next = self._kept_acts, {}, {}
        return {"kept_in": kept_in, "ref_logps": ref_logps}

    def close_step(self, ctx, *, plan, computed_next: bool) -> None:
        """Keep what the next step needs: the next batch's log-probs (batch offset 1) and the
        activations the plan carries out."""
        self._next = {mb: logps for (offset, mb), logps in ctx.ref_logps.items() if offset == 1}
        self._next_ready = computed_next
        self.carried, self._kept_acts = plan.carry_out, ctx.kept_out

    def rows(self, *, positions: Sequence[int], pair_ids: Sequence[int], given: torch.Tensor | None,
             stored: SequenceLogps | None) -> torch.Tensor | None:
        """Reference summed log-probs of the batch's pairs at `positions` (rows chosen, then
        rejected): from the table a reference group sent (`given`), the precomputed table (by
        data-set index, `pair_ids`), or what the reference forwards computed (`stored`); None
        when the run has no reference."""
        if given is not None:
            return table_rows(given, positions, device=self.device)
        if self.table is not None:
            return table_rows(self.table, [pair_ids[i] for i in positions], device=self.device)
        if stored is None and self.model is not None:  # a plan bug, never a zero reference
            raise RuntimeError(f"reference log-probs of pairs {list(positions)[:3]}... were not computed")
        return stored.logp_sum if stored is not None else None

    # ------------------------------------------------------------------ the rest of the run
    def precompute(self, table_of: Callable[[Sequence], torch.Tensor | None], pairs: Sequence,
                   eval_pairs: Sequence = (), *, mesh=None, table_dir: str | None = None, key: str | None = None,
                   reuse: bool = False) -> None:
        """`--ref-mode precomputed`: the tables of the data set and of the held-out pairs (from a
        forward-only reference pass, `table_of`), then the model is released. With `table_dir`
        the tables live on disk (checkpoint/reference_tables.py): computed and written by the
        reporting rank (`mesh.returns_result`) unless `reuse`, then memory-mapped on the last stage."""
        if not (table_dir and reuse):
            self.table = table_of(pairs)
            self.eval_table = table_of(eval_pairs) if eval_pairs else None
        if table_dir:
            if not reuse:
                if mesh.returns_result:
                    reference_tables.write(table_dir, key=key, train=self.table, eval_table=self.eval_table)
                dist.barrier()  # written before any rank maps them
            if mesh.is_last_stage:
                self.table, self.eval_table = reference_tables.read(table_dir)
        self.release()

    def release(self) -> None:
        self.model = None
        gc.collect()

    @torch.no_grad()
    def sync_toward(self, policy: torch.nn.Module, *, alpha: float) -> None:
        """TR-DPO (TRL 1.16 `SyncRefModelCallback._sync_target_model`): ref <- α·policy + (1-α)·ref,
        parameter by parameter, in the parameters' own dtype. Each rank mixes its own shard."""
        params = dict(policy.named_parameters())
        for name, param in self.model.named_parameters():
            param.mul_(1.0 - alpha).add_(params[name].detach(), alpha=alpha)

    def tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The precomputed tables, for the memory count."""
        return self.table, self.eval_table

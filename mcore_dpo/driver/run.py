"""The driver: check everything that can be checked before any process starts, start the
worker group, feed it global batches, log metrics, export the policy.

    from mcore_dpo.driver.run import train
    train(TrainConfig(tp=2, pp=2, max_steps=10))
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from checkpoint_convert import durable
from checkpoint_convert.mapping import check_layout
from mcore_dpo.checkpoint import layout as checkpoint
from mcore_dpo.checkpoint import reference_tables
from mcore_dpo.driver.outputs import export_adapter, export_policy, save_checkpoint
from mcore_dpo.driver import output_dir
from mcore_dpo.config import TrainConfig, starting_line, world_size, write_resolved
from mcore_dpo.data.mix import Source, parse_sources, weights_of
from mcore_dpo.data.order import StepOrder
from mcore_dpo.data.pairs import data_notes
from mcore_dpo.data.store import TokenStore, open_or_build
from mcore_dpo.data.tokenizer_check import check_tokenizer
from mcore_dpo.driver.metrics_log import MetricsLog, first_non_finite
from mcore_dpo.driver.resume_check import run_identity
from mcore_dpo.driver.run_lock import LockHeld, RunLock
from mcore_dpo import io_errors
from mcore_dpo.objective import registry


class InputError(ValueError):
    """Bad input found before any worker started; str() is one line."""


class Stopped(Exception):
    """SIGINT or SIGTERM stopped the run at a step boundary, after a checkpoint of that step."""

    def __init__(self, step: int):
        super().__init__(f"stopped at step {step}; rerun the same command to resume")
        self.step = step


class Diverged(Exception):
    """A step's loss or gradient norm was not finite; str() is one line naming the step and the
    metric. The step is not checkpointed and nothing is exported."""

    def __init__(self, step: int, metric: str, value: float, *, newest: Path | None):
        kept = f"the newest checkpoint, {newest}, is from before it" if newest else "no checkpoint was written"
        super().__init__(f"step {step}: {metric} is {value} (non-finite); the run stopped without saving this step and "
                         f"{kept} (a lower --lr or --clip-grad, or the data, may be the cause)")
        self.step = step


@dataclass
class Prepared:
    config: TrainConfig
    spec: object
    pad_token_id: int
    sources: list[Source]  # --data, parsed
    train_data: TokenStore  # every source's pairs, source after source (the ranks open it too); .stats per source
    eval_data: TokenStore | None = None
    identity: dict | None = None  # resume_check.run_identity, stored in every checkpoint
    packing_note: str | None = None  # why an unset --packing fell back to padded microbatches
    warnings: list[str] = dataclasses.field(default_factory=list)  # said once the run log is open
    hf_config: dict | None = None  # a score head's run: the reward model's config.json its checkpoints carry


def prepare(config: TrainConfig, *, log=print) -> Prepared:
    """Resolve the defaults and validate model, layout, tokenizer and data; the data tokenized
    into its token store, or the store of an earlier run opened (`log` says which)."""
    from transformers import AutoTokenizer

    from mcore_dpo.driver import defaults
    from checkpoint_convert.families import spec_from_hf_config
    from mcore_dpo.model.builder import open_weights, tokenizer_dir
    from mcore_dpo.model.score_head import reward_config, source_config

    if config.model is None:
        config = replace(config, model=defaults.ensure_default_model())
        if config.data is None:
            config = replace(config, data=defaults.DEFAULT_TRAIN_DATA)
            if config.eval_data is None:
                config = replace(config, eval_data=defaults.DEFAULT_EVAL_DATA)
    if config.data is None:
        raise InputError("data: --data is required when --model is given")
    config.validate()
    warnings: list[str] = []
    if config.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise InputError("wandb: --wandb needs the wandb package (pip install wandb)") from None
    spec = open_weights(config.model).spec
    score_head = registry.build(config).head == "score"
    if spec.num_labels and not score_head:
        raise InputError(f"{os.path.join(config.model, 'config.json')}: field 'architectures' is {spec.architecture!r}, "
                         f"a reward model (score head); --objective reward trains it, {config.objective} a causal LM")
    if spec.num_labels > 1:
        raise InputError(f"{os.path.join(config.model, 'config.json')}: a reward model of {spec.num_labels} labels; "
                         "--objective reward trains one score (1 label)")
    check_layout(spec, tp=config.tp, pp=config.pp, ep=config.ep, source=os.path.join(config.model, "config.json"))
    config.check_moe_grouped_gemm(num_experts=spec.num_experts, source=os.path.join(config.model, "config.json"))
    config.check_recompute(num_layers=spec.num_layers, num_experts=spec.num_experts,
                           source=os.path.join(config.model, "config.json"))
    config.check_virtual_pipeline(num_layers=spec.num_layers, source=os.path.join(config.model, "config.json"))
    config.check_context_parallel(num_experts=spec.num_experts, multi_latent_attention=spec.multi_latent_attention,
                                  family=spec.family, source=os.path.join(config.model, "config.json"))
    config = replace(config, moe_aux_loss_coef=config.resolve_moe_aux_loss_coef(
        num_experts=spec.num_experts, default=spec.router_aux_loss_coef, source=os.path.join(config.model, "config.json")))
    config, packing_note = config.decide_packing()  # off for a mode it does not serve; else the ranks decide
    if config.lora:
        config = _resolve_lora(config, spec)
    if config.ref_model and config.ref_mode != "none":
        ref_spec = open_weights(config.ref_model).spec
        if replace(ref_spec, torch_dtype=spec.torch_dtype) != spec:
            raise InputError(f"ref_model: {config.ref_model} has a different architecture than {config.model}")
    tok_dir = config.tokenizer or tokenizer_dir(config.model)
    if not os.path.isdir(tok_dir):
        raise InputError(f"{config.model}: holds no tokenizer files; pass --tokenizer DIR")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=config.trust_remote_code)
    except Exception as error:  # transformers raises many types here
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        detail = detail if len(detail) <= 300 else detail[:297] + "..."
        raise InputError(f"{tok_dir}: cannot load the tokenizer ({detail})") from None
    if config.chat_template:
        _use_chat_template(tokenizer, config.chat_template)
    sources = parse_sources(config.data)
    check_tokenizer(tokenizer, tokenizer_dir=tok_dir, data_paths=[s.path for s in sources] + [config.eval_data],
                    vocab_size=spec.vocab_size, warn=warnings.append)  # reads a data sample back, before tokenizing
    if len(tokenizer) > spec.vocab_size:
        raise InputError(
            f"{tok_dir}: tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size {spec.vocab_size}"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise InputError(f"{tok_dir}: tokenizer has neither a pad nor an eos token")
    hf_config = None
    if score_head:  # the reward model's config: its rows end before the run's pad token
        hf_config, _ = reward_config(source_config(config.model), pad_token_id=int(pad), seed=config.seed)
        spec = spec_from_hf_config(hf_config)
    # The token stores (data/store.py): tokenized here once, by --data-workers processes, then
    # opened by every later run and by the ranks, which read their own rows.
    whole_rows = registry.OBJECTIVES[config.objective].whole_rows
    stores = dict(tokenizer_dir=tok_dir, tokenizer=tokenizer, max_length=config.max_length, on_bad_row=config.on_bad_row,
                  cache_dir=config.data_cache or defaults.default_data_cache(), workers=config.data_workers, log=log,
                  unpaired=registry.unpaired_data(config), whole_rows=whole_rows)
    train_data = _open_store([s.path for s in sources], **stores)
    counts = train_data.source_counts()
    if weights_of(sources):
        for source, count in zip(sources, counts):
            if not count:
                raise InputError(f"{source.path}: no usable pairs, but it has a weight in the mix")
    what = sources[0].path if len(sources) == 1 else f"data ({len(sources)} sources)"
    if len(train_data) < config.global_batch_size:
        raise InputError(
            f"{what}: {len(train_data)} usable pairs, fewer than global_batch_size {config.global_batch_size}"
        )
    eval_data = None
    if config.eval_data:
        eval_data = _open_store([config.eval_data], **stores)
        eval_stats = eval_data.stats[0]
        # Any number of held-out pairs evaluates (the last chunk may be partial), but not none.
        if not len(eval_data):
            dropped = (f"{eval_stats.num_dropped_too_long} longer than" if whole_rows else
                       f"{eval_stats.num_dropped_prompt_too_long} with a prompt that fills")
            raise InputError(f"{config.eval_data}: no usable pairs to evaluate ({dropped} max_length {config.max_length}, "
                             f"{eval_stats.num_bad_rows_skipped} bad rows skipped)")
    return Prepared(config=config, spec=spec, pad_token_id=int(pad), sources=sources, train_data=train_data,
                    eval_data=eval_data, packing_note=packing_note, warnings=warnings, hf_config=hf_config)


def _open_store(paths: list[str], **stores) -> TokenStore:
    """open_or_build, a cache directory that cannot be written refused in one line."""
    try:
        return open_or_build(paths, **stores)
    except OSError as error:  # read-only, full, a file in its path
        raise InputError(f"data_cache: cannot write the token store ({io_errors.describe(error)})") from None


def _adapter_shape_change(saved: dict, current: dict) -> str | None:
    """Why a checkpoint's trained tensors cannot load into this run, even with
    --resume-with-changes: LoRA on vs off, or another adapter rank or target set."""
    if not saved or "lora" not in saved:  # no record (an older checkpoint): the workers check shapes
        return None
    old, new = saved["lora"], current.get("lora")
    if (old is None) != (new is None):
        held, wanted = ("LoRA adapters", "full weights") if new is None else ("full weights", "LoRA adapters")
        return f"the checkpoint holds {held} but this run trains {wanted}; a resume cannot switch, choose another --output-dir"
    if old is not None and (old["rank"], old["targets"]) != (new["rank"], new["targets"]):
        return (f"the checkpoint's adapters have rank {old['rank']} on {old['targets']}, this run asks for rank "
                f"{new['rank']} on {new['targets']}; a resume cannot change the adapters' shape (start a new run "
                "with --init-adapter from an exported OUTPUT/adapter instead)")
    return None


def _command_of(config: TrainConfig) -> dict:
    """What makes two invocations the same command: the resolved configuration, where the
    outputs go, --overwrite and --max-steps aside (a larger --max-steps continues the run)."""
    return {k: v for k, v in config.to_dict().items() if k not in ("output_dir", "overwrite", "max_steps")}


def _use_chat_template(tokenizer, path: str) -> None:
    """Give `tokenizer` the Jinja template in `path`, checked on a one-turn conversation now."""
    try:
        with open(path, encoding="utf-8") as fh:
            tokenizer.chat_template = fh.read()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"chat_template: cannot read {path} ({error})") from None
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except Exception as error:  # jinja's syntax and undefined-name errors
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise InputError(f"chat_template: {path} does not render a conversation ({detail})") from None


def _resolve_lora(config: TrainConfig, spec) -> TrainConfig:
    """LoRA's rank, alpha and targets, from --init-adapter where not given; the adapter checked
    against them and against the base."""
    from checkpoint_convert.families.base import ConversionError
    from mcore_dpo.model import lora

    try:
        return lora.resolve(config, spec=spec)
    except ConversionError as error:
        raise InputError(str(error)) from None


def train(config: TrainConfig, *, ray_address: str | None = None, log=print, announced: bool = False) -> Path:
    """Run DPO as configured; returns the output directory. `announced`: the caller already
    printed `starting_line` (the command line does, before the slow imports)."""
    from mcore_dpo.driver import console

    log = console.RunLog(log)  # also into OUTPUT/train.log, once that directory is claimed
    if announced:
        log.note(starting_line(config, ray_address=ray_address))
    else:
        log(starting_line(config, ray_address=ray_address))
    prep = prepare(config, log=log)
    if prep.packing_note:
        log(prep.packing_note)
    for warning in prep.warnings:
        log(warning)
    command = _command_of(prep.config)
    if prep.config.output_dir is None:  # a fresh directory per run, but the same command continues its own
        earlier = None
        if prep.config.resume and not prep.config.overwrite:
            earlier = output_dir.same_command_dir(command=command)
        prep.config = replace(prep.config, output_dir=str(earlier or output_dir.fresh_dir(model=config.model)))
        if earlier:
            log(f"the same command ran in {earlier} before: continuing there (--no-resume for a separate run)")
    out = Path(prep.config.output_dir)
    log(f"output directory: {out}")
    if out.exists() and not out.is_dir():
        raise InputError(f"output_dir: {out} is a file, not a directory")
    try:  # one run per directory, from here to the end (run_lock.py)
        lock = RunLock(out, log=log)
        lock.acquire()
    except LockHeld as held:
        raise InputError(str(held)) from None
    except OSError as error:  # a file in the path, a read-only or full file system, no permission
        raise InputError(f"output_dir: cannot use {out} ({io_errors.describe(error)})") from None
    try:
        return _train_locked(prep, out=out, command=command, ray_address=ray_address, log=log)
    finally:
        lock.release()


def _train_locked(prep: Prepared, *, out: Path, command: dict, ray_address: str | None, log) -> Path:
    """`train` once this process holds OUTPUT's lock: the directory's door, then the attempts."""
    from mcore_dpo.driver import ray_workers

    config = prep.config
    prep.identity = run_identity(config)
    # a broken pointer or state file is reported now, before any worker
    if config.overwrite:
        current = None
    elif config.resume:  # checked against its manifest; an older intact one when it fails (_attempt says so)
        current, _ = checkpoint.resume_point(out)
    else:
        current = checkpoint.latest(out)
    if not config.overwrite:
        saved = checkpoint.read_state(current).get("run", {}) if current is not None else None
        problem, changed = output_dir.door_problem(
            out, identity=prep.identity, checkpoint_identity=saved or None, has_checkpoint=current is not None,
            resume=config.resume, resume_with_changes=config.resume_with_changes)
        if problem:
            raise InputError(problem)
        shape_problem = _adapter_shape_change(saved, prep.identity) if current is not None else None
        if shape_problem:
            raise InputError(f"{current / 'trainer_state.json'}: {shape_problem}")
        if changed:
            log(f"resuming despite changes (--resume-with-changes): {'; '.join(changed)}")
        done_step = output_dir.completed_step(out)
        if done_step is not None and done_step >= config.max_steps:
            log(f"already complete at step {done_step}: {out} (a larger --max-steps continues it; --overwrite "
                "trains it again)")
            return out
    output_dir.claim(out, identity=prep.identity, overwrite=config.overwrite, command=command)
    log.open(out)
    write_resolved(config, str(out))
    durable.replace_file(out / "data_stats.json", json.dumps(_data_stats(prep), indent=2) + "\n")
    if config.chat_template:
        durable.replace_file(out / "chat_template.jinja", Path(config.chat_template).read_text(encoding="utf-8"))
    named = [(s.path, stats) for s, stats in zip(prep.sources, prep.train_data.stats)]
    named += [(config.eval_data, prep.eval_data.stats[0])] if prep.eval_data is not None else []
    for path, stats in named:  # unused columns; truncated, dropped and skipped pairs
        for note in data_notes(path, stats, max_length=config.max_length):
            log(note)
    world = world_size(config)
    num_cpus = max(world, os.cpu_count() or 1)
    if ray_workers.connected():
        log("using the Ray cluster this process is connected to")
    else:
        log(f"connecting to the Ray cluster at {ray_address}" if ray_address else
            f"starting a local Ray cluster ({num_cpus} logical CPUs)")
    started = ray_workers.connect(address=ray_address, num_cpus=num_cpus)
    try:
        restarts = 0
        while True:
            try:
                _attempt(prep, out=out, log=log)
                break
            except Stopped as stopped:
                log.note(str(stopped))  # the command line shows it
                raise
            except Diverged as diverged:
                log.note(f"error: {diverged}")
                raise
            except ray_workers.WorkerGroupError as error:
                if restarts >= config.max_restarts:
                    log.note(f"error: {error}")
                    if error.detail:  # the rank's traceback: train.log only, the command line shows the line
                        log.note(error.detail)
                    raise
                restarts += 1
                log(f"restart {restarts}/{config.max_restarts} from the latest checkpoint after: {error}")
                if error.detail:
                    log.note(error.detail)
    finally:
        ray_workers.disconnect(started)
    output_dir.mark_complete(out, identity=prep.identity, step=config.max_steps)
    return out


def _data_stats(prep: Prepared) -> dict:
    """OUTPUT/data_stats.json: each data source's counts (one source: an object, a mix: a list of
    them with their weights), the held-out set's, and the token stores they are in."""
    per_source = [{"path": s.path, **({"weight": s.weight} if len(prep.sources) > 1 else {}),
                   **dataclasses.asdict(stats)} for s, stats in zip(prep.sources, prep.train_data.stats)]
    found = {"data": per_source[0] if len(per_source) == 1 else per_source}
    if prep.eval_data is not None:
        found["eval_data"] = {"path": prep.config.eval_data, **dataclasses.asdict(prep.eval_data.stats[0])}
    found["token_stores"] = {"data": prep.train_data.path,
                             **({"eval_data": prep.eval_data.path} if prep.eval_data is not None else {})}
    return found


def _record_experts(prep: Prepared, kinds: set[str | None], *, out: Path) -> None:
    """config.yaml says which experts ran (the ranks decide: Transformer Engine is theirs), as it
    says whether packing ran: moe_grouped_gemm true or false for a MoE model whatever was asked
    (the note the ranks sent says why a request was not met); a dense model's stays unset."""
    if kinds == {None}:
        return
    ran = kinds == {"grouped"}
    if prep.config.moe_grouped_gemm is not ran:
        prep.config = replace(prep.config, moe_grouped_gemm=ran)
        write_resolved(prep.config, str(out))


def _record_packing(prep: Prepared, decided: set[bool], *, out: Path) -> None:
    """config.yaml says whether packing ran: an unset --packing is decided by the ranks'
    attention (`platform.default_packing`), as they decide which experts run."""
    assert len(decided) == 1, f"ranks disagree on packing: {sorted(decided)}"
    ran = decided.pop()
    if prep.config.packing is not ran:
        prep.config = replace(prep.config, packing=ran)
        write_resolved(prep.config, str(out))


def _attempt(prep: Prepared, *, out: Path, log) -> None:
    """Build the worker group, resume from the latest checkpoint if any, train to the end."""
    from mcore_dpo.rank.worker import PolicyWorker, ReferenceWorker, StepBatch

    config = prep.config
    checkpoint.remove_partials(out)
    resume_dir, fallback = checkpoint.resume_point(out) if config.resume else (None, None)
    start_step = int(checkpoint.read_state(resume_dir)["step"]) if resume_dir else 0
    if fallback:  # the newest checkpoint failed its manifest: the older one becomes current
        checkpoint.make_current(out, resume_dir)
        log(fallback)
    elif resume_dir:
        log(f"resuming from {resume_dir} (step {start_step})")
    steps = StepOrder.of(config, prep.train_data.source_counts(), weights_of(prep.sources))
    reference_tables.remove_partials(out)
    metrics_log = MetricsLog(out, total_steps=config.max_steps, keep_up_to_step=start_step,
                             wandb_project=(config.wandb_project or "mcore_dpo") if config.wandb else None,
                             run_config=config.to_dict(), note=getattr(log, "note", None))
    group = ref_group = None
    stop = _StopRequest(log, before_print=metrics_log.end_line)
    try:
        if config.ref_mode == "separate":
            ref_group = _start_group("ref", ReferenceWorker, prep, tp=config.ref_tp, pp=config.ref_pp, dp=config.ref_dp)
        group = _start_group("policy", PolicyWorker, prep, tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep, cp=config.cp,
                             resume_dir=str(resume_dir) if resume_dir else None)
        experts = group.call("experts")
        for note in sorted({note for _, note in experts if note}):
            log(note)  # grouped GEMM experts expected but not possible on the ranks
        _record_experts(prep, {kind for kind, _ in experts}, out=out)
        _record_packing(prep, set(group.call("packs")), out=out)
        workers = {}
        for g in (ref_group, group):
            if g is not None:
                check_shared_output_dir(g, out)
                check_shared_stores(g, prep)
                workers.update(zip(g.names, g.processes))
        durable.replace_file(out / "workers.json", json.dumps(workers, indent=2) + "\n")
        if config.ref_mode == "precomputed":  # the ranks read the stores; the tables stay with the run
            _precompute_reference(group, prep, out=out, log=log)
        has_eval = prep.eval_data is not None
        eval_ref = _one(ref_group.call("reference_logps", eval_set=True)) if ref_group and has_eval else None
        if has_eval and start_step == 0:
            metrics_log.write(0, _one(group.call("evaluate", None, eval_ref)))
        # Separate reference group: batch k+1's reference runs on its own devices while the
        # policy group trains on batch k. Every group is sent pair indices; the ranks read the pairs.
        ref_pending = ref_group.submit("reference_logps", pair_ids=steps[start_step]) if ref_group else None
        last_save = time.monotonic()
        for k in range(start_step, len(steps)):
            step = k + 1
            last = step == len(steps)
            ref_logps = _one(ref_group.gather(ref_pending)) if ref_group else None
            if ref_group and not last:
                ref_pending = ref_group.submit("reference_logps", pair_ids=steps[k + 1])
            batch = StepBatch(step=step, pair_ids=steps[k], next_pair_ids=None if last else steps[k + 1],
                              ref_logps=ref_logps)
            metrics = _one(group.call("train_step", batch))
            non_finite = first_non_finite(metrics)  # on the host, where the step already synchronised
            if non_finite:
                metrics_log.write(step, metrics)
                raise Diverged(step, *non_finite, newest=checkpoint.latest(out))
            if has_eval and (last or (config.eval_interval and step % config.eval_interval == 0)):
                metrics.update(_one(group.call("evaluate", None, eval_ref)))
            metrics_log.write(step, metrics)
            by_step = config.save_interval and step % config.save_interval == 0
            by_time = config.save_interval_min and time.monotonic() - last_save >= 60 * config.save_interval_min
            # The last step is always saved: `latest` names the newest checkpoint at every moment, a
            # finished run exports from it, and a larger --max-steps continues from it.
            if by_step or by_time or stop.requested or last:
                save_checkpoint(group, config=config, spec=prep.spec, out=out, step=step, identity=prep.identity,
                                hf_config=prep.hf_config)
                last_save = time.monotonic()
                if stop.requested and not last:
                    raise Stopped(step)
        if config.lora:
            export_adapter(group, config=config, spec=prep.spec, out=out)
            log(f"exported the adapter to {out / 'adapter'}")
        if config.export_hf and (config.merge_lora or not config.lora):
            export_policy(group, config=config, spec=prep.spec, out=out, hf_config=prep.hf_config)
            log(f"exported the policy to {out / 'hf'}")
    finally:
        stop.restore()
        metrics_log.close()
        for g in (group, ref_group):
            if g is not None:
                g.stop()
    from mcore_dpo.plot import plot_run

    try:  # best-effort: the run's results are written; a plot never fails it
        plot_run(str(out))
    except Exception as error:  # noqa: BLE001 - a full disk, a matplotlib back-end, bad metrics
        detail = io_errors.describe(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        log(f"warning: plots not written ({detail.splitlines()[0] if detail else type(error).__name__})")


class _StopRequest:
    """SIGINT and SIGTERM (as SLURM sends before a time limit) ask the training loop to write a
    checkpoint at the next step boundary and stop; a second signal interrupts at once."""

    def __init__(self, log=print, *, before_print=lambda: None):
        self.requested = False
        self._log = log
        self._before_print = before_print  # ends a terminal's progress line first
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, the loop runs to the end
                pass

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._before_print()
        self._log(f"{signal.Signals(signum).name}: stopping after this step (a checkpoint is written first)")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _start_group(role: str, factory, prep: Prepared, *, tp: int, pp: int, dp: int, ep: int = 1, cp: int = 1,
                 **worker_kwargs):
    """One worker group for a role: an actor per rank, each building `factory(...)`."""
    from mcore_dpo.driver import ray_workers

    config = prep.config
    return ray_workers.create_group(
        role=role,
        world_size=tp * pp * dp * cp,
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        cp=cp,
        factory=factory,
        kwargs_of_rank=lambda rank, addr, port: dict(
            config=config, spec=prep.spec, pad_token_id=prep.pad_token_id, rank=rank, master_addr=addr,
            master_port=port, stores=_store_places(prep), **worker_kwargs,
        ),
        use_gpus=ray_workers.cluster_has_gpus(),
        placement_timeout_s=config.placement_timeout_s,
    )


def _store_places(prep: Prepared) -> dict[str, tuple[str, str]]:
    """What the ranks are told of the token stores: each one's path and key (they open them)."""
    stores = {"data": prep.train_data, "eval_data": prep.eval_data}
    return {name: (store.path, store.meta["key"]) for name, store in stores.items() if store is not None}


def _precompute_reference(group, prep: Prepared, *, out: Path, log) -> None:
    """--ref-mode precomputed: the reference log-probs of every pair, computed by the ranks over
    their shares of the stores into OUTPUT/reference_logps, or reused from there (a resume, a
    restart) when they were computed for the same data and reference."""
    config = prep.config
    table_dir = out / reference_tables.DIRECTORY
    key = reference_tables.table_key(
        data_key=prep.train_data.meta["key"], eval_key=prep.eval_data.meta["key"] if prep.eval_data else None,
        reference_model=prep.identity["ref_model"] or prep.identity["model"], dtype=config.dtype,
        ld_alpha=config.ld_alpha, use_weighting=config.use_weighting)
    reuse = reference_tables.is_complete(table_dir, key=key)
    if reuse:
        log(f"reference log-probs: reusing {table_dir} (the same data and reference)")
    started = time.monotonic()
    group.call("precompute_reference", table_dir=str(table_dir), key=key, reuse=reuse)
    if not reuse:
        log(f"reference log-probs: computed for {len(prep.train_data):,} pairs in {time.monotonic() - started:.1f} s "
            f"into {table_dir}")


def check_shared_stores(group, prep: Prepared) -> None:
    """Every rank must read the token stores the driver built: each rank reads a store's
    meta.json (its key and sizes) and must find what the driver finds."""
    from mcore_dpo.driver import ray_workers

    for store in (prep.train_data, prep.eval_data):
        if store is None:
            continue
        meta_path = Path(store.path) / "meta.json"
        missing = ray_workers.ranks_not_seeing(group, path=str(meta_path), text=meta_path.read_text(encoding="utf-8"))
        if missing:
            name, node = missing[0]
            raise InputError(
                f"data_cache: the token store {store.path} is not on node {node} ({name}); a multi-node run needs "
                "--data-cache (or $MCORE_DPO_CACHE) on a file system every node shares (scripts/slurm/README.md)")


def _one(results: list) -> dict:
    """The one result a group returns (tp rank 0 of the last stage)."""
    found = [r for r in results if r is not None]
    assert len(found) == 1, f"expected one reporting rank, got {len(found)}"
    return found[0]


def check_shared_output_dir(group, out: Path) -> None:
    """Every rank must see the output directory the driver writes (checkpoints are written by
    the ranks and read by the driver): each rank reads a token the driver just wrote there."""
    from mcore_dpo.driver import ray_workers

    token_file = out / ".output-dir-token"
    token = uuid.uuid4().hex
    durable.replace_file(token_file, token + "\n")
    missing = ray_workers.ranks_not_seeing(group, path=str(token_file), text=token + "\n")
    if missing:
        name, node = missing[0]
        raise InputError(
            f"output_dir: {out} on node {node} ({name}) is not the directory the driver wrote; "
            "a multi-node run needs --output-dir on a file system every node shares"
        )

"""The command line of `python -m mcore_dpo.train`: its parser, built from TrainConfig's fields
(one flag per field, named like it, its help the text under the field), and `resolve`,
defaults <- YAML file (--config) <- flags, then TrainConfig.validate(). Errors are one line
(ConfigError) naming the flag, the field or the file."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import fields

import yaml

from checkpoint_convert.names import DTYPE_NAMES
from mcore_dpo.config import RECOMPUTE_MODES, RUN_REF_MODES, ConfigError, TrainConfig
from mcore_dpo.objective import registry
from mcore_dpo.objective.loss_spec import F_DIVERGENCE_TYPES, LOSS_TYPES


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    if text.startswith("str | list[str]"):  # --data: one source or several
        return list
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return kind
    raise AssertionError(f"unsupported config field type {f.type}")


def _coerce(name: str, value, kind: type, *, source: str):
    """Accept YAML/JSON values of the field's type (ints for floats too); reject the rest."""
    if value is None:
        return None
    if kind is list:  # one string, or a list of strings
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            return value
        raise ConfigError(f"{source}: {name}: expected a path or a list of paths, got {value!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {name}: expected true/false, got {value!r}")
    if kind is not bool and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ConfigError(f"{source}: {name}: expected {kind.__name__}, got {value!r}")
    return value


def load_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields at the top level")
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"{path}: unknown key {key!r}")
        out[name] = _coerce(name, value, _field_type(known[name]), source=path)
    return out


def field_docs() -> dict[str, str]:
    """Each TrainConfig field's documentation: the string right under it in the class body."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2, no usage dump
        raise ConfigError(f"command line: {message}")


def bool_flags(name: str) -> tuple[str, str]:
    """(flag that sets the field true, flag that sets it false) of a boolean field.

    `resume` -> (--resume, --no-resume); a field named `no_X` -> (--no-X, --X), so
    `--no-shuffle` sets no_shuffle and there is no `--no-no-shuffle`.
    """
    flag = "--" + name.replace("_", "-")
    if flag.startswith("--no-"):
        return flag, "--" + flag[len("--no-"):]
    return flag, "--no-" + flag[2:]


# --help groups: each field's group (the fields not named here are run settings).
HELP_GROUPS = {
    "data": ("data", "eval_data", "max_length", "seed", "no_shuffle", "on_bad_row", "trust_remote_code", "data_workers",
             "data_cache"),
    "model": ("model", "ref_model", "tokenizer", "chat_template", "dtype", "fused_kernels", "deterministic"),
    "parallelism": ("tp", "pp", "vpp", "dp", "cp", "ep", "moe_aux_loss_coef", "ref_tp", "ref_pp", "ref_dp", "micro_batch_size", "global_batch_size",
                    "packing", "max_tokens_per_microbatch", "prefix_sharing", "distributed_optimizer", "sequence_parallel", "moe_grouped_gemm",
                    "recompute", "recompute_num_layers", "timeout_s", "placement_timeout_s"),
    "loss": ("objective", "beta", "loss_type", "loss_weights", "label_smoothing", "ref_mode", "f_divergence_type",
             "f_alpha_divergence_coef", "discopop_tau", "ld_alpha", "use_weighting", "sync_ref_model",
             "ref_model_mixup_alpha", "ref_model_sync_steps"),
    "optimizer": ("lr", "lr_schedule", "lr_warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                  "clip_grad", "max_steps"),
    "checkpointing": ("output_dir", "overwrite", "save_interval", "save_interval_min", "keep_last", "save_format",
                      "resume", "max_restarts", "resume_with_changes", "export_hf"),
    "lora": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "init_adapter", "merge_lora"),
    "logging": ("eval_interval", "memory_interval", "wandb", "wandb_project"),
    # each objective's own options (DPO's are in "loss")
    **{name: entry.options for name, entry in registry.OBJECTIVES.items() if name != "dpo" and entry.options},
}


def _choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of the fields that take one of a fixed set, as --help lists them."""
    return {
        "objective": tuple(registry.OBJECTIVES),
        "ref_mode": RUN_REF_MODES,
        "loss_type": tuple(LOSS_TYPES),
        "dtype": DTYPE_NAMES,
        "lr_schedule": ("constant", "cosine"),
        "on_bad_row": ("error", "skip"),
        "save_format": ("safetensors", "torch_dist"),
        "f_divergence_type": tuple(F_DIVERGENCE_TYPES),
        "recompute": RECOMPUTE_MODES,
    }


class _BoolPair(argparse.Action):
    """One boolean field's two flags, shown together in --help: the first sets it, the second clears it."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string == self.option_strings[0])


def _program_name() -> str:
    """The console script's own name (mcore-dpo-train), or how the module was started."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") and name not in ("-c", "-m") else "python -m mcore_dpo.train"


def _help_of(f: dataclasses.Field, doc: str, *, choices: tuple[str, ...] | None) -> str:
    text = doc or f.name.replace("_", " ")
    if choices and not all(c in text for c in choices):
        text += f" One of: {', '.join(choices)}."
    default = f.default
    shown = "unset" if default is None else ("on" if default is True else "off" if default is False else default)
    if "(default:" not in text:
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix such as --no-shuf is an error, not a guess.
    parser = _OneLineParser(prog=_program_name(), usage="%(prog)s [options]",
                            description="DPO on megatron-core, launched by Ray. Options by group below.",
                            allow_abbrev=False)
    parser.add_argument("--config", help="YAML file of config fields; flags override it (default: none)")
    parser.add_argument("--ray-address", default=None,
                        help="join an existing Ray cluster, e.g. auto (default: start a local one)")
    docs, choices = field_docs(), _choices()
    groups = {name: parser.add_argument_group(name) for name in HELP_GROUPS}
    group_of: dict[str, str] = {}
    for name, members in HELP_GROUPS.items():
        for field in members:
            group_of.setdefault(field, name)  # a shared option (ref_model) stays in its first group
    run_group = parser.add_argument_group("run")
    for f in fields(TrainConfig):
        kind = _field_type(f)
        group = groups[group_of[f.name]] if f.name in group_of else run_group
        text = _help_of(f, docs.get(f.name, ""), choices=choices.get(f.name))
        if kind is bool:
            # Two explicit flags, not BooleanOptionalAction: that one reads any --no-... spelling
            # as a negation, so --no-shuffle would set no_shuffle to false.
            on, off = bool_flags(f.name)
            group.add_argument(on, off, dest=f.name, action=_BoolPair, default=None, help=text)
        elif kind is list:
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, nargs="+", default=None, help=text,
                               metavar=f.name.upper())
        else:
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None, help=text,
                               metavar=f.name.upper())
    return parser


def resolve(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    """defaults <- YAML (--config) <- flags; then validate."""
    args = build_parser().parse_args(argv)
    values = load_yaml(args.config) if args.config else {}
    for f in fields(TrainConfig):
        flag_value = getattr(args, f.name)
        if flag_value is not None:
            values[f.name] = flag_value
    from_file = {name for name in values if getattr(args, name) is None} if args.config else set()
    config = TrainConfig(**values)
    try:
        config.validate()
    except ConfigError as error:
        field_name = str(error).split(":", 1)[0]
        if field_name in from_file:  # the value came from the YAML file: name the file too
            raise ConfigError(f"{args.config}: {error}") from None
        raise
    return config, args

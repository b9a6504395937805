"""Command line: convert checkpoints between Hugging Face and megatron-core layouts.

    python -m checkpoint_convert hf-to-mcore --hf-dir D --out O --tp 2 --pp 2 [--vpp 2] [--ep 2] [--dtype bfloat16] [--format torch_dist]
    python -m checkpoint_convert mcore-to-hf --mcore-dir O --out D2 [--max-shard-size 5GB] [--hf-config DIR]
    python -m checkpoint_convert reshard --mcore-dir O --out O2 --tp 1 --pp 4 [--vpp 1] [--ep 1] [--format torch_dist] [--hf-config DIR]
    (each of the three also takes [--trust-remote-code]: copy the model's custom *.py code along)
    python -m checkpoint_convert verify --hf-dir D --mcore-dir O [--atol 1e-4]

--mcore-dir reads either format: this package's (safetensors per rank) or torch_dist
(megatron-core dist_checkpointing in Megatron-LM's layout, from Megatron-LM, Megatron-Bridge,
ms-swift or this package). --hf-config DIR names a directory whose config.json describes the
model when a torch_dist checkpoint has no HF config of its own and its args do not say enough.
--ep N splits the experts of a MoE model over N expert-parallel ranks (one file per tp, pp and
ep rank; default 1: every rank file holds all experts). reshard reads any ep and writes --ep.
--vpp N writes what a `--pp P --vpp N` training run writes and reads: N model chunks per pipeline
rank, chunk c of rank s holding the (c*P + s)-th of P*N equal slices of the layers (safetensors: a
directory of P*N stage files, its metadata naming the layout; torch_dist: Megatron-LM's
virtual_pipeline_model_parallel_size N in the args). It needs pp >= 2 and a layer count divisible by P*N.
verify builds the Megatron model with a trainer's runner (mcore_dpo's, found through an entry
point: checkpoint_convert/verify.py); the other commands need no trainer. The config and tokenizer
files travel with the weights (tokenizer.json checked as training loads it); custom code (*.py,
what an `auto_map` names) only with --trust-remote-code, else a line on stderr names what was left out.

(also installed as `mcore-convert`). Bad input, or verify without a runner, prints one line and
exits with code 2; verify exits with 1 when the logits differ.
"""

from __future__ import annotations

import argparse
import signal
import sys

from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.mapping import LAYER_SPECS
from checkpoint_convert.names import DTYPE_HELP, DTYPE_NAMES, canonical_dtype

# Kept in step with checkpoint_convert.convert.FORMATS (not imported here: it pulls in torch).
FORMATS = ("safetensors", "torch_dist")
_FORMAT_HELP = "safetensors: this package's format; torch_dist: Megatron-LM's layout with megatron-core dist_checkpointing"

EXIT_BAD_INPUT = 2
_EP_HELP = "expert-parallel ranks the experts of a MoE model are split over"
_VPP_HELP = ("model chunks (virtual pipeline stages) per pipeline stage, laid out as the trainer's vpp: chunk c of "
             "stage s holds the (c*pp + s)-th of pp*vpp equal slices of the layers; > 1 needs pp >= 2 and a layer "
             "count divisible by pp*vpp")
_HF_CONFIG_HELP = ("directory whose config.json describes the model, for a torch_dist checkpoint that has no HF "
                   "config of its own (default: the checkpoint's own)")
_MCORE_DIR_HELP = ("Megatron checkpoint to read (either format): its folder, or a trainer's "
                   "OUTPUT/checkpoints/step_N, .../checkpoints or .../latest")
_OVERWRITE_HELP = "replace --out if it already holds files (default: refuse a non-empty --out)"
_TRUST_HELP = ("copy the model's custom code (*.py files, what an auto_map names) into --out "
               "(default: leave it out, saying which files on stderr)")


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends in its default, or says it is required (as train's --help does)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS:  # --help's default is SUPPRESS
            return text
        if action.required:
            return text + " (required)"
        if action.default is None or action.default is False:
            return text
        return text + " (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-convert", description=__doc__.splitlines()[0],
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)

    p = command("hf-to-mcore", "HF directory -> Megatron checkpoint sharded tp x pp (x ep)")
    p.add_argument("--hf-dir", required=True, metavar="DIR",
                   help="local Hugging Face model directory to read (config.json, *.safetensors)")
    p.add_argument("--out", required=True, metavar="DIR", help="Megatron checkpoint directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to shard the weights over")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages to split the layers over")
    p.add_argument("--vpp", type=int, default=1, help=_VPP_HELP)
    p.add_argument("--ep", type=int, default=1, help=_EP_HELP)
    p.add_argument("--dtype", type=canonical_dtype, choices=DTYPE_NAMES, default=None,
                   help=f"dtype the shards are stored in: {DTYPE_HELP} (default: keep the source dtype)")
    p.add_argument("--layer-spec", choices=LAYER_SPECS, default="local",
                   help="tensor names the shards use: 'local' for megatron-core's own layers, "
                        "'te' for Transformer Engine's")
    p.add_argument("--format", choices=FORMATS, default="safetensors", help=_FORMAT_HELP)
    p.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    p.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP)

    p = command("mcore-to-hf", "Megatron checkpoint -> HF directory")
    p.add_argument("--mcore-dir", required=True, metavar="DIR", help=_MCORE_DIR_HELP)
    p.add_argument("--out", required=True, metavar="DIR", help="Hugging Face model directory to write")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest model-*.safetensors file to write, e.g. 500MB or 5GB")
    p.add_argument("--hf-config", default=None, metavar="DIR", help=_HF_CONFIG_HELP)
    p.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    p.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP)

    p = command("reshard", "Megatron checkpoint -> Megatron checkpoint at a new tp x pp x ep")
    p.add_argument("--mcore-dir", required=True, metavar="DIR", help=_MCORE_DIR_HELP)
    p.add_argument("--out", required=True, metavar="DIR", help="Megatron checkpoint directory to write")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel ranks of the new checkpoint")
    p.add_argument("--pp", type=int, required=True, help="pipeline stages of the new checkpoint")
    p.add_argument("--vpp", type=int, default=1, help=_VPP_HELP)
    p.add_argument("--ep", type=int, default=1, help=_EP_HELP)
    p.add_argument("--format", choices=FORMATS, default=None, help=_FORMAT_HELP + " (default: the input's)")
    p.add_argument("--hf-config", default=None, metavar="DIR", help=_HF_CONFIG_HELP)
    p.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    p.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP)

    p = command("verify", "compare HF and Megatron logits at the checkpoint's tp x pp")
    p.add_argument("--hf-dir", required=True, metavar="DIR", help="Hugging Face model directory (the reference side)")
    p.add_argument("--mcore-dir", required=True, metavar="DIR", help=_MCORE_DIR_HELP)
    p.add_argument("--atol", type=float, default=1e-4, help="largest |logit difference| that passes")
    p.add_argument("--batch-size", type=int, default=2, help="sequences of random token ids to compare")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    return parser


def _raise_interrupt(signum, frame) -> None:
    # SIGTERM takes the same cleanup path as Ctrl-C: temporary output is removed.
    raise KeyboardInterrupt


def _weights_dir(path: str, *, log=print) -> str:
    """A trainer's run names its weights folder: OUTPUT/checkpoints/step_N holds them in model/;
    the run directory OUTPUT, its checkpoints folder and the `latest` pointer file name the
    newest checkpoint (said in one line). Any other path is returned as given."""
    from pathlib import Path

    from checkpoint_convert.mcore_dir import is_mcore_dir

    given = Path(path)
    if is_mcore_dir(given):
        return path
    candidates = [given] if given.is_file() and given.name == "latest" else [given / "latest",
                                                                             given / "checkpoints" / "latest"]
    pointer = next((p for p in candidates if p.is_file()), None)
    if pointer is not None:
        name = pointer.read_text(encoding="utf-8").strip()
        if not name or "/" in name or name in (".", ".."):
            raise ConversionError(f"{pointer}: does not name a checkpoint ({name!r})")
        given = pointer.parent / name
        if not given.is_dir():
            raise ConversionError(f"{pointer}: names {name}, which is not a directory")
        log(f"{path}: the newest checkpoint is {given}")
    if is_mcore_dir(given / "model"):
        return str(given / "model")
    return str(given) if pointer is not None else path


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "mcore_dir", None):
        args.mcore_dir = _weights_dir(args.mcore_dir)
    if args.command == "hf-to-mcore":
        from checkpoint_convert.convert import hf_to_mcore

        hf_to_mcore(
            args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, vpp=args.vpp, dtype=args.dtype,
            layer_spec=args.layer_spec, overwrite=args.overwrite, fmt=args.format,
            trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
    elif args.command == "mcore-to-hf":
        from checkpoint_convert.convert import mcore_to_hf_dir, parse_size_bytes

        mcore_to_hf_dir(
            args.mcore_dir, args.out, max_shard_bytes=parse_size_bytes(args.max_shard_size), overwrite=args.overwrite,
            hf_config_dir=args.hf_config, trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
    elif args.command == "reshard":
        from checkpoint_convert.convert import reshard

        reshard(
            args.mcore_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, vpp=args.vpp, overwrite=args.overwrite,
            fmt=args.format,
            hf_config_dir=args.hf_config, trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
    elif args.command == "verify":
        from checkpoint_convert.verify import verify

        report = verify(
            args.hf_dir, args.mcore_dir, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
            # progress on stderr as it happens; stdout holds the one result line
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
        print(report.summary())
        if not report.passes(atol=args.atol):
            print(f"verify: FAILED (max |dlogit| {report.max_abs_diff:.3e} > atol {args.atol:g} "
                  f"or argmax agreement {report.argmax_agreement:.2%} < 100%)", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run(argv)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: no output was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

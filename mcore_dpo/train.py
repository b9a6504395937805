"""Train a policy with DPO on megatron-core.

    python -m mcore_dpo.train                          # embedded tiny default, local Ray, CPU
    python -m mcore_dpo.train --tp 4 --pp 2 --max-steps 3
    python -m mcore_dpo.train --config configs/llama3_8b.yaml --ray-address auto

Bad input ends in one line on stderr and exit code 2, before any worker starts. SIGINT or
SIGTERM writes a checkpoint at the next step boundary, prints "stopped at step N; rerun the
same command to resume" and exits 0; rerunning a finished run says "already complete at step N".
A closed stdout or terminal does not end a run; the driver's lines also go to OUTPUT/train.log.

From Python (notebooks, other tools), the module itself is callable:

    import mcore_dpo.train
    from mcore_dpo.config import TrainConfig
    run_dir = mcore_dpo.train(TrainConfig(tp=2, max_steps=10))
"""

from __future__ import annotations

import sys
import types


def main(argv: list[str] | None = None) -> int:
    from mcore_dpo.driver import console
    from mcore_dpo.command_line import resolve
    from mcore_dpo.config import ConfigError, starting_line

    console.install()  # a closed stdout (`| tee` killed by Ctrl-C, `| head`) never ends the run

    try:
        config, args = resolve(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Say what starts before the slow imports (torch, megatron-core, transformers, Ray).
    print(starting_line(config, ray_address=args.ray_address), flush=True)

    from checkpoint_convert.families.base import ConversionError
    from mcore_dpo.checkpoint.layout import CheckpointError
    from mcore_dpo.data.sources import DataError
    from mcore_dpo import io_errors
    from mcore_dpo.driver.run import Diverged, InputError, Stopped, train

    try:
        out = train(config, ray_address=args.ray_address, announced=True)
    except Stopped as stopped:  # SIGINT/SIGTERM: a checkpoint of this step was written
        print(stopped, flush=True)
        return 0
    except (ConfigError, DataError, ConversionError, InputError, CheckpointError, Diverged) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the driver's own I/O: a full disk, a read-only file system, no permission
        print(f"error: {io_errors.describe(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        from mcore_dpo.driver.ray_workers import WorkerGroupError

        if isinstance(error, WorkerGroupError):
            print(f"error: {error}", file=sys.stderr)
            return 1
        raise
    print(f"done: {out}")
    return 0


class _CallableModule(types.ModuleType):
    """`mcore_dpo.train(config)` runs training; `python -m mcore_dpo.train` runs the CLI."""

    def __call__(self, config, *, ray_address: str | None = None):
        from mcore_dpo.driver.run import train

        return train(config, ray_address=ray_address)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())

"""Benchmark 5: checkpoint conversion HF -> mcore (tp 2, pp 2) -> HF of a >= 1 GB random Llama.

`--format` picks the Megatron side: this package's safetensors per rank (default) or
torch_dist (megatron-core dist_checkpointing in Megatron-LM's layout). For torch_dist the
modules it imports (torch.distributed.checkpoint) are imported before the baseline is read:
they are a fixed cost, not memory that grows with the checkpoint.

Wall time of each direction against `cp -r` of the same input files, and peak RSS above the
interpreter's baseline against the checkpoint size. Each conversion runs in a fresh Python
process: it imports torch and checkpoint_convert, reads its peak RSS (the baseline), converts,
and reads its peak RSS again (VmHWM in /proc/self/status; `ru_maxrss` would
include the parent's peak, which Linux carries over fork + exec). Runs alternate with the
`cp -r` runs, so both see the same (warm) page cache. Before each timed step (conversion or
copy) the target is removed and `sync` flushes earlier steps' dirty pages, untimed, so no
step pays for another's writeback; nothing is fsynced inside a timed step by either side.

The generated model lives in /tmp (never in the repository) and is reused between runs.

    python benchmarks/conversion.py            # 5 repeats, ~3 min and ~4 GB of /tmp
    python benchmarks/conversion.py --format torch_dist --out /tmp/mcore_dpo_bench/conversion_torch_dist.json
    python benchmarks/conversion.py --tiny --repeats 1
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

# ~1.2 GB in fp32: 8 layers of hidden 1536, GQA (12 heads, 4 kv heads), vocab 32000, untied.
SHAPE = common.LlamaShape(hidden_size=1536, num_layers=8, num_heads=12, num_kv_heads=4,
                          intermediate_size=4096, vocab_size=32000)
TINY_SHAPE = common.LlamaShape(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                               intermediate_size=128, vocab_size=256)

_CONVERT = """
import json, time
from benchmarks.common import peak_rss_bytes
from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf_dir
if {fmt!r} == "torch_dist":
    import checkpoint_convert.torch_dist, torch.distributed.checkpoint
baseline = peak_rss_bytes()
start = time.perf_counter()
if {direction!r} == "hf_to_mcore":
    hf_to_mcore({src!r}, {dst!r}, tp=2, pp=2, overwrite=True, fmt={fmt!r}, log=lambda _m: None)
else:
    mcore_to_hf_dir({src!r}, {dst!r}, overwrite=True, log=lambda _m: None)
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak_rss_bytes()}}))
"""


def _settle(dst: Path) -> None:
    # Without this, whichever step follows a 1 GB write is throttled by the kernel's
    # writeback of the previous step's pages, and the ratios measure the disk, not the code.
    if dst.exists():
        shutil.rmtree(dst)
    subprocess.run(["sync"], check=True)


def convert_once(*, direction: str, src: Path, dst: Path, fmt: str) -> dict:
    _settle(dst)
    return common.run_python(_CONVERT.format(direction=direction, src=str(src), dst=str(dst), fmt=fmt))


def copy_once(*, src: Path, dst: Path) -> float:
    _settle(dst)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def round_trip_exact(original: Path, round_trip: Path) -> bool:
    from checkpoint_convert.io import open_hf_dir

    a, b = open_hf_dir(original), open_hf_dir(round_trip)
    return all(torch.equal(a.get(n), b.get(n)) for n in a.names)


def run(*, shape: common.LlamaShape, repeats: int, work_dir: Path, fmt: str = "safetensors") -> dict:
    hf_dir = common.write_random_llama(work_dir / "hf", shape=shape, dtype="float32")
    mcore_dir, back_dir, copy_dir = work_dir / f"mcore_{fmt}_tp2_pp2", work_dir / "hf_back", work_dir / "copy"
    hf_bytes = common.directory_bytes(hf_dir)
    samples: dict[str, list[float]] = {k: [] for k in (
        "hf_to_mcore_s", "mcore_to_hf_s", "cp_hf_s", "cp_mcore_s",
        "hf_to_mcore_rss_above_baseline_bytes", "mcore_to_hf_rss_above_baseline_bytes", "baseline_rss_bytes")}
    for _ in range(repeats):
        forward = convert_once(direction="hf_to_mcore", src=hf_dir, dst=mcore_dir, fmt=fmt)
        samples["cp_hf_s"].append(copy_once(src=hf_dir, dst=copy_dir))
        back = convert_once(direction="mcore_to_hf", src=mcore_dir, dst=back_dir, fmt=fmt)
        samples["cp_mcore_s"].append(copy_once(src=mcore_dir, dst=copy_dir))
        samples["hf_to_mcore_s"].append(forward["seconds"])
        samples["mcore_to_hf_s"].append(back["seconds"])
        for name, r in (("hf_to_mcore", forward), ("mcore_to_hf", back)):
            samples[f"{name}_rss_above_baseline_bytes"].append(r["peak_rss_bytes"] - r["baseline_rss_bytes"])
        samples["baseline_rss_bytes"].append(forward["baseline_rss_bytes"])
    stats = {k: common.summary(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in stats.items()}
    out = {
        "format": fmt,
        "shape": shape.__dict__,
        "checkpoint_bytes": hf_bytes,
        "mcore_bytes": common.directory_bytes(mcore_dir),
        "repeats": repeats,
        "stats": stats,
        "ratios": {
            "hf_to_mcore_over_cp": med["hf_to_mcore_s"] / med["cp_hf_s"],
            "mcore_to_hf_over_cp": med["mcore_to_hf_s"] / med["cp_mcore_s"],
            "round_trip_over_cp": (med["hf_to_mcore_s"] + med["mcore_to_hf_s"]) / (med["cp_hf_s"] + med["cp_mcore_s"]),
            "hf_to_mcore_rss_over_checkpoint": med["hf_to_mcore_rss_above_baseline_bytes"] / hf_bytes,
            "mcore_to_hf_rss_over_checkpoint": med["mcore_to_hf_rss_above_baseline_bytes"] / hf_bytes,
        },
        "round_trip_bit_exact": round_trip_exact(hf_dir, back_dir),
    }
    for path in (mcore_dir, back_dir):
        shutil.rmtree(path, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mcore_dpo_bench/conversion.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work-dir", default="/tmp/mcore_dpo_bench/conversion", help="keep it outside the repository")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--format", choices=("safetensors", "torch_dist"), default="safetensors")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    if common.REPO_ROOT in work.resolve().parents:
        raise SystemExit(f"--work-dir: {work} is inside the repository; use a path under /tmp")
    result = run(shape=TINY_SHAPE if args.tiny else SHAPE, repeats=args.repeats, work_dir=work, fmt=args.format)
    result["machine"] = common.machine()
    s, r, gib = result["stats"], result["ratios"], 2**30
    print(f"{args.format}: checkpoint {result['checkpoint_bytes'] / gib:.2f} GiB; round trip bit-exact: {result['round_trip_bit_exact']}")
    print(f"hf->mcore {common.fmt(s['hf_to_mcore_s'], digits=2)} s vs cp -r {common.fmt(s['cp_hf_s'], digits=2)} s: "
          f"x{r['hf_to_mcore_over_cp']:.2f}; RSS above baseline {r['hf_to_mcore_rss_over_checkpoint']:.1%} of the checkpoint")
    print(f"mcore->hf {common.fmt(s['mcore_to_hf_s'], digits=2)} s vs cp -r {common.fmt(s['cp_mcore_s'], digits=2)} s: "
          f"x{r['mcore_to_hf_over_cp']:.2f}; RSS above baseline {r['mcore_to_hf_rss_over_checkpoint']:.1%} of the checkpoint")
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()

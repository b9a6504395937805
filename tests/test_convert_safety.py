"""The converter's command line where it used to crash or pass things through (issue 44, items 6
and 9), each through `python -m checkpoint_convert`:

- verify answers when the port a free-port pick would give is taken (its store is bound by the
  process that serves it), refuses a layout the trainer's builder refuses before any rank starts
  (GPT-OSS at tp 2, ep 1), turns a rank's failure into one line with exit 2, and runs a
  Transformer Engine checkpoint on the CPU;
- custom code (*.py) travels through hf-to-mcore, reshard and mcore-to-hf only with
  --trust-remote-code, and a tokenizer.json that training could not load is refused up front.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.cli import run_python
from tests.helpers.gpt_oss import gpt_oss
from tests.helpers.models import llama_gqa_untied, save_hf, save_pretrained_with_tokenizer

CONVERT = ["-m", "checkpoint_convert"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_hf(llama_gqa_untied(), tmp_path_factory.mktemp("llama") / "hf")


def _convert(args: list[str], **kwargs):
    return run_python([*CONVERT, *map(str, args)], **kwargs)


def _hf_to_mcore(hf_dir: Path, out: Path, *flags: str) -> None:
    done = _convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out, *flags])
    assert done.returncode == 0, done.stderr


def _one_error_line(done) -> str:
    """The command failed with exit 2 and one line on stderr after its progress lines, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and done.stderr.rstrip().endswith(errors[0]), done.stderr[-3000:]
    return errors[0]


# --------------------------------------------------------------------------- verify

# Runs `checkpoint_convert verify` with the free-port helper answering a port this process holds
# (bound and listening): the port a rendezvous picked first and bound later would lose.
_TAKEN_PORT_WRAPPER = """
import socket
import sys

if __name__ == "__main__":
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]

    import mcore_dpo.parallel.ports as ports
    import mcore_dpo.tools.verify_runner as runner

    ports.free_port = lambda **_: port
    if hasattr(runner, "free_port"):
        runner.free_port = ports.free_port
    from checkpoint_convert.__main__ import main

    sys.exit(main(sys.argv[1:]))
"""

# Every spawned rank imports this script again (as __mp_main__): the patch below is made in the
# ranks, and rank 1 fails while loading its shard.
_FAILING_RANK_WRAPPER = """
import sys

import mcore_dpo.model.builder as builder

_load_shard = builder.load_shard


def _failing_load_shard(model, shard):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("injected by the test: rank 1 cannot load its shard")
    _load_shard(model, shard)


builder.load_shard = _failing_load_shard

if __name__ == "__main__":
    from checkpoint_convert.__main__ import main

    sys.exit(main(sys.argv[1:]))
"""


def test_verify_answers_when_the_port_a_free_port_pick_gives_is_taken(llama_dir, tmp_path):
    _hf_to_mcore(llama_dir, tmp_path / "m", "--pp", "2")
    wrapper = tmp_path / "taken_port.py"
    wrapper.write_text(_TAKEN_PORT_WRAPPER)
    done = run_python([str(wrapper), "verify", "--hf-dir", str(llama_dir), "--mcore-dir", str(tmp_path / "m")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("verify tp=1 pp=2: max |dlogit| ") and "argmax agreement 100.00%" in done.stdout


def test_verify_refuses_gpt_oss_at_tp2_ep1_before_any_rank_starts(tmp_path):
    hf_dir = save_pretrained_with_tokenizer(gpt_oss(seed=3), tmp_path / "hf")
    _hf_to_mcore(hf_dir, tmp_path / "m", "--tp", "2")
    done = _convert(["verify", "--hf-dir", hf_dir, "--mcore-dir", tmp_path / "m"])
    line = _one_error_line(done)
    assert "experts split over 2 tensor-parallel ranks" in line and str(tmp_path / "m") in line, line
    assert "resharded to --tp 1" in line, line
    assert "building the megatron model" not in done.stderr, done.stderr  # refused before the ranks
    assert done.stdout == ""


def test_a_failing_rank_is_one_line_with_exit_2(llama_dir, tmp_path):
    _hf_to_mcore(llama_dir, tmp_path / "m", "--pp", "2")
    wrapper = tmp_path / "failing_rank.py"
    wrapper.write_text(_FAILING_RANK_WRAPPER)
    done = run_python([str(wrapper), "verify", "--hf-dir", str(llama_dir), "--mcore-dir", str(tmp_path / "m")])
    line = _one_error_line(done)
    assert line == "error: verify: megatron rank 1: injected by the test: rank 1 cannot load its shard", line
    assert done.stdout == ""


def test_verify_runs_a_transformer_engine_checkpoint_on_the_cpu(llama_dir, tmp_path):
    """A checkpoint written with Transformer Engine's names (as a GPU run writes) is verified by
    the local spec on the CPU, its norm names translated."""
    _hf_to_mcore(llama_dir, tmp_path / "m", "--pp", "2", "--layer-spec", "te")
    done = _convert(["verify", "--hf-dir", llama_dir, "--mcore-dir", tmp_path / "m"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "argmax agreement 100.00%" in done.stdout, done.stdout


# --------------------------------------------------------------------------- custom code, tokenizer


@pytest.fixture(scope="module")
def custom_code_dir(llama_dir, tmp_path_factory) -> Path:
    """The llama directory with custom model code that its config's auto_map names."""
    out = tmp_path_factory.mktemp("custom") / "hf"
    shutil.copytree(llama_dir, out)
    (out / "modeling_custom.py").write_text("raise SystemExit('custom code ran')\n")
    (out / "configuration_custom.py").write_text("raise SystemExit('custom code ran')\n")
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig",
                          "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _py_files(directory: Path) -> set[str]:
    return {p.name for p in directory.rglob("*.py")}


def _left_out_note(done, command: str) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith(f"{command}: left out custom code")]


@pytest.mark.parametrize("fmt", ["safetensors", "torch_dist"])
def test_custom_code_travels_only_with_trust_remote_code(custom_code_dir, tmp_path, fmt):
    code = {"configuration_custom.py", "modeling_custom.py"}
    runs = {}  # (command, --trust-remote-code given) -> its run
    for trust in (False, True):
        out = tmp_path / f"hf-to-mcore_{trust}"
        runs["hf-to-mcore", trust] = _convert(["hf-to-mcore", "--hf-dir", custom_code_dir, "--out", out,
                                               "--format", fmt, *(["--trust-remote-code"] if trust else [])])
    # From the checkpoint that holds the code, the other two commands copy it only when asked too.
    for command, extra in (("reshard", ["--tp", "1", "--pp", "2"]), ("mcore-to-hf", [])):
        for trust in (False, True):
            out = tmp_path / f"{command}_{trust}"
            runs[command, trust] = _convert([command, "--mcore-dir", tmp_path / "hf-to-mcore_True", "--out", out,
                                             *extra, *(["--trust-remote-code"] if trust else [])])
    for (command, trust), done in runs.items():
        assert done.returncode == 0, (command, done.stderr)
        assert _py_files(tmp_path / f"{command}_{trust}") == (code if trust else set()), command
        notes = _left_out_note(done, command)
        if trust:
            assert notes == [], done.stderr
        else:
            assert len(notes) == 1, done.stderr
            assert "configuration_custom.py, modeling_custom.py" in notes[0] and "--trust-remote-code" in notes[0]


@pytest.mark.parametrize("damage", ["truncated", "not_a_tokenizer"])
def test_a_tokenizer_json_training_cannot_load_is_refused(llama_dir, tmp_path, damage):
    hf_dir = tmp_path / "hf"
    shutil.copytree(llama_dir, hf_dir)
    tokenizer = hf_dir / "tokenizer.json"
    text = tokenizer.read_text()
    tokenizer.write_text(text[: len(text) // 2] if damage == "truncated" else json.dumps({"version": "1.0"}))
    out = tmp_path / "m"
    line = _one_error_line(_convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out]))
    assert f"{tokenizer}:" in line, line
    assert not out.exists()


def test_a_checkpoint_with_a_truncated_tokenizer_json_is_refused_by_reshard_and_mcore_to_hf(llama_dir, tmp_path):
    _hf_to_mcore(llama_dir, tmp_path / "m")
    tokenizer = tmp_path / "m" / "hf_files" / "tokenizer.json"
    text = tokenizer.read_text()
    tokenizer.write_text(text[: len(text) // 2])
    for command, extra in (("reshard", ["--tp", "1", "--pp", "2"]), ("mcore-to-hf", [])):
        out = tmp_path / command
        line = _one_error_line(_convert([command, "--mcore-dir", tmp_path / "m", "--out", out, *extra]))
        assert "tokenizer.json" in line, line
        assert not out.exists()

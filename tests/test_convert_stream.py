"""checkpoint_convert.safetensors_stream and the streaming conversions built on it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert import convert
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.gather import mcore_to_hf
from checkpoint_convert.mapping import hf_tensor_shapes, hf_to_mcore_shard
from checkpoint_convert.safetensors_stream import SafetensorsReader, SafetensorsWriter, write_tensors
from tests.helpers.cli import command_env, run_python

REPO_ROOT = Path(__file__).resolve().parents[1]


def _sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w_bf16": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "w_f16": torch.randn(3, 2, 2, generator=gen).to(torch.float16),
        "w_f32": torch.randn(11, generator=gen),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }


def test_writer_output_loads_with_safetensors(tmp_path):
    tensors = _sample_tensors()
    write_tensors(tmp_path / "a.safetensors", tensors)
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    header_bytes = struct.unpack("<Q", (tmp_path / "a.safetensors").read_bytes()[:8])[0]
    assert header_bytes % 8 == 0
    header = json.loads((tmp_path / "a.safetensors").read_bytes()[8 : 8 + header_bytes])
    assert header["__metadata__"] == {"format": "pt"}


def test_reader_reads_reference_files_and_row_ranges(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    with SafetensorsReader(tmp_path / "ref.safetensors") as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        assert reader.metadata == {"format": "pt"}
        for name, tensor in tensors.items():
            got = reader.read(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert torch.equal(reader.read("w_bf16", rows=(1, 4)), tensors["w_bf16"][1:4])
        assert reader.read("w_bf16", rows=(2, 2)).shape == (0, 7)


def test_writer_accepts_row_blocks(tmp_path):
    big = torch.randn(10, 3).to(torch.bfloat16)
    path = tmp_path / "rows.safetensors"
    with SafetensorsWriter(path, tensors=[("big", torch.bfloat16, (10, 3)), ("n", torch.float32, (2,))]) as writer:
        writer.write_rows("big", big[:4])
        writer.write_rows("big", big[4:])
        writer.write("n", torch.ones(2))
    loaded = load_file(str(path))
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["n"], torch.ones(2))


@pytest.mark.parametrize(
    "misuse,message",
    [
        (lambda w: w.write("b", torch.zeros(2)), "expected 'a' next"),
        (lambda w: w.write("a", torch.zeros(3)), "has shape [3], declared [2]"),
        (lambda w: w.write("a", torch.zeros(2, dtype=torch.bfloat16)), "dtype torch.bfloat16, declared torch.float32"),
        (lambda w: w.write_rows("a", torch.zeros(5)), "does not fit the declared [2]"),
    ],
)
def test_writer_misuse_raises(tmp_path, misuse, message):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", tensors=[("a", torch.float32, (2,)), ("b", torch.float32, (2,))])
    with pytest.raises(ValueError, match=None) as info:
        misuse(writer)
    assert message in str(info.value)
    writer.abort()


def test_writer_close_before_all_written_raises(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", tensors=[("a", torch.float32, (2,)), ("b", torch.float32, (2,))])
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="closed before tensor 'b'"):
        writer.close()


def _raw_file(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\x05\x00", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 1000) + b"{}", "truncated: header of 1000 bytes"),
        (struct.pack("<Q", 4) + b"nope", "header is not valid JSON"),
        (_raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "truncated: tensor 'a'"),
        (
            _raw_file(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            "tensor 'b': data_offsets overlaps the previous tensor",
        ),
        (_raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9), "1 trailing bytes"),
        (_raw_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "shape [3] of F32 needs 12"),
        (_raw_file({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2), "tensor 'a': unsupported dtype 'Q4'"),
    ],
)
def test_reader_rejects_bad_files_with_one_line(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ConversionError) as info:
        SafetensorsReader(path)
    text = str(info.value)
    assert str(path) in text and message in text and "\n" not in text


def test_truncated_real_checkpoint_names_the_tensor(tmp_path):
    tensors = {"first.weight": torch.randn(4, 4), "second.weight": torch.randn(4, 4)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ConversionError, match="truncated: tensor 'second.weight'"):
        SafetensorsReader(path)


# ---------------------------------------------------------------------------------------
# Streaming conversions agree with the mapping's whole-shard functions
# ---------------------------------------------------------------------------------------


def _llama_config(*, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, tied: bool, family: str = "llama") -> dict:
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    return {
        "architectures": [architecture], "model_type": family, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
        "vocab_size": vocab, "tie_word_embeddings": tied, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
        "hidden_act": "silu", "torch_dtype": "float32",
    }  # fmt: skip


def _write_random_hf(directory: Path, config: dict, *, dtype: torch.dtype = torch.float32) -> Path:
    """A random HF checkpoint written tensor by tensor (never whole in memory)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    shapes = hf_tensor_shapes(spec_from_hf_config(config))
    gen = torch.Generator().manual_seed(1)
    with SafetensorsWriter(directory / "model.safetensors", tensors=[(n, dtype, s) for n, s in shapes.items()]) as writer:
        for name, shape in shapes.items():
            writer.write(name, torch.randn(shape, generator=gen).to(dtype))
    return directory


@pytest.mark.parametrize(
    "family,tied,tp,pp", [("llama", False, 2, 2), ("qwen2", True, 2, 3), ("llama", True, 4, 1)]
)
def test_streamed_shards_equal_mapping_shards(tmp_path, family, tied, tp, pp):
    config = _llama_config(hidden=32, layers=3, heads=8, kv_heads=4, inter=48, vocab=300, tied=tied, family=family)
    hf_dir = _write_random_hf(tmp_path / "hf", config, dtype=torch.bfloat16)
    convert.hf_to_mcore(hf_dir, tmp_path / "m", tp=tp, pp=pp, divisor=8, log=lambda _m: None)
    source, written = open_hf_dir(hf_dir), open_mcore_dir(tmp_path / "m")
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            expected = hf_to_mcore_shard(source.spec, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, get=source.get, divisor=8)
            got = written.shard(tp_rank, pp_rank)
            assert list(got) == list(expected)
            assert all(torch.equal(got[n], expected[n]) and got[n].dtype == torch.bfloat16 for n in expected)
    convert.mcore_to_hf_dir(tmp_path / "m", tmp_path / "back", max_shard_bytes=3000, log=lambda _m: None)
    back = open_hf_dir(tmp_path / "back")
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 3  # entries straddle shard files
    reference = mcore_to_hf(written.spec, tp=tp, pp=pp, get_shard=written.shard_view)
    for name, tensor in reference:
        assert torch.equal(back.get(name), tensor) and torch.equal(tensor, source.get(name)), name


def test_interrupt_mid_stage_leaves_no_output(tmp_path, monkeypatch):
    hf_dir = _write_random_hf(tmp_path / "hf", _llama_config(hidden=32, layers=2, heads=4, kv_heads=2, inter=64, vocab=128, tied=False))
    calls = []
    real_write = SafetensorsWriter.write

    def write_then_interrupt(self, name, tensor):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert.hf_to_mcore(hf_dir, tmp_path / "out", tp=2, pp=2, divisor=8, log=lambda _m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---------------------------------------------------------------------------------------
# Peak memory of a real-size conversion, in a fresh process
# ---------------------------------------------------------------------------------------

_MEMORY_SCRIPT = """
import json, sys
def peak_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf_dir
import torch
torch.zeros(1).sum()  # first-op initialisation belongs to the baseline, not the conversion
hf, mcore, back = sys.argv[1:4]
baseline = peak_bytes()
hf_to_mcore(hf, mcore, tp=2, pp=2, log=lambda _m: None)
after_forward = peak_bytes()
mcore_to_hf_dir(mcore, back, log=lambda _m: None)
print(json.dumps({"baseline": baseline, "forward": after_forward, "back": peak_bytes()}))
"""


def test_round_trip_peak_rss_is_a_fraction_of_the_checkpoint(tmp_path):
    # ~200 MB fp32: the vocabulary tensors (33 MB each) and the MLP entries dominate.
    config = _llama_config(hidden=512, layers=10, heads=8, kv_heads=4, inter=1408, vocab=16000, tied=False)
    hf_dir = _write_random_hf(tmp_path / "hf", config)
    checkpoint_bytes = (hf_dir / "model.safetensors").stat().st_size
    assert checkpoint_bytes > 180 * 10**6
    env = command_env(PYTHONPATH=str(REPO_ROOT))
    result = run_python(["-c", _MEMORY_SCRIPT, str(hf_dir), str(tmp_path / "m"), str(tmp_path / "back")], env=env,
                        timeout=120, check=True)
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    assert peaks["back"] - peaks["baseline"] <= 0.25 * checkpoint_bytes, (peaks, checkpoint_bytes)
    source, back = open_hf_dir(hf_dir), open_hf_dir(tmp_path / "back")
    assert back.names == source.names
    assert all(torch.equal(source.get(n), back.get(n)) for n in source.names)

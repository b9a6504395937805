"""Start-up reads: each tensor-parallel rank reads only its own rows and columns of the weights.

`mapping.hf_to_mcore_shard` asks the reader for each HF tensor's part a rank holds
(`get_part`); every reader (an HF directory, hub or fused experts; this package's Megatron
directory at any tp, pp, ep; torch_dist) reads only those parts. These tests count the bytes
each rank reads (the readers' own counters, checked against a counting wrapper around the file
reads) at tp 1, 2 and 4, and check that every rank's shard is bit for bit the one cut from the
whole tensors. Printed with `-s`: the exact counts docs/MODELS.md quotes.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from checkpoint_convert import convert
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.gather import stored_group_pieces, stored_pieces, unfuse_groups
from checkpoint_convert.mapping import (
    entry_slices,
    hf_tensor_shapes,
    hf_to_mcore_shard,
    mcore_entries,
    padded_vocab_size,
    split_entry,
)
from tests.helpers.models import hf_state, llama_gqa_untied, qwen2_bias_tied, save_hf, save_tokenizer

QUIET = {"log": lambda *_: None}
TPS = (1, 2, 4)


def _even_llama() -> LlamaForCausalLM:
    """A bf16 Llama whose vocabulary (1024) splits evenly at tp 1, 2 and 4 (no padding rows)."""
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _shards(open_weights, spec: ModelSpec, *, tp: int, pp: int = 1, ep: int = 1) -> list[tuple[dict, int]]:
    """(shard, bytes read) of every rank of the layout, each rank with a freshly opened reader
    (as each training rank opens its own)."""
    out = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                weights = open_weights()
                shard = hf_to_mcore_shard(spec, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank,
                                          get=weights.get, get_part=weights.get_part)
                out.append((shard, weights.bytes_read))
    return out


def _assert_bit_identical(open_weights, source: dict[str, torch.Tensor], spec: ModelSpec, layouts, what: str) -> None:
    """Every rank's shard equals the one cut from the whole HF tensors (today's loading)."""
    for tp, pp, ep in layouts:
        expected = [hf_to_mcore_shard(spec, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e, get=source.__getitem__)
                    for p in range(pp) for t in range(tp) for e in range(ep)]
        for (shard, _), want in zip(_shards(open_weights, spec, tp=tp, pp=pp, ep=ep), expected):
            assert list(shard) == list(want), (what, tp, pp, ep)
            for name, tensor in shard.items():
                assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), (what, tp, pp, ep, name)


def _replicated_bytes(spec: ModelSpec) -> int:
    """Bytes of the tensors every tp rank holds whole (the norms, the router)."""
    shapes = hf_tensor_shapes(spec)
    element = torch.empty((), dtype=getattr(torch, spec.torch_dtype)).element_size()
    return sum(math.prod(shapes[t.format(layer=layer)]) * element
               for _, kind, hf, _, layer in mcore_entries(spec, pp=1, pp_rank=0) if kind == "replicated" for t in hf)


def _own_bytes(spec: ModelSpec, *, tp: int, tp_rank: int) -> int:
    """The bytes of the rank's own part (pp 1, ep 1), from the shapes alone: replicated tensors
    whole, the rank's real rows of each vocabulary tensor, 1/tp of every other tensor."""
    shapes = hf_tensor_shapes(spec)
    element = torch.empty((), dtype=getattr(torch, spec.torch_dtype)).element_size()
    rows = padded_vocab_size(spec.vocab_size, tp=tp) // tp
    own_rows = max(0, min(spec.vocab_size, (tp_rank + 1) * rows) - tp_rank * rows)
    total = 0
    for _, kind, hf, _, layer in mcore_entries(spec, pp=1, pp_rank=0):
        for template in hf:
            size = math.prod(shapes[template.format(layer=layer)]) * element
            total += {"replicated": size, "vocab": own_rows * spec.hidden_size * element}.get(kind, size // tp)
    return total


@pytest.fixture(scope="module")
def even_dirs(tmp_path_factory):
    """The even Llama as an HF directory (three shard files), this package's format at tp 2 x
    pp 2 and torch_dist at tp 4."""
    root = tmp_path_factory.mktemp("rank_reads")
    model = _even_llama()
    hf = save_hf(model, root / "hf", num_shards=3)
    convert.hf_to_mcore(hf, root / "mcore_tp2pp2", tp=2, pp=2, **QUIET)
    convert.hf_to_mcore(hf, root / "torch_dist_tp4", tp=4, pp=1, fmt="torch_dist", **QUIET)
    return {"hf": hf, "mcore": root / "mcore_tp2pp2", "torch_dist": root / "torch_dist_tp4", "state": hf_state(model)}


def test_each_rank_reads_its_own_part_hf_and_mcore(even_dirs, monkeypatch):
    """HF safetensors and this package's format read exact bytes: at tp k every rank reads
    (B1 - R) / k + R, with B1 the bytes rank 0 reads at tp 1 (every tensor once) and R the
    replicated norms. So tp 2 reads half of tp 1 plus half of R, tp 4 a quarter plus 3/4 R."""
    spec = open_hf_dir(even_dirs["hf"]).spec
    total = sum(t.numel() * t.element_size() for t in even_dirs["state"].values())
    replicated = _replicated_bytes(spec)
    preadv = os.preadv
    counted = [0]

    def counting_preadv(fd, buffers, offset, *args):  # the file reads the readers make
        got = preadv(fd, buffers, offset, *args)
        counted[0] += got
        return got

    monkeypatch.setattr(os, "preadv", counting_preadv)
    table = {}
    from mcore_dpo.model.builder import open_weights as trainer_open  # what the trainer's ranks open

    for fmt, open_weights in (("hf", lambda: trainer_open(str(even_dirs["hf"]))),
                              ("mcore tp2 pp2", lambda: trainer_open(str(even_dirs["mcore"])))):
        for tp in TPS:
            counted[0] = 0
            reads = [count for _, count in _shards(open_weights, spec, tp=tp)]
            assert sum(reads) == counted[0], (fmt, tp)  # the counters are the file reads
            table[(fmt, tp)] = reads
            assert reads == [(total - replicated) // tp + replicated] * tp, (fmt, tp, reads)
            assert reads == [_own_bytes(spec, tp=tp, tp_rank=t) for t in range(tp)]
    for fmt in ("hf", "mcore tp2 pp2"):
        tp1, tp2 = table[(fmt, 1)][0], table[(fmt, 2)][0]
        assert tp1 == total and tp2 == (tp1 + replicated) // 2 and tp2 < 0.51 * tp1
    print(f"\nbytes read per rank (payload {total}, replicated {replicated}):")
    for (fmt, tp), reads in table.items():
        print(f"  {fmt:14s} tp {tp}: {reads}")


def test_torch_dist_ranks_load_only_the_chunks_they_need(even_dirs):
    """torch_dist stores each tp rank's part as chunks (torch.save records, loaded whole), here
    written at tp 4, so a rank at tp 1, 2 or 4 loads exactly the chunks of its part: the ranks
    together load every chunk once plus the replicated ones (R, written once) once more per
    extra rank, and each rank (B1 - R) / k + R."""
    spec = open_hf_dir(even_dirs["hf"]).spec

    from mcore_dpo.model.builder import open_weights as trainer_open

    def open_weights():
        return trainer_open(str(even_dirs["torch_dist"]))

    reads = {tp: [count for _, count in _shards(open_weights, spec, tp=tp)] for tp in TPS}
    (whole,) = reads[1]
    replicated = sum(reads[2]) - whole
    assert 0 < replicated < 0.1 * whole
    assert sum(reads[4]) - whole == 3 * replicated
    for tp in TPS:
        assert reads[tp] == [(whole - replicated) // tp + replicated] * tp, (tp, reads[tp])
    print(f"\ntorch_dist written at tp 4, bytes loaded per rank (chunks {whole}, replicated {replicated}):")
    for tp, counts in reads.items():
        print(f"  tp {tp}: {counts}")


@pytest.mark.parametrize("factory", [llama_gqa_untied, qwen2_bias_tied], ids=lambda f: f.__name__)
def test_shards_are_bit_identical_for_every_format_dense(tmp_path, even_dirs, factory):
    """A vocabulary of 100 (at tp 2 the second rank's rows are all padding), fp32 models in one
    file (Qwen2: q/k/v biases, tied embeddings), this package's format at tp 2 pp 2 and tp 4,
    torch_dist at tp 2, each read at tp 1, 2, 4 and pp 1, 2, 4; and the even bf16 model from its
    three formats."""
    model = factory()
    source = hf_state(model)
    hf = save_hf(model, tmp_path / "hf")
    convert.hf_to_mcore(hf, tmp_path / "m22", tp=2, pp=2, **QUIET)
    convert.hf_to_mcore(hf, tmp_path / "m41", tp=4, pp=1, **QUIET)
    convert.hf_to_mcore(hf, tmp_path / "td", tp=2, pp=1, fmt="torch_dist", **QUIET)
    spec = open_hf_dir(hf).spec
    layouts = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1)]
    _assert_bit_identical(lambda: open_hf_dir(hf), source, spec, layouts, "hf")
    for name in ("m22", "m41", "td"):
        _assert_bit_identical(lambda: open_mcore_dir(tmp_path / name).hf_view(), source, spec, layouts, name)
    even = open_hf_dir(even_dirs["hf"]).spec
    for name, open_weights in (("even hf", lambda: open_hf_dir(even_dirs["hf"])),
                               ("even mcore", lambda: open_mcore_dir(even_dirs["mcore"]).hf_view()),
                               ("even torch_dist", lambda: open_mcore_dir(even_dirs["torch_dist"]).hf_view())):
        _assert_bit_identical(open_weights, even_dirs["state"], even, [(1, 1, 1), (2, 2, 1), (4, 1, 1)], name)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_every_format_bit_identical_and_tp2_reads_half_the_experts(tmp_path, family):
    """Qwen3-MoE (a dense layer among its MoE layers) and Mixtral (tied) from the hub form, the
    fused form (transformers 5's in-memory tensors, sliced in the file), this package's format at
    tp 2 ep 2 (experts whole on their ep rank) and tp 2 pp 2, and torch_dist at tp 2 ep 2. The
    byte-exact readers read the same counts whatever the format; at tp 2 (ep 1) a rank reads
    (B1 - R) / 2 + R, the experts split like a dense MLP."""
    from tests.helpers.models import mixtral, qwen3_moe

    model = qwen3_moe(seed=5, num_layers=4) if family == "qwen3_moe" else mixtral(seed=6)
    model.save_pretrained(str(tmp_path / "hub"))
    save_tokenizer(tmp_path / "hub")
    save_hf(model, tmp_path / "fused")
    hub = open_hf_dir(tmp_path / "hub")
    assert any(name.endswith("experts.gate_up_proj") for name in open_hf_dir(tmp_path / "fused")._file_of)
    spec = hub.spec
    source = {name: hub.get(name) for name in hub.names}
    convert.hf_to_mcore(tmp_path / "hub", tmp_path / "ep2", tp=2, pp=1, ep=2, **QUIET)
    convert.hf_to_mcore(tmp_path / "hub", tmp_path / "pp2", tp=2, pp=2, **QUIET)
    convert.hf_to_mcore(tmp_path / "hub", tmp_path / "td", tp=2, pp=1, ep=2, fmt="torch_dist", **QUIET)
    readers = {"hub": lambda: open_hf_dir(tmp_path / "hub"), "fused": lambda: open_hf_dir(tmp_path / "fused"),
               **{name: (lambda name=name: open_mcore_dir(tmp_path / name).hf_view()) for name in ("ep2", "pp2", "td")}}
    layouts = [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 1, 4), (1, 2, 2)]
    counts = {}
    for name, open_weights in readers.items():
        _assert_bit_identical(open_weights, source, spec, layouts, name)
        counts[name] = {tp: [c for _, c in _shards(open_weights, spec, tp=tp)] for tp in (1, 2)}
    total = sum(t.numel() * t.element_size() for t in source.values())
    replicated = _replicated_bytes(spec)
    own = {tp: [_own_bytes(spec, tp=tp, tp_rank=t) for t in range(tp)] for tp in (1, 2)}
    assert own[1] == [total]
    for name in ("hub", "fused", "ep2", "pp2"):
        assert counts[name] == own, (name, counts[name])
    # Without the vocabulary's padding rows (here a rank of its own) tp 2 reads (B1 - R) / 2 + R.
    vocab = sum(math.prod(source[n].shape) * source[n].element_size() for n in ("model.embed_tokens.weight", "lm_head.weight")
                if n in source)
    assert sum(own[2]) == total + replicated and max(own[2]) <= (total - replicated - vocab) // 2 + replicated + vocab
    print(f"\n{family} bytes read per rank (payload {total}, replicated {replicated}): {counts}")


@pytest.mark.parametrize("kind", ["vocab", "qkv", "fc1", "row", "replicated"])
def test_stored_pieces_reassemble_every_part_the_mapping_asks_for(kind):
    """The pure translation: a part of an HF tensor read from a tp_s-way split checkpoint (its
    pieces, concatenated) equals the part cut from the whole tensor, for every run tp, rank and
    stored tp_s."""
    spec = ModelSpec(architecture="LlamaForCausalLM", family="llama", vocab_size=200, hidden_size=8,
                     intermediate_size=16, num_layers=1, num_heads=8, num_query_groups=4, head_dim=2,
                     rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, qkv_bias=False,
                     max_position_embeddings=64, torch_dtype="float32")
    generator = torch.Generator().manual_seed(0)
    shapes = {"vocab": [(200, 8)], "qkv": [(16, 8), (8, 8), (8, 8)], "fc1": [(16, 8), (16, 8)], "row": [(8, 16)],
              "replicated": [(8,)]}[kind]
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    for stored_tp in TPS:
        padded = 512 if stored_tp == 4 else 256
        if kind == "vocab":
            padded_whole = torch.cat([tensors[0], torch.zeros(padded - 200, 8)])
            stored = list(padded_whole.chunk(stored_tp))
        else:
            stored = [split_entry(spec, kind=kind, tensors=tensors, tp=stored_tp, tp_rank=s) for s in range(stored_tp)]
        for tp in TPS:
            for rank in range(tp):
                if kind == "vocab":
                    rows = 256 // tp
                    slices = [(0, min(rank * rows, 200), min((rank + 1) * rows, 200))]
                else:
                    slices = entry_slices(spec, kind=kind, shapes=shapes, tp=tp, tp_rank=rank)
                for index, (tensor, (dim, start, stop)) in enumerate(zip(tensors, slices)):
                    want = tensor.narrow(dim, start, stop - start)
                    if kind == "qkv":
                        (g0, g1), pieces = stored_group_pieces(spec, index=index, start=start, stop=stop, tp=stored_tp)
                        got = unfuse_groups(spec, torch.cat([stored[s][lo:hi] for s, lo, hi in pieces]))[index]
                    else:
                        pieces = stored_pieces(spec, kind=kind, index=index, dim=dim, start=start, stop=stop,
                                               size=tensor.shape[dim], tp=stored_tp, padded_vocab=padded)
                        got = torch.cat([stored[s].narrow(dim, lo, hi - lo) for s, lo, hi in pieces], dim=dim)
                    assert torch.equal(got, want), (kind, stored_tp, tp, rank, index)


def test_llama3_70b_node_reads_one_stage_not_eight():
    """The Llama-3-70B config (tp 8 x pp 4, one stage per node): a rank asks for its part only,
    so a node's eight ranks read its stage once plus 7 copies of the norms, where whole-tensor
    reads read the stage eight times (twice: the policy and the reference). Counted on the
    meta device: the bytes of the parts hf_to_mcore_shard asks for."""
    spec = ModelSpec(architecture="LlamaForCausalLM", family="llama", vocab_size=128256, hidden_size=8192,
                     intermediate_size=28672, num_layers=80, num_heads=64, num_query_groups=8, head_dim=128,
                     rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None, tie_word_embeddings=False, qkv_bias=False,
                     max_position_embeddings=8192, torch_dtype="bfloat16")
    shapes = hf_tensor_shapes(spec)
    asked, whole = [0], [0]

    def get(name):
        whole[0] += math.prod(shapes[name]) * 2
        return torch.empty(shapes[name], dtype=torch.bfloat16, device="meta")

    def get_part(name, dim, start, stop):
        size = list(shapes[name])
        size[dim] = stop - start
        asked[0] += math.prod(size) * 2
        return torch.empty(size, dtype=torch.bfloat16, device="meta")

    def no_whole_reads(name):
        raise AssertionError(f"'{name}' read whole")

    nodes = []
    for pp_rank in range(4):
        layers = range(20 * pp_rank, 20 * (pp_rank + 1))
        names = [n for n in shapes if n.startswith("model.layers.") and int(n.split(".")[2]) in layers]
        names += ["model.embed_tokens.weight"] if pp_rank == 0 else []
        names += ["model.norm.weight", "lm_head.weight"] if pp_rank == 3 else []
        stage = sum(math.prod(shapes[n]) * 2 for n in names)
        norms = sum(math.prod(shapes[n]) * 2 for n in names if n.endswith("norm.weight"))
        asked[0] = whole[0] = 0
        for tp_rank in range(8):
            hf_to_mcore_shard(spec, tp=8, tp_rank=tp_rank, pp=4, pp_rank=pp_rank, get=no_whole_reads, get_part=get_part)
        hf_to_mcore_shard(spec, tp=8, tp_rank=0, pp=4, pp_rank=pp_rank, get=get)  # one rank, whole tensors
        assert whole[0] == stage and asked[0] == stage + 7 * norms, pp_rank
        nodes.append((asked[0], 8 * whole[0]))
    assert all(new < before / 7.99 for new, before in nodes)
    print("\nLlama-3-70B tp 8 pp 4, bytes a node's 8 ranks read per model, by stage: "
          f"{[new for new, _ in nodes]} (whole tensors: {[before for _, before in nodes]})")

"""Bit layout of pack-quantized int32 words, with fixed expected values."""

import pytest
import torch

from quantkit.quant.packing import pack_int32, packed_size, unpack_int32


def test_int4_fixed_words():
    # codes -8..7 are stored as 0..15, element i at bits 4i..4i+3
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)
    packed = pack_int32(q, 4)
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[0x76543210, 0xFEDCBA98 - 2**32]]  # 1985229328, -19088744


def test_int8_fixed_word():
    q = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)  # stored 0, 127, 128, 255
    assert pack_int32(q, 8).tolist() == [[0xFF807F00 - 2**32]]


def test_int3_fixed_words_straddle_the_word_boundary():
    # codes -4..3 stored as 0..7, one dense bit stream: element 10 (stored 7 = 0b111) has its two low bits
    # at bits 30-31 of word 0 and its top bit at bit 0 of word 1
    stored = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 7]
    q = torch.tensor([[u - 4 for u in stored]], dtype=torch.int8)
    packed = pack_int32(q, 3)
    assert packed.tolist() == [[0xD11F58D1 - 2**32, 0x00000001]]
    assert unpack_int32(packed, 3, 11).tolist() == q.tolist()


def test_int4_zero_point_packs_along_output_dim():
    zp = torch.arange(-8, 1, dtype=torch.int8).reshape(9, 1)  # [out=9, groups=1]
    packed = pack_int32(zp, 4, dim=0)
    assert packed.shape == (2, 1)  # ceil(9 * 4 / 32) words per group
    # rows 0..7 hold codes 0..7 -> 0x76543210; row 8 holds code 8, the padding bits are zero
    assert packed[0, 0].item() == 0x76543210
    assert packed[1, 0].item() == 0x00000008


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape", [(3, 64), (5, 40), (1, 7), (2, 97)])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip(bits, shape, dim):
    gen = torch.Generator().manual_seed(bits * 100 + shape[1])
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int8)
    packed = pack_int32(q, bits, dim=dim)
    n = shape[dim]
    expected = list(shape)
    expected[dim] = packed_size(n, bits)
    assert list(packed.shape) == expected
    assert torch.equal(unpack_int32(packed, bits, n, dim=dim), q)


def test_matches_compressed_tensors_library():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (6, 96), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    assert torch.equal(pack_int32(q, 4), ct.pack_to_int32(q, 4))
    zp = torch.randint(-8, 8, (20, 3), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    assert torch.equal(pack_int32(zp, 4, dim=0), ct.pack_to_int32(zp, 4, packed_dim=0))
    q8 = torch.randint(-128, 128, (4, 12), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    assert torch.equal(pack_int32(q8, 8), ct.pack_to_int32(q8, 8))


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7])
@pytest.mark.parametrize("dim", [0, 1])
def test_every_width_matches_compressed_tensors_library(bits, dim):
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.randint(lo, hi, (7, 131), generator=torch.Generator().manual_seed(bits), dtype=torch.int8)
    q = q if dim == 1 else q.t().contiguous()
    packed = pack_int32(q, bits, dim=dim)
    assert torch.equal(packed, ct.pack_to_int32(q, bits, packed_dim=dim))
    assert torch.equal(ct.unpack_from_int32(packed, bits, q.shape, packed_dim=dim), q)


def test_streamed_shards_are_byte_for_byte_safetensors_files(tmp_path):
    """The shard writer streams each tensor to disk as it comes and lays the file out itself: its bytes
    must equal safetensors' own writer's for the same tensors (every dtype we write, names that sort in
    tricky ways, and shards split by size)."""
    import json

    from safetensors.torch import save_file

    from quantkit.formats.checkpoint import ST_DTYPES, ShardWriter

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i, (name, dtype) in enumerate(ST_DTYPES.items()):
        shape = (3 + i, 2) if i % 2 else (5 + i,)
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        t = raw.view(dtype).reshape(shape) if dtype != torch.bool else raw[: torch.Size(shape).numel()].remainder(2).bool().reshape(shape)
        tensors[f"model.layers.{i}.{name.lower()}"] = t
        tensors[f"model.layers.{i}_{name.lower()}"] = t.clone()  # "_" sorts after "."
    one = tmp_path / "one"
    one.mkdir()
    writer = ShardWriter(one)
    for k, t in tensors.items():
        writer.add(k, t)
    writer.close()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (one / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    many = tmp_path / "many"
    many.mkdir()
    writer = ShardWriter(many, max_shard_bytes=100)
    for k, t in tensors.items():
        writer.add(k, t)
    files = writer.close()
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert len(files) > 3 and sorted(index["weight_map"]) == sorted(tensors)
    for f in files:  # each shard equals safetensors' file of the tensors it holds
        held = {k: tensors[k] for k, v in index["weight_map"].items() if v == f.name}
        save_file(held, str(tmp_path / "part.safetensors"), metadata={"format": "pt"})
        assert f.read_bytes() == (tmp_path / "part.safetensors").read_bytes()
    assert sorted(p.name for p in many.iterdir()) == sorted([f.name for f in files] + ["model.safetensors.index.json"])
    # with a plan (every tensor known first: each written once, in place), pieces included: the same files
    for limit, name in ((2 << 30, "planned-one"), (100, "planned-many")):
        out = tmp_path / name
        out.mkdir()
        writer = ShardWriter(out, max_shard_bytes=limit, plan=[(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
        for i, (k, t) in enumerate(tensors.items()):
            if i % 3 == 0 and t.dtype != torch.bool:
                writer.add_pieces(k, t.dtype, tuple(t.shape), list(t.reshape(-1).split(2)))
            else:
                writer.add(k, t)
        writer.close()
        ref = one if limit > 100 else many
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
        assert all((out / p.name).read_bytes() == p.read_bytes() for p in ref.iterdir())
    with pytest.raises(ValueError, match="plan"):
        ShardWriter(tmp_path / "planned-one", plan=[("a", torch.float32, (2,))]).add("b", torch.zeros(2))

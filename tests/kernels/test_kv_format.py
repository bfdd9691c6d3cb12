"""Packed cache records: the reference (``kv_format.py``) against a per-element definition written from the formulas
(``tests/helpers/kv_format_scalar.py``), byte layouts, the formats the specs cover against the models', and the
kv_pack spec's comparison."""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace

import pytest
import torch

from deepinfer.models.deepseek_v4.cache import v4_formats
from deepinfer.models.deepseek_v41.cache import v41_formats
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.kv_format import KVFormat, pack_rows, unpack_rows
from deepinfer_interfaces.quant import decode_table
from deepinfer_interfaces.specs import SPECS
from deepinfer_interfaces.specs.kv_formats import (
    FORMATS, SMALL_KV, V4_INDEX, V4_KV, V4_KV_FP32, V41_ENTRY, V41_INDEX, V41_WINDOW,
)
from deepinfer_interfaces.specs.kv_quant import canonical_records
from tests.helpers import kv_format_scalar as scalar


def _scalar_format(fmt: KVFormat) -> scalar.Format:
    return scalar.Format(fmt.dim, fmt.code, fmt.block, fmt.scale, fmt.rope)


def _spec_inputs(op: str, key: str, fmt: KVFormat) -> list:
    return [c.kwargs for c in SPECS[op].cases() if c.kwargs["fmt"] == fmt and c.kwargs[key].shape[0]]


def _one_rope_nan(record: bytes, fmt: KVFormat) -> bytes:
    """``record`` with each NaN rotary channel as the definition writes it (0x7FC0): torch's casts write a bf16 NaN
    as 0x7FC0 or 0x7FFF depending on the code path, and any NaN decodes alike."""
    out = bytearray(record)
    for j in range(fmt.rope):
        at = fmt.rope_offset + 2 * j
        (bits,) = struct.unpack("<H", record[at : at + 2])
        if bits & 0x7F80 == 0x7F80 and bits & 0x7F:
            out[at : at + 2] = struct.pack("<H", 0x7FC0)
    return bytes(out)


def _same_floats(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)) for a, b in zip(got, want))


def test_code_tables_are_the_bit_layouts():
    e4m3 = decode_table("e4m3", torch.device("cpu")).tolist()
    assert _same_floats(e4m3, [scalar.e4m3_value(c) for c in range(256)])
    assert decode_table("e2m1", torch.device("cpu")).tolist() == [scalar.e2m1_value(c) for c in range(16)]
    assert scalar.e4m3_value(0x7E) == 448 and scalar.e4m3_value(0x01) == 2.0**-9 and math.isnan(scalar.e4m3_value(0xFF))
    assert [scalar.e2m1_value(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_scalar_rounding_ties_to_even():
    """The definition's own rules, on the values the issue names."""
    assert [scalar.E2M1.nearest(m) for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)] == [0, 2, 2, 4, 4, 6, 6]
    assert [scalar.E2M1.nearest(m) for m in (0.26, 0.74, -0.1, -0.0, 7.0)] == [1, 1, 0x8, 0x8, 7]
    assert scalar.E4M3.nearest(1.0625) == 0x38 and scalar.E4M3.nearest(1.1875) == 0x3A and scalar.E4M3.nearest(2.0**-10) == 0
    assert scalar.ue8m0_exponent(448.0, 448.0) == 0 and scalar.ue8m0_exponent(math.nextafter(448.0, 1e9), 448.0) == 1
    assert scalar.bf16_bits(1 + 2**-8) == 0x3F80 and scalar.bf16_bits(1 + 3 * 2**-8) == 0x3F82


@pytest.mark.parametrize("tag", sorted(FORMATS))
def test_pack_rows_is_the_scalar_definition(tag):
    """Every record the kv_pack spec's cases of the format pack (edges, ties, NaN and inf blocks, nibbles), and
    random rows across magnitudes, byte for byte."""
    fmt = FORMATS[tag]
    g = torch.Generator().manual_seed(7)
    rows = [kw["values"] for kw in _spec_inputs("kv_pack", "values", fmt)]
    rows.append(torch.randn(3, fmt.dim, generator=g) * torch.tensor([[1e-6], [1.0], [3e4]]))
    x = torch.cat(rows).float()
    records = pack_rows(x, fmt)
    sfmt = _scalar_format(fmt)
    for i, row in enumerate(x.tolist()):
        want = scalar.pack_row(row, sfmt)
        got = _one_rope_nan(bytes(records[i].tolist()), fmt)
        if got != want:
            at = next(j for j in range(len(want)) if got[j] != want[j])
            pytest.fail(f"{tag} row {i}: byte {at} is {got[at]:#04x}, the definition says {want[at]:#04x}")


@pytest.mark.parametrize("tag", sorted(FORMATS))
def test_unpack_rows_is_the_scalar_definition(tag):
    """The kv_unpack spec's records (packed rows, random bytes: NaN codes and scales, e4m3 subnormal scales, junk
    padding) decode exactly in fp32, and in bf16 as the fp32 values rounded once."""
    fmt = FORMATS[tag]
    records = torch.cat([kw["records"] for kw in _spec_inputs("kv_unpack", "records", fmt)])
    got32, got16 = unpack_rows(records, fmt, torch.float32), unpack_rows(records, fmt, torch.bfloat16)
    sfmt = _scalar_format(fmt)
    for i in range(records.shape[0]):
        want = scalar.unpack_row(bytes(records[i].tolist()), sfmt)
        assert _same_floats(got32[i].tolist(), want), (tag, i)
        bits16 = [b & 0xFFFF for b in got16[i].view(torch.int16).tolist()]
        assert all((b & 0x7FFF) > 0x7F80 if math.isnan(v) else b == scalar.bf16_bits(v) for v, b in zip(want, bits16)), (tag, i)


def test_e4m3_scales_in_the_subnormal_range_decode_exactly():
    records = next(c.kwargs["records"] for c in SPECS["kv_unpack"].cases() if c.name == "v41_entry_fp4_d512_subnormal_e4m3_scales")
    scales = records[:, V41_ENTRY.scale_offset : V41_ENTRY.scale_offset + V41_ENTRY.scale_bytes]
    assert set(scales.flatten().tolist()) == set(range(1, 9))
    got = unpack_rows(records, V41_ENTRY)
    codes = torch.tensor([scalar.e2m1_value(n) for b in records[0, :256].tolist() for n in (b & 0xF, b >> 4)])
    assert torch.equal(got[0, :16], codes[:16] * 2.0**-9)  # scale byte 1: 1/8 of e4m3's smallest normal 2^-6


# ----- layouts -----


def test_record_sizes():
    sizes = {V4_KV: 584, V4_KV_FP32: 604, V4_INDEX: 68, V41_WINDOW: 528, V41_ENTRY: 288, V41_INDEX: 68, SMALL_KV: 44}
    assert {fmt: fmt.record_bytes for fmt in sizes} == sizes


def _blocks(fmt: KVFormat, codes: list[int], exps: list[int]) -> torch.Tensor:
    """A row whose block ``b`` holds ``codes``' values times ``2^exps[b]`` (its largest value the code's maximum)."""
    value = scalar.e4m3_value if fmt.code == "e4m3" else scalar.e2m1_value
    row = torch.tensor([value(codes[i]) for i in range(fmt.quantized)]).view(fmt.num_scales, fmt.block)
    return (row * torch.tensor([2.0**e for e in exps])[:, None]).flatten()


def test_v4_kv_layout_codes_rope_scales_padding():
    codes = [(i * 7) % 0x7E for i in range(448)]
    for b in range(7):
        codes[b * 64 + 5] = 0x7E  # the block's maximum: 448 times its scale
    exps = [-3, -2, -1, 0, 1, 2, 20]
    rope = torch.randn(64, generator=torch.Generator().manual_seed(1))
    row = torch.cat([_blocks(V4_KV, codes, exps), rope])
    rec = pack_rows(row[None], V4_KV)[0].tolist()
    assert rec[:448] == codes
    assert bytes(rec[448:576]) == b"".join(struct.pack("<H", scalar.bf16_bits(v)) for v in rope.tolist())
    assert rec[576:583] == [127 + e for e in exps] and rec[583] == 0
    fp32 = pack_rows(row[None], V4_KV_FP32)[0].tolist()
    assert fp32[:448] == codes and bytes(fp32[576:604]) == b"".join(struct.pack("<f", 2.0**e) for e in exps)


def test_fp4_layout_even_channel_in_the_low_nibble():
    codes = [(i * 5 + 3) % 16 for i in range(512)]
    for b in range(32):
        codes[b * 16] = 0x7  # +6: the block's maximum, scale 2^e exactly (e4m3: 0x38 + 8e)
    exps = [(b % 5) - 2 for b in range(32)]
    rec = pack_rows(_blocks(V41_ENTRY, codes, exps)[None], V41_ENTRY)[0].tolist()
    assert rec[:256] == [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(256)]
    assert rec[256:288] == [0x38 + 8 * e for e in exps]
    index = pack_rows(_blocks(V4_INDEX, codes[:128], [-126, 0, 3, -5])[None], V4_INDEX)[0].tolist()
    assert index[:64] == [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(64)] and index[64:] == [1, 127, 130, 122]


def test_narrow_row_pads_with_zeros():
    row = torch.randn(1, SMALL_KV.dim, generator=torch.Generator().manual_seed(2))
    rec = pack_rows(row, SMALL_KV)[0].tolist()
    assert SMALL_KV.scale_offset == 24 + 16 and rec[41:] == [0, 0, 0]
    assert rec == list(scalar.pack_row(row[0].tolist(), _scalar_format(SMALL_KV)))


# ----- the specs' formats are the models' -----


def test_spec_formats_are_the_models():
    v4 = v4_formats(SimpleNamespace(head_dim=512, qk_rope_head_dim=64, index_head_dim=128), "ue8m0")
    assert (v4.window, v4.entry, v4.index) == (V4_KV, V4_KV, V4_INDEX)
    assert v4_formats(SimpleNamespace(head_dim=512, qk_rope_head_dim=64, index_head_dim=128), "float").window == V4_KV_FP32
    v41 = v41_formats(SimpleNamespace(head_dim=512, index_head_dim=128))
    assert (v41.window, v41.entry, v41.index) == (V41_WINDOW, V41_ENTRY, V41_INDEX)


# ----- hadamard -----


def test_hadamard_is_the_walsh_formula():
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = [[sum((-1) ** bin(i & j).count("1") * row[i] for i in range(16)) / 4 for j in range(16)] for row in x.tolist()]
    assert torch.allclose(Kernels().hadamard(x), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(Kernels().hadamard(Kernels().hadamard(x)), x, atol=1e-12)  # orthonormal and symmetric


# ----- the kv_pack spec's comparison -----


def test_canonical_records_free_only_what_decodes_alike():
    """Codes inside a NaN-scaled block and the NaN's encoding are free; everything else is compared byte for byte."""
    fmt = V41_ENTRY
    x = torch.randn(2, fmt.dim, generator=torch.Generator().manual_seed(4))
    x[0, 20] = float("nan")  # block 1 of row 0
    rec = pack_rows(x, fmt)
    other = rec.clone()
    other[0, 8:16] = 0x35  # block 1's codes
    other[0, fmt.scale_offset + 1] = 0xFF  # e4m3's other NaN
    assert torch.equal(canonical_records(other, fmt), canonical_records(rec, fmt))
    for at in (0, 7, 16, fmt.scale_offset, fmt.scale_offset + 2):
        changed = rec.clone()
        changed[0, at] ^= 0x01
        assert not torch.equal(canonical_records(changed, fmt), canonical_records(rec, fmt)), at
    finite_scale = other.clone()
    finite_scale[0, fmt.scale_offset + 1] = 0x38
    assert not torch.equal(canonical_records(finite_scale, fmt), canonical_records(rec, fmt))

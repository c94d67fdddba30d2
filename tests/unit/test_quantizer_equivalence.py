"""The vectorised quantizer and packing give bit for bit what the first, per-block version gave.

``tests/helpers/compress_previous.py`` holds that version verbatim. Inputs: random columns of
different scales, all-zero and constant columns, one-value tensors, awkward sizes, stripe
layouts (blocks that start mid-buffer), float32 and float64 buffers, every width 1..32.
"""
from __future__ import annotations

import pytest
import torch

import tests.helpers.compress_previous as previous

from dtrain.compress import ColumnLayout, StripeLayout, dequantize, pack, quantize, quantize_with_feedback, unpack

SHAPES = [(64, 3, 3, 3), (64,), (10, 128), (6, 2), (), (33, 17), (5, 16), (3, 1000), (1,), (17, 31)]
ALL_BITS = list(range(1, 33))


def layouts() -> list[ColumnLayout]:
    """The plain tensor-order layout and the stripe-major layouts of 2 and 3 workers."""
    return [ColumnLayout.for_shapes(SHAPES)] + [StripeLayout(SHAPES, workers).columns for workers in (2, 3)]


def as_previous(layout: ColumnLayout):
    return previous.ColumnLayout(tuple(previous.ColumnBlock(block.offset, block.num_columns, block.column_length)
                                       for block in layout.blocks))


def awkward_values(layout: ColumnLayout, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layout.numel, generator=generator, dtype=torch.float64)
    values *= torch.rand(layout.numel, generator=generator, dtype=torch.float64).add(0.01) * 10.0 ** (seed % 5 - 2)
    values += 0.3 * torch.randn(1, generator=generator, dtype=torch.float64)
    first, second = layout.blocks[0], layout.blocks[2]
    values[first.offset:first.offset + first.column_length] = 0.0      # an all-zero column
    values[second.offset:second.offset + second.column_length] = 0.25  # a constant column (range 0)
    values[-1] = -0.0
    return values.to(dtype)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.is_floating_point():  # compare bit patterns: -0.0 vs 0.0 and NaN count as values
        width = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16}[actual.dtype]
        actual, expected = actual.view(width), expected.view(width)
    assert torch.equal(actual, expected), what


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("layout_index", [0, 1, 2])
def test_quantize_and_dequantize_match_the_previous_version(bits, layout_index):
    layout = layouts()[layout_index]
    for seed, dtype in ((bits, torch.float32), (bits + 100, torch.float64)):
        values = awkward_values(layout, seed, dtype)
        ours, theirs = quantize(values, layout, bits), previous.quantize(values, as_previous(layout), bits)
        assert_bitwise_equal(ours.codes, theirs.codes, "codes")
        assert_bitwise_equal(ours.lower, theirs.lower, "lower")
        assert_bitwise_equal(ours.upper, theirs.upper, "upper")
        for out_dtype in (torch.float32, torch.float64):
            assert_bitwise_equal(dequantize(ours, layout, dtype=out_dtype),
                                 previous.dequantize(theirs, as_previous(layout), dtype=out_dtype), "decoded")
        window = torch.full((layout.numel + 6,), 7.0)
        dequantize(ours, layout, out=window[3:-3])
        assert_bitwise_equal(window[3:-3], previous.dequantize(theirs, as_previous(layout)), "decoded into out")
        assert torch.equal(window[:3], torch.full((3,), 7.0)) and torch.equal(window[-3:], torch.full((3,), 7.0))


@pytest.mark.parametrize("bits", ALL_BITS)
def test_error_feedback_matches_the_previous_version_over_steps(bits):
    layout = StripeLayout(SHAPES, 2).columns
    ours, theirs = torch.zeros(layout.numel), torch.zeros(layout.numel)
    for step in range(3):
        values = awkward_values(layout, 10 * bits + step)
        sent = quantize_with_feedback(values, ours, layout, bits)
        expected = previous.quantize_with_feedback(values, theirs, as_previous(layout), bits)
        assert_bitwise_equal(sent.codes, expected.codes, f"codes, step {step}")
        assert_bitwise_equal(sent.lower, expected.lower, f"lower, step {step}")
        assert_bitwise_equal(ours, theirs, f"residual, step {step}")


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("count", [1, 7, 8, 9, 63, 1000, 4099])
def test_pack_and_unpack_match_the_previous_version(bits, count):
    generator = torch.Generator().manual_seed(bits * 10_000 + count)
    codes = torch.randint(0, 1 << bits, (count,), generator=generator, dtype=torch.int64)
    codes[0] = (1 << bits) - 1  # the widest code
    for dtype in (torch.int64, previous.code_dtype(bits)):
        packed = pack(codes.to(dtype), bits)
        assert_bitwise_equal(packed, previous.pack(codes.to(dtype), bits), f"packed {dtype}")
    unpacked = unpack(packed, bits, count)
    assert_bitwise_equal(unpacked, previous.unpack(packed, bits, count), "unpacked")
    # a message slice (the codes follow the scales in one buffer) unpacks the same
    message = torch.cat([torch.zeros(5, dtype=torch.uint8), packed])
    assert_bitwise_equal(unpack(message[5:], bits, count), unpacked, "unpacked from an offset")
    packed_copy = packed.clone()
    unpacked[:] = 0
    assert torch.equal(packed, packed_copy), "unpack must return new codes, not a view of the bytes"

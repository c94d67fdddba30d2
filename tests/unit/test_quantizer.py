"""CNTK's column quantizer and the bit packing: exact decodes, error bounds, round trips, error feedback."""
from __future__ import annotations

import pytest
import torch

from dtrain.compress import (
    MIN_COLUMN_LENGTH,
    STDDEVS,
    ColumnLayout,
    code_dtype,
    column_shape,
    dequantize,
    pack,
    packed_size,
    quantize,
    quantize_with_feedback,
    unpack,
)

SHAPES = [(64, 3, 3, 3), (64,), (10, 128), (6, 2), (), (33, 17)]  # conv, bias, linear, tiny, scalar, odd


def random_buffer(layout: ColumnLayout, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # columns with different scales and offsets, as gradients of different units have
    values = torch.randn(layout.numel, generator=generator)
    return values * torch.rand(layout.numel, generator=generator).add(0.1) + 0.3 * torch.randn(1, generator=generator)


# -- the column view ----------------------------------------------------------------------------------


def test_column_view_is_one_column_per_output_unit_and_vectors_are_one_column():
    assert column_shape((64, 3, 3, 3)) == (64, 27)
    assert column_shape((256, 3136)) == (256, 3136)
    assert column_shape((64,)) == (1, 64)
    assert column_shape(()) == (1, 1)
    assert column_shape((0, 5)) == (0, 0)
    # columns shorter than MIN_COLUMN_LENGTH would cost more in scales than in codes
    assert column_shape((32, 1, 3, 3)) == (1, 288)
    assert column_shape((4, MIN_COLUMN_LENGTH)) == (4, MIN_COLUMN_LENGTH)


def test_layout_tiles_the_buffer_in_tensor_order():
    layout = ColumnLayout.for_shapes(SHAPES)
    assert layout.numel == sum(torch.Size(shape).numel() for shape in SHAPES)
    assert layout.num_columns == 64 + 1 + 10 + 1 + 1 + 33
    assert [block.offset for block in layout.blocks] == [0, 1728, 1792, 3072, 3084, 3085]


# -- 1 bit --------------------------------------------------------------------------------------------


def test_one_bit_decodes_exactly_to_the_mean_of_each_side():
    # dyadic values: every step of CNTK's lower/upper arithmetic is exact in float32
    column = torch.tensor([-1.0, -3.0, 0.5, 1.5, 0.0, -2.0, 4.0, -2.0] * 4)  # means -2 and 1.5
    layout = ColumnLayout.for_shapes([column.shape])
    quantized = quantize(column, layout, 1)
    decoded = dequantize(quantized, layout)
    mean0, mean1 = column[column < 0].mean(), column[column >= 0].mean()
    assert torch.equal(quantized.codes, (column >= 0).to(torch.uint8))
    assert torch.equal(decoded, torch.where(column >= 0, mean1, mean0))
    # CNTK stores the range, not the means: mid ± radius with radius = 2 (mean1 - mid)
    mid = (mean0 + mean1) / 2
    assert quantized.lower.item() == mid - (mean1 - mean0) and quantized.upper.item() == mid + (mean1 - mean0)


def test_one_bit_decodes_to_the_side_means_on_random_columns():
    layout = ColumnLayout.for_shapes(SHAPES)
    values = random_buffer(layout)
    decoded = dequantize(quantize(values, layout, 1), layout)
    for block in layout.blocks:
        columns, result = block.view(values), block.view(decoded)
        negative = columns < 0
        count0 = negative.sum(1).clamp(min=1)
        count1 = (~negative).sum(1).clamp(min=1)
        mean0 = columns.clamp(max=0).sum(1) / count0
        mean1 = columns.clamp(min=0).sum(1) / count1
        expected = torch.where(negative, mean0[:, None], mean1[:, None])
        torch.testing.assert_close(result, expected, rtol=2e-6, atol=1e-7)


def test_one_bit_empty_side_counts_as_one_so_its_mean_is_zero():
    layout = ColumnLayout.for_shapes([(3, 16)])
    values = torch.cat([torch.full((16,), 2.0), torch.full((16,), -0.5), torch.zeros(16)])
    decoded = dequantize(quantize(values, layout, 1), layout)
    assert torch.equal(decoded, values)  # one side only: that side's mean is every value


# -- k bits -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(2, 32))
def test_k_bits_error_is_at_most_half_a_step_inside_five_sigma(bits):
    # every k, powers of two (CNTK's) and the others this packing allows
    layout = ColumnLayout.for_shapes(SHAPES)
    values = random_buffer(layout, seed=bits)
    quantized = quantize(values, layout, bits)
    decoded = dequantize(quantized, layout)
    assert quantized.codes.dtype == code_dtype(bits)
    assert int(quantized.codes.max()) <= (1 << bits) - 1
    column = 0
    for block in layout.blocks:
        columns = block.view(values).double()
        mean, std = columns.mean(1), columns.std(1, unbiased=False)
        lower = quantized.lower[column:column + block.num_columns].double()
        upper = quantized.upper[column:column + block.num_columns].double()
        torch.testing.assert_close(lower, mean - STDDEVS * std, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(upper, mean + STDDEVS * std, rtol=1e-5, atol=1e-6)
        step = (upper - lower) / ((1 << bits) - 1)
        inside = (columns >= lower[:, None]) & (columns <= upper[:, None])
        error = (block.view(decoded).double() - columns).abs()
        # float32 scales and arithmetic add rounding of a few ulps of the values
        bound = 0.5 * step[:, None] * (1 + 1e-3) + 4e-7 * columns.abs().amax(1, keepdim=True)
        assert bool((error <= bound)[inside].all()), f"{bits} bits: worst {float((error - bound)[inside].max())}"
        column += block.num_columns


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_k_bits_clip_outliers_to_the_end_levels(bits):
    values = torch.cat([torch.zeros(99), torch.tensor([1000.0])])  # one value far beyond 5 sigma
    layout = ColumnLayout.for_shapes([values.shape])
    quantized = quantize(values, layout, bits)
    step = (quantized.upper - quantized.lower) / ((1 << bits) - 1)
    assert int(quantized.codes[-1]) == (1 << bits) - 1
    decoded = dequantize(quantized, layout)
    torch.testing.assert_close(decoded[-1], (quantized.upper + 0.5 * step)[0])


def test_symmetric_range_has_a_level_at_its_centre():
    # 2**k - 1 steps: the middle code decodes to the column mean (CNTK's "0 slot")
    values = torch.tensor([-2.0, 2.0] * 8)
    layout = ColumnLayout.for_shapes([values.shape])
    quantized = quantize(values, layout, 4)
    middle = quantized.codes.new_full((16,), 7)
    decoded = dequantize(type(quantized)(middle, quantized.lower, quantized.upper, 4), layout)
    assert torch.allclose(decoded, torch.zeros(16), atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 8, 20])
def test_constant_column_decodes_to_its_value(bits):
    values = torch.full((40,), 0.375)
    layout = ColumnLayout.for_shapes([values.shape])
    assert torch.equal(dequantize(quantize(values, layout, bits), layout), values)


def test_thirty_two_bits_is_lossless():
    layout = ColumnLayout.for_shapes(SHAPES)
    values = random_buffer(layout)
    values[:3] = torch.tensor([float("inf"), -0.0, 1e-42])
    assert torch.equal(dequantize(quantize(values, layout, 32), layout), values)


@pytest.mark.parametrize("bad", [0, 33, 1.0, True])
def test_bits_outside_one_to_thirty_two_are_rejected(bad):
    layout = ColumnLayout.for_shapes([(4,)])
    with pytest.raises(ValueError, match=r"bits=.*: expected a whole number of bits from 1 to 32"):
        quantize(torch.zeros(4), layout, bad)


def test_buffer_of_the_wrong_size_is_rejected():
    layout = ColumnLayout.for_shapes([(4, 16)])
    with pytest.raises(ValueError, match="1-D buffer of 64 values"):
        quantize(torch.zeros(63), layout, 1)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.zeros(64, dtype=torch.int32), layout, 1)


# -- error feedback -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_error_feedback_sends_everything_eventually(bits):
    """Σ_t decode(q_t) + final residual == Σ_t input_t: the error is delayed, never dropped."""
    layout = ColumnLayout.for_shapes(SHAPES)
    residual = torch.zeros(layout.numel, dtype=torch.float64)
    sent = torch.zeros(layout.numel, dtype=torch.float64)
    inputs = torch.zeros(layout.numel, dtype=torch.float64)
    for step in range(12):
        values = random_buffer(layout, seed=100 + step).double()
        quantized = quantize_with_feedback(values, residual, layout, bits)
        sent += dequantize(quantized, layout, dtype=torch.float64)
        inputs += values
    torch.testing.assert_close(sent + residual, inputs, rtol=0, atol=1e-9)
    # and the residual stays bounded (it does not grow with the number of steps)
    assert float(residual.abs().max()) < 10 * float(inputs.abs().max())


def test_error_feedback_float32_invariant_holds_to_float_tolerance():
    layout = ColumnLayout.for_shapes(SHAPES)
    residual = torch.zeros(layout.numel)
    sent, inputs = torch.zeros(layout.numel), torch.zeros(layout.numel)
    for step in range(8):
        values = random_buffer(layout, seed=step)
        sent += dequantize(quantize_with_feedback(values, residual, layout, 1), layout)
        inputs += values
    torch.testing.assert_close(sent + residual, inputs, rtol=1e-5, atol=1e-5)


# -- bit packing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 33))
def test_pack_round_trip_for_every_width_and_odd_lengths(bits):
    generator = torch.Generator().manual_seed(bits)
    for count in (0, 1, 3, 7, 8, 9, 13, 1001):
        codes = torch.randint(0, 1 << bits, (count,), generator=generator, dtype=torch.int64)
        codes[:1] = (1 << bits) - 1  # the largest code survives
        packed = pack(codes.to(code_dtype(bits)), bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_size(count, bits) == -(-count * bits // 8)
        unpacked = unpack(packed, bits, count)
        assert unpacked.dtype == code_dtype(bits)
        assert torch.equal(unpacked.to(torch.int64), codes)


def test_pack_is_a_least_significant_bit_first_stream():
    assert pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1]), 1).tolist() == [0b10000001, 0b1]
    assert pack(torch.tensor([5, 3]), 3).tolist() == [0b011101]
    assert pack(torch.tensor([0x1234]), 16).tolist() == [0x34, 0x12]


def test_pack_rejects_codes_out_of_range_and_unpack_wrong_sizes():
    with pytest.raises(ValueError, match=r"\[0, 2\*\*2\)"):
        pack(torch.tensor([4]), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*3\)"):
        pack(torch.tensor([-1]), 3)
    with pytest.raises(TypeError, match="integer"):
        pack(torch.tensor([0.5]), 3)
    with pytest.raises(ValueError, match="take 2 bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), 2, 5)

"""int8's pure parts: block quantization, its bound, the compression spelling, block size checks."""
import warnings

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from hvd_averaging.wire import (COMPRESSION_CHOICES, WIRE_FORMATS, AsIs, Fp16, Int8,
                                dequantize_blocks, level_codecs, quantize_blocks, window_absmax,
                                wire_format)
from hvd_averaging.transports.in_pieces import piece_bounds


@pytest.mark.parametrize("length,block", [(1, 1), (5, 2), (1024, 1024), (3000, 1024), (7, 64)])
def test_quantize_round_trip_within_half_a_step(length, block):
    values = torch.randn(3, length, generator=torch.Generator().manual_seed(length)) * 10 ** torch.linspace(-3, 6, length)
    q, scales = quantize_blocks(values, block)
    assert q.dtype == torch.int8 and q.shape == (3, length)
    assert scales.shape == (3, -(-length // block))
    back = dequantize_blocks(q, scales, block)
    step = scales.repeat_interleave(block, dim=1)[:, :length]
    assert bool(((back - values).abs() <= step / 2 * (1 + 1e-6) + 1e-30).all())
    assert int(q.abs().max()) == 127  # each block's largest value takes the last level


def test_zero_block_has_zero_scale_and_comes_back_zero():
    values = torch.zeros(2, 10)
    values[1, 5:] = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.25])
    q, scales = quantize_blocks(values, 5)
    assert scales[0].tolist() == [0.0, 0.0] and scales[1, 0] == 0.0
    back = dequantize_blocks(q, scales, 5)
    assert torch.equal(back[0], torch.zeros(10)) and torch.equal(back[1, :5], torch.zeros(5))
    assert back[1, 7] == 3.0  # the block's peak is exact


def test_window_absmax_covers_every_block_holding_the_element():
    values = torch.zeros(2, 20)
    values[1, 10] = -7.0
    peaks = window_absmax(values, 4)
    assert peaks[7:14].tolist() == [7.0] * 7 and peaks[6] == 0.0 and peaks[14] == 0.0


@pytest.mark.parametrize("spelling,kind", [(None, AsIs), ("none", AsIs), (hvd.Compression.none, AsIs),
                                           ("fp16", Fp16), (hvd.Compression.fp16, Fp16),
                                           ("int8", Int8), (Int8(block_size=64), Int8)])
def test_compression_spellings(spelling, kind):
    assert type(wire_format(spelling)) is kind


def test_every_registered_format_is_spelled_by_its_name_and_listed():
    assert WIRE_FORMATS.names == ("none", "fp16", "int8")
    for name in WIRE_FORMATS.names:
        assert wire_format(name).name == name and f'"{name}"' in COMPRESSION_CHOICES
    with pytest.raises(ValueError, match="registered twice"):
        WIRE_FORMATS.register(Fp16(), {})


def test_a_format_is_frozen_settings_and_each_codec_has_its_own_state():
    spec = Int8(block_size=64, error_feedback=True)
    with pytest.raises(Exception):
        spec.block_size = 8
    assert spec == Int8(64, True) and hash(spec) == hash(Int8(64, True))
    first, second = spec.codec(), spec.codec()
    assert first.format is spec and first.state is not second.state and first.keeps_state
    assert not Fp16().codec().keeps_state and Fp16().codec().state_dict() == {}


@pytest.mark.parametrize("bad", ["int4", "Int8", "float16", 8, hvd.Compression.fp16(), object()])
def test_bad_compression_names_the_value_and_the_choices(bad):
    with pytest.raises(ValueError) as caught:
        wire_format(bad)
    assert repr(bad) in str(caught.value) and ", ".join(COMPRESSION_CHOICES) in str(caught.value)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None, "64"])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"block_size must be a positive int .*got {bad!r}"):
        hva.Int8(block_size=bad)


def test_each_level_gets_its_own_codec_and_feedback_only_on_int8():
    shared = Int8(block_size=256)
    codecs = level_codecs({2: "fp16", 8: shared, 32: shared}, True)
    assert type(codecs[2].format) is Fp16 and codecs[8] is not codecs[32]
    assert codecs[8].format == Int8(256, error_feedback=True) and not shared.error_feedback
    assert codecs[8].state is not codecs[32].state and codecs[2].state is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        level_codecs({8: "int8"}, False)
    with pytest.warns(UserWarning, match="error_feedback=True does nothing without an int8 level"):
        level_codecs({8: "fp16"}, True)
    with pytest.raises(ValueError, match="error_feedback must be True or False, got 1"):
        level_codecs({8: "int8"}, 1)


@pytest.mark.parametrize("block", [1, 3, 1024])
@pytest.mark.parametrize("pieces", [1, 2, 4, 7])
def test_piece_bounds_cover_the_chunk_on_block_boundaries(block, pieces):
    for chunk in [1, 2, block, block + 1, 63 * block, 64 * block, 129 * block + 5, 1000 * block]:
        bounds = piece_bounds(chunk, block, pieces)
        assert bounds[0][0] == 0 and bounds[-1][1] == chunk
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order
        assert all(start % block == 0 and end > start for start, end in bounds)
        assert len(bounds) <= pieces
        if len(bounds) > 1:  # every piece but the last holds at least 64 whole blocks
            assert all(end - start >= 64 * block for start, end in bounds[:-1])
        if chunk >= 64 * block * pieces:
            assert len(bounds) == pieces  # large enough: cut as often as asked

"""What a round's buffers become on the wire: one module per format, behind one interface
(:class:`~.base.WireFormat`, which builds the transport along a route; a
:class:`~.base.WireCodec` is one user's instance, with the format's state).

- :mod:`.as_is`: the buffers' own dtype (the default);
- :mod:`.fp16`: float16 with a power of two agreed on so that nothing overflows (half the bytes);
- :mod:`.int8`: int8 with a float32 scale per block, reduce-scatter by alltoall (a quarter of
  the bytes across the link), optional error feedback; :mod:`.int8_blocks` its pure parts.

:mod:`.registry` holds them by name and reads the public ``compression=`` argument; each format
module registers itself, and is imported here.
"""

from .registry import WIRE_FORMATS, WireFormats, level_codecs, wire_format
from .base import AgreeFinite, NonFiniteOnWire, WireCodec, WireFormat
from .as_is import AsIs
from .fp16 import FP16_MAX, Fp16, Fp16Wire, fp16_error_bound, fp16_scale
from .int8 import DEFAULT_BLOCK_SIZE, Int8, Int8Exchange
from .int8_blocks import dequantize_blocks, int8_error_bound, quantize_blocks, window_absmax

COMPRESSION_CHOICES = WIRE_FORMATS.choices  # every spelling of compression=, for messages

__all__ = ["WireFormat", "WireCodec", "NonFiniteOnWire", "AgreeFinite", "AsIs", "Fp16", "Fp16Wire",
           "fp16_scale", "fp16_error_bound", "FP16_MAX", "Int8", "Int8Exchange",
           "DEFAULT_BLOCK_SIZE", "quantize_blocks", "dequantize_blocks", "int8_error_bound",
           "window_absmax", "COMPRESSION_CHOICES", "WIRE_FORMATS", "WireFormats", "wire_format",
           "level_codecs"]

"""The wire formats by name, and the public ``compression=`` argument read through them.

A format registers itself where it is defined (one line at the end of its module), with the
other objects that spell it (``hvd.Compression.fp16``); :mod:`hvd_averaging.wire` imports every
format module, so a new format is one new module plus its import there.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from .base import WireCodec, WireFormat

__all__ = ["WireFormats", "WIRE_FORMATS", "wire_format", "level_codecs"]


class WireFormats:
    """The registered formats: each one's default settings by name, and the other spellings."""

    def __init__(self) -> None:
        self._by_name: dict[str, WireFormat] = {}
        self._aliases: list[tuple[Any, str]] = []  # (object, format name), compared by identity
        self._choices: list[str] = []

    def register(self, default: WireFormat, aliases: dict[str, Any],
                 instance_choice: Optional[str] = None) -> None:
        """Make ``default.name`` (and each object in ``aliases``, keyed by how the docs spell
        it) mean ``default``; ``instance_choice`` names passing a format object in messages."""
        if default.name in self._by_name:
            raise ValueError(f"wire format {default.name!r} is registered twice")
        self._by_name[default.name] = default
        self._aliases += [(alias, default.name) for alias in aliases.values()]
        self._choices += [*aliases, f'"{default.name}"', *([instance_choice] if instance_choice else [])]

    @property
    def names(self) -> tuple[str, ...]:
        """The registered formats' names (the string spellings), in registration order."""
        return tuple(self._by_name)

    @property
    def choices(self) -> tuple[str, ...]:
        """Every accepted spelling, as the docs write it (for messages)."""
        return tuple(self._choices)

    def parse(self, compression: Any) -> WireFormat:
        """The format ``compression`` spells: a registered name, an alias object, or a format.

        Raises:
            ValueError: anything else, naming the value and the choices.
        """
        if isinstance(compression, WireFormat):
            return compression
        for alias, name in self._aliases:
            if compression is alias:
                return self._by_name[name]
        if isinstance(compression, str) and compression in self._by_name:
            return self._by_name[compression]
        raise ValueError(f"compression must be one of {', '.join(self.choices)}; got "
                         f"{compression!r}")


WIRE_FORMATS = WireFormats()


def wire_format(compression: Any) -> WireFormat:
    """The registered format ``compression`` spells (see :meth:`WireFormats.parse`)."""
    return WIRE_FORMATS.parse(compression)


def level_codecs(compression_per_level: dict[int, Any], error_feedback: bool, *,
                 stacklevel: int = 2) -> dict[int, WireCodec]:
    """One codec per averager level (each keeps its own state); with ``error_feedback`` the
    levels whose format has residuals keep them. Warns when ``error_feedback`` has no level to
    act on.

    Raises:
        ValueError: a bad compression (named, with the choices), or ``error_feedback`` not a bool.
    """
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    formats = {level: wire_format(c) for level, c in compression_per_level.items()}
    if error_feedback:
        kept = {level: f.with_error_feedback() for level, f in formats.items()}
        if not any(kept.values()):
            warnings.warn("error_feedback=True does nothing without an int8 level "
                          f"(compression per level: { {l: f.name for l, f in formats.items()} })",
                          UserWarning, stacklevel=stacklevel + 1)
        formats.update({level: f for level, f in kept.items() if f is not None})
    return {level: f.codec() for level, f in formats.items()}

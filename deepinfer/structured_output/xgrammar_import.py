"""The xgrammar library, imported on first use: it loads slowly and is an optional dependency."""

from __future__ import annotations

from types import ModuleType

from ..errors import ConfigError


def import_xgrammar() -> ModuleType:
    """The xgrammar module, or a one-line error saying how to install it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ConfigError(
            f"structured output needs xgrammar ({exc}); install it with pip install 'deepinfer[structured]'"
        ) from None
    return xgrammar

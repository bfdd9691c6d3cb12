"""Deterministic mode, engine side: the kernels' batch-invariant switch, turned on once per rank.

With ``EngineConfig.deterministic`` every op that promises batch invariance
computes each row bitwise the same whatever else is in the call, so a
request's logits do not depend on its neighbours, the batch size, how its
prompt was cut into chunks, whether a step verified drafts, or whether its
context was recomputed after a preemption. The rest of the mode lives where
each decision is made: the config forces an exact prefix replay, the sampler
keys seeded noise by position, and combine sums expert outputs in rank order.
"""

from __future__ import annotations

from deepinfer_interfaces import NotSupportedError

from .errors import ConfigError
from .registry import SelectedBackend

#: the ``Kernels`` method that turns batch invariance on (documented in the ``Kernels`` class)
SWITCH = "set_batch_invariant"


def enable_batch_invariance(selected: SelectedBackend) -> None:
    """Turn on the kernels' batch invariance; a backend that cannot is a one-line ``ConfigError``."""
    switch = getattr(selected.kernels, SWITCH, None)
    where = f"backend '{selected.name}' (kernels '{selected.kernels_name}')"
    if switch is None:
        raise ConfigError(f"{where} has no batch-invariant kernels, which --deterministic needs; "
                          "run without --deterministic or choose kernels that have them (--kernels reference)")
    try:
        switch(True)
    except NotSupportedError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else "not supported"
        raise ConfigError(f"{where} cannot run --deterministic: {reason}; run without --deterministic "
                          "or choose kernels that support it (--kernels reference)") from None

"""One result per checked case, with a Khronos-style status."""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: pass; quality warning (within WARN_FACTOR of tolerance); fail; not supported here; error (raised);
#: not applicable (a contract feature newer than the version the kernel set declares: the engine runs the
#: reference for it, so the set's own code is never called with it)
STATUSES = ("pass", "warn", "fail", "not_supported", "error", "not_applicable")
FAILING = ("fail", "error")


@dataclass
class CaseResult:
    suite: str
    op: str
    case: str
    dtype: str
    status: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    frac_out_of_tol: float | None = None
    atol: float | None = None
    rtol: float | None = None
    message: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

"""The tolerances the suites apply, and the Markdown table that documents them.

Op tolerances live in ``deepinfer_interfaces.specs.TOLERANCES`` (an op spec may
override them with a stated reason); the end-to-end thresholds live here.
``docs/tolerances.md`` holds the table ``render()`` prints, and a test keeps
the two in sync: ``python -m deepinfer_conformance.tolerances`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_interfaces.specs import RMS_LIMITS, SPECS, TOLERANCES, WARN_FACTOR


@dataclass(frozen=True)
class E2ETolerance:
    """End-to-end thresholds for one dtype, in nats.

    ``logprob``: a greedy divergence is accepted (a warning) when the
    reference's log-probability of the token the backend chose is within this
    of the reference's own choice, i.e. the reference itself saw a near tie.
    ``kl``: the mean per-step KL(reference ‖ backend) of the next-token
    distribution; above it is a warning, above ``WARN_FACTOR`` times it a failure.
    """

    logprob: float
    kl: float


#: End-to-end thresholds per dtype the backend runs the model in (the reference runs fp32).
#: fp32 backends are expected to match to rounding; bf16/fp16 ones to carry their
#: rounding through every layer of a trained model.
E2E_TOLERANCES: dict[torch.dtype, E2ETolerance] = {
    torch.float32: E2ETolerance(logprob=1e-3, kl=1e-7),
    torch.float16: E2ETolerance(logprob=0.05, kl=2e-3),
    torch.bfloat16: E2ETolerance(logprob=0.2, kl=1e-2),
}

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def e2e_tolerance(dtype: torch.dtype) -> E2ETolerance:
    """The end-to-end thresholds for ``dtype`` (fp32's for a dtype not in the table)."""
    return E2E_TOLERANCES.get(dtype, E2E_TOLERANCES[torch.float32])


def render() -> str:
    """The Markdown tables of every tolerance the suites apply."""
    lines = [
        (
            "Op parity: an element passes when `|got − expected| ≤ atol + rtol·|expected|`; "
            f"an element beyond that but within {WARN_FACTOR:g}× the bound is a quality warning (`warn`), "
            "further is a failure."
        ),
        "",
        "| dtype | atol | rtol |",
        "|---|---|---|",
    ]
    lines += [f"| {_NAMES[d]} | {t.atol:g} | {t.rtol:g} |" for d, t in TOLERANCES.items()]
    lines += ["", "Overrides by op spec (the report's `message` carries the reason):", ""]
    overrides = [s for s in sorted(SPECS.values(), key=lambda s: s.op) if s.tolerances]
    if overrides:
        lines += ["| op | dtype | atol | rtol | reason |", "|---|---|---|---|---|"]
        for spec in overrides:
            for d, t in spec.tolerances.items():
                lines.append(f"| {spec.op} | {_NAMES.get(d, str(d))} | {t.atol:g} | {t.rtol:g} | {spec.tolerance_reason} |")
    else:
        lines.append("none: every op spec uses the table above.")
    lines += [
        "",
        (
            "Relative RMS error, besides the per-element bound: `rms(got − expected) / max(rms(expected), atol)` over the "
            "finite elements of each output; above the limit the case fails. Default limits:"
        ),
        "",
        "| dtype | limit |",
        "|---|---|",
    ]
    lines += [f"| {_NAMES[d]} | {v:g} |" for d, v in RMS_LIMITS.items()]
    lines += ["", "Op specs with a limit (the report's `rms_limit`):", "", "| op | float32 | float16 | bfloat16 | reason |", "|---|---|---|---|---|"]
    for spec in sorted((s for s in SPECS.values() if s.rms_limits), key=lambda s: s.op):
        cells = " | ".join(f"{spec.rms_limits[d]:g}" if d in spec.rms_limits else "-" for d in (torch.float32, torch.float16, torch.bfloat16))
        lines.append(f"| {spec.op} | {cells} | {spec.rms_reason} |")
    lines += [
        "",
        (
            "Accumulation rules (an op spec's `accumulation`): these sums stay in fp32 whatever the dtype under test. "
            "Each rule's cases (named `accumulation_*`, run in bfloat16 and float16) are built so that a sum kept in 16 bits "
            "misses by many times the tolerance, while one kept in fp32 stays far inside it; there any element beyond "
            "tolerance fails (no warning band)."
        ),
        "",
        "| op | rule | cases |",
        "|---|---|---|",
    ]
    for spec in sorted((s for s in SPECS.values() if s.accumulation), key=lambda s: s.op):
        cases = ", ".join(f"`{c.name}`" for c in spec.cases() if c.accumulation)
        lines.append(f"| {spec.op} | {spec.accumulation} | {cases} |")
    exact = sorted(s.op for s in SPECS.values() if s.exact)
    lines += ["", f"Compared exactly (token ids, masks, cache rows): {', '.join(f'`{o}`' for o in exact)}."]
    lines += [
        "",
        f"End-to-end parity, by the dtype the backend runs the model in (nats; `warn` above `kl`, `fail` above {WARN_FACTOR:g}× `kl`):",
        "",
        "| dtype | logprob (divergence accepted within) | kl (mean per step) |",
        "|---|---|---|",
    ]
    lines += [f"| {_NAMES[d]} | {t.logprob:g} | {t.kl:g} |" for d, t in E2E_TOLERANCES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")

"""Speculative decoding: the DSpark proposer, lossless verification and which drafts a step verifies."""

from .admission import Policy, StepCostProfile, admit
from .proposer import Anchor, DSparkProposer, Observed
from .verify import verify_drafts

__all__ = ["Anchor", "DSparkProposer", "Observed", "Policy", "StepCostProfile", "admit", "verify_drafts"]

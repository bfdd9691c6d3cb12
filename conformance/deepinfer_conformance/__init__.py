"""The conformance suite: proves a backend computes what the reference computes."""

from .results import STATUSES, CaseResult

__all__ = ["STATUSES", "CaseResult"]

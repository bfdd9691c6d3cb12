"""Moving a request's KV cache between engines: prefill in one, decode in another."""

from .sequence_state import PrefilledRequest, SequenceState, read_sequence, write_sequence

__all__ = ["PrefilledRequest", "SequenceState", "read_sequence", "write_sequence"]

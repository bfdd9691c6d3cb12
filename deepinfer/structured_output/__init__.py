"""Structured output: compiled grammars, one matcher per request, and the batch token bitmask.

A ``StructuredOutputsParams`` is compiled once per distinct grammar into an
xgrammar automaton over the model's vocabulary (``GrammarCompilerCache``). Each
constrained request owns a ``RequestGrammar`` that tracks the tokens it has
produced; every step the matchers of the constrained rows write their allowed
tokens into an int32 bitmask in xgrammar's layout (bit ``j`` of word ``i`` is
token ``32·i + j``), which the sampler applies with
``kernels.apply_token_bitmask``. Rows without a grammar are neither filled nor
masked. ``StructuredOutputManager`` is the engine's single owner of all of it.
A ``ThinkingGate`` (``thinking``) stands in for a matcher where a request has a
thinking budget or a grammar that starts after its reasoning.
"""

from .bitmask import allocate_bitmask
from .compiler import GrammarCompilerCache
from .manager import StructuredOutputManager
from .matcher import RequestGrammar, fill_batch_bitmask

__all__ = [
    "GrammarCompilerCache",
    "RequestGrammar",
    "StructuredOutputManager",
    "allocate_bitmask",
    "fill_batch_bitmask",
]

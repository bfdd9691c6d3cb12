"""What steps and draft passes cost in this process: the start-up profile as the prior, corrected online.

The start-up profile (``ModelRunner.step_cost_profile``) times forwards over
padding only; the draft profile times draft passes. Neither sees what a real
step costs here: sampling, the host's scheduling and bookkeeping, this batch
mix, this context length, a graph replay instead of an eager forward, a machine
that got busier. So every step the engine completes is recorded by its shape —
its kind (``decode``: one token per sequence; ``verify``: one token and drafts;
``mixed``: anything with a prefill chunk), whether it replayed a graph, its
token count (a graph's padded count) — as the ratio of its observed seconds to
the prior's. A shape's correction is the median of the last ``window`` ratios
recorded in its token bucket (half an octave wide), so one slow step moves
nothing; between observed buckets' centres it is interpolated, past them the nearest
holds, and a shape never observed borrows the corrections of shapes that were
(a verify step's from the decode steps, a draft pass the steps' largest). A machine that gets busier or
quieter moves every shape at once: each observation's miss against its own
shape's estimate moves one machine-wide drift factor (the median of the last
few misses, clipped), ratios
are kept relative to the drift of their time, and every estimate is scaled by
the drift of now — so the shapes the policy is not running stay comparable to
the one it is. Costs are the prior times the correction, non-decreasing in
tokens.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .admission import StepCostProfile

StepKind = Literal["decode", "verify", "mixed"]
#: ratios a bucket needs before its median counts
MIN_SAMPLES = 3
#: how fast the machine-wide drift follows each observation's miss, and the largest miss (log) one may count
DRIFT_RATE = 0.3
DRIFT_CLIP = 0.5
#: the drift follows the median of this many recent misses
DRIFT_MISSES = 5


@dataclass(frozen=True)
class CostKey:
    """The shape of a step as its cost depends on it (or ``draft``: a draft pass)."""

    kind: str
    graph: bool = False


DRAFT = CostKey("draft")


def scale(tokens: np.ndarray | float) -> np.ndarray:
    """A token count on the buckets' scale: two units per doubling (1 → 0, 2 → 2, 4 → 4, 16 → 8)."""
    return 2 * np.log2(np.maximum(np.asarray(tokens, dtype=np.float64), 1.0))


def bucket(tokens: int) -> int:
    """Half-octave bucket of a token count: its ``scale``, rounded."""
    return round(2 * math.log2(tokens))


class Corrections:
    """Observed/prior ratios of one shape, by token bucket; the median of each bucket's recent ones."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.ratios: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, b: int, ratio: float) -> None:
        self.ratios.setdefault(b, deque(maxlen=self.window)).append(ratio)
        self._medians.pop(b, None)
        self._arrays = None

    def medians(self) -> tuple[np.ndarray, np.ndarray]:
        """``(buckets, median ratios)`` of the buckets with enough samples, sorted by bucket."""
        if self._arrays is None:
            for b, q in self.ratios.items():
                if b not in self._medians and len(q) >= MIN_SAMPLES:
                    self._medians[b] = statistics.median(q)
            keys = sorted(self._medians)
            self._arrays = (np.asarray(keys, dtype=np.float64), np.asarray([self._medians[k] for k in keys], dtype=np.float64))
        return self._arrays


class LiveCosts:
    """Seconds of a step (by kind, graph or eager, token count) and of a draft pass (by requests drafting)."""

    def __init__(self, prior: StepCostProfile, draft_prior: StepCostProfile | None = None, window: int = 32, learn: bool = True) -> None:
        """``learn=False``: the priors are taken as they are (a fixed cost model) and observations only counted."""
        self.prior = prior
        self.learn = learn
        self.draft_prior = draft_prior
        self.window = window
        self._shapes: dict[CostKey, Corrections] = {}
        #: observations per shape (reported with the estimates)
        self.samples: dict[CostKey, int] = {}
        #: how much slower (> 1) or faster every step is now than when the kept ratios were recorded
        self.drift = 1.0
        self._misses: deque[float] = deque(maxlen=DRIFT_MISSES)
        self._version = 0
        self._curves: dict[CostKey, tuple[int, tuple[np.ndarray, np.ndarray] | None]] = {}

    def record(self, key: CostKey, tokens: int, seconds: float) -> None:
        """One observed step (or draft pass, ``tokens`` = requests drafting) of shape ``key``."""
        if tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        self.samples[key] = self.samples.get(key, 0) + 1
        if not self.learn:
            return
        ratio = seconds / self._prior(key).cost(tokens)
        at = bucket(tokens)
        curve = self._shapes[key].medians() if key in self._shapes else None
        if curve is not None and len(curve[0]):  # how far off this shape's estimate was: the machine's drift
            self._misses.append(max(-DRIFT_CLIP, min(DRIFT_CLIP, math.log(ratio / (float(np.interp(at, *curve)) * self.drift)))))
            self.drift *= math.exp(DRIFT_RATE * statistics.median(self._misses))  # one odd step moves nothing
        self._shapes.setdefault(key, Corrections(self.window)).add(at, ratio / self.drift)
        self._version += 1

    def _prior(self, key: CostKey) -> StepCostProfile:
        return self.draft_prior if key == DRAFT and self.draft_prior is not None else self.prior

    def _curve(self, key: CostKey) -> tuple[np.ndarray, np.ndarray] | None:
        """``(buckets, corrections)`` that serve ``key``: its own shape's, else the other step shapes' (graph
        or eager alike first); None: nothing observed yet. Kept until the next observation."""
        cached = self._curves.get(key)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        curve = None
        own = self._shapes.get(key)
        if own is not None and len(own.medians()[0]):
            curve = own.medians()
        else:  # a draft pass not seen yet is corrected as the steps were (host work, a busier machine)
            others = sorted((k for k in self._shapes if k not in (DRAFT, key)), key=lambda k: (k.graph != key.graph, k.kind))
            curve = next((self._shapes[k].medians() for k in others if len(self._shapes[k].medians()[0])), None)
            if curve is not None and key == DRAFT:
                curve = (curve[0], np.full(len(curve[1]), float(np.max(curve[1]))))  # its own token scale: the largest one
        self._curves[key] = (self._version, curve)
        return curve

    def _correction(self, key: CostKey, at: np.ndarray) -> np.ndarray:
        """The correction at points ``at`` of the buckets' scale: interpolated between observed buckets."""
        curve = self._curve(key)
        return np.full(len(at), self.drift) if curve is None else np.interp(at, *curve) * self.drift

    def seconds(self, key: CostKey, tokens: np.ndarray) -> np.ndarray:
        """Estimated seconds at each token count of ``tokens`` (ascending counts give non-decreasing costs)."""
        t = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
        out = self._prior(key).costs(t) * self._correction(key, scale(t))
        if len(out) > 1 and np.all(np.diff(t) >= 0):
            out = np.maximum.accumulate(out)
        return out

    def step(self, kind: StepKind, graph: bool, tokens: np.ndarray) -> np.ndarray:
        return self.seconds(CostKey(kind, graph), tokens)

    def draft(self, requests: np.ndarray) -> np.ndarray:
        return self.seconds(DRAFT, requests)

    def snapshot(self, points: tuple[int, ...]) -> dict[str, list[list[float]]]:
        """The current estimates at a few token counts, in ms, per observed shape (and the draft pass):
        ``{"decode/eager": [[tokens, ms, samples], ...], ...}``."""
        out: dict[str, list[list[float]]] = {}
        for key in sorted(self._shapes, key=lambda k: (k.kind, k.graph)):
            name = key.kind if key == DRAFT else f"{key.kind}/{'graph' if key.graph else 'eager'}"
            ms = self.seconds(key, np.asarray(points)) * 1e3
            out[name] = [[p, round(float(m), 4)] for p, m in zip(points, ms)]
        return out

"""How long a GPR will hold its devices, learned online from the GPRs that finished.

Every finished GPR (completed, or stopped at its ``exitDuration``) is one sample of *hold time* (admission to
release). Samples are kept per key, most specific first:

    workspace + template  ->  workspace + owner/workload name  ->  workspace + shape  ->  workspace  ->  shape  ->  all

and a prediction uses the most specific key with at least ``min_samples`` samples. Each key holds two bounded
histograms (fixed bins, counts halved when they pass ``max_count`` so recent work weighs more):

- hold time in seconds, on a log scale (4 bins per doubling, 1 s to about two years);
- hold time as a fraction of the GPR's own ``exitDuration`` (users who always ask for about twice what they need
  are predicted well from this one, whatever their jobs' lengths).

For each key the engine tracks, online, how far each histogram's median was from the samples that arrived
(mean absolute log error) and predicts from the one that has been closer. ``exitDuration`` is a hard cap:
no value of any prediction exceeds it (a GPR cannot hold longer; the core enforces it).

For a running GPR, :meth:`DurationPredictor.remaining` conditions the distribution on the time it has already
held: the expected remaining time of a long-tailed workload *grows* with age, which ``mean - elapsed`` misses.

Pure and deterministic (no clock, no randomness); memory is bounded by ``max_keys`` (least recently updated
key dropped first). :meth:`to_state` / :meth:`from_state` give a JSON-able form for persistence.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

PER_OCTAVE = 4
DUR_BINS = 26 * PER_OCTAVE + 1  # 1 s .. 2**26 s (~2 years), the last bin takes anything longer
RATIO_BINS = 12 * PER_OCTAVE + 1  # bin 0: the whole exitDuration (>= 0.999); then 2**-0.25 .. 2**-12
STATE_VERSION = 1
ERR_STRIDE = 4  # model errors are updated on every 4th sample of a key

# bin representatives and edges (seconds, resp. fraction of exitDuration), ascending
_D_LO = np.concatenate(([0.0], 2.0 ** (np.arange(1, DUR_BINS) / PER_OCTAVE)))
_D_HI = np.concatenate((2.0 ** (np.arange(1, DUR_BINS) / PER_OCTAVE), [math.inf]))
_D_MID = np.sqrt(np.maximum(_D_LO, 0.5) * np.where(np.isfinite(_D_HI), _D_HI, _D_LO * 2 ** (1 / PER_OCTAVE)))
# ratio bins, ascending: index j < last covers [2**(-k/4), 2**(-(k-1)/4)) with k = last - j (the lowest from 0);
# the last bin is "used all of its exitDuration" (>= 0.999)
_K = RATIO_BINS - 1 - np.arange(RATIO_BINS - 1)
_R_LO = np.concatenate((np.where(_K == RATIO_BINS - 1, 0.0, 2.0 ** (-_K / PER_OCTAVE)), [0.999]))
_R_HI = np.concatenate((2.0 ** (-(_K - 1) / PER_OCTAVE), [1.0]))
_R_MID = np.concatenate((np.sqrt(np.maximum(_R_LO[:-1], 2.0 ** (-RATIO_BINS / PER_OCTAVE)) * _R_HI[:-1]), [1.0]))


def _dur_bin(seconds: float) -> int:
    if seconds < 2 ** (1 / PER_OCTAVE):
        return 0
    return min(DUR_BINS - 1, math.floor(PER_OCTAVE * math.log2(seconds)))


def _ratio_bin(r: float) -> int:
    """Index in ascending order (the last bin is 'used all of its exitDuration')."""
    if r >= 0.999:
        return RATIO_BINS - 1
    k = min(RATIO_BINS - 1, math.floor(-PER_OCTAVE * math.log2(max(r, 1e-12))) + 1)
    return RATIO_BINS - 1 - k


class JobKey(NamedTuple):
    """What a prediction is keyed on. ``shape``: e.g. ``nvidia.com/gpu:4x1000x2`` (devices x milli x nodes).
    A named tuple: built, hashed and compared in C, as it is for every queued GPR at every pass."""

    workspace: str = ""
    template: str = ""
    owner: str = ""
    shape: str = ""

    def levels(self) -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = []
        if self.template:
            out.append(("t", self.workspace, self.template))
        if self.owner:
            out.append(("o", self.workspace, self.owner))
        out += [("s", self.workspace, self.shape), ("w", self.workspace), ("S", self.shape), ("*",)]
        return out


@dataclass(frozen=True)
class Prediction:
    """Hold time (seconds) as mean and P10/P50/P90; ``source`` names the key and model used."""

    mean: float
    p10: float
    p50: float
    p90: float
    source: str = "prior"


class _Stats:
    __slots__ = ("dur", "err_d", "err_r", "med_d", "med_r", "nd", "nr", "nz_d", "nz_r", "ratio")

    def __init__(self) -> None:
        self.dur = np.zeros(DUR_BINS)
        self.ratio = np.zeros(RATIO_BINS)
        self.nd = 0.0
        self.nr = 0.0
        self.err_d = math.nan  # mean |log error| of the median, exponentially weighted
        self.err_r = math.nan
        self.med_d = math.nan  # cached medians (bin values), nan = stale
        self.med_r = math.nan
        # cached non-empty bins as (low edge, high edge, weight), ascending; None = stale
        self.nz_d: list[tuple[float, float, float]] | None = None
        self.nz_r: list[tuple[float, float, float]] | None = None

    def median_d(self) -> float:
        if math.isnan(self.med_d):
            self.med_d = float(_D_MID[min(int(np.searchsorted(np.cumsum(self.dur), 0.5 * self.nd)), DUR_BINS - 1)])
        return self.med_d

    def median_r(self) -> float:
        if math.isnan(self.med_r):
            self.med_r = float(_R_MID[min(int(np.searchsorted(np.cumsum(self.ratio), 0.5 * self.nr)), RATIO_BINS - 1)])
        return self.med_r

    def bins_d(self) -> list[tuple[float, float, float]]:
        if self.nz_d is None:
            idx = np.flatnonzero(self.dur)
            self.nz_d = list(zip(_D_LO[idx].tolist(), _D_HI[idx].tolist(), self.dur[idx].tolist(), strict=True))
        return self.nz_d

    def bins_r(self) -> list[tuple[float, float, float]]:
        if self.nz_r is None:
            idx = np.flatnonzero(self.ratio)
            self.nz_r = list(zip(_R_LO[idx].tolist(), _R_HI[idx].tolist(), self.ratio[idx].tolist(), strict=True))
        return self.nz_r


class DurationPredictor:
    """Online hold-time predictor; see the module docstring.

    ``prior_s``: the prediction for a GPR without ``exitDuration`` when nothing is known yet (one with it
    is predicted to use all of it until history says otherwise).
    """

    def __init__(
        self,
        min_samples: int = 5,
        max_count: float = 500.0,
        max_keys: int = 10_000,
        prior_s: float = 3600.0,
        err_weight: float = 0.05,
    ) -> None:
        if min_samples < 1 or max_count < 2 * min_samples or max_keys < 1 or prior_s <= 0:
            raise ValueError("predictor: need min_samples >= 1, max_count >= 2*min_samples, max_keys >= 1, prior_s > 0")
        self.min_samples = min_samples
        self.max_count = max_count
        self.max_keys = max_keys
        self.prior_s = prior_s
        self.err_weight = err_weight
        self._keys: OrderedDict[tuple[str, ...], _Stats] = OrderedDict()
        self.observed = 0
        # predict() is a pure function of what has been observed: memoized until the next observation (the
        # controller predicts every queued GPR at every pass; the history changes only when GPRs finish)
        self._memo: dict[tuple[JobKey, float | None], Prediction] = {}
        self.epoch = 0  # +1 whenever what it predicts may change (observe, load_state): a key for callers' memos

    def __len__(self) -> int:
        return len(self._keys)

    # ------------------------------------------------------------------ learning
    def observe(self, key: JobKey, hold_s: float, exit_s: float | None = None) -> None:
        """One finished GPR held its devices for ``hold_s`` seconds (``exit_s``: its exitDuration, if set)."""
        self._memo.clear()
        self.epoch += 1
        if not math.isfinite(hold_s) or hold_s < 0:
            raise ValueError(f"hold time must be a finite non-negative number of seconds, got {hold_s!r}")
        if exit_s is not None and (not math.isfinite(exit_s) or exit_s <= 0):
            exit_s = None
        if exit_s is not None:
            hold_s = min(hold_s, exit_s)
        self.observed += 1
        db = _dur_bin(hold_s)
        rb = _ratio_bin(hold_s / exit_s) if exit_s is not None else -1
        logh = math.log(max(hold_s, 1.0))
        w = self.err_weight
        for lv in key.levels():
            st = self._keys.get(lv)
            if st is None:
                st = self._keys[lv] = _Stats()
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(lv)
            # how good was each model's median for this sample (before learning from it)? Judged on every
            # ERR_STRIDE-th sample of the key: enough to choose, a quarter of the cost
            if (exit_s is not None and st.nd >= self.min_samples and st.nr >= self.min_samples
                    and int(st.nd) % ERR_STRIDE == 0):
                ed = abs(math.log(max(min(st.median_d(), exit_s), 1.0)) - logh)
                er = abs(math.log(max(st.median_r() * exit_s, 1.0)) - logh)
                st.err_d = ed if math.isnan(st.err_d) else (1 - w) * st.err_d + w * ed
                st.err_r = er if math.isnan(st.err_r) else (1 - w) * st.err_r + w * er
            st.dur[db] += 1.0
            st.nd += 1.0
            st.med_d = math.nan
            st.nz_d = None
            if st.nd > self.max_count:
                st.dur *= 0.5
                st.nd *= 0.5
            if rb >= 0:
                st.ratio[rb] += 1.0
                st.nr += 1.0
                st.med_r = math.nan
                st.nz_r = None
                if st.nr > self.max_count:
                    st.ratio *= 0.5
                    st.nr *= 0.5

    # ------------------------------------------------------------------ predicting
    def distribution(self, key: JobKey, exit_s: float | None = None) -> tuple[list[tuple[float, float, float]], str]:
        """The predicted hold time as non-empty bins ``(low, high, weight)``, ascending, capped at ``exit_s``,
        and the source (key and model). Empty when nothing is known (the caller falls back to the prior)."""
        if exit_s is not None and (not math.isfinite(exit_s) or exit_s <= 0):
            exit_s = None
        for lv in key.levels():
            st = self._keys.get(lv)
            if st is None:
                continue
            use_r = exit_s is not None and st.nr >= self.min_samples
            use_d = st.nd >= self.min_samples
            if use_r and use_d and not math.isnan(st.err_d) and st.err_d < st.err_r:
                use_r = False
            name = ":".join(lv)
            if use_r:
                assert exit_s is not None
                e = exit_s
                return [(lo * e, hi * e, w) for lo, hi, w in st.bins_r()], f"{name}/exit-fraction"
            if use_d:
                bins = st.bins_d()
                if exit_s is not None:
                    e = exit_s
                    bins = [(min(lo, e), min(hi, e), w) for lo, hi, w in bins]
                return bins, f"{name}/seconds"
        return [], "prior"

    def predict(self, key: JobKey, exit_s: float | None = None) -> Prediction:
        """Predicted hold time of a GPR not yet admitted. Never above ``exit_s``."""
        hit = self._memo.get((key, exit_s))
        if hit is None:
            if len(self._memo) > 100_000:
                self._memo.clear()
            hit = self._memo[key, exit_s] = self.remaining(key, 0.0, exit_s)
        return hit

    def remaining(self, key: JobKey, elapsed_s: float, exit_s: float | None = None) -> Prediction:
        """Predicted *remaining* hold time of a GPR that has held its devices for ``elapsed_s`` seconds: the
        history's hold times conditioned on being longer than ``elapsed_s`` (each bin taken as log-uniform),
        minus ``elapsed_s``. Never above ``exit_s - elapsed_s``. When no history is that long, the GPR is
        expected to run as long again as it already has (capped)."""
        elapsed_s = max(0.0, elapsed_s)
        if exit_s is not None and (not math.isfinite(exit_s) or exit_s <= 0):
            exit_s = None
        cap = math.inf if exit_s is None else max(0.0, exit_s - elapsed_s)
        bins, source = self.distribution(key, exit_s)
        if bins:
            vals: list[tuple[float, float]] = []
            total = acc = 0.0
            for lo, hi, w in bins:
                if hi <= elapsed_s:
                    continue
                if math.isinf(hi):
                    hi = max(lo, elapsed_s) * 2 ** (1 / PER_OCTAVE)
                if lo < elapsed_s:  # the bin holding the elapsed time: only its part above it (log-uniform)
                    w *= math.log(hi / elapsed_s) / math.log(hi / lo) if lo > 0 else (hi - elapsed_s) / hi
                    lo = elapsed_s
                mid = math.sqrt(lo * hi) if lo > 0 else hi / 2  # log-uniform within a bin: its geometric middle
                v = max(0.0, min(mid - elapsed_s, cap))
                vals.append((v, w))
                total += w
                acc += v * w
            if total > 0:
                qs = [0.1 * total, 0.5 * total, 0.9 * total]
                out: list[float] = []
                run = 0.0
                for v, w in vals:
                    run += w
                    while qs and run >= qs[0] - 1e-9 * total:
                        out.append(v)
                        qs.pop(0)
                while len(out) < 3:
                    out.append(vals[-1][0])
                return Prediction(min(acc / total, cap), out[0], out[1], out[2], source)
            guess = max(elapsed_s, 1.0)
            return Prediction(min(guess, cap), min(guess / 2, cap), min(guess, cap), min(2 * guess, cap), source)
        if exit_s is not None:
            return Prediction(cap, cap, cap, cap, "prior/exit")
        guess = max(self.prior_s - elapsed_s, elapsed_s, 1.0)
        return Prediction(guess, guess, guess, guess, "prior")

    # ------------------------------------------------------------------ persistence
    def to_state(self, max_keys: int | None = None) -> dict[str, Any]:
        """JSON-able state: the ``max_keys`` most recently updated keys (all by default), sparse counts."""
        items = list(self._keys.items())
        if max_keys is not None:
            items = items[-max_keys:] if max_keys > 0 else []
        keys = []
        for lv, st in items:
            d = np.flatnonzero(st.dur)
            r = np.flatnonzero(st.ratio)
            keys.append(
                {
                    "k": list(lv),
                    "d": [[int(i), round(float(st.dur[i]), 4)] for i in d],
                    "r": [[int(i), round(float(st.ratio[i]), 4)] for i in r],
                    "ed": None if math.isnan(st.err_d) else round(st.err_d, 6),
                    "er": None if math.isnan(st.err_r) else round(st.err_r, 6),
                }
            )
        return {"version": STATE_VERSION, "bins": [PER_OCTAVE, DUR_BINS, RATIO_BINS], "observed": self.observed,
                "keys": keys}

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace what is known with ``state`` (from :meth:`to_state`); ValueError naming what is wrong.
        A state written with other bins is refused (the caller starts empty)."""
        self._memo.clear()
        self.epoch += 1
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"predictor state: version must be {STATE_VERSION}")
        if state.get("bins") != [PER_OCTAVE, DUR_BINS, RATIO_BINS]:
            raise ValueError("predictor state: written with different bins")
        keys = state.get("keys")
        if not isinstance(keys, list):
            raise ValueError("predictor state: 'keys' must be a list")
        loaded: OrderedDict[tuple[str, ...], _Stats] = OrderedDict()
        for i, item in enumerate(keys):
            try:
                lv = tuple(str(x) for x in item["k"])
                st = _Stats()
                for arr, n_attr, field, size in ((st.dur, "nd", "d", DUR_BINS), (st.ratio, "nr", "r", RATIO_BINS)):
                    for b, c in item[field]:
                        if not 0 <= int(b) < size or not math.isfinite(float(c)) or float(c) < 0:
                            raise ValueError(f"bin {b}: count {c}")
                        arr[int(b)] = float(c)
                    setattr(st, n_attr, float(arr.sum()))
                st.err_d = math.nan if item.get("ed") is None else float(item["ed"])
                st.err_r = math.nan if item.get("er") is None else float(item["er"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"predictor state: keys[{i}]: {exc}") from exc
            loaded[lv] = st
        while len(loaded) > self.max_keys:
            loaded.popitem(last=False)
        self._keys = loaded
        self.observed = int(state.get("observed", 0) or 0)

    @classmethod
    def from_state(cls, state: dict[str, Any], **kwargs: Any) -> DurationPredictor:
        p = cls(**kwargs)
        p.load_state(state)
        return p


@functools.lru_cache(maxsize=4096)  # few shapes, asked for every queued GPR and holder at every pass
def shape_of(resource: str, devices_per_node: int, milli_per_device: int, node_count: int) -> str:
    return f"{resource}:{devices_per_node}x{milli_per_device}x{node_count}"


def job_key(workspace: str, template: str, owner: str, shape: str) -> JobKey:
    """``JobKey(...)`` built in C: a named tuple's own constructor is a Python function, and the controller
    makes one per queued GPR and holder at every pass."""
    return tuple.__new__(JobKey, (workspace, template, owner, shape))

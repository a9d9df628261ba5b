"""The cost model (DESIGN §5): load a prefix from a secondary tier only while that beats
recomputing it.

Each secondary tier keeps a live estimate of its promotions: a latency (seconds until a first
chunk lands) and a bandwidth (bytes per second while chunks land), both from its own finished
promotions (`LinkEstimate`), starting from `cost_model.tiers.<label>` when configured. A tier
with neither starts from its cascades (stores cross the same link): until its first
promotion is measured, its stores' estimate stands in for its loads'. The serving engine's prefill throughput (tokens per second) is kept per
band of tokens per step (powers of two) from the integration's step timings
(`PrefillEstimate`, fed by `CostModel.observe_prefill`), starting from
`cost_model.prefill_tokens_per_s` when configured.

When a lookup meets a chunk only a secondary tier holds, for the `n` chunks of the prefix
from there on (`tokens_per_chunk` tokens each):

    load_s      = latency (unless a promotion of this prefix is already on its way)
                  + n * chunk_nbytes / bandwidth
    recompute_s = n * tokens_per_chunk / prefill_tokens_per_s(n * tokens_per_chunk)
    load   iff  load_s * (1 + margin) <= recompute_s

An estimate that is not known yet (a cold tier with nothing configured, no prefill timed yet)
decides "load": the status quo, and the load measures the tier. The margin (default 0.1) asks
a load to be predicted that much faster than the recompute, so estimation noise near the
break-even costs at most the margin. A tier the model keeps skipping is measured again every
`probe_every` skipped decisions: one chunk of the skipped run (its last: no request waits for
it) is promoted in the background, so a link that recovered is seen. Host hits (and chunks
already promoted into host memory) always load; so does every hit with `mode: "always"`.

A skip never changes bytes: the engine answers MISS from that chunk on and the serving engine
computes the tokens itself.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from kvhal.config import CostModelConfig, TierCost
from kvhal.tier import JobKind

logger = logging.getLogger(__name__)

#: Weight of a new sample in the running estimates (an exponential moving average): a link
#: whose speed changes is followed within a few measured promotions.
EWMA_WEIGHT = 0.5


class LinkEstimate:
    """Latency and bandwidth of one tier's promotions, from its busy periods: from the first
    promotion submitted while none was in flight to the poll that collected the last one, but
    at most the sum of its jobs' own seconds (a poll that comes late, e.g. an idle serving
    engine collecting a cascade only with its next request, does not count; jobs that
    overlapped make that bound up to the tier's concurrency too long: a slower estimate).
    A period of `n` chunks, `nbytes` landed in `T` seconds, whose fastest job took `t_min`
    (the tier's own `JobResult.seconds`), gives latency ≈ t_min − chunk/bandwidth and
    bandwidth ≈ nbytes / (T − latency) (a period of one chunk keeps the latency believed and
    measures the bandwidth alone). Bandwidth is averaged as seconds per byte, so one
    slow period weighs as much as the time it cost: a slowed link is believed after one
    period, a recovered one after a few."""

    def __init__(self, start: TierCost):
        self.latency_s = start.latency_s
        bandwidth = start.bandwidth_bytes_per_s
        self._s_per_byte = None if bandwidth is None else 1 / bandwidth
        self.in_flight = 0
        self._since = 0.0
        self._nbytes = 0
        self._chunks = 0
        self._fastest_s = math.inf
        self._busy_s = 0.0

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """Bytes per second while chunks land, or None if not known."""
        return None if self._s_per_byte is None else 1 / self._s_per_byte

    @property
    def known(self) -> bool:
        """Both figures are known (measured or configured)."""
        return self.latency_s is not None and self._s_per_byte is not None

    def started(self, now: float) -> None:
        """A promotion was submitted at `now` (`time.monotonic()`)."""
        if not self.in_flight:
            self._since, self._nbytes, self._chunks, self._fastest_s = now, 0, 0, math.inf
            self._busy_s = 0.0
        self.in_flight += 1

    def finished(self, nbytes: int, seconds: float, ok: bool, now: float) -> None:
        """A promotion ended (collected at `now`): `nbytes` landed if `ok`, the tier took
        `seconds`. The last one of a busy period updates the estimates."""
        self.in_flight = max(0, self.in_flight - 1)
        if ok:
            self._nbytes += nbytes
            self._chunks += 1
            self._fastest_s = min(self._fastest_s, seconds)
            self._busy_s += seconds
        if self.in_flight or not self._chunks:
            return
        period = max(min(now - self._since, self._busy_s), self._fastest_s, 1e-6)
        chunk = self._nbytes / self._chunks
        s_per_byte = self._s_per_byte if self._s_per_byte is not None else period / self._nbytes
        if self._chunks == 1 and self.latency_s is not None:   # cannot tell the two apart
            latency = min(self.latency_s, period / 2)
        else:
            latency = min(max(0.0, self._fastest_s - chunk * s_per_byte), period / 2)
            self.latency_s = _blend(self.latency_s, latency)
        self._s_per_byte = _blend(self._s_per_byte, (period - latency) / self._nbytes)


class PrefillEstimate:
    """The serving engine's prefill throughput per band of tokens per step (band b holds
    steps of [2^b, 2^(b+1)) tokens); a band never timed answers with the nearest one timed,
    else the configured start."""

    def __init__(self, start_tokens_per_s: float | None):
        self._start = start_tokens_per_s
        self._bands: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step computed `num_tokens` tokens in `seconds` (ignored unless both > 0)."""
        if num_tokens > 0 and seconds > 0:
            band = num_tokens.bit_length() - 1
            self._bands[band] = _blend(self._bands.get(band), num_tokens / seconds)

    def tokens_per_s(self, num_tokens: int) -> float | None:
        """Expected throughput of a prefill of `num_tokens`, or None if unknown."""
        if not self._bands:
            return self._start
        band = max(num_tokens, 1).bit_length() - 1
        nearest = min(self._bands, key=lambda b: (abs(b - band), -b))
        return self._bands[nearest]


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision of `CostModel.decide`: `load` or not, with the predictions it compared
    (seconds; None where not known)."""

    load: bool
    load_s: float | None = None
    recompute_s: float | None = None


class CostModel:
    """Decides load or recompute per tier (module docstring).

    Args:
        config: The `cost_model` config.
        tier_labels: The `tier` label of each secondary tier, in order.
        tokens_per_chunk: Tokens per chunk; None: nothing to compare against, every hit loads.

    Raises:
        ValueError: "cost_model.tiers.<label>: ..." for a configured label no tier has.
    """

    def __init__(self, config: CostModelConfig, tier_labels: list[str],
                 tokens_per_chunk: int | None):
        unknown = sorted(set(config.tiers) - set(tier_labels))
        if unknown:
            raise ValueError(f"cost_model.tiers.{unknown[0]}: no secondary tier has this "
                             f"label; labels: {', '.join(tier_labels) or '(no tiers)'}")
        self.config = config
        self.enabled = config.mode == "model" and tokens_per_chunk is not None
        self.tokens_per_chunk = tokens_per_chunk or 0
        self.links = [LinkEstimate(config.tiers.get(label, TierCost()))
                      for label in tier_labels]
        self.store_links = [LinkEstimate(TierCost()) for _ in tier_labels]
        self.prefill = PrefillEstimate(config.prefill_tokens_per_s)
        self._labels = tier_labels
        self._skips = [0] * len(tier_labels)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """One engine step computed `num_tokens` tokens in `seconds` (the integration's step
        timings)."""
        self.prefill.observe(num_tokens, seconds)

    def decide(self, t: int, num_chunks: int, chunk_nbytes: int, first: bool) -> Decision:
        """Load `num_chunks` chunks of `chunk_nbytes` from tier `t`, or recompute them?
        `first`: no promotion of this prefix is on its way yet (its latency is still to pay).
        Logs the decision (debug)."""
        if not self.enabled:
            return Decision(True)
        link = self.links[t] if self.links[t].known else self.store_links[t]
        tokens = num_chunks * self.tokens_per_chunk
        rate = self.prefill.tokens_per_s(tokens)
        if not link.known or not rate:
            logger.debug("cost model: %s tier, %d chunks: load (not measured yet)",
                         self._labels[t], num_chunks)
            return Decision(True)
        load_s = (link.latency_s if first else 0.0) + \
            num_chunks * chunk_nbytes / link.bandwidth_bytes_per_s
        recompute_s = tokens / rate
        load = load_s * (1 + self.config.margin) <= recompute_s
        logger.debug("cost model: %s tier, %d chunks (%d tokens): load %.4f s vs recompute "
                     "%.4f s (%.0f tokens/s) -> %s", self._labels[t], num_chunks, tokens,
                     load_s, recompute_s, rate, "load" if load else "recompute")
        return Decision(load, load_s, recompute_s)

    def probe_due(self, t: int) -> bool:
        """Count a skipped decision of tier `t`; True every `probe_every`-th one while no
        promotion of it is in flight (promote one chunk in the background to re-measure)."""
        self._skips[t] += 1
        if self._skips[t] >= self.config.probe_every and not self.links[t].in_flight:
            self._skips[t] = 0
            return True
        return False

    def started(self, t: int, kind: JobKind = JobKind.LOAD) -> None:
        """A promotion (LOAD) or a cascade (STORE) of tier `t` was submitted."""
        (self.links if kind is JobKind.LOAD else self.store_links)[t].started(time.monotonic())

    def finished(self, t: int, nbytes: int, seconds: float, ok: bool,
                 kind: JobKind = JobKind.LOAD) -> None:
        """A promotion (LOAD) or a cascade (STORE) of tier `t` was collected (`JobResult`)."""
        (self.links if kind is JobKind.LOAD else self.store_links)[t].finished(
            nbytes, seconds, ok, time.monotonic())


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new

"""A workload from the Lublin-Feitelson model of rigid parallel jobs, for replays.

Source: Uri Lublin and Dror G. Feitelson, "The workload on parallel supercomputers: modeling the
characteristics of rigid jobs", J. Parallel and Distributed Computing 63(11), 2003.  The model's
parameters below are its published values for the whole sample (batch and interactive jobs together,
as in the authors' reference generator); the code is this project's.

* Size: a job is serial (1 processor) with probability ``SERIAL_PROB``; otherwise ``u``, the log2 of
  its size, is drawn from a two-stage uniform distribution (``U(ULOW, UMED)`` with probability
  ``UPROB``, else ``U(UMED, UHI)``, ``UHI`` the log2 of the machine's size, ``UMED = UHI - 2.5``), and
  its size is ``2**round(u)`` with probability ``POW2_PROB`` (the model's excess of powers of two),
  else ``round(2**u)``.
* Run time: ``exp(x)`` seconds, ``x`` from a hyper-gamma distribution: ``gamma(A1, B1)`` with
  probability ``p = PA * size + PB`` (so larger jobs run longer), else ``gamma(A2, B2)``; draws past
  ``exp(12)`` seconds (about 45 hours) are drawn again, as the model bounds run times.
* Arrivals: inter-arrival gaps at the rush hours are ``exp(g)`` seconds, ``g ~ gamma(AARR * ARAR,
  BARR)``; through the day, the arrival rate follows a daily cycle, the mass of ``gamma(ANUM, BNUM)``
  over each of the day's 48 half-hours counted from 11:00 (the model's cyclic day start), relative to
  the busiest half-hour; a gap is spent at that rate, so it lasts longer in the quiet hours.  This is
  our reading of the model's cycle: its shape is the model's, its hour of peak may differ from the
  reference generator's.  Arrival times are then scaled so that the workload offers a chosen load.

Gamma distributions here are shape ``a`` and scale ``b`` (mean ``a * b``).
"""

from __future__ import annotations

import math
import random

SERIAL_PROB, POW2_PROB = 0.244, 0.576
ULOW, UPROB = 0.8, 0.86
A1, B1, A2, B2, PA, PB = 4.2, 0.94, 312.0, 0.03, -0.0054, 0.78
AARR, BARR, ANUM, BNUM, ARAR = 10.2303, 0.4871, 8.1737, 3.9631, 1.0225
BUCKETS, DAY_START_HOUR = 48, 11
MAX_LOG_RUN = 12.0


def _gamma_cdf(x: float, a: float, b: float, steps: int = 400) -> float:
    """The CDF of gamma(shape ``a``, scale ``b``) at ``x``: Simpson's rule on its density."""
    if x <= 0:
        return 0.0
    h = x / steps
    log_norm = math.lgamma(a) + a * math.log(b)

    def pdf(t: float) -> float:
        return 0.0 if t <= 0 else math.exp((a - 1) * math.log(t) - t / b - log_norm)

    total = pdf(0.0) + pdf(x)
    for i in range(1, steps):
        total += (4 if i % 2 else 2) * pdf(i * h)
    return min(1.0, total * h / 3)


def daily_rates() -> list[float]:
    """The relative arrival rate of each half-hour of the day (index 0: 00:00-00:30), the busiest 1.0."""
    masses = [0.0] * BUCKETS
    start = DAY_START_HOUR * BUCKETS // 24
    for i in range(BUCKETS):  # the i-th half-hour after the cyclic day start
        masses[(start + i) % BUCKETS] = _gamma_cdf(i + 1.0, ANUM, BNUM) - _gamma_cdf(float(i), ANUM, BNUM)
    top = max(masses)
    return [max(m / top, 1e-3) for m in masses]  # never zero: a gap always ends


def size_of(rng: random.Random, processors: int) -> int:
    """A job's size in processors (1 to ``processors``)."""
    if rng.random() < SERIAL_PROB:
        return 1
    uhi = math.log2(processors)
    umed = uhi - 2.5
    u = rng.uniform(ULOW, umed) if rng.random() < UPROB else rng.uniform(umed, uhi)
    size = 2 ** round(u) if rng.random() < POW2_PROB else round(2**u)
    return max(1, min(processors, int(size)))


def runtime_of(rng: random.Random, size: int) -> float:
    """A job's run time in seconds (at least 1)."""
    p = min(1.0, max(0.0, PA * size + PB))
    while True:
        x = rng.gammavariate(A1, B1) if rng.random() < p else rng.gammavariate(A2, B2)
        if x <= MAX_LOG_RUN:
            return max(1.0, math.exp(x))


def jobs(seed: int, count: int, processors: int, load: float) -> list[tuple[float, int, float]]:
    """``count`` jobs of a machine of ``processors`` processors as (submission second from 0, size,
    run time in seconds), their arrivals scaled so that the work offered (size x run time) over the
    span of the submissions is ``load`` of the machine."""
    rng = random.Random(seed)
    rates, bucket_s = daily_rates(), 86400.0 / BUCKETS
    t, raw = 0.0, []
    for _ in range(count):
        gap = math.exp(rng.gammavariate(AARR * ARAR, BARR))  # seconds at the busiest rate
        while gap > 0:
            bucket = int(t // bucket_s)
            rate = rates[bucket % BUCKETS]
            room = ((bucket + 1) * bucket_s - t) * rate
            if room >= gap:
                t += gap / rate
                gap = 0.0
            else:
                gap -= room
                t = (bucket + 1) * bucket_s
        size = size_of(rng, processors)
        raw.append((t, size, runtime_of(rng, size)))
    work = sum(size * run for _, size, run in raw)
    span = raw[-1][0] - raw[0][0] or 1.0
    scale = work / (load * processors * span)  # the natural load over the chosen one
    return [((at - raw[0][0]) * scale, size, run) for at, size, run in raw]

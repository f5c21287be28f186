"""Scraping the engine pods' ``/metrics`` for coordinated autoscaling (``mode: ketch``).

Each ready pod of a role is asked directly (``http://<podIP>:<port>/metrics``, a short timeout);
the spec's metric types become values through ``metric_table.METRICS``: a gauge as exported, the
time-to-first-token quantile from the increase of the pod's histogram buckets over the last
``metric_table.RATE_WINDOW`` (2 minutes, as the PromQL of the other modes; ``Windows``), or since
the pod started while the operator has seen it for less than that.

The page is the InferenceService author's (the engine image is theirs), so it is read as
untrusted (security review M2): no redirect is followed (a 3xx is an error: the operator must
not fetch what a pod points it to), the body is read up to ``MAX_BODY_BYTES`` and no further,
uncompressed, within the timeout (connect, each read and the whole request); only the lines of
the series the spec asks for reach the parser; and what goes into status names the pod and the
HTTP status or the class of the error, never text from the response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ketch.operator.autoscaling import metric_table

Obj = dict[str, Any]

MAX_BODY_BYTES = 1 << 20  # 1 MiB; the engine's page is a few KiB
MAX_LINE_BYTES = 4096  # longer lines are skipped: no series the operator reads is that long
_CHUNK = 64 << 10


class ScrapeError(Exception):
    """Why a pod's page was not used: a fixed text, never anything the pod sent."""


@dataclasses.dataclass
class RoleMetrics:
    values: dict[str, list[float]]  # metric type -> one value per pod
    errors: list[str]  # "pod: why", for each pod without a usable sample


def pod_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


Buckets = list[tuple[float, float]]


class Windows:
    """Per pod and histogram, the bucket counts seen over the last ``seconds``: a quantile is
    taken over their increase, as PromQL's ``histogram_quantile(q, rate(...[2m]))``."""

    def __init__(self, seconds: float = 120.0):
        self.seconds = seconds
        self.snapshots: dict[tuple[str, str], list[tuple[float, Buckets]]] = {}

    def increase(self, pod: str, series: str, now: float, buckets: Buckets) -> Buckets:
        snaps = self.snapshots.setdefault((pod, series), [])
        snaps.append((now, sorted(buckets)))
        while len(snaps) > 1 and now - snaps[1][0] >= self.seconds:
            snaps.pop(0)  # keep the newest snapshot at least `seconds` old as the base
        base = dict(snaps[0][1])
        delta = [(le, count - base.get(le, 0.0)) for le, count in sorted(buckets)]
        if len(snaps) == 1 or any(d < 0 for _, d in delta) or len(base) != len(delta):
            return sorted(buckets)  # first sight, or the counters were reset
        return delta

    def forget(self, pods: set[str]) -> None:
        for key in [k for k in self.snapshots if k[0] not in pods]:
            del self.snapshots[key]


def extract(
    text: str,
    types: list[str],
    *,
    windows: Windows | None = None,
    pod: str = "",
    now: float = 0.0,
) -> dict[str, float]:
    """The value of each metric type in one pod's exposition (types without a sample left out).
    Only the lines of the series ``types`` need are parsed (``wanted_lines``)."""
    samples: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    series = {
        metric_table.BY_TYPE[name].series
        for name in types
        if metric_table.BY_TYPE[name].engine is not None
    }
    for family in text_string_to_metric_families(wanted_lines(text, series)):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                buckets.setdefault(sample.name, []).append(
                    (float(sample.labels["le"]), float(sample.value))
                )
            else:
                samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    out = {}
    for name in types:
        metric = metric_table.BY_TYPE[name]
        if metric.engine is None:
            continue
        if metric.quantile is None:
            if metric.series in samples:
                out[name] = samples[metric.series]
        else:
            series = buckets.get(metric.series, [])
            if windows is not None and series:
                series = windows.increase(pod, metric.series, now, series)
            value = quantile(series, metric.quantile)
            out[name] = 0.0 if value is None else value  # no request yet: no latency
    return out


def wanted_lines(text: str, series: set[str]) -> str:
    """The sample lines of ``series`` in an exposition (no comments: the parser then takes each
    series as untyped, which is all ``extract`` needs), lines over ``MAX_LINE_BYTES`` left out."""
    out = []
    for line in text.splitlines():
        if len(line) > MAX_LINE_BYTES:
            continue
        name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
        if name in series:
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float) -> str:
    """The body of ``url`` as text: ``ScrapeError`` for a status other than 200 (a redirect
    included), a compressed body, or one over ``MAX_BODY_BYTES``."""
    limits = aiohttp.ClientTimeout(
        total=timeout, connect=timeout, sock_connect=timeout, sock_read=timeout
    )
    async with session.get(
        url,
        timeout=limits,
        allow_redirects=False,
        auto_decompress=False,
        headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
    ) as response:
        if 300 <= response.status < 400:
            raise ScrapeError(f"HTTP {response.status} (redirects are not followed)")
        if response.status != 200:
            raise ScrapeError(f"HTTP {response.status}")
        if response.headers.get("Content-Encoding", "identity").lower() not in ("", "identity"):
            raise ScrapeError("compressed body refused (Content-Encoding)")
        too_big = ScrapeError(f"body over {MAX_BODY_BYTES} bytes")
        if (response.content_length or 0) > MAX_BODY_BYTES:
            raise too_big
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_big
    return body.decode("utf-8", errors="replace")


async def scrape_role(
    session: aiohttp.ClientSession,
    pods: list[Obj],
    port: int,
    types: list[str],
    timeout: float,
    *,
    windows: Windows | None = None,
    now: float = 0.0,
) -> RoleMetrics:
    ready = sorted((p for p in pods if pod_ready(p)), key=lambda p: p["metadata"]["name"])
    result = RoleMetrics({t: [] for t in types}, [])
    if not ready:
        result.errors.append("no ready pods")
        return result

    async def one(pod: Obj) -> tuple[str, dict[str, float] | str]:
        name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
        try:
            text = await fetch(session, f"http://{ip}:{port}/metrics", timeout)
            return name, extract(text, types, windows=windows, pod=name, now=now)
        except ScrapeError as exc:
            return name, str(exc)
        except TimeoutError:
            return name, f"no answer within {timeout:g} s"
        except aiohttp.ClientError as exc:  # its text may quote the pod's answer
            return name, f"request failed ({type(exc).__name__})"
        except Exception as exc:  # the parser's messages quote the page
            return name, f"unreadable metrics ({type(exc).__name__})"

    for name, got in await asyncio.gather(*(one(p) for p in ready)):
        if isinstance(got, str):
            result.errors.append(f"{name}: {got}")
            continue
        missing = [t for t in types if t not in got]
        if missing:
            result.errors.append(f"{name}: no sample of {', '.join(missing)}")
            continue
        for t in types:
            result.values[t].append(got[t])
    return result

"""The server's own view while a run drives it: its Prometheus /metrics, scraped on a thread.

`ServerMetricsScraper` GETs `<base_url>/metrics` every `workload.server_metrics_interval_s`
from the moment the client starts until it ends, on its own thread with its own HTTP
client and a short timeout, so the load client's event loop never waits for it. Each
answer becomes one line of server_metrics.jsonl in the run directory, appended whole as it
arrives (`remnant.records.files.append_line`; remnant.run_dir names the file), so a crash or Ctrl-C loses nothing already
scraped:

    {"t": 12.01, "sglang:token_usage": 0.42, "sglang:num_running_reqs": 8.0,
     "sglang:num_queue_reqs": 3.0, "sglang:cache_hit_rate": 0.1, "sglang:prompt_tokens_total": 5120.0, ...}

`t` is seconds since the client started, the clock of requests.jsonl. Every gauge and
counter the server publishes is kept under its own name (SGLang's `sglang:` names, which
remnant-serve publishes too); histogram and summary series are left out. Where a name has
several label sets (SGLang's data-parallel ranks, its `is_streaming` and `cache_source`
splits) they become one value: summed, shares averaged (`SHARE_SUFFIXES`), and where one
label set says `total` (SGLang's `cache_source="total"`) that one alone.

`record()` summarizes the series for run.json's `server_metrics` (over the measured phase:
KV usage, queue depth and running requests peak and mean, the cache hit rate last and
mean, counters' increase) and says in run.json's limits what it could not scrape. A
server without /metrics (SGLang started without --enable-metrics answers 404), one that
refuses the connection or one whose answer does not parse gives `server_metrics: null`
and one limit; it never fails the run. The API key, where the run has one, is sent as on
every other request (remnant-serve leaves /metrics open; SGLang may not).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from remnant.api_key import bearer
from remnant.records.files import append_line
from remnant.workloads.base import SERVER_METRICS_MIN_INTERVAL_S as MIN_INTERVAL_S

log = logging.getLogger(__name__)

#: SGLang's gauges the summary reads (sglang.srt.observability.metrics_collector, 0.5.18).
KV_USAGE = "sglang:token_usage"
QUEUE = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
CACHE_HIT_RATE = "sglang:cache_hit_rate"
#: Names whose values are shares or averages: averaged over label sets, not summed.
SHARE_SUFFIXES = ("usage", "rate", "ratio", "utilization", "occupancy", "perc", "length")
#: Consecutive failed scrapes, none of them answered, after which the server is taken to
#: have no /metrics and the scraper stops asking.
GIVE_UP_AFTER = 3

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
#: Sample suffixes of histogram and summary families (and OpenMetrics' _created).
_FAMILY_SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_gcount", "_gsum")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def _labels(line: str, i: int, lineno: int) -> tuple[dict, int]:
    """The label set starting after '{' at `i`; returns it and the index after '}'."""
    labels: dict[str, str] = {}
    n = len(line)
    while True:
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] == "}":
            return labels, i + 1
        m = _LABEL.match(line, i)
        if not m:
            raise ValueError(f"line {lineno}: bad label name at column {i + 1}")
        name, i = m.group(), m.end()
        while i < n and line[i] in " \t":
            i += 1
        if line[i : i + 2] != '="':
            raise ValueError(f"line {lineno}: label {name} has no =\"value\"")
        i += 2
        value = []
        while True:
            if i >= n:
                raise ValueError(f"line {lineno}: label {name}'s value is not closed")
            c = line[i]
            if c == "\\" and i + 1 < n:
                value.append(_ESCAPES.get(line[i + 1], "\\" + line[i + 1]))
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                value.append(c)
                i += 1
        labels[name] = "".join(value)
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] == ",":
            i += 1
        elif not (i < n and line[i] == "}"):
            raise ValueError(f"line {lineno}: expected , or }} after label {name}")


def parse_prometheus(text: str) -> tuple[list[Sample], dict[str, str]]:
    """Prometheus text exposition (0.0.4, and OpenMetrics' lines alike) -> (samples, the
    type each `# TYPE` line gives a family). Comments and blank lines are skipped, label
    values unescaped, timestamps and exemplars dropped; ValueError names the first line
    that is not a sample."""
    samples: list[Sample] = []
    types: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) == 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip().lower()
            continue
        m = _NAME.match(line)
        if not m:
            raise ValueError(f"line {lineno} is not a metric sample: {line[:80]!r}")
        name, i = m.group(), m.end()
        labels: dict[str, str] = {}
        if i < len(line) and line[i] == "{":
            labels, i = _labels(line, i + 1, lineno)
        rest = line[i:].split(" # ", 1)[0].split()  # an OpenMetrics exemplar follows " # "
        if not 1 <= len(rest) <= 2:
            raise ValueError(f"line {lineno}: {name} has no value: {line[:80]!r}")
        try:
            value = float(rest[0])
        except ValueError:
            raise ValueError(f"line {lineno}: {name}'s value {rest[0]!r} is not a number") from None
        samples.append(Sample(name, labels, value))
    return samples, types


def _kind(name: str, types: dict[str, str]) -> str:
    """gauge, counter, untyped, or the histogram/summary a sample belongs to."""
    if name in types:
        return types[name]
    for suffix in _FAMILY_SUFFIXES:
        if name.endswith(suffix) and types.get(name[: -len(suffix)]) in ("histogram", "summary", "gaugehistogram",
                                                                          "counter"):
            return types[name[: -len(suffix)]] + suffix
    if name.endswith("_total") and types.get(name[:-6]) == "counter":  # OpenMetrics counters
        return "counter"
    return "untyped"


def _created(name: str, types: dict[str, str]) -> bool:
    """A counter's or histogram's creation time, which prometheus_client's text format
    publishes as a gauge of its own (`<family>_created`)."""
    if not name.endswith("_created"):
        return False
    base = name[: -len("_created")]
    return types.get(base + "_total") == "counter" or types.get(base) in ("counter", "histogram", "summary")


def flatten(samples: list[Sample], types: dict[str, str]) -> dict[str, float]:
    """One value per gauge and counter name (see the module doc for several label sets);
    histogram and summary series, and NaN or infinite values, are left out."""
    series: dict[str, list[Sample]] = {}
    for s in samples:
        if _kind(s.name, types) not in ("gauge", "counter", "untyped", "unknown") or _created(s.name, types):
            continue
        if "le" in s.labels or "quantile" in s.labels or not math.isfinite(s.value):
            continue  # an untyped histogram's bucket or summary's quantile; not JSON
        series.setdefault(s.name, []).append(s)
    out = {}
    for name, group in series.items():
        totals = [s for s in group if "total" in s.labels.values()]
        values = [s.value for s in (totals or group)]
        share = name.rsplit(":", 1)[-1].endswith(SHARE_SUFFIXES)
        out[name] = sum(values) / len(values) if share else sum(values)
    return out


def describe_error(exc: BaseException) -> str:
    """A transport error in one line; httpx's timeouts carry no message of their own."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


class ServerMetricsScraper:
    """Scrapes `base_url`/metrics every `interval_s` on a thread, from start() to stop().

    t0: the client's perf_counter origin, so each line's t is on requests.jsonl's clock.
    timeout_s: per scrape (default: the interval, between 0.5 and 5 s); a scrape that
    takes longer counts as failed and the next starts on the next tick.
    """

    def __init__(self, base_url: str, path: Path, interval_s: float, t0: float, api_key: str | None = None,
                 timeout_s: float | None = None):
        if not (math.isfinite(interval_s) and interval_s >= MIN_INTERVAL_S):
            raise ValueError(f"interval_s={interval_s} must be >= {MIN_INTERVAL_S}")
        self.url = base_url.rstrip("/") + "/metrics"
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.timeout_s = timeout_s if timeout_s is not None else min(max(self.interval_s, 0.5), 5.0)
        self.t0 = t0
        self._headers = bearer(api_key)
        self.samples: list[dict] = []
        self.failed = 0
        self.first_error: str | None = None
        self.write_error: str | None = None
        self.gave_up = False
        self._latest: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def latest(self) -> dict | None:
        """The last sample scraped (None before the first): read from any thread."""
        return self._latest

    def start(self) -> "ServerMetricsScraper":
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="remnant-server-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the scrape in flight (at most its timeout); every line is on disk."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # httpx's timeout bounds connect and each read apart: three of them, at most.
            self._thread.join(3 * self.timeout_s + 1.0)

    def __enter__(self) -> "ServerMetricsScraper":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout_s, headers=self._headers) as http:
                due = time.perf_counter()
                # One scrape at least, even where the client stopped first (a run shorter than
                # this thread's start on a loaded machine): the record then says whether the
                # server has /metrics, not only that no sample came.
                while True:
                    self.scrape_once(http)
                    if self.gave_up or self._stop.is_set():
                        return
                    due += self.interval_s
                    now = time.perf_counter()
                    if due < now:  # a slow scrape: skip the ticks it overran, keep the grid
                        due += math.ceil((now - due) / self.interval_s) * self.interval_s
                    if self._stop.wait(due - now):
                        return
        except Exception as exc:  # noqa: BLE001 - the scraper must never take the run down
            log.warning("server metrics: the scraper stopped: %r", exc)
            self.first_error = self.first_error or f"the scraper stopped: {exc!r}"

    def scrape_once(self, http: httpx.Client) -> dict | None:
        """One GET /metrics: its sample (also appended to the file), or None (counted)."""
        error = None
        try:
            r = http.get(self.url)
            t = self.now()
            if r.status_code != 200:
                error = f"answered HTTP {r.status_code}"
            else:
                values = flatten(*parse_prometheus(r.text))
                if not values:
                    error = "answered no gauge or counter"
        except httpx.HTTPError as exc:
            error = describe_error(exc)
        except ValueError as exc:
            error = f"answered what does not parse as Prometheus text ({exc})"
        if error is not None:
            self.failed += 1
            self.first_error = self.first_error or error
            if not self.samples and self.failed >= GIVE_UP_AFTER:
                self.gave_up = True
            return None
        sample = {"t": round(t, 6), **values}
        self.samples.append(sample)
        self._latest = sample
        if self.write_error is None:
            try:
                append_line(self.path, orjson.dumps(sample).decode())
            except OSError as exc:
                self.write_error = str(exc)
        return sample

    def record(self, phases: list) -> tuple[dict | None, list[str]]:
        """run.json's server_metrics and the limits it calls for; see `summarize`."""
        return summarize(self.samples, phases, source=self.url, interval_s=self.interval_s,
                         path=self.path.name if self.path.is_file() else None, failed=self.failed,
                         first_error=self.first_error, write_error=self.write_error)


def _stat(values: list[float], last: bool = False) -> dict | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    return {"last": values[-1], "mean": mean} if last else {"peak": max(values), "mean": mean}


def summarize(samples: list[dict], phases: list, *, source: str, interval_s: float, path: str | None,
              failed: int = 0, first_error: str | None = None, write_error: str | None = None
              ) -> tuple[dict | None, list[str]]:
    """(run.json's server_metrics, limits) from the scraped samples.

    The summary covers the measured phase (phases: the client's PhaseResults, times on the
    samples' clock) where it ran and a scrape fell within it, else every sample (phase
    null). None, with a limit saying why, where no scrape succeeded.
    """
    limits = []
    if not samples:
        if first_error is None:
            why = "gave no sample before the client stopped"
        elif first_error.startswith("answered"):
            why = first_error
        else:
            why = f"failed: {first_error}"
        hint = " (SGLang serves it only when started with --enable-metrics)" if "HTTP 404" in why else ""
        return None, [f"no server metrics: GET {source} {why}{hint}; run.json's server_metrics is null"]
    measured = next((p for p in phases if getattr(p, "name", None) == "measured"), None)
    window, phase = (samples[0]["t"], samples[-1]["t"]), None
    if measured is not None:
        lo, hi = measured.started_at_s, measured.started_at_s + measured.duration_s
        if any(lo <= s["t"] <= hi for s in samples):
            window, phase = (lo, hi), "measured"
    inside = [s for s in samples if window[0] <= s["t"] <= window[1]]
    before = [s for s in samples if s["t"] < window[0]]

    def series(name: str) -> list[float]:
        return [s[name] for s in inside if name in s]

    counters = {}
    for name in sorted({k for s in inside for k in s if k.startswith("sglang:") and k.endswith("_total")}):
        last = next(s[name] for s in reversed(inside) if name in s)
        base = next((s[name] for s in reversed(before) if name in s), None)
        if base is None:
            base = next(s[name] for s in inside if name in s)
        counters[name] = max(0.0, last - base)
    summary = {
        "source": source,
        "interval_s": interval_s,
        "path": path,
        "scrapes": len(samples),
        "failed": failed,
        "first_error": first_error,
        "phase": phase,
        "from_s": window[0],
        "to_s": window[1],
        "samples": len(inside),
        "kv_usage": _stat(series(KV_USAGE)),
        "queue_depth": _stat(series(QUEUE)),
        "running_requests": _stat(series(RUNNING)),
        "cache_hit_rate": _stat(series(CACHE_HIT_RATE), last=True),
        "counters": counters,
    }
    missing = [n for n in (KV_USAGE, QUEUE, RUNNING, CACHE_HIT_RATE) if not any(n in s for s in samples)]
    if missing:
        limits.append(f"the server's /metrics ({source}) has no {', '.join(missing)} (SGLang's names): "
                      "server_metrics leaves them null")
    if failed:
        limits.append(f"{failed} of {failed + len(samples)} scrapes of {source} failed (first: {first_error}): "
                      "server_metrics.jsonl has gaps")
    if write_error:
        limits.append(f"server_metrics.jsonl stopped short: {write_error}")
    return summary, limits

"""remnant.client.metrics against a timeline whose every metric is worked out by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from remnant.client.metrics import (
    distribution,
    itl_samples,
    load_requests_jsonl,
    records_frame,
    summarize,
)
from remnant.client.request_record import RequestRecord

DIST_KEYS = {"count", "mean", "std", "p50", "p90", "p95", "p99", "max"}
METRIC_KEYS = {
    "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
    "total_cached_tokens", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "cache_hit_rate", "ttft_ms", "itl_ms", "tpot_ms",
    "e2e_ms", "dispatch_delay_ms",
}


def timeline() -> list[RequestRecord]:
    """Three successful requests and one failed one (times in s since t0).

    a: sent 10 ms late; chunks of 1, 3, 2 tokens at 0.11, 0.14, 0.20.
    b: sent on time; chunks of 1, 1 tokens at 0.25, 0.30.
    c: sent 30 ms late; a single token.
    d: failed; its tokens, chunks and latencies must count nowhere.
    """
    a = RequestRecord(
        id="a", phase="measured", index=0, intended_start_s=0.00, start_s=0.01,
        end_s=0.21, success=True, ttft_s=0.10, chunk_times_s=[0.11, 0.14, 0.20],
        chunk_tokens=[1, 3, 2], prompt_tokens=100, completion_tokens=6,
        cached_tokens=50, finish_reason="length",
    )
    b = RequestRecord(
        id="b", phase="measured", index=1, intended_start_s=0.05, start_s=0.05,
        end_s=0.35, success=True, ttft_s=0.20, chunk_times_s=[0.25, 0.30],
        chunk_tokens=[1, 1], prompt_tokens=200, completion_tokens=2,
        cached_tokens=0, finish_reason="length",
    )
    c = RequestRecord(
        id="c", phase="measured", index=2, intended_start_s=0.10, start_s=0.13,
        end_s=0.55, success=True, ttft_s=0.40, chunk_times_s=[0.53],
        chunk_tokens=[1], prompt_tokens=100, completion_tokens=1,
        cached_tokens=100, finish_reason="stop",
    )
    d = RequestRecord(
        id="d", phase="measured", index=3, intended_start_s=0.20, start_s=0.20,
        end_s=0.30, success=False, error="HTTP 500", ttft_s=0.02,
        chunk_times_s=[0.22, 0.25], chunk_tokens=[1, 1], prompt_tokens=50,
        completion_tokens=2, cached_tokens=50,
    )
    return [a, b, c, d]


def assert_plain(obj) -> None:
    """Only dict/str/int/float/None, no numpy scalars (np.float64 subclasses float)."""
    if isinstance(obj, dict):
        for v in obj.values():
            assert_plain(v)
    else:
        assert obj is None or type(obj) in (int, float, bool, str), (obj, type(obj))
        if type(obj) is float:
            assert math.isfinite(obj)


def assert_dist(got: dict, want: dict) -> None:
    assert set(got) == DIST_KEYS
    assert got["count"] == want["count"]
    for k in DIST_KEYS - {"count"}:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-9), k


def pop_std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_summarize_hand_computed_timeline():
    m = summarize(timeline(), duration_s=2.0)
    assert set(m) == METRIC_KEYS
    assert_plain(m)

    assert m["completed"] == 3
    assert m["failed"] == 1
    assert m["duration_s"] == 2.0
    # d's 50 prompt / 2 completion / 50 cached tokens do not count.
    assert m["total_input_tokens"] == 100 + 200 + 100
    assert m["total_output_tokens"] == 6 + 2 + 1
    assert m["total_cached_tokens"] == 50 + 0 + 100
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["input_throughput"] == pytest.approx(400 / 2.0)
    assert m["output_throughput"] == pytest.approx(9 / 2.0)
    assert m["total_throughput"] == pytest.approx((400 + 9) / 2.0)
    # E2E: a 0.21-0.01, b 0.35-0.05, c 0.55-0.13.
    assert m["concurrency"] == pytest.approx((0.20 + 0.30 + 0.42) / 2.0)
    assert m["cache_hit_rate"] == pytest.approx(150 / 400)

    # TTFT [100, 200, 400] ms; linear percentile rank = q/100 * (n - 1) = q/50 here.
    assert_dist(m["ttft_ms"], {
        "count": 3, "mean": 700 / 3, "std": pop_std([100, 200, 400]),
        "p50": 200.0,
        "p90": 200 + 0.8 * (400 - 200),   # rank 1.8
        "p95": 200 + 0.9 * (400 - 200),   # rank 1.9
        "p99": 200 + 0.98 * (400 - 200),  # rank 1.98
        "max": 400.0,
    })

    # ITL: a's 3-token chunk after 30 ms -> 3 x 10 ms; its 2-token chunk after 60 ms ->
    # 2 x 30 ms; b's second chunk after 50 ms -> 50 ms; c (one chunk) and d give none.
    itl = [10, 10, 10, 30, 30, 50]
    assert_dist(m["itl_ms"], {
        "count": 6, "mean": 140 / 6, "std": pop_std(itl),
        "p50": 10 + 0.5 * (30 - 10),     # rank 2.5 between sorted[2]=10 and sorted[3]=30
        "p90": 30 + 0.5 * (50 - 30),     # rank 4.5
        "p95": 30 + 0.75 * (50 - 30),    # rank 4.75
        "p99": 30 + 0.95 * (50 - 30),    # rank 4.95
        "max": 50.0,
    })

    # TPOT: a (200 - 100) / (6 - 1) = 20 ms; b (300 - 200) / (2 - 1) = 100 ms; c has 1 token.
    assert_dist(m["tpot_ms"], {
        "count": 2, "mean": 60.0, "std": 40.0,
        "p50": 60.0,
        "p90": 20 + 0.9 * 80,   # rank 0.9
        "p95": 20 + 0.95 * 80,
        "p99": 20 + 0.99 * 80,
        "max": 100.0,
    })

    e2e = [200, 300, 420]
    assert_dist(m["e2e_ms"], {
        "count": 3, "mean": 920 / 3, "std": pop_std(e2e),
        "p50": 300.0,
        "p90": 300 + 0.8 * 120,
        "p95": 300 + 0.9 * 120,
        "p99": 300 + 0.98 * 120,
        "max": 420.0,
    })

    # Dispatch delay: a 10 ms, b 0 ms, c 30 ms -> sorted [0, 10, 30].
    assert_dist(m["dispatch_delay_ms"], {
        "count": 3, "mean": 40 / 3, "std": pop_std([10, 0, 30]),
        "p50": 10.0,
        "p90": 10 + 0.8 * 20,
        "p95": 10 + 0.9 * 20,
        "p99": 10 + 0.98 * 20,
        "max": 30.0,
    })

    json.dumps(m, allow_nan=False)


def test_duration_inferred_from_records():
    # max(end_s) = 0.55 (c), min(start_s) = 0.01 (a); the failed d lies inside.
    m = summarize(timeline())
    assert m["duration_s"] == pytest.approx(0.55 - 0.01)
    assert m["request_throughput"] == pytest.approx(3 / 0.54)
    assert m["concurrency"] == pytest.approx(0.92 / 0.54)


def test_dict_records_give_the_same_metrics():
    recs = timeline()
    dicts = [json.loads(json.dumps(r.to_dict())) for r in recs]  # as read from jsonl
    assert summarize(dicts, duration_s=2.0) == summarize(recs, duration_s=2.0)


def test_records_frame_derived_columns():
    df = records_frame(timeline())
    assert list(df["id"]) == ["a", "b", "c", "d"]
    assert {"e2e_s", "tpot_s", "dispatch_delay_s"} <= set(df.columns)
    np.testing.assert_allclose(df["e2e_s"], [0.20, 0.30, 0.42, 0.10])
    np.testing.assert_allclose(df["dispatch_delay_s"], [0.01, 0.0, 0.03, 0.0], atol=1e-12)
    np.testing.assert_allclose(df["tpot_s"], [0.02, 0.10, np.nan, (0.10 - 0.02) / 1])
    assert df["tpot_s"].dtype == np.float64


def test_itl_samples_seconds_and_zero_token_chunks():
    np.testing.assert_allclose(
        np.sort(itl_samples(timeline())), [0.01, 0.01, 0.01, 0.03, 0.03, 0.05]
    )
    # A chunk with no tokens is not an arrival: the gap runs 0.1 -> 0.3 over 2 tokens.
    r = RequestRecord(
        id="z", phase="measured", index=0, intended_start_s=0.0, end_s=0.3,
        success=True, ttft_s=0.1, chunk_times_s=[0.1, 0.2, 0.3],
        chunk_tokens=[1, 0, 2], completion_tokens=3,
    )
    np.testing.assert_allclose(itl_samples([r]), [0.1, 0.1])


def test_itl_length_mismatch_names_the_request():
    r = RequestRecord(
        id="bad", phase="measured", index=0, intended_start_s=0.0, end_s=0.3,
        success=True, chunk_times_s=[0.1, 0.2], chunk_tokens=[1],
    )
    with pytest.raises(ValueError, match="'bad'.*chunk_times_s"):
        itl_samples([r])


def test_single_token_request_has_no_tpot():
    c = timeline()[2]
    m = summarize([c])
    assert m["tpot_ms"] == {"count": 0, **{k: None for k in DIST_KEYS - {"count"}}}
    assert m["itl_ms"]["count"] == 0
    assert m["ttft_ms"]["count"] == 1 and m["ttft_ms"]["p99"] == pytest.approx(400.0)
    assert m["duration_s"] == pytest.approx(0.42)


@pytest.mark.parametrize("duration_s", [None, 0.0])
def test_empty_input(duration_s):
    m = summarize([], duration_s=duration_s)
    assert set(m) == METRIC_KEYS
    assert m["completed"] == 0 and m["failed"] == 0
    assert m["duration_s"] == 0.0
    for k in ("request_throughput", "input_throughput", "output_throughput",
              "total_throughput", "concurrency"):
        assert m[k] == 0.0
    assert m["cache_hit_rate"] is None
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "dispatch_delay_ms"):
        assert m[k] == {"count": 0, **{q: None for q in DIST_KEYS - {"count"}}}
    assert_plain(m)
    json.dumps(m, allow_nan=False)
    assert len(records_frame([])) == 0
    assert itl_samples([]).shape == (0,)


def test_all_failed():
    d = timeline()[3]
    m = summarize([d], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["total_input_tokens"] == 0 and m["cache_hit_rate"] is None
    assert m["ttft_ms"]["count"] == 0 and m["itl_ms"]["count"] == 0
    json.dumps(m, allow_nan=False)


def test_negative_duration_is_refused():
    with pytest.raises(ValueError, match="duration_s=-1.0"):
        summarize(timeline(), duration_s=-1.0)


def test_distribution_matches_numpy_on_random_samples():
    rng = np.random.default_rng(1234)
    x = rng.lognormal(mean=3.0, sigma=1.0, size=997)
    d = distribution(x)
    assert_plain(d)
    assert d["count"] == 997
    assert d["mean"] == pytest.approx(np.mean(x), rel=1e-12)
    assert d["std"] == pytest.approx(np.std(x), rel=1e-12)
    for q in (50, 90, 95, 99):
        assert d[f"p{q}"] == pytest.approx(np.percentile(x, q), rel=1e-12)
    assert d["max"] == float(np.max(x))
    # NaN and None samples are dropped, not propagated.
    assert distribution([1.0, float("nan"), None, 3.0]) == distribution([1.0, 3.0])


def write_jsonl(path, recs, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in recs) + tail)


def test_load_requests_jsonl_round_trip(tmp_path):
    p = tmp_path / "requests.jsonl"
    write_jsonl(p, timeline())
    assert load_requests_jsonl(p) == timeline()


def test_load_requests_jsonl_skips_truncated_last_line(tmp_path):
    recs = timeline()
    p = tmp_path / "requests.jsonl"
    cut = json.dumps(recs[3].to_dict())[:40]  # a crash mid-write, no newline
    write_jsonl(p, recs[:3], tail=cut)
    assert load_requests_jsonl(p) == recs[:3]


def test_load_requests_jsonl_bad_middle_line_names_file_and_line(tmp_path):
    recs = timeline()
    p = tmp_path / "requests.jsonl"
    lines = [json.dumps(r.to_dict()) for r in recs]
    lines[1] = lines[1][:30]
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"requests\.jsonl:2: not valid JSON"):
        load_requests_jsonl(p)


def test_load_requests_jsonl_non_record_line(tmp_path):
    p = tmp_path / "requests.jsonl"
    p.write_text(json.dumps({"phase": "measured"}) + "\n")
    with pytest.raises(ValueError, match=r"requests\.jsonl:1: not a request record"):
        load_requests_jsonl(p)

"""The load-test tools pointed at the run's shared platform (conftest's `platform`, through --target): a load test,
the cross-check against guidellm (loadtest.crosscheck), the throughput span, and the soak sampling the platform's
gateway and engines. The tools starting platforms of their own are tests/test_bench_platform.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness.engines import KEY
from harness.engines import PUBLIC as SHARED_MODEL  # the shared platform's public model
from harness.loadtest import ROOT, is_plot, needs_manpages, soak
from harness.loadtest import bench_platform as swiftkv
from harness.processes import tool_env

from loadtest.workloads import fixed


@pytest.fixture(scope="module")
def running(platform) -> str:
    """The tools pointed at a running server get the run's shared platform (two engine pools, keys required)."""
    return platform.base


@needs_manpages
@pytest.mark.slow
@pytest.mark.engine
def test_platform_run_against_a_target(running, tiny_base, corpus, tmp_path):
    r = swiftkv("--target", running, "--target-model", SHARED_MODEL, "--api-key", KEY, "--tokenizer", str(tiny_base), "--workload", "chat",
                "--rate", "4", "--count", "6", "--scale", "0.1", "--text", str(corpus), "--json", "--no-progress",
                "--base-model", str(tmp_path / "unused"), "--configs", "ignored")
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)
    name = f"{SHARED_MODEL}@{running.split('://')[1]}"
    assert list(report["configs"]) == [name] and report["target"] == {"url": running, "model": SHARED_MODEL}
    f = report["configs"][name]["rates"]["4.0"]
    assert f["completed"] == f["requests"] == 6 and f["ttft_p50_s"] > 0 and f["output_tok_s"] > 0
    assert set(f["pool_share"]) <= {"swiftkv", "base"}  # the gateway's route header, read as in its own runs
    r = swiftkv("--target", running, "--target-model", "nope", "--api-key", KEY, "--tokenizer", str(tiny_base), "--text", str(corpus),
                "--no-progress")
    assert r.returncode == 2 and "does not serve 'nope'" in r.stderr


@needs_manpages
@pytest.mark.slow
@pytest.mark.engine
def test_crosscheck_with_guidellm(running, tiny_base, corpus, tmp_path):
    """Both tools against the same server, same count, rate and lengths: each completes every request, the
    server's usage shows the same lengths for both, and the throughputs are of the same order (the 10% agreement
    is for a quiet machine, not these shared cores)."""
    from loadtest.crosscheck import GUIDELLM

    if not GUIDELLM.exists():
        pytest.fail("guidellm is not installed: run `make setup` (builds .tools/guidellm)")
    n, p_tok, o_tok = 10, 64, 16
    out = tmp_path / "crosscheck.json"
    env = tool_env()
    r = subprocess.run([sys.executable, "-m", "loadtest.crosscheck", "--target", running, "--target-model", SHARED_MODEL,
                        "--api-key", KEY, "--tokenizer", str(tiny_base), "--text", str(corpus), "--profile", "constant", "--rate", "4", "--count", str(n),
                        "--prompt-tokens", str(p_tok), "--output-tokens", str(o_tok), "--warmup", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert report["traffic"] == {"profile": "constant", "rate": 4.0, "count": n, "prompt_tokens": p_tok, "output_tokens": o_tok,
                                      "endpoint": "/v1/chat/completions", "warmup_requests": 2}
    ours, theirs = report["ours"], report["guidellm"]
    assert ours["requests"] == ours["completed"] == n and ours["errors"] == 0, ours
    # guidellm's max_requests constraint is its own: on two busy cores its report has held 7 of 10 requests, none
    # failed or incomplete (the others never recorded); what it did record must have succeeded
    assert n // 2 <= theirs["requests"] <= n and theirs["completed"] == theirs["requests"] and theirs["errors"] == 0, theirs
    for side in (ours, theirs):
        assert side["output_tokens_mean"] == o_tok  # ignore_eos and max tokens on both sides
    # the same prompt length in the server's count (document + chat template), give or take a token
    assert abs(ours["prompt_tokens_mean"] - theirs["prompt_tokens_mean"]) <= 2, (ours, theirs)
    # throughput is held near the arrival rate on both sides, so it agrees in order; a 64-token TTFT on two
    # shared cores is decided by whichever process the scheduler ran (guidellm's own workers among them), so
    # its ratio is only required to exist: agreement is measured on a quiet machine (docs/benchmarks.md)
    for key, value in report["ratios_ours_over_guidellm"].items():
        assert value is not None and value > 0 and (0.2 < value < 5 or key.startswith("ttft")), (key, value, ours, theirs)
    # constant rate 4/s, 10 requests: both spans are about 2.5 s plus the last request
    assert 0.5 < ours["requests_per_s"] <= 4.5 and 0.5 < theirs["requests_per_s"] <= 4.5
    # guidellm's median is a record of the middle pair (no interpolation; float rounding picks which), read from
    # the same per-request records we recompute ours from
    ttfts, k = theirs["recomputed"]["ttft_s"], theirs["completed"]
    assert len(ttfts) == k and ttfts == sorted(ttfts)
    middle = ttfts[(k - 1) // 2], ttfts[k // 2]
    assert any(abs(theirs["ttft_p50_s"] - t) <= 1e-3 for t in middle), (theirs["ttft_p50_s"], ttfts)
    assert min(middle) <= theirs["recomputed"]["ttft_p50_s"] <= max(middle)


@needs_manpages
@pytest.mark.engine
def test_span_starts_at_the_first_send(running, corpus, tokenizer):
    """Throughput is counted from the first request sent, as guidellm counts it: requests arriving 3 s into the
    run do not add those 3 idle seconds to the span."""
    import asyncio

    from loadtest.platform_bench import drive

    reqs = fixed(corpus, tokenizer, 10.0, 2, 32, 4, 0, "constant")  # arrivals at 0.1 and 0.2 s
    late = [dataclasses.replace(r, arrival_s=r.arrival_s + 3.0) for r in reqs]
    records, span = asyncio.run(drive(running, [SHARED_MODEL], late, 120, lambda rec: None, KEY))
    assert all(r.error is None for r in records), records
    last_finish = max(r.sent_s + r.e2e_s for r in records)
    assert abs(span - (last_finish - late[0].arrival_s)) < 0.5, (span, last_finish)
    assert span < 3.0


@needs_manpages
@pytest.mark.slow
@pytest.mark.engine
def test_soak_on_tiny_models(platform, tiny_base, corpus, tmp_path):
    """An 8-second soak of the shared platform (--target, its gateway sampled by --gateway-pid) sampled every 2 s:
    four rows of gateway and engine RSS and fds, TTFT and requests, no error, the trend and verdict, the PNG and the
    markdown table. The soak starting a platform of its own is test_soak_stops_the_platform_on_ctrl_c."""
    out = tmp_path / "soak" / "soak.json"
    r = soak("--rate", "2", "--duration", "8", "--interval", "2", "--scale", "0.1", "--warmup", "1",
             "--target", platform.base, "--target-model", SHARED_MODEL, "--api-key", KEY, "--gateway-pid", str(platform.proc.pid),
             "--tokenizer", str(tiny_base), "--text", str(corpus), "--out", str(out))
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(out.read_text())
    rows, totals = report["rows"], report["totals"]
    assert len(rows) == 4 and [row["minute"] for row in rows] == [round(2 * k / 60, 2) for k in (1, 2, 3, 4)]
    for row in rows:
        for key in ("gateway_rss_mib", "engine_rss_mib", "gateway_fds", "engine_fds"):
            assert isinstance(row[key], (int, float)) and row[key] > 0, (key, row)
        assert row["errors"] == 0 and row["load_1min"] >= 0
        # the gateway's children: the two engine cores (the platform's pools) are among them
        assert sum("EngineCor" in e["name"] for e in row["engines"]) == 2, row["engines"]
        assert row["engine_rss_mib"] == pytest.approx(sum(e["rss_mib"] for e in row["engines"]), abs=0.2)
        if row["ttft_n"]:
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert sum(row["ttft_n"] for row in rows) >= 3
    assert totals["errors"] == 0 and totals["planned"] == totals["finished"] == totals["completed"] == sum(row["done"] for row in rows) > 5
    assert totals["ttft_p50_s"] > 0 and totals["output_tokens"] > 0 and set(totals["pool_share"]) <= {"swiftkv", "base"}
    assert report["machine"]["cpu_model"] and not report["interrupted"]
    assert report["server"]["target"] == platform.base and report["server"]["sampled_pid"] == platform.proc.pid
    assert report["traffic"]["workload"] == "mixed" and report["command"].startswith("python -m loadtest.soak --rate 2")
    trend = report["trend"]
    assert trend["points"] == 3 and set(trend["within"]) == {"gateway_rss_mib", "engine_rss_mib", "gateway_fds", "engine_fds"}
    assert isinstance(trend["no_growth"], bool)
    png = Path(report["plot"])
    assert png == out.with_suffix(".png") and is_plot(png)
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| minute | gateway RSS MiB") and len(table) == 1 + 4
    assert "no_growth" in r.stdout and r.stderr.count("] gateway ") == 4  # a progress line per interval

"""JobMetrics: events in, Prometheus text out, scraped over loopback HTTP."""
from __future__ import annotations

import threading
from pathlib import Path
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jitckpt.observability.metrics import JobMetrics, is_loopback

TOKEN = "s3cret-token-0123456789"


def _scrape(port, token=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def _samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _job_events():
    ev = [
        {"t": 1.0, "event": "job_start", "gen": 0, "world_size": 4, "nproc": 4},
        *({"t": 1.1, "event": "worker_start", "gen": 0, "rank": r, "pid": r, "warm": r == 3} for r in range(4)),
        {"t": 2.0, "event": "step", "gen": 0, "rank": 0, "step": 10, "step_time": 0.2},
        {"t": 2.0, "event": "step", "gen": 0, "rank": 1, "step": 9, "step_time": 0.3},
        {"t": 3.0, "event": "checkpoint_saved", "gen": 0, "rank": 0, "step": 10, "bytes": 1000,
         "seconds": 0.5, "path": "a", "kind": "periodic"},
        # failure 1: two ranks report the same incident
        {"t": 4.0, "event": "failure_detected", "gen": 0, "kind": "exit", "rank": 1, "detect_time": 0.1},
        {"t": 4.1, "event": "failure_detected", "gen": 0, "kind": "hang", "rank": 0, "detect_time": None},
        {"t": 5.0, "event": "checkpoint_saved", "gen": 0, "rank": 0, "step": 11, "bytes": 3000,
         "seconds": 1.5, "path": "b", "kind": "jit"},
        {"t": 6.0, "event": "restart", "gen": 1, "reason": "failure", "restart_count": 1},
        {"t": 7.0, "event": "recovery_summary", "gen": 1, "failure_kind": "exit", "failed_ranks": [1],
         "detect_s": 0.1, "save_s": 1.5, "restart_s": 2.0, "restore_s": 0.4, "total_s": 4.0,
         "checkpoint_bytes": 3000, "step_failed": 11, "step_resumed": 11, "steps_redone": 1},
        # failure 2
        {"t": 8.0, "event": "failure_detected", "gen": 1, "kind": "signal", "rank": 2},
        {"t": 9.0, "event": "checkpoint_failed", "gen": 1, "rank": 2, "reason": "dead"},
        {"t": 9.5, "event": "restart", "gen": 2, "reason": "failure", "restart_count": 2},
        {"t": 10.0, "event": "recovery_summary", "gen": 2, "failure_kind": "signal", "failed_ranks": [2],
         "detect_s": 0.3, "save_s": 0.0, "restart_s": 1.0, "restore_s": "bad", "total_s": 1.3,
         "steps_redone": 2},
        {"t": 11.0, "event": "step", "gen": 2, "rank": 0, "step": 12, "step_time": 0.25},
        {"t": 12.0, "event": "some_future_event", "gen": 2},
        {"t": 13.0, "event": "job_end", "gen": 2, "status": "ok", "exit_code": 0, "restarts": 2},
    ]
    return ev


def test_scrape_over_loopback_after_events():
    m = JobMetrics(port=0)
    try:
        assert m.port and m.port > 0
        for e in _job_events():
            m.record_event(e)
        s = _samples(_scrape(m.port))
    finally:
        m.close()
    assert s[("jitckpt_step", ())] == 12
    assert s[("jitckpt_step_time_seconds_count", ())] == 3
    assert s[("jitckpt_step_time_seconds_sum", ())] == pytest.approx(0.75)
    assert s[("jitckpt_failures_total", (("kind", "exit"),))] == 1  # the hang report joined it
    assert s[("jitckpt_failures_total", (("kind", "hang"),))] == 0
    assert s[("jitckpt_failures_total", (("kind", "signal"),))] == 1
    # One failures counter: no separate count of reports, and no *_created series.
    assert not [k for k in s if k[0].startswith("jitckpt_failure_reports") or k[0].endswith("_created")], sorted(s)
    assert s[("jitckpt_recovery_phase_seconds_sum", (("phase", "restart"),))] == pytest.approx(3.0)
    assert s[("jitckpt_recovery_phase_seconds_count", (("phase", "restore"),))] == 1  # "bad" skipped
    assert s[("jitckpt_recovery_seconds_sum", ())] == pytest.approx(5.3)
    assert s[("jitckpt_steps_redone_total", ())] == 3
    assert s[("jitckpt_checkpoint_bytes_total", (("kind", "jit"),))] == 3000
    assert s[("jitckpt_checkpoint_bytes_total", (("kind", "periodic"),))] == 1000
    assert s[("jitckpt_checkpoints_total", (("kind", "jit"),))] == 1
    assert s[("jitckpt_checkpoint_failures_total", ())] == 1
    assert s[("jitckpt_restarts_total", ())] == 2
    assert s[("jitckpt_generation", ())] == 2
    assert s[("jitckpt_workers_started_total", (("warm", "true"),))] == 1
    assert s[("jitckpt_world_size", ())] == 4
    assert s[("jitckpt_job_running", ())] == 0


def test_only_the_metrics_path_is_served():
    m = JobMetrics(port=0)
    try:
        for path in ("/", "/other", "/metricsx"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{m.port}{path}", timeout=5)
            assert err.value.code == 404, path
        assert "jitckpt_step" in _scrape(m.port)
    finally:
        m.close()


def test_a_missing_prometheus_client_names_the_install(tmp_path):
    import subprocess
    import sys
    # A directory shadowing the package with one that fails to import, as a missing one does.
    (tmp_path / "prometheus_client").mkdir()
    (tmp_path / "prometheus_client" / "__init__.py").write_text("raise ImportError('No module named prometheus_client')\n")
    code = "from jitckpt.observability.metrics import JobMetrics"
    import os
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), repo]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "pip install 'jitckpt[metrics]'" in r.stderr, r.stderr


def test_disabled_by_default_serves_nothing():
    m = JobMetrics()
    assert m.port is None
    m.record_event({"t": 0, "event": "restart", "gen": 1})
    assert b"jitckpt_restarts_total 1.0" in m.render()
    m.close()
    m.close()  # idempotent


def test_close_stops_the_server():
    m = JobMetrics(port=0)
    port = m.port
    _scrape(port)
    m.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(port)


def test_bearer_token_required_when_given():
    with JobMetrics(port=0, token=TOKEN) as m:
        with pytest.raises(urllib.error.HTTPError) as exc:
            _scrape(m.port)
        assert exc.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            _scrape(m.port, token=TOKEN + "x")
        assert "jitckpt_failures_total" in _scrape(m.port, token=TOKEN)


def test_non_loopback_refused_without_token():
    with pytest.raises(ValueError, match="non-loopback address '0.0.0.0' without authentication"):
        JobMetrics(port=0, addr="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16 characters"):
        JobMetrics(port=0, addr="0.0.0.0", token="short")
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")


@pytest.mark.parametrize("port", [-1, 70000, "9100", True])
def test_bad_port(port):
    with pytest.raises(ValueError, match="metrics port must be an integer"):
        JobMetrics(port=port)


def test_record_event_rejects_non_dict():
    with pytest.raises(TypeError, match="event dict"):
        JobMetrics().record_event("step")


def test_concurrent_steps_keep_the_max():
    m = JobMetrics()
    ths = [threading.Thread(target=lambda r=r: [m.record_event({"event": "step", "rank": r, "step": i,
                                                                "step_time": 0.1}) for i in range(200)])
           for r in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in ths)
    s = _samples(m.render().decode())
    assert s[("jitckpt_step", ())] == 199
    assert s[("jitckpt_step_time_seconds_count", ())] == 800


def test_port_in_use_is_a_clear_error():
    with JobMetrics(port=0) as m:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{m.port}"):
            JobMetrics(port=m.port)


def test_ipv6_loopback():
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with JobMetrics(port=0, addr="::1") as m:
        with urllib.request.urlopen(f"http://[::1]:{m.port}/metrics", timeout=5) as resp:
            assert b"jitckpt_step" in resp.read()


def test_each_stage_replacement_is_a_failure_and_a_restart():
    m = JobMetrics()
    for gen, rank in ((0, 2), (1, 0)):  # --recovery stage: two deaths, each replaced alone
        m.record_event({"t": 1.0, "event": "failure_detected", "gen": gen, "kind": "signal",
                        "rank": rank})
        m.record_event({"t": 1.1, "event": "stage_replaced", "gen": gen + 1, "rank": rank,
                        "generation": gen + 1, "restart_count": gen + 1})
        m.record_event({"t": 1.5, "event": "recovery_summary", "gen": gen + 1,
                        "failure_kind": "signal", "failed_ranks": [rank], "detect_s": 0.0,
                        "save_s": 0.0, "restart_s": 0.1, "restore_s": 0.3, "total_s": 0.4,
                        "steps_redone": 1, "scope": "stage"})
    s = _samples(m.render().decode())
    assert s[("jitckpt_failures_total", (("kind", "signal"),))] == 2
    assert s[("jitckpt_restarts_total", ())] == 2
    assert s[("jitckpt_recovery_seconds_count", ())] == 2


def test_worker_records_of_transparent_recovery_are_counted_and_told(tmp_path):
    """libjit.so's records, appended to events.jsonl by the workers, reach the metrics once each
    (from where the file was when the launcher opened it; a torn last line waits for its end), and
    a refused recovery or a failed validation gets a console line."""
    import json

    from jitckpt.observability.worker_records import WorkerRecords, console_line

    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps({"event": "transparent_recovery", "rank": 9, "recovered": True}) + "\n")
    tail = WorkerRecords(log)  # that record was there before: not counted
    recs = [{"t": 1.0, "event": "transparent_validation", "gen": 0, "rank": 1, "minibatch": 5, "matched": False,
             "detail": "allocation 0x7f0000000000 differs at byte 12"},
            {"t": 1.1, "event": "worker_start", "gen": 0, "rank": 0},  # the launcher's own
            {"t": 2.0, "event": "transparent_recovery", "gen": 0, "rank": 0, "recovered": True},
            {"t": 2.1, "event": "transparent_recovery", "gen": 0, "rank": 1, "recovered": False,
             "reason": "replay validation turned it off"}]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    with open(log, "a") as f:
        f.write(text[:-10])  # the last line is still being written
    m = JobMetrics()
    got = tail.poll()
    assert [r["event"] for r in got] == ["transparent_validation", "transparent_recovery"]
    with open(log, "a") as f:
        f.write(text[-10:])
    got += tail.poll()
    assert tail.poll() == []
    for r in got:
        m.record_event(r)
    s = _samples(m.render().decode())
    assert s[("jitckpt_transparent_validations_total", (("result", "mismatch"),))] == 1
    assert s[("jitckpt_transparent_validations_total", (("result", "matched"),))] == 0
    assert s[("jitckpt_transparent_recoveries_total", (("outcome", "recovered"),))] == 1
    assert s[("jitckpt_transparent_recoveries_total", (("outcome", "refused"),))] == 1
    lines = [console_line(r) for r in got]
    assert "rank 1: replay validation at minibatch 5 found a difference" in lines[0]
    assert lines[1] is None and "rank 1: not recovered transparently: replay validation" in lines[2]

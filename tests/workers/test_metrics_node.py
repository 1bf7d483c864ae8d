"""A node's metrics directory: several processes write, one collector merges.

The writers are real subprocesses (``record_into`` switches a process's metric values to
files, which must not happen to the test process itself).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from workers.serving.metrics_node import NodeCollector

WRITER = textwrap.dedent(
    """
    import sys
    from workers.serving.metrics_node import record_into
    record_into(sys.argv[1])
    from workers.serving.metrics import WorkerMetrics
    from workers.protocol.wire import WorkerReport
    m = WorkerMetrics("decode", "tiny", sys.argv[2])
    from workers.engine.request import Request
    from workers.protocol.sampling_params import SamplingParams
    req = Request("r", list(range(10)), SamplingParams(), max_tokens=4, eos_token_ids=frozenset())
    req.first_scheduled_time = req.arrival_time + 0.02
    req.num_cached_tokens = 8
    m.first_scheduled(req)
    m.transferred(0.5, 4096)
    m.report(WorkerReport(name=sys.argv[2], role="decode", healthy=True, num_running=3,
                          num_waiting=1, kv_blocks_total=10, kv_blocks_used=4,
                          kv_blocks_cached=0, num_held=0, spec_num_steps=3, spec_num_draft_tokens=12,
                          spec_num_accepted_tokens=7))
    print("ready", flush=True)
    sys.stdin.readline()  # stay alive until told
    """
)


def _writer(directory, instance) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(directory), instance],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def _samples(directory) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in NodeCollector(str(directory)).collect()
        for s in family.samples
    }


def _key(name, instance, **extra):
    labels = {"role": "decode", "model": "tiny", "instance": instance, **extra}
    return (name, tuple(sorted(labels.items())))


def test_processes_merge_and_a_dead_one_keeps_counters_but_not_gauges(tmp_path):
    first, second = _writer(tmp_path, "decode-0"), _writer(tmp_path, "decode-0")
    try:
        s = _samples(tmp_path)
        # Same worker name in two processes (as after a restart): counters add up.
        assert s[_key("baton_prefix_cache_hit_tokens_total", "decode-0")] == 16
        assert s[_key("baton_prefix_cache_queried_tokens_total", "decode-0")] == 20
        assert s[_key("baton_kv_transfer_bytes_sum", "decode-0")] == 8192
        assert s[_key("baton_kv_transfer_seconds_bucket", "decode-0", le="0.5")] == 2
        assert s[_key("baton_kv_transfer_seconds_bucket", "decode-0", le="0.25")] == 0
        assert s[_key("baton_request_queue_time_seconds_count", "decode-0")] == 2
        assert s[_key("baton_num_requests_running", "decode-0")] == 6  # livesum
        assert s[_key("baton_kv_cache_usage_ratio", "decode-0")] == pytest.approx(0.8)
        assert s[_key("baton_spec_decode_verify_steps_total", "decode-0")] == 6
        assert s[_key("baton_spec_decode_draft_tokens_total", "decode-0")] == 24
        assert s[_key("baton_spec_decode_accepted_tokens_total", "decode-0")] == 14
        first.communicate("\n", timeout=30)  # exits
        s = _samples(tmp_path)
        assert s[_key("baton_prefix_cache_hit_tokens_total", "decode-0")] == 16
        assert s[_key("baton_num_requests_running", "decode-0")] == 3  # the live one only
        assert s[_key("baton_num_requests_waiting", "decode-0")] == 1
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.communicate("\n", timeout=30)


def test_a_process_records_into_one_directory_only(tmp_path):
    code = textwrap.dedent(
        f"""
        from workers.serving.metrics_node import record_into
        record_into({str(tmp_path / "a")!r})
        record_into({str(tmp_path / "a")!r})  # again: nothing changes
        try:
            record_into({str(tmp_path / "b")!r})
        except RuntimeError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "already records metrics into" in out.stdout and str(tmp_path / "a") in out.stdout

"""The device-timeline summary that ``python -m benchmarks.decode_step --trace`` prints, on a known timeline."""

import pytest

from benchmarks.device_timeline import Event, host_during, load_events, save_events, summarize


def test_busy_idle_and_gaps_of_overlapping_streams():
    # Two steps on two streams: a kernel overlapping another, a copy, and two gaps (8 us, 200 us).
    events = [
        Event("gemm", "Stream #1", 0, 10_000),
        Event("norm", "Stream #1", 5_000, 12_000),
        Event("MemcpyH2D", "Stream #2", 20_000, 21_000),
        Event("attention", "Stream #1", 221_000, 222_000),
    ]
    summary = summarize(events, num_steps=2)
    assert summary["span_ms_per_step"] == pytest.approx(0.222 / 2)
    assert summary["busy_ms_per_step"] == pytest.approx(0.014 / 2)
    assert summary["idle_ms_per_step"] == pytest.approx(0.208 / 2)
    assert summary["kinds"]["copy"] == {"per_step": 0.5, "ms_per_step": pytest.approx(0.001 / 2)}
    assert summary["gaps"]["2-10 us"]["per_step"] == 0.5 and summary["gaps"]["100-inf us"]["per_step"] == 0.5
    longest = summary["longest_gaps"][0]
    assert (longest["us"], longest["after"], longest["before"]) == (200.0, "MemcpyH2D", "attention")
    assert summary["longest_gaps"][1]["after"] == "norm"  # the run's last end, not its last start


def test_a_gap_names_the_host_events_that_overlap_it_longest():
    device = [Event("sample", "Stream #1", 0, 1_000), Event("forward", "Stream #1", 101_000, 102_000)]
    host = [
        Event("Execute", "pjrt", 500, 100_500),  # overlaps the 100 us gap for 99.5 us
        Event("cuStreamSynchronize", "pjrt", 30_000, 60_000),  # 30 us inside it
        Event("python", "main", 0, 900),  # ends before the gap
    ]
    gap = summarize(device, num_steps=1, host=host)["longest_gaps"][0]
    assert gap["host"] == [
        "pjrt: Execute (100 us; 100 us from +0 us)",
        "pjrt: cuStreamSynchronize (30 us; 30 us from +29 us)",
    ]
    # Among events that cover the whole gap, the innermost comes first.
    outer = Event("time_decode", "python", -5_000_000, 5_000_000)
    assert host_during(1_000, 101_000, [outer, *host], top=2) == [
        "pjrt: Execute (100 us; 100 us from +0 us)",
        "python: time_decode (100 us; 10000 us from -5001 us)",
    ]


def test_no_device_events_says_so():
    assert "error" in summarize([], num_steps=1)


def test_saved_events_read_back_the_same(tmp_path):
    device = [Event("gemm", "Stream #1", 0, 10_000.5)]
    host = [Event("cuGraphLaunch", "pjrt", 100, 2_000), Event("python", "main", 0, 5_000)]
    save_events(tmp_path / "events.json.gz", device, host)
    assert load_events(tmp_path / "events.json.gz") == (device, host)

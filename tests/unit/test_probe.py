"""Blackout analysis of probe records (synthetic send/recv records)."""
import pytest

from emulation.probe import Gap, gaps, lost_count, summarize


def stream(n, interval=0.001, t0=100.0):
    return [[i, t0 + i * interval] for i in range(n)]


def test_no_loss_no_gaps():
    sent = stream(100)
    assert gaps(sent, range(100)) == []
    assert lost_count(sent, range(100)) == 0


def test_inner_gap_measured_on_sender_clock():
    sent = stream(100, interval=0.001)
    received = [s for s in range(100) if not 40 <= s <= 49]
    g = gaps(sent, received)
    assert len(g) == 1
    assert (g[0].first_lost, g[0].last_lost, g[0].lost, g[0].truncated) == (40, 49, 10, False)
    # last received before: 39, first after: 50 -> 11 intervals
    assert g[0].duration_s == pytest.approx(0.011)
    assert lost_count(sent, received) == 10


def test_arrival_order_and_duplicates_do_not_matter():
    sent = stream(20)
    received = [19, 0, 1, 1, 2, 5, 3, 18, 17] + list(range(6, 15))
    g = gaps(sent, received)
    assert [(x.first_lost, x.last_lost) for x in g] == [(4, 4), (15, 16)]
    assert lost_count(sent, received) == 3


def test_uneven_pacing_uses_actual_send_times():
    sent = [[0, 0.0], [1, 0.001], [2, 0.050], [3, 0.051], [4, 0.052]]
    g = gaps(sent, [0, 1, 3, 4])
    assert g == [Gap(2, 2, 1, pytest.approx(0.050), False)]


def test_leading_and_trailing_runs_are_truncated():
    sent = stream(10, interval=0.01)
    g = gaps(sent, [3, 4, 5, 6])
    assert [(x.first_lost, x.last_lost, x.truncated) for x in g] == [(0, 2, True), (7, 9, True)]
    assert g[0].duration_s == pytest.approx(0.03)  # first lost (0) -> first received (3)
    assert g[1].duration_s == pytest.approx(0.03)  # last received (6) -> last lost (9)


def test_everything_lost_is_one_truncated_run():
    sent = stream(5)
    g = gaps(sent, [])
    assert len(g) == 1 and g[0].lost == 5 and g[0].truncated


def test_unknown_sequence_numbers_are_ignored():
    sent = stream(5)
    assert gaps(sent, [0, 1, 2, 3, 4, 99]) == []
    assert lost_count(sent, [0, 1, 2, 3, 4, 99]) == 0


def test_summarize_reports_largest_inner_gap():
    sent = stream(1000, interval=0.0001)
    received = [s for s in range(1000) if not (100 <= s < 110 or 500 <= s < 650 or s >= 990)]
    doc = summarize({"records": sent, "pps": 10000}, {"records": [[s, 0.0] for s in received]})
    assert doc["lost"] == 10 + 150 + 10
    assert doc["max_gap_s"] == pytest.approx(0.0151)  # trailing (truncated) run excluded
    assert len(doc["gaps"]) == 3

"""controller.ocs: matchings, diffs, circuit flows, flow read-back, fake flow table."""
import pytest

from controller.ocs import (OCS_COOKIE, FlowSpec, Matching, circuit_flow_changes, circuit_flows,
                            circuits_from_flows, diff, split_flows)
from emulation.validation import SpecError
from fakes_controller import FakeFlowTable


def test_from_pairs_normalises_and_queries():
    m = Matching.from_pairs(8, [[5, 3], (1, 2)])
    assert m.circuits == frozenset({(1, 2), (3, 5)})
    assert m.peer(3) == 5 and m.peer(5) == 3 and m.peer(4) is None
    assert m.pairs() == [(1, 2), (3, 5)]
    assert m.to_json() == [[1, 2], [3, 5]]
    assert m.ports_in_use() == frozenset({1, 2, 3, 5})
    assert Matching.empty(4).pairs() == [] and Matching.empty(4).n_ports == 4
    assert hash(m) == hash(Matching.from_pairs(8, [[1, 2], [3, 5]]))


@pytest.mark.parametrize("pairs, field, text", [
    ([[1, 3], [2, 4], [5, 3]], "circuits[2]", "port 3 is already in circuit [1, 3]"),
    ([[9, 1]], "circuits[0]", "port 9 does not exist (ports 1..8)"),
    ([[1, 2], [0, 3]], "circuits[1]", "port 0 does not exist"),
    ([[1, 2], [4, 4]], "circuits[1]", "a port cannot be connected to itself"),
    ([[1.0, 2]], "circuits[0]", "port must be an integer"),
    ([["1", 2]], "circuits[0]", "port must be an integer"),
    ([[True, 2]], "circuits[0]", "port must be an integer"),
    ([[1, 2, 3]], "circuits[0]", "must be a pair"),
    ([7], "circuits[0]", "must be a pair"),
])
def test_from_pairs_errors_name_the_index(pairs, field, text):
    with pytest.raises(SpecError) as e:
        Matching.from_pairs(8, pairs)
    assert e.value.field == field
    assert text in str(e.value)


def test_from_pairs_custom_field_and_bad_container():
    with pytest.raises(SpecError) as e:
        Matching.from_pairs(4, [[1, 5]], field="ocs.0")
    assert e.value.field == "ocs.0[0]"
    with pytest.raises(SpecError):
        Matching.from_pairs(4, "12")
    with pytest.raises(SpecError):
        Matching.from_pairs(-1, [])


def test_direct_construction_is_validated():
    with pytest.raises(SpecError):
        Matching(4, frozenset({(2, 1)}))
    with pytest.raises(SpecError):
        Matching(4, frozenset({(1, 2), (2, 3)}))


def test_diff():
    old = Matching.from_pairs(8, [[1, 2], [3, 4], [5, 6]])
    new = Matching.from_pairs(8, [[1, 2], [3, 5], [4, 6]])
    d = diff(old, new)
    assert d.unchanged == {(1, 2)}
    assert d.removed == {(3, 4), (5, 6)}
    assert d.added == {(3, 5), (4, 6)}
    assert d.changed_ports == {3, 4, 5, 6}
    assert not d.is_empty and diff(old, old).is_empty
    with pytest.raises(SpecError):
        diff(old, Matching.empty(6))


def test_circuit_flows_forward_by_in_port_both_ways():
    flows = circuit_flows([(2, 7)])
    assert flows == [FlowSpec(100, (("in_port", 2),), (("output", 7),), OCS_COOKIE),
                     FlowSpec(100, (("in_port", 7),), (("output", 2),), OCS_COOKIE)]
    assert len(set(flows)) == 2  # hashable


def test_flow_changes_leave_unchanged_circuits_alone():
    old = Matching.from_pairs(8, [[1, 2], [3, 4]])
    new = Matching.from_pairs(8, [[1, 2], [3, 5]])
    dels, adds = circuit_flow_changes(old, new)
    touched = {v for f in dels + adds for k, v in f.match}
    assert touched == {3, 4, 5}
    assert len(dels) == 2 and len(adds) == 2


def test_circuits_from_flows_round_trip():
    m = Matching.from_pairs(16, [[1, 9], [2, 3], [10, 16]])
    flows = [(f.match[0][1], f.actions[0][1]) for f in circuit_flows(m.circuits)]
    assert circuits_from_flows(16, flows) == m
    assert circuits_from_flows(16, []) == Matching.empty(16)


def test_half_and_conflicting_circuits_are_reported():
    flows = [(1, 2), (2, 1), (3, 4), (5, 6), (5, 7), (6, 5), (8, 99)]
    rb = split_flows(8, flows)
    assert rb.matching.circuits == {(1, 2)}
    assert rb.stray == ((3, 4), (5, 6), (5, 7), (6, 5), (8, 99))
    with pytest.raises(SpecError) as e:
        circuits_from_flows(8, flows)
    assert e.value.field == "flows" and "3->4" in str(e.value)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_fake_flow_table_dark_intervals():
    clock = Clock()
    table = FakeFlowTable(clock)
    old = Matching.from_pairs(6, [[1, 2], [3, 4]])
    new = Matching.from_pairs(6, [[1, 2], [3, 5]])
    table.apply([], circuit_flows(old.circuits))
    assert table.lookup(1) == 2 and table.lookup(4) == 3 and table.lookup(5) is None
    dels, adds = circuit_flow_changes(old, new)
    clock.t = 1.0
    table.delete(dels)
    assert table.lookup(3) is None and table.lookup(1) == 2
    clock.t = 1.01
    table.add(adds)
    assert table.lookup(3) == 5 and table.lookup(5) == 3
    assert table.dark_intervals(3) == [(1.0, 1.01)]
    assert table.dark_intervals(4) == [(1.0, None)]  # removed for good
    assert table.dark_intervals(1) == []  # unchanged circuit never went dark
    assert table.dark_intervals(5) == []  # never forwarded before
    assert circuits_from_flows(6, table.port_flows()) == new

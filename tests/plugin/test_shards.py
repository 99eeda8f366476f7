"""core.shards: the I/N value, the assignment of whole models to shards, and the durations file."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_qreport.core.shards import Shard, assign_shards, read_durations, shard_value, write_durations


def test_a_shard_is_i_of_n_within_range():
    assert shard_value("2/4") == Shard(2, 4) and str(Shard(2, 4)) == "2/4"
    for bad in ("0/3", "4/3", "1/0", "3", "a/b", "1/-2"):
        with pytest.raises(ValueError):
            shard_value(bad)


def test_the_longest_model_gets_a_shard_of_its_own_and_the_rest_balance():
    units = {"a": 10, "b": 10, "c": 10, "d": 10}
    assigned = assign_shards(units, 2, {"a": 30.0, "b": 10.0, "c": 10.0, "d": 10.0})
    assert assigned["a"] == 1 and {assigned[u] for u in "bcd"} == {2}


def test_without_durations_models_are_spread_by_items():
    assigned = assign_shards({"big": 90, "small1": 30, "small2": 30, "small3": 30}, 2, {})
    assert assigned["big"] == 1 and {assigned[u] for u in ("small1", "small2", "small3")} == {2}


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(1, 50), min_size=1, max_size=30),
       st.integers(1, 6))
def test_every_model_lands_on_exactly_one_shard_whatever_the_order_given(units, count):
    assigned = assign_shards(units, count, {})
    assert set(assigned) == set(units) and all(1 <= shard <= count for shard in assigned.values())
    assert assign_shards(dict(reversed(list(units.items()))), count, {}) == assigned  # every runner agrees


def test_the_durations_file_merges_and_a_corrupt_one_is_named(tmp_path):
    path = tmp_path / ".qreport_durations"
    assert read_durations(str(path)) == {}
    write_durations(str(path), {"x::qreport/a": 1.23456})
    write_durations(str(path), {"x::qreport/b": 2.0})
    assert json.loads(path.read_text()) == {"x::qreport/a": 1.235, "x::qreport/b": 2.0}
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"the durations file .*\.qreport_durations cannot be read"):
        read_durations(str(path))

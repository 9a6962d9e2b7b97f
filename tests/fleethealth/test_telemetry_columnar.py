"""A poll of telemetry decoded at once (``decode_many``) gives exactly what each value decoded alone gives:
the same samples (values, dtypes, field order) and, for a bad value, the same error naming the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from fleethealth import schema
from fleethealth.schema import Telemetry
from fleethealth.sim.fleet import FleetSim
from fleethealth.sim.scenario import Scenario


def _sim_values(ticks: int = 12) -> list[bytes]:
    sim = FleetSim(Scenario.load("fleethealth/scenarios/default.yaml"))
    out: list[bytes] = []
    for k, st in enumerate(sim.run()):
        out += [schema.encode(s) for s in st.telemetry]
        if k >= ticks:
            return out
    return out


def _alone(raw: bytes) -> Telemetry | Exception:
    try:
        return schema.decode(Telemetry, raw)
    except Exception as exc:  # compared with what the bulk decode returns for it
        return exc


def _same(bulk: Telemetry | Exception, alone: Telemetry | Exception) -> bool:
    if isinstance(bulk, Exception) or isinstance(alone, Exception):
        return type(bulk) is type(alone) and str(bulk) == str(alone)
    return (bulk.to_obj() == alone.to_obj() and list(bulk.columns) == list(alone.columns)
            and bulk.gpu.dtype == alone.gpu.dtype
            and all(bulk.columns[k].dtype == v.dtype for k, v in alone.columns.items())
            and (bulk.nic is None) == (alone.nic is None))


HOSTILE: dict[str, Callable[[dict[str, Any]], object]] = {
    "temperature_out_of_range": lambda o: o["columns"]["temp_c"].__setitem__(0, 500),
    "duplicate_gpu": lambda o: o["gpu"].__setitem__(1, o["gpu"][0]),
    "gpu_over_int16": lambda o: o["gpu"].__setitem__(1, 40_000),
    "boolean_value": lambda o: o["columns"]["temp_c"].__setitem__(0, True),
    "string_value": lambda o: o["columns"]["power_w"].__setitem__(2, "1"),
    "negative_nic_counter": lambda o: o["nic"]["columns"]["tx_bytes"].__setitem__(0, -1),
    "column_too_long": lambda o: o["columns"]["temp_c"].append(1.0),
    "null_value": lambda o: o["columns"]["temp_c"].__setitem__(0, None),
    "integer_ts_no_util": lambda o: o.update(ts=5, nic_util=None),
    "negative_nic_util": lambda o: o.update(nic_util=-1),
    "uuid_not_strings": lambda o: o.update(uuid=[1]),
    "unknown_port_kind": lambda o: o["nic"].update(kind=["xx"]),
    "no_nic": lambda o: o.pop("nic"),
    "column_missing": lambda o: o["columns"].pop("temp_c"),
    "unknown_column": lambda o: o["columns"].update(bogus=[1.0] * len(o["gpu"])),
    "version_true": lambda o: o.update(v=True),
    "empty_rack": lambda o: o.update(rack=""),
    "huge_number": lambda o: o["columns"]["energy_mj"].__setitem__(0, 1e300),
    "column_a_string": lambda o: o["columns"].update(temp_c="0" * len(o["gpu"])),
    "column_a_number": lambda o: o["columns"].update(temp_c=5),
    "column_an_object": lambda o: o["columns"].update(temp_c={str(i): 1 for i in range(len(o["gpu"]))}),
    "nested_value": lambda o: o["columns"]["temp_c"].__setitem__(1, [1.0]),
    "nic_column_short": lambda o: o["nic"]["columns"]["rx_bytes"].append(1.0),
}


def test_bulk_decode_matches_each_value_alone_on_simulated_and_hostile_values() -> None:
    raws = _sim_values()
    good = len(raws)
    for change in HOSTILE.values():
        obj = orjson.loads(raws[0])
        change(obj)
        raws.append(orjson.dumps(obj))
    bulk = schema.decode_many(Telemetry, raws)
    wrong = [i for i, (raw, got) in enumerate(zip(raws, bulk, strict=True)) if not _same(got, _alone(raw))]
    first = (list(HOSTILE)[wrong[0] - good] if wrong[0] >= good else "simulated") if wrong else ""
    assert not wrong, f"bulk decode differs on values {wrong[:5]} (first: {first})"
    assert all(isinstance(m, Telemetry) for m in bulk[:good])
    errors = {name for name, got in zip(HOSTILE, bulk[good:], strict=True) if isinstance(got, Exception)}
    assert {"temperature_out_of_range", "duplicate_gpu", "boolean_value", "negative_nic_counter"} <= errors


def test_bulk_decoded_samples_own_their_arrays() -> None:
    """A sample's columns are its own (not views of the poll's array), so a held sample keeps only itself."""
    bulk = schema.decode_many(Telemetry, _sim_values(1))
    a, b = bulk[0], bulk[1]
    assert isinstance(a, Telemetry) and isinstance(b, Telemetry)
    col = a.columns["temp_c"]
    assert not np.shares_memory(col, b.columns["temp_c"])
    assert col.base is None or col.base.size <= len(a.columns) * a.gpu.size


def test_node_state_encodes_to_the_bytes_of_its_list_form() -> None:
    """``encode`` hands a node state's float arrays to orjson as arrays: the bytes are those of the list
    form (NaN as null), for views and strided arrays too, and decode back to the state."""
    from fleethealth.schema import NodeState

    wide = np.array([[61.0, np.nan, 0.1 + 0.2, 1e300, -0.0, np.inf], [0.0] * 6])
    state = NodeState(node="n1", rack="r1", ts=1_767_225_600.25, gpu=np.arange(3, dtype=np.int16),
                      temp_c=wide[0, ::2], slowdown_temp_c=np.full(3, 87.0), clock_reasons=np.array([0.0, 4.0, np.nan]),
                      nvlink_links_up=wide[1, :3], nvlink_links_max=np.full(3, 18.0),
                      reports=np.array([True, False, True]),
                      nvlink_errors_per_min=np.nan, nic_util=0.5, power_w=wide[0, 1:4], has_nic=True,
                      nic_port=("mlx5_0/1",), nic_port_util=np.array([np.nan]), nic_port_wait=np.array([0.25]),
                      nic_port_down=np.array([False]))
    assert schema.encode(state) == orjson.dumps(state.to_obj(), option=orjson.OPT_SERIALIZE_NUMPY)
    back = schema.decode(NodeState, schema.encode(state))
    assert back.to_obj() == state.to_obj()

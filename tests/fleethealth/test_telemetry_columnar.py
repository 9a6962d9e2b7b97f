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


def test_node_states_encoded_at_once_give_the_bytes_of_each_alone() -> None:
    """``encode_states`` (the node stage's publish: a poll's states stacked per field) gives each state
    exactly ``encode``'s bytes: mixed GPU and port counts, NaN, infinities, -0.0, views and strided arrays,
    states without NIC ports, and a state whose arrays do not match its GPUs (encoded alone)."""
    from fleethealth.schema import NodeState
    from fleethealth.schema.nodestate import encode_states

    rng = np.random.default_rng(28)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.1 + 0.2, 1e300, 5e-324, 61.0])
    states = []
    for k in range(300):
        n, p = (8, 4, 2)[k % 3], k % 3

        def floats(n: int = n, strided: bool = k % 2 == 1) -> np.ndarray:
            wide = np.where(rng.random(2 * n) < 0.2, rng.choice(special, 2 * n), rng.normal(60.0, 20.0, 2 * n))
            return wide[::2] if strided else wide[:n]  # strided or a view

        ports = {} if p == 0 else {"has_nic": True, "nic_port": tuple(f"mlx5_{i}/1" for i in range(p)),
                                   "nic_port_util": floats(p), "nic_port_wait": floats(p),
                                   "nic_port_down": rng.random(p) < 0.5}
        states.append(NodeState(node=f"node-{k:03d}", rack=f"rack-{k % 7}", ts=1_767_225_600.0 + k / 3,
                                gpu=rng.permutation(16)[:n].astype(np.int16), temp_c=floats(), slowdown_temp_c=floats(),
                                clock_reasons=floats(), nvlink_links_up=floats(), nvlink_links_max=floats(),
                                reports=rng.random(n) < 0.5, nvlink_errors_per_min=float(rng.choice(special)),
                                nic_util=float(rng.choice(special[[0, 3, 4, 7]])), power_w=floats(),
                                load_power_w=floats(), residual_c=floats(), **ports))
    odd = NodeState(node="odd", rack="r", ts=1_767_225_600.0, gpu=np.arange(8, dtype=np.int16), temp_c=np.zeros(3),
                    slowdown_temp_c=np.zeros(8), clock_reasons=np.zeros(8), nvlink_links_up=np.zeros(8),
                    nvlink_links_max=np.zeros(8), reports=np.ones(8, dtype=bool))
    states.insert(5, odd)
    got = encode_states(states)
    wrong = [s.node for s, value in zip(states, got, strict=True) if value != schema.encode(s)]
    assert not wrong, f"{len(wrong)} states encode to other bytes at once than alone, first {wrong[:3]}"

"""The NIC source on sysfs trees: InfiniBand / RoCE port counters, Ethernet statistics, rates.

``fixtures/sysfs_ib`` and ``fixtures/sysfs_eth`` are fixtures written by hand after the kernel's
documented sysfs layout (see ``fixtures/README.md``), not copies of a real node; each test copies
one and rewrites counters to make traffic, wraps, resets and a port going down. One test reads
this machine's real ``/sys/class/net``.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from fleethealth import schema
from fleethealth.probe.nic import NicReader, parse_ib_rate
from fleethealth.schema import NicPorts, Telemetry

FIXTURES = Path(__file__).parent / "fixtures"
IB0 = "sys/class/infiniband/mlx5_0/ports/1"
IB1 = "sys/class/infiniband/mlx5_1/ports/1"


@pytest.fixture
def ib_root(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / "sysfs_ib", tmp_path / "ib"))


@pytest.fixture
def eth_root(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / "sysfs_eth", tmp_path / "eth"))


def _write(root: Path, rel: str, value: object) -> None:
    (root / rel).write_text(f"{value}\n")


def _col(ports: NicPorts, port: str, column: str) -> float:
    return float(ports.columns[column][ports.port.index(port)])


def test_ib_ports_read_in_bytes_with_rate_state_and_hw_counter_fallback(ib_root: Path) -> None:
    reader = NicReader(ib_root)
    ports = reader.read(100.0)
    assert ports is not None and ports.port == ("mlx5_0/1", "mlx5_1/1") and ports.kind == ("ib", "ib")
    assert _col(ports, "mlx5_0/1", "tx_bytes") == 4_000_000_000  # port_xmit_data counts 4-byte words
    assert _col(ports, "mlx5_0/1", "rx_bytes") == 3_600_000_000
    assert _col(ports, "mlx5_0/1", "link_gbps") == 400.0 and _col(ports, "mlx5_1/1", "link_gbps") == 200.0
    assert _col(ports, "mlx5_0/1", "up") == 1.0 and _col(ports, "mlx5_0/1", "link_downed") == 1.0
    assert _col(ports, "mlx5_1/1", "xmit_wait") == 120.0  # found under hw_counters/
    # mlx5_1 has no symbol_error: NaN, reported once, the rest of the sample still there
    assert math.isnan(_col(ports, "mlx5_1/1", "symbol_errors"))
    problems = reader.take_problems()
    assert len(problems) == 1 and "mlx5_1/1" in problems[0] and "symbol_error" in problems[0]
    reader.read(101.0)
    assert reader.take_problems() == []
    assert parse_ib_rate("100 Gb/sec (4X EDR)") == 100.0 and math.isnan(parse_ib_rate("garbage"))


def test_rates_utilisation_and_xmit_wait_share_from_deltas(ib_root: Path) -> None:
    reader = NicReader(ib_root, bytes_per_tick=8.0)
    reader.read(100.0)
    assert reader.rates == {} and math.isnan(reader.util)
    # 2 s later: 40 GB sent on the 400 Gb/s (50 GB/s) port -> 40 % util; 2.5e9 ticks x 8 B = 20 GB lost of 100 GB
    _write(ib_root, f"{IB0}/counters/port_xmit_data", 1_000_000_000 + 10_000_000_000)
    _write(ib_root, f"{IB0}/counters/port_xmit_wait", 5000 + 2_500_000_000)
    reader.read(102.0)
    rates = reader.rates["mlx5_0/1"]
    assert rates.tx_bytes_per_s == pytest.approx(20e9)
    assert rates.util == pytest.approx(0.4) and rates.xmit_wait_share == pytest.approx(0.2)
    assert reader.util == pytest.approx(0.4)


def test_32_bit_wrap_is_folded_in_and_a_reset_is_reported_once(ib_root: Path) -> None:
    reader = NicReader(ib_root)
    first = reader.read(100.0)
    assert first is not None
    # mlx5_1's port_xmit_data sits just below 2**32: it wraps to 1000
    _write(ib_root, f"{IB1}/counters/port_xmit_data", 1000)
    wrapped = reader.read(101.0)
    assert wrapped is not None
    words = (2**32 - 4_294_967_000) + 1000
    assert _col(wrapped, "mlx5_1/1", "tx_bytes") - _col(first, "mlx5_1/1", "tx_bytes") == 4 * words
    assert reader.take_problems() == ["NIC mlx5_1/1: counter symbol_error is missing "
                                      f"({ib_root / IB1 / 'counters' / 'symbol_error'}); reported as not known"]
    # mlx5_0's 64-bit counter goes back from 1e9 to 10: a reset, counted from zero, reported once
    _write(ib_root, f"{IB0}/counters/port_xmit_data", 10)
    reset = reader.read(102.0)
    assert reset is not None
    assert _col(reset, "mlx5_0/1", "tx_bytes") == _col(wrapped, "mlx5_0/1", "tx_bytes") + 40
    problems = reader.take_problems()
    assert len(problems) == 1 and "went back from 1000000000 to 10" in problems[0]
    _write(ib_root, f"{IB0}/counters/port_xmit_data", 5)
    reader.read(103.0)
    assert reader.take_problems() == []  # once per port and counter, not once per sample
    assert reader.rates["mlx5_0/1"].tx_bytes_per_s >= 0  # totals never go backwards


def test_port_going_down_and_unreadable_counter(ib_root: Path) -> None:
    reader = NicReader(ib_root)
    reader.read(100.0)
    _write(ib_root, f"{IB0}/state", "1: DOWN")
    _write(ib_root, f"{IB0}/counters/link_downed", 2)
    _write(ib_root, f"{IB1}/counters/port_rcv_errors", "not-a-number")
    ports = reader.read(101.0)
    assert ports is not None
    assert _col(ports, "mlx5_0/1", "up") == 0.0 and math.isnan(_col(ports, "mlx5_0/1", "link_gbps"))
    assert _col(ports, "mlx5_0/1", "link_downed") == 2.0
    assert math.isnan(_col(ports, "mlx5_1/1", "rx_errors"))
    assert any("port_rcv_errors holds 'not-a-number'" in p for p in reader.take_problems())
    assert math.isnan(reader.rates["mlx5_0/1"].util)  # no link rate on a down port
    assert reader.util == pytest.approx(reader.rates["mlx5_1/1"].util)


def test_ethernet_interfaces_speed_operstate_and_virtual_ones_skipped(eth_root: Path) -> None:
    reader = NicReader(eth_root)
    ports = reader.read(10.0)
    assert ports is not None and ports.port == ("ens1f0", "ens1f1") and ports.kind == ("eth", "eth")
    assert _col(ports, "ens1f0", "link_gbps") == 100.0 and _col(ports, "ens1f0", "up") == 1.0
    assert _col(ports, "ens1f1", "up") == 0.0 and math.isnan(_col(ports, "ens1f1", "link_gbps"))
    assert _col(ports, "ens1f1", "link_downed") == 2.0
    assert math.isnan(_col(ports, "ens1f0", "xmit_wait"))  # Ethernet has no credit-wait counter
    assert reader.take_problems() == []
    everything = NicReader(eth_root, virtual=True).read(10.0)
    assert everything is not None and "veth1a2b" in everything.port and "lo" not in everything.port
    _write(eth_root, "sys/class/net/ens1f0/statistics/tx_bytes", 123456789 + 6_250_000_000)
    reader.read(11.0)
    assert reader.rates["ens1f0"].util == pytest.approx(0.5)


def test_no_nic_is_none_and_the_message_round_trips(ib_root: Path, tmp_path: Path) -> None:
    assert NicReader(tmp_path / "empty").read(1.0) is None
    ports = NicReader(ib_root).read(1.0)
    msg = Telemetry.from_columns("n0001", "r00", 1.0, [0, 1], nic=ports, nic_util=0.25,
                                 pci_bus_id=("00000000:18:00.0", "00000000:2A:00.0"))
    back = schema.decode(Telemetry, schema.encode(msg))
    assert back.nic is not None and back.nic.port == ports.port and back.nic.kind == ports.kind
    for name in schema.NIC_FIELDS:
        np.testing.assert_array_equal(back.nic.columns[name], ports.columns[name])
    assert back.pci_bus_id == msg.pci_bus_id
    # a message from a probe without NIC support still decodes, with no ports
    old = orjson.loads(schema.encode(Telemetry.from_columns("n0001", "r00", 1.0, [0])))
    assert "nic" not in old and "pci_bus_id" not in old
    assert schema.decode(Telemetry, orjson.dumps(old)).nic is None
    bad = orjson.loads(schema.encode(msg))
    bad["nic"]["kind"] = ["ib", "token-ring"]
    with pytest.raises(schema.SchemaError, match="nic.kind"):
        schema.decode(Telemetry, orjson.dumps(bad))
    bad = orjson.loads(schema.encode(msg))
    bad["nic"]["columns"]["tx_bytes"] = [1.0]
    with pytest.raises(schema.SchemaError, match="nic.columns.tx_bytes"):
        schema.decode(Telemetry, orjson.dumps(bad))


def test_this_machines_real_sys_class_net() -> None:
    """Reads the real ``/sys/class/net`` of the machine running the tests (virtual interfaces
    included, since CI containers often have nothing else)."""
    net = Path("/sys/class/net")
    if not net.is_dir():
        pytest.skip("this machine has no /sys/class/net")
    reader = NicReader("/", virtual=True)
    first = reader.read(1.0)
    assert first is not None, "no network interface besides lo under /sys/class/net"
    second = reader.read(2.0)
    assert second is not None and second.port == first.port
    for port in first.port:
        if port in second.port and first.kind[first.port.index(port)] == "eth":
            tx0, tx1 = _col(first, port, "tx_bytes"), _col(second, port, "tx_bytes")
            assert math.isnan(tx0) or tx1 >= tx0
    assert set(first.kind) <= {"ib", "eth"}


def test_probe_adds_the_nic_to_each_sample_and_reports_a_bad_counter_once(ib_root: Path, tmp_path: Path,
                                                                          recording) -> None:
    from fleethealth.probe.daemon import Probe, ProbeConfig
    from fleethealth.probe.delivery import Delivery
    from fleethealth.probe.nvml import NvmlSource
    from fleethealth.probe.recorded import NvmlReplay
    from fleethealth.probe.spool import Spool
    from fleethealth.schema import TOPIC_TYPES, Event, EventKind, Topic

    source = NvmlSource("n0003", "r00", nvml=NvmlReplay(recording("nvml_h100_faults.json")), xid_events=False)
    config = ProbeConfig(node="n0003", rack="r00", socket_path=None, metrics_port=None, nic_root=str(ib_root))
    probe = Probe(source, config, delivery=Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool"))).open(
        background_delivery=False)
    try:
        probe.tick(now=100.0)
        _write(ib_root, f"{IB0}/counters/port_xmit_data", 1_000_000_000 + 12_500_000_000)  # 50 GB in 2 s: 50 %
        probe.tick(now=102.0)
        msgs = [schema.decode(TOPIC_TYPES[Topic(r.topic)], r.value) for r in probe.delivery.spool.peek(1000)]
    finally:
        probe.close(drain_timeout_s=0.0)
    tel = [m for m in msgs if isinstance(m, Telemetry)]
    assert len(tel) == 2 and all(t.nic is not None and t.nic.port == ("mlx5_0/1", "mlx5_1/1") for t in tel)
    assert tel[0].gpu.tolist() == [0, 1, 2, 3]  # the GPU sample goes out with the NIC
    assert tel[1].nic_util == pytest.approx(0.5)  # the busiest up port over the last interval
    errors = [m for m in msgs if isinstance(m, Event) and m.kind is EventKind.PROBE_ERROR]
    assert len(errors) == 1 and "symbol_error" in (errors[0].message or "") and errors[0].data["source"] == "nic"

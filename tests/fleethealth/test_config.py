"""One configuration: defaults < file < environment < flags, unknown keys named, every detector and
policy parameter a key, and ``fleethealth config show`` printing where each value came from."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import orjson
import pytest

from fleethealth.commands import build_parser, main
from fleethealth.commands._settings import load_settings, schema
from fleethealth.config import Key, Schema
from fleethealth.errors import ConfigError

FILE = """
kafka = "kafka://from-file:9092"

[policy]
fleet_nodes = 1000
restart_s = 300

[detect.straggler]
clip = 5.0
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "fleethealth.toml"
    path.write_text(FILE)
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("FLEETHEALTH_CONFIG", "FLEETHEALTH_KAFKA", "FLEETHEALTH_STORE", "FLEETHEALTH_NODE",
                 "FLEETHEALTH_NODE_NAMING", "FLEETHEALTH_POLICY_FLEET_NODES", "FLEETHEALTH_SOCKET",
                 "FLEETHEALTH_RACK"):
        monkeypatch.delenv(name, raising=False)


def _settings(argv):
    return load_settings(build_parser().parse_args(argv))


def test_file_then_environment_then_flags(config_file, monkeypatch) -> None:
    s = _settings(["detect", "--config", str(config_file)])
    assert s["kafka"] == "kafka://from-file:9092" and s.sources["kafka"] == f"file {config_file}"
    assert s["policy.fleet_nodes"] == 1000 and s["policy.restart_s"] == 300.0
    assert s["detect.group"] == "fh-detect" and s.sources["detect.group"] == "default"

    monkeypatch.setenv("FLEETHEALTH_KAFKA", "kafka://from-env:9092")
    monkeypatch.setenv("FLEETHEALTH_POLICY_FLEET_NODES", "2000")
    s = _settings(["detect", "--config", str(config_file)])
    assert (s["kafka"], s["policy.fleet_nodes"]) == ("kafka://from-env:9092", 2000)
    assert s.sources["policy.fleet_nodes"] == "env FLEETHEALTH_POLICY_FLEET_NODES"
    assert s["detect.straggler.clip"] == 5.0  # the file still holds what nothing overrides

    s = _settings(["detect", "--config", str(config_file), "--kafka", "kafka://from-flag:9092",
                   "--set", "policy.fleet_nodes=3000", "--group", "fh-detect"])
    assert (s["kafka"], s["policy.fleet_nodes"]) == ("kafka://from-flag:9092", 3000)
    assert s.sources["kafka"] == "flag --kafka" and s.sources["policy.fleet_nodes"] == "flag --set"
    # a flag given with its default value still counts as given
    assert s.sources["detect.group"] == "flag --group"


def test_config_file_from_the_environment_and_yaml(tmp_path, monkeypatch) -> None:
    path = tmp_path / "fh.yaml"
    path.write_text("policy:\n  fleet_nodes: 640\nprobe:\n  interval_s: 2\n")
    monkeypatch.setenv("FLEETHEALTH_CONFIG", str(path))
    s = _settings(["probe"])
    assert s["policy.fleet_nodes"] == 640 and s["probe.interval_s"] == 2.0
    assert _settings(["probe", "--interval", "0.5"])["probe.interval_s"] == 0.5


def test_existing_environment_variables_keep_their_names(monkeypatch) -> None:
    monkeypatch.setenv("FLEETHEALTH_NODE", "gpu-017")
    monkeypatch.setenv("FLEETHEALTH_RACK", "r07")
    monkeypatch.setenv("FLEETHEALTH_SOCKET", "/tmp/fh.sock")
    s = _settings(["probe"])
    assert (s["node.name"], s["node.rack"], s["probe.socket"]) == ("gpu-017", "r07", "/tmp/fh.sock")


def test_every_key_answers_to_its_canonical_variable(monkeypatch) -> None:
    """The documented rule holds for every key, also those with an older alias."""
    keys = schema().keys.values()
    for key in keys:
        assert key.envs[0] == "FLEETHEALTH_" + key.name.upper().replace(".", "_")
    monkeypatch.setenv("FLEETHEALTH_PROBE_DCGM_HOST", "dcgm.gpu-operator.svc:5555")
    monkeypatch.setenv("FLEETHEALTH_NODE_NAME", "gpu-017")
    monkeypatch.setenv("FLEETHEALTH_PROBE_SOCKET", "/tmp/fh.sock")
    s = _settings(["probe"])
    assert (s["probe.dcgm_host"], s["node.name"], s["probe.socket"]) == (
        "dcgm.gpu-operator.svc:5555", "gpu-017", "/tmp/fh.sock")
    assert s.sources["probe.dcgm_host"] == "env FLEETHEALTH_PROBE_DCGM_HOST"
    monkeypatch.setenv("FLEETHEALTH_NODE", "gpu-018")  # the alias, with another value
    with pytest.raises(ConfigError, match="node.name is set twice.*FLEETHEALTH_NODE_NAME.*FLEETHEALTH_NODE"):
        _settings(["probe"])


def test_a_mistyped_environment_variable_is_an_error_with_a_hint(monkeypatch) -> None:
    monkeypatch.setenv("FLEETHEALTH_POLICY_FLEET_NODE", "100")
    with pytest.raises(ConfigError, match=r"FLEETHEALTH_POLICY_FLEET_NODE \(did you mean "
                                          r"FLEETHEALTH_POLICY_FLEET_NODES\?\)"):
        _settings(["detect"])
    monkeypatch.delenv("FLEETHEALTH_POLICY_FLEET_NODE")
    for var in ("FLEETHEALTH_API_TOKEN", "FLEETHEALTH_READ_TOKEN", "FLEETHEALTH_JOB"):
        monkeypatch.setenv(var, "x")  # not keys, but known: no error
    assert _settings(["detect"])["policy.fleet_nodes"] == 0


def test_every_fleethealth_variable_the_code_reads_is_known(source_modules) -> None:
    """A variable read anywhere in the source is a key's, an alias or one of ENV_NOT_KEYS, so the
    unknown-variable check cannot refuse something fleethealth itself uses."""
    import re

    from fleethealth.config import ENV_NOT_KEYS

    known = {var for key in schema().keys.values() for var in key.envs} | set(ENV_NOT_KEYS)
    read = set()
    for path in source_modules.values():
        read |= set(re.findall(r"FLEETHEALTH_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert read - known == set()


def test_unknown_keys_are_an_error_naming_the_key_and_the_known_ones(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[detect.straggler]\nclipp = 5.0\n")
    known = r"known in \[detect.straggler\]: baseline_steps, clip, clip_margin, drifts"
    with pytest.raises(ConfigError, match=rf"'detect.straggler.clipp'.*{known}"):
        _settings(["detect", "--config", str(path)])
    path.write_text("[detectors]\nz = 1\n")
    tables = r"known: data, kafka, store, \[act\].*\[detect.straggler\].*\[policy\]"
    with pytest.raises(ConfigError, match=rf"'detectors.z'.*{tables}"):
        _settings(["serve", "--config", str(path)])
    with pytest.raises(ConfigError, match="'policy.fleet_node'.*fleet_nodes"):
        _settings(["act", "--set", "policy.fleet_node=3"])


def test_values_of_the_wrong_type_name_the_key_and_where(tmp_path, monkeypatch) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[policy]\nfleet_nodes = \"many\"\n")
    with pytest.raises(ConfigError, match=rf"policy.fleet_nodes \(file {path}\) must be an integer"):
        _settings(["detect", "--config", str(path)])
    monkeypatch.setenv("FLEETHEALTH_PROBE_SOURCE", "nvidia")
    with pytest.raises(ConfigError, match="probe.source .env FLEETHEALTH_PROBE_SOURCE. must be one of dcgm"):
        _settings(["probe"])
    with pytest.raises(ConfigError, match="not valid TOML"):
        path.write_text("[policy\n")
        _settings(["detect", "--config", str(path)])


def test_every_detector_and_policy_parameter_is_a_key() -> None:
    from fleethealth.detectors.hang import HangDetector
    from fleethealth.policy.engine import PolicyEngine

    keys = schema().keys
    for name in ("timeout_factor", "quantile", "min_timeout_s", "window", "stack_grace_s", "max_listed"):
        assert f"detect.hang.{name}" in keys and keys[f"detect.hang.{name}"].default == getattr(HangDetector(), name)
    engine = PolicyEngine()
    assert keys["policy.fleet_nodes"].default == engine.breaker_.fleet_nodes == 0
    assert keys["policy.breaker_share"].default == engine.breaker_.share
    for table in ("detect.straggler", "detect.diagnosis", "detect.health", "detect.sdc", "detect.lifecycle",
                  "detect.predict", "detect.features", "detect.assembly", "detect.pipeline", "detect.runner",
                  "policy.paging"):
        assert any(k.section == table for k in keys.values()), table


def test_the_stage_is_one_key() -> None:
    """``detect.stage`` chooses the stage; the runner's ``stage`` argument is wiring, not a second key that
    would reach ``Runner`` beside it (a TypeError at start) or disagree with it."""
    keys = schema().keys
    assert "detect.stage" in keys and "detect.runner.stage" not in keys
    with pytest.raises(ConfigError, match="'detect.runner.stage'"):
        _settings(["detect", "--set", "detect.runner.stage=job"])


def test_text_values_parse_by_type() -> None:
    s = Schema([Key("a.flag", "bool", False), Key("a.list", "floats", (1.0,)), Key("a.opt", "float", None,
                                                                                  optional=True)])
    got = s.load(environ={"FLEETHEALTH_A_FLAG": "yes", "FLEETHEALTH_A_LIST": "0.5, 2", "FLEETHEALTH_A_OPT": "none"})
    assert (got["a.flag"], got["a.list"], got["a.opt"]) == (True, (0.5, 2.0), None)
    with pytest.raises(ConfigError, match="a.flag .env FLEETHEALTH_A_FLAG. must be true or false"):
        s.load(environ={"FLEETHEALTH_A_FLAG": "maybe"})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        s.load(environ={}, sets=["a.flag"])


def test_config_show_prints_values_and_sources_as_a_loadable_file(config_file, monkeypatch, capsys) -> None:
    monkeypatch.setenv("FLEETHEALTH_POLICY_FLEET_NODES", "2048")
    assert main(["config", "show", "--config", str(config_file), "--set", "detect.hang.window=64"]) == 0
    out = capsys.readouterr().out
    assert "fleet_nodes = 2048" in out and "# env FLEETHEALTH_POLICY_FLEET_NODES" in out
    assert f"# file {config_file}" in out and "window = 64" in out and "# flag --set" in out
    again = tomllib.loads(out)  # the printout is itself a config file
    assert again["policy"]["fleet_nodes"] == 2048 and again["detect"]["straggler"]["clip"] == 5.0
    assert again["detect"]["hang"]["window"] == 64 and "store" not in again  # none: commented out

    assert main(["config", "show", "--json", "--config", str(config_file)]) == 0
    obj = orjson.loads(capsys.readouterr().out)
    assert obj["policy.fleet_nodes"] == {"value": 2048, "source": "env FLEETHEALTH_POLICY_FLEET_NODES",
                                         "env": "FLEETHEALTH_POLICY_FLEET_NODES"}
    assert obj["detect.straggler.clip"]["source"] == f"file {config_file}"
    assert obj["detect.group"] == {"value": "fh-detect", "source": "default", "env": "FLEETHEALTH_DETECT_GROUP"}


def test_config_errors_exit_2_with_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("nonsense = 1\n")
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fleethealth config: error: unknown config key 'nonsense'") and "\n" not in err
    assert main(["config", "show", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_config_get_prints_one_value_and_resolves_the_node_name(monkeypatch, capsys) -> None:
    assert main(["config", "get", "policy.breaker_share"]) == 0
    assert capsys.readouterr().out.strip() == "0.1"
    monkeypatch.setenv("FLEETHEALTH_NODE", "n0042")
    assert main(["config", "get", "node.name"]) == 0
    assert capsys.readouterr().out.strip() == "n0042"


def test_a_closed_pipe_ends_the_command_without_a_traceback() -> None:
    """``fleethealth config show --json | head -c 10``: the reader leaves early; no BrokenPipe trace."""
    out = subprocess.run(f"{sys.executable} -m fleethealth config show --json | head -c 10",
                         shell=True, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert len(out.stdout) == 10 and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_python_dash_m_fleethealth_help_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "fleethealth", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for command in ("demo", "detect", "probe", "serve", "act", "selftest", "sweep", "budget", "config"):
        assert command in done.stdout
    detect = subprocess.run([sys.executable, "-m", "fleethealth", "detect", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert detect.returncode == 0 and "--config FILE" in detect.stdout and "--set KEY=VALUE" in detect.stdout


def test_detect_without_a_bus_or_store_is_a_clear_error(capsys) -> None:
    assert main(["detect", "--store", "chdb:///nowhere"]) == 2
    assert "no bus: give --kafka DSN" in capsys.readouterr().err
    assert main(["detect", "--kafka", "kafka://127.0.0.1:9"]) == 2
    assert "no store: give --store DSN" in capsys.readouterr().err
    assert main(["act", "--kafka", "kafka://127.0.0.1:9"]) == 2
    assert "no scheduler" in capsys.readouterr().err


def test_the_readme_example_is_a_valid_config(tmp_path) -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("### Configuration", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "readme.toml"
    path.write_text(block)
    s = _settings(["detect", "--config", str(path)])
    assert s["policy.fleet_nodes"] == 2048 and s["node.naming"] == "short"


def test_the_help_example_is_a_valid_config(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    example = capsys.readouterr().out.split("example file:\n", 1)[1]
    path = tmp_path / "help.toml"
    path.write_text("\n".join(line.strip() for line in example.splitlines()))
    s = _settings(["serve", "--config", str(path), "--set", "detect.straggler.clip=6"])
    assert s["policy.fleet_nodes"] == 2048 and s["detect.straggler.clip"] == 6.0

"""The whole tier as three cores wired in process against the single pipeline it replaced.

A shipped scenario's records (the simulator's telemetry, step batches and events, in event-time order)
go, in chunks of ``--chunk`` records, through

* **single** — the earlier form of ``--stage all``: one :class:`Pipeline` for node and job detection and
  the policy composed by :func:`~fleethealth.detectors.cores.conclude` (the baseline, measured in this run);
* **wired** — :class:`~fleethealth.detectors.cores.WholeCore`: a node-side and a job-side pipeline and the
  policy, passing between them only node states, findings, derived events, ``job_progress`` and ``job_end``.

No broker or store: the cores are pure, so this isolates what the wiring changes. Prints one JSON object:
the finding and recommendation ids of each (counts, and whether they are the same sets) and the CPU
seconds each took (``time.process_time()``). ``python bench/whole_wiring.py [--scenario multi_job.yaml]``.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

import orjson
import yaml

from fleethealth.bus import Record
from fleethealth.detectors.cores import conclude, make_core
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Event, Message, StepBatch, StepBlock, Telemetry, Topic
from fleethealth.sim.fleet import FleetSim
from fleethealth.sim.scenario import Scenario

_TOPIC = {Telemetry: Topic.TELEMETRY, StepBatch: Topic.STEPS, StepBlock: Topic.STEPS, Event: Topic.EVENTS}


def _messages(name: str) -> list[Message]:
    with resources.as_file(resources.files("fleethealth.scenarios") / name) as path:
        scenario = Scenario.from_obj(yaml.safe_load(path.read_text()))
    msgs: list[Message] = []
    for tick in FleetSim(scenario).run():
        msgs += [*tick.telemetry, *tick.batches, *tick.events]
    msgs.sort(key=lambda m: m.ts)
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="default.yaml", help="a shipped scenario (default: default.yaml)")
    ap.add_argument("--chunk", type=int, default=2000, help="records per step (default 2000, a runner's max_records)")
    args = ap.parse_args()
    msgs = _messages(args.scenario)
    n, chunk = len(msgs), args.chunk

    started = time.process_time()
    pipe, policy = Pipeline(), PolicyStage()
    single_f: set[str] = set()
    single_r: set[str] = set()
    for at in range(0, n, chunk):
        out = conclude(pipe, policy, msgs[at:at + chunk], final=at + chunk >= n)
        single_f |= {f.id for f in out.findings}
        single_r |= {r.id for r in out.recommendations}
    single_s = time.process_time() - started

    records = [Record(_TOPIC[type(m)].value, 0, i, None, m) for i, m in enumerate(msgs)]
    started = time.process_time()
    core, now = make_core("all"), float("-inf")
    wired_f: set[str] = set()
    wired_r: set[str] = set()
    for at in range(0, n, chunk):
        eff = core.step(records[at:at + chunk], now, final=at + chunk >= n)
        now = max(now, eff.now)
        wired_f |= {f.id for f in eff.findings}
        wired_r |= {r.id for r in eff.recommendations}
    wired_s = time.process_time() - started

    print(orjson.dumps({
        "scenario": args.scenario, "records": n, "chunk": chunk,
        "single": {"findings": len(single_f), "recommendations": len(single_r), "cpu_s": round(single_s, 2)},
        "wired": {"findings": len(wired_f), "recommendations": len(wired_r), "cpu_s": round(wired_s, 2)},
        "same_findings": single_f == wired_f, "same_recommendations": single_r == wired_r,
        "findings_differing": len(single_f ^ wired_f), "recommendations_differing": len(single_r ^ wired_r),
        "cpu_ratio": round(wired_s / single_s, 3) if single_s else None,
    }, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()

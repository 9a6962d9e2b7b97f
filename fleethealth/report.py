"""Human and JSON summaries of a demo run (what the CLI prints)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from fleethealth.demo import DemoResult

__all__ = ["demo_summary"]


def demo_summary(result: DemoResult, *, as_json: bool = False) -> str:
    """One screen: messages and rates, then every finding and recommendation, one line each."""
    if as_json:
        return orjson.dumps({
            "scenario": result.scenario, "messages": result.messages, "dead_letters": result.dead_letters,
            "wall_s": round(result.wall_s, 2), "publish_s": round(result.publish_s, 2),
            "detect_s": round(result.detect_s, 2), "messages_per_s": round(result.messages_per_s, 1),
            "findings": len(result.findings), "recommendations": len(result.recommendations),
            "findings_by_kind": dict(Counter(f.kind.value for f in result.findings)),
            "recommendations_by_action": dict(Counter(r.action.value for r in result.recommendations)),
            "out_dir": str(result.out_dir), "store_dir": str(result.store_dir),
        }).decode()
    lines = [
        f"scenario {result.scenario}: {result.messages} messages through Kafka -> detectors -> ClickHouse "
        f"in {result.wall_s:.1f} s ({result.messages_per_s:,.0f} messages/s; {result.dead_letters} dead-lettered)",
        "",
        f"findings ({len(result.findings)}):",
    ]
    for f in result.findings:
        where = f.node + ("" if f.gpu is None else f" gpu {f.gpu}") + ("" if f.rank is None else f" rank {f.rank}")
        extra = []
        if f.diagnosis is not None:
            extra.append(f.diagnosis.value)
        if f.slowdown is not None:
            extra.append(f"{100 * f.slowdown:+.1f}% slower")
        if f.probability is not None:
            extra.append(f"p={f.probability:.2f}")
        if f.step is not None:
            extra.append(f"step {f.step}")
        lines.append(f"  {f.kind.value:12s} {where:28s} {'  '.join(extra)}")
    acted = [r for r in result.recommendations if r.action.value != "none"]
    lines += ["", f"recommendations ({len(acted)}, plus {len(result.recommendations) - len(acted)} recorded as "
                  "'none': already decided, stale or not worth acting on):"]
    for r in acted:
        lines.append(f"  {r.action.value:16s} {r.node:8s} [{r.guard.value}] {r.reason}")
    lines += ["", f"wrote {result.out_dir}/findings.jsonl and {result.out_dir}/recommendations.jsonl; "
                  f"query the store: fleethealth query \"SELECT kind, node, count() FROM findings GROUP BY ALL\" "
                  f"--data {result.store_dir.parent}"]
    return "\n".join(lines)

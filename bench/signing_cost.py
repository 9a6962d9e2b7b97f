"""What signing costs a record, against encoding it, in the same run (one JSON object).

For one node's telemetry sample of 8 GPUs and a 10-step block of 8 ranks: ``schema.encode`` (the
baseline every record pays already), the probe's ``Signer.headers`` (HMAC-SHA256 over topic, key and
value) and the detectors' ``Verifier.check`` in ``require`` mode (key derived once and cached, HMAC,
the node check). CPU time per record, the median of alternating blocks.

    python bench/signing_cost.py            # ~3 s
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from fleethealth import schema
from fleethealth.schema import StepBlock, Telemetry
from fleethealth.signing import KeyRing, Signer, Verifier

SECRET = bytes(range(32))


def _per_record_us(fn, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    node = "gpu-a01"
    tele = Telemetry.from_columns(node, "r00", 1_800_000_000.0, np.arange(8), temp_c=np.full(8, 50.0),
                                  power_w=np.full(8, 300.0))
    block = StepBlock(job="train", steps=np.arange(10), node=node, step_ts=1_800_000_000.0 + np.arange(10.0),
                      ranks=np.arange(8, dtype=np.int32), gpus=np.arange(8, dtype=np.int16),
                      compute_s=np.full((10, 8), 1.9))
    signer, verifier = Signer.for_node(SECRET, node), Verifier("require", KeyRing(fleet_secret=SECRET))
    out: dict[str, object] = {}
    for name, msg in (("telemetry_8_gpus", tele), ("step_block_10x8", block)):
        value, key, topic = schema.encode(msg), msg.key.encode(), msg.TOPIC.value
        headers = signer.headers(topic, key, value)
        if verifier.check(topic, key, value, headers, msg) is not None:
            raise RuntimeError("a record signed by its own node did not verify")
        enc, sig, ver = [], [], []
        for _ in range(7):
            enc.append(_per_record_us(lambda m=msg: schema.encode(m), 2000))
            sig.append(_per_record_us(lambda v=value, k=key, t=topic: signer.headers(t, k, v), 2000))
            ver.append(_per_record_us(lambda v=value, k=key, t=topic, h=headers, m=msg:
                                      verifier.check(t, k, v, h, m), 2000))
        e, s, v = statistics.median(enc), statistics.median(sig), statistics.median(ver)
        out[name] = {"value_bytes": len(value), "encode_us": round(e, 2), "sign_us": round(s, 2),
                     "verify_us": round(v, 2), "sign_over_encode": round(s / e, 2),
                     "verify_over_encode": round(v / e, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""fleethealth: fleet health and silent-data-corruption detection for synchronous GPU training.

The spine every part shares lives here: the message schema (:mod:`fleethealth.schema`), the Kafka
bus (:mod:`fleethealth.bus`), the ClickHouse store (:mod:`fleethealth.store`), the CLI, the probe,
the in-job library, the policy and the fleet simulator. ``import fleethealth`` stays light: no
chdb, torch, cupy or fastapi is imported until a part that needs it is used.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

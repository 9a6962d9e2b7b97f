"""The wire contract: every message on the bus, as frozen dataclasses with a JSON codec."""

from fleethealth.errors import SchemaError
from fleethealth.schema.telemetry import *  # noqa: F403
from fleethealth.schema.telemetry import __all__

for _name in __all__:
    if isinstance(globals()[_name], type):
        globals()[_name].__module__ = __name__

"""Wire schemas of areal-bus: messages, packed arrays, subject names. A leaf package
(pydantic + standard library only)."""

from schemas.arrays import PackedArray
from schemas.messages import (
    MESSAGE_TYPES,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    DeadLetter,
    Event,
    Message,
    MetricRecord,
    Sample,
    SampleGroup,
    SchemaVersionError,
    ScoredGroup,
    ScoredSample,
    Task,
    WeightAnnouncement,
)
from schemas.subjects import RunNames

__all__ = [
    "MESSAGE_TYPES",
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "DeadLetter",
    "Event",
    "Message",
    "MetricRecord",
    "PackedArray",
    "RunNames",
    "Sample",
    "SampleGroup",
    "SchemaVersionError",
    "ScoredGroup",
    "ScoredSample",
    "Task",
    "WeightAnnouncement",
]

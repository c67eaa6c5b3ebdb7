"""Where a run is seen besides its own files: the job's ``metrics`` section (metrics through
Ray's own metrics agent, ``docs/observe.md``)."""

from __future__ import annotations

from .section import Section, key


class MetricsConfig(Section):
    ray: bool = key(
        True,
        description="a run on Ray records its metrics through `ray.util.metrics`: each node's "
        "metrics agent exports them to Prometheus, as Ray's own (`docs/observe.md`); "
        "`false`: none",
    )

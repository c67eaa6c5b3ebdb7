"""Where a run is seen besides its own files: the job's ``metrics`` section (metrics through
Ray's own metrics agent) and ``mlflow`` (tracking in MLflow); ``docs/observe.md``."""

from __future__ import annotations

from .section import Section, key


class MetricsConfig(Section):
    ray: bool = key(
        True,
        description="a run on Ray records its metrics through `ray.util.metrics`: each node's "
        "metrics agent exports them to Prometheus, as Ray's own (`docs/observe.md`); "
        "`false`: none",
    )


class MlflowConfig(Section):
    tracking_uri: str = key(
        min_length=1,
        description="the MLflow tracking server or store: `http://host:5000`, "
        "`sqlite:///mlflow.db`, `databricks`, ... (the `mlflow` extra)",
        expected="a tracking URI",
    )
    experiment: str = key("raysinga", min_length=1, description="the MLflow experiment's name")
    run_name: str | None = key(
        None, min_length=1, shown="the job's `name`", description="the MLflow run's name"
    )

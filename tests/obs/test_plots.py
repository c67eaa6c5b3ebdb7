"""`raysinga plot`: PNGs from a run's metrics.jsonl, and clear errors for what is not one."""

from __future__ import annotations

import json

import pytest

from raysinga.cli import main
from raysinga.obs.plots import (
    _mark_events,
    accuracy_limits,
    load_records,
    loss_figure,
    loss_scale,
    plot_run,
    throughput_figure,
)

pytest.importorskip("matplotlib")

RECORDS = [
    *({"kind": "train", "step": s, "loss": 2.0 / s, "samples_per_s": 1000.0 + s} for s in (5, 10)),
    {"kind": "checkpoint", "step": 10, "blocked_ms": 3.0, "seconds": 0.1},
    {"kind": "eval", "step": 10, "test_loss": 0.3, "test_accuracy": 0.9},
    {"kind": "failure", "step": 15, "restored_from": 10, "role": "worker", "time": 1.0},
    *({"kind": "train", "step": s, "loss": 2.0 / s, "samples_per_s": 900.0} for s in (15, 20)),
    {"kind": "resize", "step": 20, "restored_from": 20, "workers": 2, "time": 2.0},
    {"kind": "eval", "step": 20, "test_loss": 0.2, "test_accuracy": 0.95},
]


def write(run, records) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_writes_loss_and_throughput_pngs(tmp_path, capsys):
    write(tmp_path / "run", RECORDS)
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "pics")]) == 0
    out = capsys.readouterr().out
    for name in ("loss.png", "throughput.png"):
        png = (tmp_path / "pics" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
        assert f"wrote {tmp_path / 'pics' / name}" in out
    # the events are marked: one legend entry each, whatever their number
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    _mark_events(ax, RECORDS)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["checkpoint", "failure", "restored from", "resize"]
    plt.close(fig)


def test_an_eval_only_run_has_no_throughput_plot(tmp_path):
    write(tmp_path, [{"kind": "eval", "step": 3, "test_loss": 0.5}])
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]


@pytest.mark.parametrize(
    "content, why",
    [
        ('{"kind": "train"\n', r"metrics.jsonl:1: not a JSON record"),
        ('{"step": 3}\n', r"metrics.jsonl:1: a record needs a 'kind'"),
        ('{"kind": "failure", "step": 3}\n', "no train or eval records to plot"),
    ],
)
def test_bad_metrics_name_the_file_and_line(tmp_path, content, why, capsys):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=why):
        plot_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("raysinga: error:")


def test_a_missing_run_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such metrics file"):
        load_records(tmp_path / "nothing")
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no such metrics file" in capsys.readouterr().err


def test_axes_that_show_what_changed():
    """Loss and learning rate on a log scale once they span a decade; an accuracy axis at
    least 0.1 tall, so that 0.970 to 0.973 is not drawn as a climb from floor to ceiling."""
    assert loss_scale([2.3, 0.9, 0.05]) == "log"
    assert loss_scale([0.5, 0.2]) == "linear"
    assert loss_scale([0.5, 0.0, 3.0]) == "linear"  # not positive: no log scale
    assert accuracy_limits([0.970, 0.973, 0.971]) == pytest.approx((0.9, 1.0))
    assert accuracy_limits([0.1, 0.95]) == pytest.approx((0.08, 1.0))
    assert accuracy_limits([0.01]) == (0.0, 1.0)
    import matplotlib.pyplot as plt

    records = [
        *(
            {"kind": "train", "step": s, "loss": 3.0 / s, "samples_per_s": 500.0, "lr": 0.1 / s}
            for s in range(1, 101)
        ),
        *({"kind": "eval", "step": s, "test_accuracy": 0.97 + s * 1e-5} for s in (50, 100)),
    ]
    fig, ax = loss_figure(plt, records)
    assert ax.get_yscale() == "log"
    (acc_ax,) = [a for a in fig.axes if a is not ax]
    assert acc_ax.get_ylim() == pytest.approx((0.9, 1.0))
    plt.close(fig)
    fig, ax = throughput_figure(plt, records)
    (lr_ax,) = [a for a in fig.axes if a is not ax]
    assert lr_ax.get_ylabel() == "learning rate" and lr_ax.get_yscale() == "log"
    plt.close(fig)


def test_the_validation_split_is_drawn_beside_the_test_split():
    import matplotlib.pyplot as plt

    records = [
        *({"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 21)),
        *(
            {"kind": "eval", "step": s, "valid_loss": 0.5, "valid_accuracy": 0.8}
            | ({"test_loss": 0.6, "test_accuracy": 0.7} if s == 20 else {})
            for s in (10, 20)
        ),
    ]
    fig, ax = loss_figure(plt, records)
    labels = ax.get_legend_handles_labels()[1]
    (acc_ax,) = [a for a in fig.axes if a is not ax]
    labels += acc_ax.get_legend_handles_labels()[1]
    assert {"train loss", "valid loss", "test loss", "valid accuracy", "test accuracy"} <= set(
        labels
    )
    assert acc_ax.get_ylim() == pytest.approx((0.68, 1.0))  # both splits on the axis
    plt.close(fig)

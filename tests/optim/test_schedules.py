"""Learning-rate schedules against torch.optim.lr_scheduler and closed forms; state round trips."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch

from raysinga.optim.schedules import KINDS, Schedule, make_schedule, schedule_from_state

N = 50
BASE = 0.1


def torch_lrs(make_scheduler, n: int = N) -> list[float]:
    """The lr torch uses at steps 0..n-1 (read before each scheduler.step())."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=BASE)
    sched = make_scheduler(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()  # no grad: a no-op that keeps torch from warning about the call order
        sched.step()
    return out


def ours(spec: dict, n: int = N) -> list[float]:
    s = make_schedule(spec)
    return [s(i) for i in range(n)]


S = torch.optim.lr_scheduler
VS_TORCH = {
    "step": (
        {"kind": "step", "lr": BASE, "gamma": 0.5, "step_size": 7},
        lambda o: S.StepLR(o, step_size=7, gamma=0.5),
    ),
    "multistep": (
        {"kind": "multistep", "lr": BASE, "gamma": 0.3, "milestones": [10, 25, 40]},
        lambda o: S.MultiStepLR(o, milestones=[10, 25, 40], gamma=0.3),
    ),
    "exponential": (
        {"kind": "exponential", "lr": BASE, "gamma": 0.95},
        lambda o: S.ExponentialLR(o, gamma=0.95),
    ),
    "cosine": (
        {"kind": "cosine", "lr": BASE, "steps": N - 1, "min_lr": 1e-3},
        lambda o: S.CosineAnnealingLR(o, T_max=N - 1, eta_min=1e-3),
    ),
    "linear": (
        {"kind": "linear", "lr": BASE, "final_lr": BASE * 0.1, "steps": 30},
        lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=30),
    ),
}


@pytest.mark.parametrize("kind", sorted(VS_TORCH))
def test_matches_torch(kind: str) -> None:
    spec, make = VS_TORCH[kind]
    # torch updates recursively (lr *= factor each step), we use the closed form: rounding only.
    np.testing.assert_allclose(ours(spec), torch_lrs(make), rtol=1e-12, atol=1e-15)


CLOSED_FORMS = {
    "fixed": ({"kind": "fixed", "lr": BASE}, lambda i: BASE),
    "inverse": (
        {"kind": "inverse", "lr": BASE, "gamma": 1e-2, "power": 0.75},
        lambda i: BASE * (1 + 1e-2 * i) ** -0.75,
    ),
    "step": (
        {"kind": "step", "lr": BASE, "gamma": 0.5, "step_size": 7},
        lambda i: BASE * 0.5 ** (i // 7),
    ),
    "exponential": ({"kind": "exponential", "lr": BASE, "gamma": 0.9}, lambda i: BASE * 0.9**i),
    # Flat after `steps`, unlike torch's CosineAnnealingLR, which turns back up.
    "cosine": (
        {"kind": "cosine", "lr": BASE, "steps": 20},
        lambda i: BASE * (1 + math.cos(math.pi * min(i, 20) / 20)) / 2,
    ),
    "linear": (
        {"kind": "linear", "lr": BASE, "final_lr": 0.0, "steps": 20},
        lambda i: BASE * (1 - min(i, 20) / 20),
    ),
}


@pytest.mark.parametrize("kind", sorted(CLOSED_FORMS))
def test_closed_form(kind: str) -> None:
    spec, f = CLOSED_FORMS[kind]
    np.testing.assert_allclose(ours(spec), [f(i) for i in range(N)], rtol=1e-14, atol=0)


def test_warmup_ramps_then_follows_after_at_the_global_step() -> None:
    after = {"kind": "multistep", "lr": BASE, "gamma": 0.1, "milestones": [10]}
    w = make_schedule({"kind": "warmup", "steps": 5, "after": after, "start_factor": 0.2})
    a = make_schedule(after)
    lrs = [w(i) for i in range(N)]
    assert lrs[0] == pytest.approx(0.2 * BASE, rel=1e-15)
    # Linear over 0..5, reaching after(5) exactly at the end of the ramp.
    np.testing.assert_allclose(np.diff(lrs[:6]), 0.8 * BASE / 5, rtol=1e-12)
    # Not offset: the milestone at global step 10 stays at step 10.
    assert lrs[5:] == [a(i) for i in range(5, N)]
    assert lrs[9] == BASE and lrs[10] == pytest.approx(BASE * 0.1, rel=1e-15)


def test_warmup_default_starts_at_zero_and_nests() -> None:
    cos = {"kind": "cosine", "lr": 1.0, "steps": 40}
    w = make_schedule({"kind": "warmup", "steps": 10, "after": cos})
    assert w(0) == 0.0
    assert w(5) == pytest.approx(0.5 * make_schedule(cos)(10), rel=1e-15)
    assert w(10) == make_schedule(cos)(10)
    assert w.state_dict()["after"] == {"kind": "cosine", "lr": 1.0, "steps": 40, "min_lr": 0.0}


def test_make_schedule_accepts_numbers_and_schedules() -> None:
    assert make_schedule(0.5).state_dict() == {"kind": "fixed", "lr": 0.5}
    assert make_schedule(1)(123) == 1.0
    s = make_schedule({"kind": "exponential", "lr": 1.0, "gamma": 0.5})
    assert make_schedule(s) is s
    assert isinstance(s, Schedule) and s(3) == 0.125


EXAMPLES = [
    {"kind": "fixed", "lr": 0.1},
    {"kind": "step", "lr": 0.1, "gamma": 0.5, "step_size": 100},
    {"kind": "multistep", "lr": 0.1, "gamma": 0.5, "milestones": [3, 9]},
    {"kind": "exponential", "lr": 0.1, "gamma": 0.99},
    {"kind": "linear", "lr": 0.1, "final_lr": 0.01, "steps": 10},
    {"kind": "inverse", "lr": 0.1, "gamma": 1e-4, "power": 0.75},
    {"kind": "cosine", "lr": 0.1, "steps": 10, "min_lr": 1e-4},
    {"kind": "warmup", "steps": 3, "start_factor": 0.5, "after": {"kind": "fixed", "lr": 0.1}},
]


def test_examples_cover_every_kind() -> None:
    assert {e["kind"] for e in EXAMPLES} == set(KINDS)


@pytest.mark.parametrize("spec", EXAMPLES, ids=[e["kind"] for e in EXAMPLES])
def test_state_dict_round_trip(spec: dict) -> None:
    s = make_schedule(spec)
    d = s.state_dict()
    assert d == spec  # every hyperparameter, nothing else, plain types
    back = schedule_from_state(msgpack.unpackb(msgpack.packb(d)))
    assert back == s
    assert [back(i) for i in range(30)] == [s(i) for i in range(30)]


def test_load_state_dict_replaces_hyperparameters_and_refuses_other_kinds() -> None:
    s = make_schedule({"kind": "step", "lr": 0.1, "gamma": 0.5, "step_size": 10})
    s.load_state_dict({"kind": "step", "lr": 1.0, "gamma": 0.1, "step_size": 2})
    assert s(2) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="cannot load a 'fixed' schedule into a 'step'"):
        s.load_state_dict({"kind": "fixed", "lr": 0.1})
    with pytest.raises(ValueError, match="gamma must be > 0"):
        s.load_state_dict({"kind": "step", "lr": 1.0, "gamma": 0.0, "step_size": 2})
    assert s.gamma == 0.1  # a refused load leaves the schedule as it was


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"kind": "fixed", "lr": -0.1}, ValueError, "lr must be >= 0"),
        ({"kind": "fixed", "lr": float("nan")}, ValueError, "lr must be finite"),
        ({"kind": "fixed", "lr": True}, TypeError, "lr must be a number"),
        ({"kind": "step", "lr": 0.1, "gamma": 0, "step_size": 1}, ValueError, "gamma must be > 0"),
        ({"kind": "step", "lr": 0.1, "gamma": 0.5, "step_size": 0}, ValueError, "step_size"),
        ({"kind": "step", "lr": 0.1, "gamma": 0.5, "step_size": 1.5}, TypeError, "step_size"),
        ({"kind": "exponential", "lr": 0.1, "gamma": -1}, ValueError, "gamma must be > 0"),
        ({"kind": "cosine", "lr": 0.1, "steps": 0}, ValueError, "steps must be >= 1"),
        ({"kind": "linear", "lr": 0.1, "final_lr": -1, "steps": 5}, ValueError, "final_lr"),
        ({"kind": "inverse", "lr": 0.1, "gamma": 1, "power": -1}, ValueError, "power"),
        (
            {"kind": "multistep", "lr": 0.1, "gamma": 0.5, "milestones": [5, 5]},
            ValueError,
            "strictly increasing",
        ),
        (
            {"kind": "multistep", "lr": 0.1, "gamma": 0.5, "milestones": []},
            ValueError,
            "milestones",
        ),
        ({"kind": "warmup", "steps": 0, "after": 0.1}, ValueError, "steps must be >= 1"),
        (
            {"kind": "warmup", "steps": 2, "after": 0.1, "start_factor": 2},
            ValueError,
            "start_factor",
        ),
        ({"kind": "warmup", "steps": 2, "after": {"kind": "nope"}}, ValueError, "unknown sched"),
        ({"kind": "poly", "lr": 0.1}, ValueError, r"unknown schedule kind 'poly'.*cosine"),
        ({"lr": 0.1}, ValueError, "unknown schedule kind None"),
        (
            {"kind": "step", "lr": 0.1, "gamma": 0.5, "step_size": 2, "warm": 1},
            ValueError,
            r"unknown key\(s\) \['warm'\].*allowed",
        ),
        ({"kind": "step", "lr": 0.1}, ValueError, r"missing required key\(s\) \['gamma', 'step"),
    ],
)
def test_bad_specs(spec: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_schedule(spec)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="must be a number, a dict or a Schedule"):
        make_schedule("0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        make_schedule(0.1)(-1)

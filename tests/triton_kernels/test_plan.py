"""The triton backend's plan: its settings change only inside plan.override, are restored after it, refuse what is
not a setting, and are part of the key the backend replays a call's launches under."""

from __future__ import annotations

import pytest
import torch

import lightning_edu as le
from lightning_edu.triton_kernels import ops, plan


def test_override_changes_the_settings_inside_and_restores_them_after_an_error():
    assert plan.settings() == plan.Settings()
    with pytest.raises(RuntimeError, match="inside"):
        with plan.override(replay=False, tma=False) as inside:
            assert plan.settings() is inside and not inside.replay and not inside.tma and inside.fast_launch
            raise RuntimeError("inside")
    assert plan.settings() == plan.Settings()


def test_override_refuses_an_unknown_setting_and_a_value_that_is_not_a_bool():
    with pytest.raises(ValueError, match=r"^setting must be one of \('exact_in_place'.*got 'replays'"):
        with plan.override(replays=False):
            pass
    with pytest.raises(TypeError, match="^setting tma must be a bool, got int"):
        with plan.override(tma=0):
            pass
    assert plan.settings() == plan.Settings()


def test_a_call_under_other_settings_plans_its_launches_afresh(monkeypatch):
    # A plan recorded under the defaults is not replayed under override(exact_in_place=False): the launchers run
    # (their host code plans the call again), and the outputs are the same bits.
    ops.forget_plans()
    q = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(0))
    first = le.lightning_attention(q, q, q, [0.9, 0.5], backend="triton", block_size=16)
    planned = []
    real = ops.launch_plan
    monkeypatch.setattr(ops, "launch_plan", lambda *a, **kw: planned.append(a) or real(*a, **kw))
    le.lightning_attention(q, q, q, [0.9, 0.5], backend="triton", block_size=16)
    assert not planned  # replayed
    with plan.override(exact_in_place=False):
        again = le.lightning_attention(q, q, q, [0.9, 0.5], backend="triton", block_size=16)
    assert planned  # planned afresh under the other settings
    assert torch.equal(first, again)

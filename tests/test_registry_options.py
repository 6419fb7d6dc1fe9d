"""The registry's options: each hook declares the ones it takes, and a misspelt one is an error, never ignored.

One table over :data:`lightning_edu.registry.IMPLEMENTATIONS` and their hooks; the refusals happen before a hook
runs, so nothing here launches a kernel. A hook of this file's own records what it is handed.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from lightning_edu import registry
from lightning_edu.validation import validate_attention_args

HOOKS = [pytest.param(impl.name, role, id=f"{impl.name}-{role}") for impl in registry.IMPLEMENTATIONS.values()
         for role in ("forward", "backward") if (impl.forward_path if role == "forward" else impl.backward_path)]


def _hook(impl, role):
    return impl.forward if role == "forward" else impl.backward


def _call(hook, role, **options):
    return hook(None, **options) if role == "forward" else hook(None, None, **options)


def _defaults(impl, role):
    """Each declared option with its default, read from the hook's own signature."""
    path = impl.forward_path if role == "forward" else impl.backward_path
    params = inspect.signature(registry._resolve(path)).parameters
    return {name: params[name].default for name in impl.declared_options(role)}


@pytest.mark.parametrize("name, role", HOOKS)
def test_a_misspelt_option_is_refused_naming_the_implementation_and_what_it_takes(name, role):
    impl = registry.get(name)
    declared = impl.declared_options(role)
    takes = re.escape(str(sorted(declared))) if declared else "no options"
    with pytest.raises(TypeError, match=rf"'{re.escape(name)}'.*'not_an_option'.*{takes}"):
        _call(_hook(impl, role), role, not_an_option=1)  # refused before the hook runs: args None is never read


@pytest.mark.parametrize("name, role", HOOKS)
def test_every_declared_option_is_accepted(name, role):
    impl = registry.get(name)
    defaults = _defaults(impl, role)
    assert all(value is not inspect.Parameter.empty for value in defaults.values()), defaults
    for option, value in defaults.items():
        assert impl.options_for(role, given={option: value}) == {
            **{k: v for k, v in impl.options.items() if k in defaults}, option: value}


def test_each_record_option_reaches_the_hooks_that_declare_it():
    # The variants' own options: each is declared by one of the record's hooks and reaches exactly those.
    variants = [impl for impl in registry.IMPLEMENTATIONS.values() if impl.options]
    assert {impl.name for impl in variants} >= {"triton.la2_fast.no_state_reuse", "triton.one_pass.chained"}
    for impl in variants:
        for option, value in impl.options.items():
            roles = [role for role in ("forward", "backward") if option in impl.declared_options(role)]
            assert roles, (impl.name, option)
            for role in ("forward", "backward"):
                if (impl.forward_path if role == "forward" else impl.backward_path) is not None:
                    assert (impl.options_for(role).get(option) == value) == (role in roles), (impl.name, role)


SEEN = []


def _recording_forward(args, *, width=1):
    SEEN.append(("forward", width))
    return None, None


def _recording_backward(args, d_final_state=None, *, depth=2):
    SEEN.append(("backward", depth))
    return None, None, None, None


def _record(**options):
    return registry.Implementation("test.recording", "numpy", "00", "records its options",
                                   f"{__name__}:_recording_forward", f"{__name__}:_recording_backward",
                                   options=options)


def test_hooks_are_called_with_the_record_options_and_the_callers():
    SEEN.clear()
    impl = _record(width=3)
    impl.forward(None)
    impl.forward(None, width=5)
    impl.backward(None)  # width is the forward's: the backward is not handed it
    impl.backward(None, None, depth=7)
    assert SEEN == [("forward", 3), ("forward", 5), ("backward", 2), ("backward", 7)]
    with pytest.raises(TypeError, match=r"'test.recording'.*backward.*'width'.*\['depth'\]"):
        impl.backward(None, None, width=5)  # declared by the forward only


def test_a_record_option_no_hook_declares_is_refused():
    with pytest.raises(TypeError, match=r"'test.recording' is registered with option 'widht'.*\['width'\]"):
        _record(widht=3).forward
    real = registry.get("triton.la2_fast")
    typo = registry.Implementation(**{**real.__dict__, "name": "test.typo", "options": {"segmnts": False}})
    with pytest.raises(TypeError, match=r"'test.typo' is registered with option 'segmnts'.*'segments'"):
        typo.forward


def test_a_declared_option_runs_end_to_end():
    # numpy.la3's backward takes micro_size: a micro-chunk of 64 tokens is refused for chunks of 16 (it must lie in
    # one), so the option is read, not dropped; the torch log scan gives the sequential scan's answer.
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, 32, 4)) for _ in range(4))
    args = validate_attention_args(q, k, v, [0.9], backend="numpy", block_size=16, do=do)
    la3 = registry.get("numpy.la3")
    with pytest.raises(ValueError, match="micro_size"):
        la3.backward(args, None, micro_size=64)
    small = la3.backward(args, None, micro_size=4)
    exact = registry.get("numpy.blockwise").backward(args, None)
    for got, want in zip(small[:3], exact[:3]):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)

"""The P-collapse check as a pytest fixture, ``p_collapse``: one line turns it on in a kernel's test file.

::

    pytest_plugins = ["pcast_jax.testing.pytest_plugin"]

    def test_my_kernel_keeps_p(p_collapse):
        p_collapse(my_kernel, head_dim=128)

The plugin is opt-in: a test module (or the root ``conftest.py``) names it in ``pytest_plugins``, or
``pytest -p pcast_jax.testing.pytest_plugin`` loads it for one run; installing pcast_jax registers
nothing in other pytest sessions.

``p_collapse(kernel, **kwargs)`` takes :func:`pcast_jax.testing.check_p_collapse`'s arguments and returns
its :class:`~pcast_jax.testing.CollapseCheck`. Unless the verdict passes, the test fails with the check's
report as its message (no traceback into the check). Either way the report is kept as the test's
"P-collapse check" section (``pytest -rA`` prints it for passing tests too) and the verdict as the user
property ``p_collapse`` (JUnit XML carries it).
"""

from __future__ import annotations

import pytest

from pcast_jax import testing

__all__ = ["p_collapse"]


@pytest.fixture
def p_collapse(request):
    """A function ``check(kernel, **kwargs)``: :func:`pcast_jax.testing.check_p_collapse`, failing the test
    with the report unless the verdict passes (a verdict within noise fails too: the probes are seeded)."""

    def check(kernel, **kwargs) -> testing.CollapseCheck:
        __tracebackhide__ = True
        result = testing.check_p_collapse(kernel, **kwargs)
        request.node.add_report_section("call", "P-collapse check", result.summary())
        request.node.user_properties.append(("p_collapse", result.verdict))
        if result.safe is not True:
            pytest.fail(result.summary(), pytrace=False)
        return result

    return check

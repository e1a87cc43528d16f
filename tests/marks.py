"""Parametrizations that keep part of a case list in the default (CI) suite and mark the rest `slow`."""

import pytest


def slow_except(values, keep):
    """pytest params for `values`: each marked `slow` unless it is in `keep` (a tuple value becomes
    several arguments, for multi-name parametrize)."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=() if v in keep else pytest.mark.slow)
            for v in values]

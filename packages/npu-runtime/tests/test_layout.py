"""The package is importable as part of the PEP 420 `turnrl` namespace."""

import importlib.metadata

import turnrl
import turnrl.npu_runtime as pkg


def test_turnrl_is_a_namespace_package():
    # A regular package would have an __init__.py and so a __file__; a namespace has none.
    assert getattr(turnrl, "__file__", None) is None


def test_version_matches_distribution_metadata():
    assert pkg.__version__ == importlib.metadata.version("turnrl-npu-runtime")

"""Shared test helpers, one module per test tier: ``helpers.unit`` and ``helpers.distributed``.

``tests/`` is on ``sys.path`` (pytest puts the root ``conftest.py``'s directory there), so tests
import them as ``from helpers.unit import FakeGroup``.
"""

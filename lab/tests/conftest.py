"""The lab's tests use the unit tests' fixtures."""

from tests.unit.conftest import one_thread  # noqa: F401

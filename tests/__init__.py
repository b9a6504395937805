"""The test suite (tests/README.md): test modules, their helpers in tests.helpers, fixtures in conftest.py."""

"""The test suite. A package so that tests and bench/ import the shared helpers as `tests.helpers...` (pytest puts
the repository root on sys.path: pyproject's [tool.pytest.ini_options] pythonpath)."""

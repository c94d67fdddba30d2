"""dtrain's test suite (a package only so that ``tests.helpers`` imports the same way everywhere).

See ``tests/helpers/__init__.py`` for the layout and how multi-process checks are written.
"""

"""Runnable examples of jacobkit, run from a checkout of the repository
(``python examples/<name>.py``), each with its page in ``docs/`` and its test
in ``tests/``. Not part of the installed package."""

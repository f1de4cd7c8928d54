"""The benchmark suite: every strategy's time, peak memory and agreement with
a reference, each measured in a fresh subprocess. Run from the repository's
root: ``python -m benchmarks.suite --quick --out /tmp/bench``.

Not part of the installed package: it runs from a checkout, on that
checkout's own ``jacobkit``. What ``jacobkit compare`` shares with it stays in
the package (:mod:`jacobkit.bench`: the measurements, the statistics, the
child processes with a time limit).

- :mod:`~benchmarks.suite.problems`: the problems and the quick and full suites;
- :mod:`~benchmarks.suite.runner`: runs a suite, one subprocess per run;
- :mod:`~benchmarks.suite.child`: the suite's tasks inside each subprocess
  (on top of :mod:`jacobkit.bench.child`);
- :mod:`~benchmarks.suite.paired`: auto against a fixed strategy, timed in
  pairs;
- :mod:`~benchmarks.suite.report`, :mod:`~benchmarks.suite.auto_report` and
  :mod:`~benchmarks.suite.plots`: ``results.md`` and the PNGs, from rows
  grouped by :mod:`~benchmarks.suite.rows`;
- :mod:`~benchmarks.suite.machine`: the machine, described generically;
- :mod:`~benchmarks.suite.command`: the command line
  (``python -m benchmarks.suite``);
- :mod:`~benchmarks.suite.budget_child`: the child process of
  ``benchmarks/auto_budgets.py``.
"""

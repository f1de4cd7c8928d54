"""The benchmark suite: every strategy's time, peak memory and agreement with
a reference, each measured in a fresh subprocess (``jacobkit bench``).

- :mod:`~jacobkit.bench.problems`: the problems and the quick and full suites;
- :mod:`~jacobkit.bench.runner`: runs a suite, one subprocess per run;
- :mod:`~jacobkit.bench.processes`: those subprocesses, with a time limit
  (also each strategy of ``jacobkit compare``);
- :mod:`~jacobkit.bench.child`: what runs inside each subprocess;
- :mod:`~jacobkit.bench.measure`: time, peak memory and agreement of
  strategies on one problem (also ``jacobkit compare`` and the notebooks);
- :mod:`~jacobkit.bench.disagreement`: when a strategy disagrees with the
  reference;
- :mod:`~jacobkit.bench.report`, :mod:`~jacobkit.bench.auto_report` and
  :mod:`~jacobkit.bench.plots`: ``results.md`` and the PNGs, from rows
  grouped by :mod:`~jacobkit.bench.rows`;
- :mod:`~jacobkit.bench.machine`: the machine, described generically;
- :mod:`~jacobkit.bench.command`: the ``jacobkit bench`` command.
"""

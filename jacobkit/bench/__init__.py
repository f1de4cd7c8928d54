"""What ``jacobkit compare`` measures with, and runs its strategies in.

- :mod:`~jacobkit.bench.measure`: time, peak memory and agreement of
  strategies on one problem, and the table (also the notebooks and the
  benchmark suite);
- :mod:`~jacobkit.bench.resident`: the process's resident memory, with
  psutil or without;
- :mod:`~jacobkit.bench.stats`: the bootstrap intervals and rank tests behind
  every "faster";
- :mod:`~jacobkit.bench.disagreement`: when a strategy disagrees with the
  reference;
- :mod:`~jacobkit.bench.processes`: fresh child processes with a time limit,
  one per strategy;
- :mod:`~jacobkit.bench.child`: what runs inside each of them.

The benchmark suite itself (its problems, runner, reports and plots) is not
part of the installed package: it lives in a checkout of the repository, in
``benchmarks/suite``, and builds on these modules.
"""

"""jacobkit's benchmarks, run from a checkout of the repository: the suite
(:mod:`benchmarks.suite`, ``python -m benchmarks.suite``) and one script per
question (``python benchmarks/<name>.py``). Not part of the installed
package."""

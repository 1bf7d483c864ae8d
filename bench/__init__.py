"""Benchmarks, each a module run from the repository root: ``python -m bench.<name>``
(the commands and results are in bench/RESULTS.md). Not part of the installed package."""

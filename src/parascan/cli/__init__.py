"""The ``parascan`` command and the tooling behind it, apart from the library.

- ``main``: the command (``parascan``, ``python -m parascan``): ``info``, ``check``, ``bench``;
- ``info``: facts about this machine and build (``parascan info``, benchmark headers);
- ``check``: the self-test, every backend against the float64 loop (``parascan check``);
- ``bench``, ``bench_generic``, ``bench_packed``: the benchmarks (``parascan bench``);
- ``bench_transformers``: a transformers model of every patched family, unpatched against
  patched by parascan (``python -m parascan.cli.bench_transformers``, ``parascan bench
  --models``); ``linear_floor``: the time of such a model's linear layers alone;
- ``peers``: other ways of computing the recurrence, which the benchmark times;
- ``common``: what the benchmarks share: rounds of timings, ratios, tables;
- ``timing``: the clock under them (``parascan.distributed.bench`` uses it too).

Nothing here is public API; the library (``import parascan``) never imports this package.
"""

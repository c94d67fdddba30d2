"""Shared helpers of dtrain's test suite, imported as ``tests.helpers.<module>``.

Layout of ``tests/``:

* ``unit/``     one process, no launcher: each module of the package on its own (seconds).
* ``dist/``     real launchers (``mpiexec``, ``torchrun``, an emulated ``srun``): a ``test_*.py``
  starts ranks, often of a ``_*_worker.py`` script beside it, and checks what they report.
* ``recipes/``  ``python -m dtrain`` end to end: recipes, the command line, bad input.
* ``helpers/``  this package; ``conftest.py`` beside it holds the shared fixtures.

Modules here:

* :mod:`~tests.helpers.mpi`         ``run_mpi``: run a script as N ranks under a real ``mpiexec``.
* :mod:`~tests.helpers.checks`      named checks: a worker runs several, each test id asserts one.
* :mod:`~tests.helpers.thread_world`  N ranks as N threads (``FakeWorld``), for unit tests of learners.
* :mod:`~tests.helpers.bmuf_reference`, :mod:`~tests.helpers.quantized_reference`  block momentum and
  the quantized exchange written out directly, the independent references learners are compared with.
* :mod:`~tests.helpers.cli`         ``run_dtrain``: ``python -m dtrain ARGS`` as from a plain shell, each in a
  process forked from a warm interpreter (``gpu=True``: a fresh one, which sees the GPUs); ``run_python``
  the same for dtrain's tools (``-m dtrain.generate``, a benchmark script).
* :mod:`~tests.helpers.cli_runs`    many ``python -m dtrain`` command lines in one ``mpiexec`` launch, for
  tests that compare whole runs (a run and its resumed copy, several learners' runs).
* :mod:`~tests.helpers.toy_data`    the small classification data set most training tests use.
* :mod:`~tests.helpers.compare`     models compared between two runs, or between the ranks of a job.
* :mod:`~tests.helpers.failing_model`  a digits model that fails on purpose (fail-fast tests, a run that
  becomes unstable).
* :mod:`~tests.helpers.forked_dtrain`  runs many ``python -m dtrain`` (and tool) command lines from one warm interpreter
  (``run_dtrain``'s, and ``tests/recipes/test_bad_input.py``'s).

Shipped with the package, because benchmarks use them too: :mod:`dtrain.testing` (simulated hosts from
network namespaces, ``dtrain.testing.netns``; small data sets in real file formats, ``dtrain.testing.image_files``
and ``dtrain.testing.cifar_files``; running ``mpiexec`` in a session of its own, ``dtrain.testing.processes``).

How ``tests`` becomes importable, the one rule: the repository root must be on ``sys.path``.
pytest puts it there (``pythonpath = ["."]`` in ``pyproject.toml``); every process the helpers
start (``run_mpi``'s ranks, the forked runner, the ranks of ``test_comm.py``'s launchers) gets it
through ``PYTHONPATH`` (:func:`tests.helpers.mpi.with_repository_on_path`). So no test or
worker edits ``sys.path``, and a worker run by hand needs ``PYTHONPATH=.`` from the repository root.
"""

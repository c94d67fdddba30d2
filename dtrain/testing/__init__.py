"""Tools for testing and benchmarking distributed training on one machine: a cluster of simulated hosts
built from network namespaces (:mod:`dtrain.testing.netns`, needs root), small data sets written in real
file formats (:mod:`dtrain.testing.image_files`: CNTK map files of JPEG/PNG images;
:mod:`dtrain.testing.cifar_files`: CIFAR-10's binary layout), and running ``mpiexec`` in a session of its
own (:mod:`dtrain.testing.processes`).

dtrain's tests and ``benchmarks/`` both import them from here; nothing in the training path does, and
importing this package imports none of its modules (each needs only the standard library, NumPy or Pillow).
"""

"""GPU benchmarks of megazoo against peers, run as modules from the repository root:
``python -m bench.<name>`` (``torchrun --nproc-per-node N -m bench.<name>`` for several
GPUs). Each has a ``--dry-run`` (or ``--small`` / ``--device cpu``) that exercises its code
on CPU; bench/README.md lists them with their results.
"""

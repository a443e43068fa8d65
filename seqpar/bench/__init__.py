"""The benchmark: ``torchrun --nproc-per-node N -m seqpar.bench --preset table --peers``.

``presets`` (the performance table and CPU smoke sizes), ``runners`` (limit, seqpar, peers), ``timing``
(CUDA events, slowest rank, peak memory, exposed communication), ``report`` (tables and plots).
"""

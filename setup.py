"""Build the C kernels as one plain shared library (no Python or torch headers).

parascan loads it with ctypes; it is `optional` so that a machine without a C
compiler still installs parascan, with the `cpu` backend reported unavailable.
"""

from glob import glob

from setuptools import Extension, setup

KERNEL_SOURCES = [
    "src/parascan/_native/abi.c",
    "src/parascan/_native/parallel.c",
    "src/parascan/first_order/cpu.c",
    "src/parascan/matrix/cpu.c",
    "src/parascan/generic/cpu.c",
    "src/parascan/selective/cpu.c",
    "src/parascan/ssd/cpu.c",
    "src/parascan/delta_rule/cpu.c",
    "src/parascan/linear_attention/cpu.c",
    "src/parascan/dplr/cpu.c",
]

setup(
    ext_modules=[
        Extension(
            "parascan._kernels",
            sources=KERNEL_SOURCES,
            # The headers, so that editing one rebuilds the library.
            depends=sorted(glob("src/parascan/**/*.h", recursive=True)),
            include_dirs=["src/parascan/_native"],
            extra_compile_args=[
                "-std=c11",
                "-O3",
                "-ffp-contract=off",  # the same bits on every path and thread count
                "-fno-trapping-math",  # lets gcc vectorize selects (no FP traps are used)
                "-fopenmp",  # threads from torch's own OpenMP pool (parallel.c)
                "-fvisibility=hidden",
                # no note on 32-byte vectors passed between inlined functions built for
                # SSE2 (selective/cpu.c): no such call crosses a library boundary
                "-Wno-psabi",
            ],
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        )
    ]
)

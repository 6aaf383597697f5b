"""Build of the pippy_xla C++ extension against the installed torch.

Install with ``pip install --no-build-isolation -e .`` (build isolation would fetch another torch).
Environment switches: ``DEBUG=1`` builds with ``-O0 -g``; ``MAX_JOBS`` bounds ninja's parallelism.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

debug = os.environ.get("DEBUG", "0") == "1"
cxx_flags = ["-std=c++17", "-O0", "-g"] if debug else ["-std=c++17", "-O2"]
sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/ops/*.cpp"))

setup(
    ext_modules=[
        CppExtension(
            "pippy_xla._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": cxx_flags},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

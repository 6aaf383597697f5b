"""Build of the pippy_xla C++ extension against the installed torch.

Install with ``pip install --no-build-isolation -e .`` (build isolation would fetch another torch).
Environment switches: ``DEBUG=1`` builds with ``-O0 -g``; ``MAX_JOBS`` bounds ninja's parallelism.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

debug = os.environ.get("DEBUG", "0") == "1"
# No -std flag: torch's BuildExtension adds the standard its headers need (C++17 up to torch 2.11,
# C++20 in 2.13); the sources are C++17 and build under either.
cxx_flags = ["-O0", "-g"] if debug else ["-O2"]


def torch_libstdcxx() -> list[str]:
    """The libstdc++ shared object that this process (which imported torch) runs with.

    [Note: one libstdc++] The extension must call the same libstdc++ as libtorch. A compiler whose
    own libstdc++ is only a static archive (the GPU machine's /opt/gcc/bin/g++) copied parts of
    it into the extension: streams made there found no number-formatting facet in the locale
    libtorch's copy set up, so every c10::str of an integer (error messages, a c10d work's
    description) crashed with SIGSEGV on torch 2.11 and printed nothing on 2.13. Naming the
    loaded libstdc++ on the link line resolves every std:: symbol there first, so no archive
    member is pulled in; pippy_xla/_native.py refuses a build that still holds its own copy.
    """
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return [path]
    except OSError:  # not Linux: the compiler's default applies
        pass
    return []


# One folder per wing (schedule, runtime, transport, plan) and the pybind11 bindings, which only
# this extension builds (CMakeLists.txt builds and tests the wings without them).
sources = sorted(glob.glob("csrc/*/*.cpp"))

setup(
    ext_modules=[
        CppExtension(
            "pippy_xla._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=torch_libstdcxx(),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

"""The native part of the package (everything else is in pyproject.toml).

``gcache._native._dataplane`` (and ``_index``, the compact index's kernels) is compiled here with the system C compiler at
``pip install`` (``make test`` does that on a clean clone). It needs the xxHash
headers and library: Debian/Ubuntu ``libxxhash-dev`` (``make`` installs it when
missing). Without them the build fails with one line saying so, rather than
shipping a package that silently runs the slower Python path.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    def run(self) -> None:
        inc = [*(self.include_dirs or []), "/usr/include", "/usr/local/include"]
        for var in ("CPATH", "C_INCLUDE_PATH"):
            inc += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
        if not any(os.path.exists(os.path.join(d, "xxhash.h")) for d in inc):
            sys.exit(
                "gcache: building the native data plane needs xxhash.h: install libxxhash-dev "
                "(apt-get install -y libxxhash-dev; `make venv` does this)"
            )
        super().run()


setup(
    ext_modules=[
        Extension(
            "gcache._native._dataplane",
            sources=["gcache/_native/_dataplane.c"],
            libraries=["xxhash"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "gcache._native._index",
            sources=["gcache/_native/_index.c", "gcache/_native/_lease.c"],
            depends=["gcache/_native/_index.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)

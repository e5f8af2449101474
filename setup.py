"""Builds the optional C extension ``tierkv._native`` (key chain and key set).

The extension is optional: where no compiler or no ``xxhash.h`` is present, the
package installs without it and ``tierkv.keys`` falls back to the pure-Python chain
(same keys, slower).
"""

import os

from setuptools import Extension, setup

ext_modules = []
if os.path.exists(os.path.join("tierkv", "_native.c")):
    ext_modules.append(
        Extension("tierkv._native", ["tierkv/_native.c"], extra_compile_args=["-O3"], optional=True)
    )

setup(ext_modules=ext_modules)

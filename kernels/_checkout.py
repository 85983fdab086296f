"""Keep a source checkout on ``sys.path`` from shadowing other distributions.

The folders ``kernels/``, ``model/`` and ``service/`` are installed as ``yoso_serve.kernels``
and friends. When a checkout's root is on ``sys.path`` (``python -c`` run from it), the same
folders are also reachable as the top-level names ``kernels``, ``model`` and ``service``,
which belong to other PyPI distributions (transformers imports Hugging Face's ``kernels``).
A folder imported under such a name calls :func:`step_aside`, which hands the name to the
real distribution if one is installed, and otherwise leaves an empty namespace-like module
(no ``__file__``) that import probes such as transformers' treat as "not installed".

The three folders run this file by its path (``runpy.run_path``), never by importing it through a
package: under its bare name, ``kernels`` itself is the name being handed over, so a guard imported
as ``kernels._checkout`` would vanish with it. Run by path it needs nothing installed and belongs
to no package, so all three folders behave alike whether or not yoso-serve is installed (the top
level of the checkout is fixed, so the file sits in ``kernels/``; the installed package never
uses it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def step_aside(name: str, file: str) -> None:
    checkout = os.path.realpath(os.path.dirname(os.path.dirname(file)))
    search = [p for p in sys.path if os.path.realpath(p or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return
    placeholder = types.ModuleType(name, "not installed: a yoso-serve source folder stood here")
    placeholder.__path__ = []
    sys.modules[name] = placeholder

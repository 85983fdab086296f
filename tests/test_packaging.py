"""The project neither shadows nor is shadowed by the PyPI distributions `kernels`, `service`, `model`.

The worst case is a checkout's root on sys.path (``python -c`` run from it, no PYTHONSAFEPATH): the
folders kernels/, service/ and model/ are then reachable as top-level names. These tests run exactly that.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_checkout(code: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    out = subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkout_on_sys_path_does_not_shadow_hf_kernels():
    got = run_in_checkout(
        "import json, sys, kernels, importlib.metadata as md;"
        "print(json.dumps({'cwd_first': sys.path[0] == '', 'file': kernels.__file__,"
        " 'has_get_kernel': hasattr(kernels, 'get_kernel'), 'version': md.version('kernels')}))"
    )
    assert got["cwd_first"]
    assert "site-packages" in got["file"] and not got["file"].startswith(str(ROOT / "kernels"))
    assert got["has_get_kernel"]


def test_transformers_imports_cleanly_beside_the_project():
    got = run_in_checkout(
        "import json, transformers;"
        "from transformers.utils.import_utils import is_kernels_available, _is_package_available;"
        "from transformers import YosoModel, YosoConfig;"
        "import yoso_serve.kernels as yk;"
        "YosoModel(YosoConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64));"
        "import importlib.metadata as md;"
        "print(json.dumps({'kernels': list(_is_package_available('kernels', return_version=True)),"
        " 'kernels_dist': md.version('kernels'), 'checked': is_kernels_available() in (True, False),"
        " 'service': _is_package_available('service', True)[0], 'model': _is_package_available('model', True)[0],"
        " 'ours': yk.yoso_attention.__module__}))"
    )
    # HF's kernels is installed in the dev environment and must be what transformers sees
    # (whether its version suits this transformers release is transformers' business).
    assert got["kernels"] == [True, got["kernels_dist"]] and got["checked"]
    # No `service` or `model` distribution is installed: the checkout's folders must not pose as one.
    assert got["service"] is False and got["model"] is False
    assert got["ours"] == "yoso_serve.kernels.yoso"


def test_the_three_folders_step_aside_alike_when_nothing_is_installed():
    """-S leaves site-packages out: neither yoso-serve nor HF's kernels is importable, as in a bare
    checkout. Each folder then becomes the same empty placeholder, none of them fails."""
    got = run_in_checkout(
        "import json, importlib.util as u, kernels, model, service;"
        "print(json.dumps({m.__name__: [getattr(m, '__file__', None), list(m.__path__)]"
        " for m in (kernels, model, service)} | {'yoso_serve': u.find_spec('yoso_serve') is None}))",
        "-S",
    )
    assert got == {"kernels": [None, []], "model": [None, []], "service": [None, []], "yoso_serve": True}


def test_installed_package_adds_only_yoso_serve():
    """Without the checkout on sys.path (-P), the install itself exposes no bare name."""
    code = (
        "import importlib.util as u, json, kernels, yoso_serve.kernels, yoso_serve.model, yoso_serve.service;"
        "print(json.dumps({'kernels': kernels.__file__,"
        " 'service': u.find_spec('service') is None, 'model': u.find_spec('model') is None}))"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "site-packages" in got["kernels"]
    assert got["service"] and got["model"]



def test_the_tree_run_uninstalled_reports_pyprojects_version(monkeypatch):
    """The GPU image runs this tree from PYTHONPATH (bench/gpu_run.sh links it as yoso_serve), with
    no yoso-serve distribution: the service failed to import there on the missing metadata. The
    version then comes from pyproject.toml, the same string the installed package reports."""
    import importlib.metadata
    import tomllib

    from yoso_serve.model import version as version_module

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.metadata.version("yoso-serve") == declared

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    version_module.package_version.cache_clear()
    try:
        assert version_module.package_version() == declared
        monkeypatch.setattr(version_module, "PYPROJECT", ROOT / "no-such-pyproject.toml")
        version_module.package_version.cache_clear()
        assert version_module.package_version() == "0+unknown"
    finally:
        version_module.package_version.cache_clear()

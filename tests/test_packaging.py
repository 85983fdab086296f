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


def run_in_checkout(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
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
    assert "site-packages" in got["file"] and str(ROOT) not in got["file"]
    assert got["has_get_kernel"]


def test_transformers_imports_cleanly_beside_the_project():
    got = run_in_checkout(
        "import json, transformers;"
        "from transformers.utils.import_utils import is_kernels_available, _is_package_available;"
        "from transformers import YosoModel, YosoConfig;"
        "import yoso_serve.kernels as yk;"
        "YosoModel(YosoConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64));"
        "print(json.dumps({'kernels_ok': bool(is_kernels_available()),"
        " 'service': _is_package_available('service')[0], 'model': _is_package_available('model')[0],"
        " 'ours': yk.yoso_attention.__module__}))"
    )
    # HF's kernels is installed in the dev environment and must be what transformers sees.
    assert got["kernels_ok"] is True
    # No `service` or `model` distribution is installed: the checkout's folders must not pose as one.
    assert got["service"] is False and got["model"] is False
    assert got["ours"] == "yoso_serve.kernels.yoso"


def test_installed_package_imports_only_under_yoso_serve():
    got = run_in_checkout(
        "import json, importlib.metadata as md;"
        "files = [str(f) for f in md.files('yoso-serve') or []];"
        "print(json.dumps({'top': sorted({f.split('/')[0] for f in files if f.endswith('.py')})}))"
    )
    assert not {"kernels", "service", "model"} & set(got["top"])

"""The HTTP inference service (import as ``yoso_serve.service``)."""

if __name__ != "yoso_serve.service":  # a checkout on sys.path, imported as top-level `service`
    import os
    import runpy

    guard = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "kernels", "_checkout.py")
    runpy.run_path(guard)["step_aside"](__name__, __file__)
else:
    from .app import create_app
    from .engine import Engine
    from .params import ClassifyParams, EmbedParams, HiddenParams
    from .settings import ServeSettings

    __all__ = ["ClassifyParams", "EmbedParams", "Engine", "HiddenParams", "ServeSettings", "create_app"]

"""The HTTP inference service (import as ``yoso_serve.service``)."""

if __name__ != "yoso_serve.service":  # a checkout on sys.path, imported as top-level `service`
    from _yoso_serve_checkout import step_aside

    step_aside(__name__, __file__)
else:
    from .app import create_app
    from .engine import Engine
    from .params import ClassifyParams, EmbedParams, HiddenParams
    from .settings import ServeSettings

    __all__ = ["ClassifyParams", "EmbedParams", "Engine", "HiddenParams", "ServeSettings", "create_app"]

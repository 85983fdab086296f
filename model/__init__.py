"""The YOSO encoder, its checkpoints and conversion (import as ``yoso_serve.model``)."""

if __name__ != "yoso_serve.model":  # a checkout on sys.path, imported as top-level `model`
    import os
    import runpy

    guard = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "kernels", "_checkout.py")
    runpy.run_path(guard)["step_aside"](__name__, __file__)
else:
    from .checkpoint import CheckpointError, load_pretrained, save_pretrained
    from .config import EncoderConfig
    from .convert import convert_bert_to_yoso
    from .default import default_model_dir
    from .encoder import YosoEncoder
    from .encoder_model import EncoderModel
    from .tokenizer import TextTokenizer

    __all__ = [
        "CheckpointError",
        "EncoderConfig",
        "EncoderModel",
        "TextTokenizer",
        "YosoEncoder",
        "convert_bert_to_yoso",
        "default_model_dir",
        "load_pretrained",
        "save_pretrained",
    ]

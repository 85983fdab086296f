"""YOSO attention operators (import as ``yoso_serve.kernels``)."""

if __name__ != "yoso_serve.kernels":  # a checkout on sys.path, imported as top-level `kernels`
    import os
    import runpy

    guard = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "kernels", "_checkout.py")
    runpy.run_path(guard)["step_aside"](__name__, __file__)
else:
    from ._build import backend_info, cpu_kernels_built, exact_bf16_dots, int8_hashing_body, precompile
    from .dense_int8 import (Int8Rows, LayerNormArgs, cpu_flags, int8_linear, int8_linear_ref, int8_linear_rows,
                             int8_gemm, int8_mm, int8_rows, int8_sums, tensor_key, weight_levels)
    from .dense_parts import sum_parts, sum_parts_ref
    from .hashing import hash_codes, hash_codes_ref
    from .yoso import yoso_attention, yoso_attention_ref

    __all__ = [
        "Int8Rows", "LayerNormArgs", "backend_info", "cpu_flags", "cpu_kernels_built", "exact_bf16_dots", "hash_codes",
        "hash_codes_ref", "int8_gemm", "int8_hashing_body", "int8_linear", "int8_linear_ref", "int8_linear_rows",
        "int8_mm", "int8_rows", "int8_sums", "precompile", "sum_parts", "sum_parts_ref", "tensor_key", "weight_levels",
        "yoso_attention", "yoso_attention_ref",
    ]

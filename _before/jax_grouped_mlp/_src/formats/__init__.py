"""Quantized number formats (MXFP8): the tensor type, quantize and dequantize in pure JAX."""

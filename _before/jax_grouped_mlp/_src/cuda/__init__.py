"""Bindings to the compiled extension: load it, check operands, call the XLA FFI targets."""

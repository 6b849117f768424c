"""CuTe DSL kernels, compiled ahead of time (see ``aot.py``).

Nothing here is imported at run time: importing a kernel module needs
nvidia-cutlass-dsl, which only the build uses. The run-time side is the C++
extension ``jax_grouped_mlp._kernels`` and ``jax_grouped_mlp._src.cuda.ffi``.
"""

"""The op: the differentiable grouped MLP, its primitives, their pure-JAX reference, recipes and residual tags."""

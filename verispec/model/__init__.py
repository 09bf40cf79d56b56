"""The target model: loading, the lean forward, low-bit weights and the row kernels."""

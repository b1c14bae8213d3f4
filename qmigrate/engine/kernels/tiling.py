"""Tile sizes for the Triton kernels' launches (no triton import: the CPU runner sizes with it too)."""


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton tile sides are powers of two."""
    return 1 << max(0, (n - 1).bit_length())

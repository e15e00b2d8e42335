"""Orthogonal rotations for quantization (QuaRot / SpinQuant style): the matrices and how weights absorb them.

Pure functions of tensors. A rotation Q (orthogonal, Q Q^T = I) of a hidden state h (row vector) gives h Q.
A linear y = h W^T that reads the rotated state keeps its function with W Q (`rotate_input`); one whose output
is to be rotated becomes Q^T W (`rotate_output`). Rotations spread a few outlier channels over all of them,
so that 4-bit activation (and weight) grids lose less.

`random_hadamard(n, seed)`: for n = 2^k m, the Kronecker product of the Sylvester Hadamard matrix of order 2^k
(scaled to be orthogonal) with a random orthogonal m x m matrix (QR of a Gaussian; m = 1 gives a pure
Hadamard), its columns multiplied by random signs. Deterministic for a seed; built in float64.
"""

from __future__ import annotations

import torch


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The orthogonal Sylvester-Hadamard matrix of order n (a power of two), float64, entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A random orthogonal n x n matrix (float64): Q of the QR factorization of a Gaussian, signs fixed so
    that R has a positive diagonal (Haar-distributed)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def random_hadamard(n: int, seed: int) -> torch.Tensor:
    """An orthogonal n x n rotation (float64) mixing every channel with every other: see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    two = n & -n  # the largest power of two dividing n
    m = n // two
    q = sylvester_hadamard(two)
    if m > 1:
        q = torch.kron(q.contiguous(), random_orthogonal(m, gen).contiguous())
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return q * signs.unsqueeze(0)


def block_hadamard(n: int, block: int, seed: int) -> torch.Tensor:
    """The block-diagonal rotation of n channels in blocks of `block` (a power of two dividing n), each block a
    Sylvester Hadamard matrix with random column signs: rotations confined to quantization groups (MR-GPTQ's
    block-wise Hadamard), float64."""
    if n % block:
        raise ValueError(f"a block rotation of {block} channels needs a width divisible by it, got {n}")
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    h = sylvester_hadamard(block)
    return torch.block_diag(*([h] * (n // block))) * (signs.to(torch.float64) * 2 - 1).unsqueeze(0)


def rotate_input(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """W Q in W's dtype (computed in float64): the weight of a linear that reads h Q instead of h."""
    return (w.double() @ q).to(w.dtype)


def rotate_input_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """W H (computed in float64, returned in W's dtype) for H block-diagonal with `sylvester_hadamard(block)` blocks,
    without building H: the weight of a linear whose input is rotated online by H (`qmodules.online_rotation`)."""
    if w.shape[1] % block:
        raise ValueError(f"a rotation in blocks of {block} needs an input width divisible by it, got {w.shape[1]}")
    return (w.double().unflatten(1, (-1, block)) @ sylvester_hadamard(block)).flatten(1).to(w.dtype)


def rotate_output(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q^T W (W [out, in]) in W's dtype: the weight of a linear whose output is to be rotated by Q."""
    return (q.t() @ w.double()).to(w.dtype)


def rotate_vector(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """b Q (a bias of a linear whose output is rotated, or an embedding row)."""
    return (b.double() @ q).to(b.dtype)


def fold_scale_into_inputs(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W diag(scale): a norm's per-channel weight moved into the linear that reads the norm's output."""
    return (w.double() * scale.double().unsqueeze(0)).to(w.dtype)


def per_head(q: torch.Tensor, heads: int) -> torch.Tensor:
    """The block-diagonal rotation applying `q` (head_dim x head_dim) to each of `heads` heads."""
    return torch.block_diag(*([q] * heads))

"""Input Hessians H = 2/n sum x x^T of a linear layer, accumulated in float32 from calibration batches.

The sum is symmetric, so only block rows of its upper triangle are accumulated: for each block of
`BLOCK` rows, S[i:i+b, i:] += x[:, i:i+b]^T x[:, i:]. That skips ~half the multiply-adds of a
full `addmm`; measured on this project's 2-core CPU with 2048 tokens per update: 1.45x faster at
width 576, 1.5x at 1536. (BLAS `ssyrk` through scipy was as fast alone, but its OpenBLAS threads
spin after each call and halved the speed of torch's matmuls in the forward that follows.)

The Hessian stays float32 throughout: GPTQ inverts it, and rounding each update's sum to bf16 (the output of
a bf16 GEMM, ~2^-9 of an entry) made SmolLM2's gptq-w4a16 markedly worse (KLD 0.1915 against 0.1684 at
emma 8 x 2048). `CrossAccumulator` (the activation target's D, which enters its solve linearly) may take
bf16 products: `products=torch.bfloat16` multiplies pairs that are bf16 already (a bf16 calibration
forward) as one bf16 GEMM per update: products and the GEMM's own sum are exact in the float32
accumulator of a bf16 dot product, and each update's result is rounded to bf16 once before it joins the
float32 running sum (errors ~2^-9 / sqrt(updates) of an entry); where bf16 GEMMs are fast
(avx512_bf16 without AMX, 2048 tokens per update) 3.9x the float32 GEMM at width 2048.
"""

from __future__ import annotations

from typing import Callable

import torch

BLOCK = 128  # rows per block: measured best or near-best at widths 576 and 1536


class HessianAccumulator:
    """Running float32 sum of x^T x over every token given to `add`, and the token count."""

    def __init__(self, n: int):
        self.n = n
        self.tokens = 0
        self._upper: torch.Tensor | None = None  # block rows on and above the diagonal, on the inputs' device

    def add(self, x: torch.Tensor) -> None:
        """Add the tokens of x [..., n] (any float dtype; converted to float32 exactly)."""
        if x.shape[-1] != self.n:
            raise ValueError(f"input width {x.shape[-1]} does not match the Hessian's {self.n}")
        rows = x.detach().reshape(-1, self.n).to(torch.float32)
        if self._upper is None:
            self._upper = torch.zeros(self.n, self.n, dtype=torch.float32, device=rows.device)
        rows = rows.to(self._upper.device)
        self.tokens += rows.shape[0]
        for i in range(0, self.n, BLOCK):
            self._upper[i : i + BLOCK, i:].addmm_(rows[:, i : i + BLOCK].t(), rows[:, i:])

    def reduce(self, sum_: "Callable[[torch.Tensor], torch.Tensor]") -> None:
        """Replace the running sum and token count by their totals under `sum_` (an in-place all-reduce over
        the ranks of a distributed run, `quantkit.calibration.distributed`): every rank then holds the same Hessian."""
        self.tokens = _reduce(self._upper, self.tokens, sum_)

    def hessian(self) -> torch.Tensor:
        """H = 2/tokens * sum x x^T as a full symmetric float32 matrix [n, n]."""
        if self.tokens == 0:
            raise ValueError("no tokens were added to the Hessian")
        upper = self._upper.triu()
        return (upper + upper.triu(1).t()).mul_(2.0 / self.tokens)

    def take_hessian(self) -> torch.Tensor:
        """The same matrix as `hessian()`, built in the accumulator's own memory (which it then gives up:
        no second n x n matrix is made; a 14336-wide Hessian is 822 MB)."""
        if self.tokens == 0:
            raise ValueError("no tokens were added to the Hessian")
        H, self._upper = self._upper, None
        H.triu_()
        for j in range(0, self.n, BLOCK):  # mirror the upper triangle one column block at a time
            dst = H[j:, j : j + BLOCK]
            dst.copy_(H[j : j + BLOCK, j:].t().tril(-1) + dst.triu())
        return H.mul_(2.0 / self.tokens)


class CrossAccumulator:
    """Running float32 sum of x^T y over paired tokens, and the token count: 2/tokens sum x y^T, scaled as the
    Hessian (GPTQ's activation target: x the error x - q(x) of the quantized input q(x) a kernel multiplies, y
    that q(x)). `products` as `HessianAccumulator`'s: pairs already in bf16 multiplied as one bf16 GEMM."""

    def __init__(self, n: int, products: torch.dtype = torch.float32):
        self.n = n
        self.tokens = 0
        self.products = products
        self._sum: torch.Tensor | None = None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.shape != y.shape or x.shape[-1] != self.n:
            raise ValueError(f"paired inputs of shapes {tuple(x.shape)} and {tuple(y.shape)}; width {self.n} expected")
        xr, yr = x.detach().reshape(-1, self.n), y.detach().reshape(-1, self.n)
        if self._sum is None:
            self._sum = torch.zeros(self.n, self.n, dtype=torch.float32, device=xr.device)
        xr, yr = xr.to(self._sum.device), yr.to(self._sum.device)
        if xr.dtype == yr.dtype == self.products != torch.float32:
            self._sum.add_(xr.t() @ yr)
        else:
            self._sum.addmm_(xr.to(torch.float32).t(), yr.to(torch.float32))
        self.tokens += xr.shape[0]

    def reduce(self, sum_: "Callable[[torch.Tensor], torch.Tensor]") -> None:
        self.tokens = _reduce(self._sum, self.tokens, sum_)

    def take(self) -> torch.Tensor:
        """C = 2/tokens sum x y^T [n, n] (x's dimension first), in the accumulator's own memory (given up)."""
        if self.tokens == 0:
            raise ValueError("no tokens were added")
        C, self._sum = self._sum, None
        return C.mul_(2.0 / self.tokens)


def _reduce(total: "torch.Tensor | None", tokens: int, sum_: "Callable[[torch.Tensor], torch.Tensor]") -> int:
    """Sum a running total in place over the ranks (`sum_`, an all-reduce) and return the summed token count."""
    if total is None:
        raise ValueError("no tokens were added")
    sum_(total)
    count = torch.tensor([float(tokens)], dtype=torch.float64, device=total.device)
    return int(sum_(count).item())

"""How a projection's weight is stored and computed after quantisation: one class per form.

* `NBitsForm` (precision int8 / int4): ONNX Runtime's `MatMulNBits`, block-wise scales along K,
  activations untouched (or quantised per row and block at accuracy level 4);
* `RowsForm` (precision w8a8): 7-bit weight codes with a scale per column times each activation row
  quantised on its own, summed as integers (ortcompile/rows_product.py).

A form quantises one weight to a (codes, scales) pair, tells along which axes q/k/v (or gate/up) stack
into one weight, and writes the node that computes a projection from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_cli.ortcompile.transpose import transposed

SPLIT_ROWS = 2048  # weights with at least twice this many output rows are quantised in two halves at once


@dataclass(frozen=True)
class NBitsForm:
    bits: int
    block_size: int
    accuracy_level: int = 0

    @property
    def suffix(self) -> str:  # of the quantised tensors' names
        return f".w{self.bits}"

    @property
    def label(self) -> str:
        return f"int{self.bits}"

    stack_axes = (0, 0)  # packed [N, blocks, blob] and scales [N, blocks] stack along N

    def quantise(self, w: np.ndarray, transposed: bool) -> tuple[np.ndarray, np.ndarray, int, int]:
        if w.dtype not in (np.float32, np.float16):
            w = w.astype(np.float32)
        if transposed:  # [N, K], nn.Linear's layout
            N, K = w.shape
            packed, scales = quantize_rows(w, self.bits, self.block_size)
        else:
            K, N = w.shape
            packed, scales = quantize_kn(np.ascontiguousarray(w), self.bits, self.block_size)
        return packed, scales, K, N

    def node(self, x: str, outputs: list[str], name: str, tensors, K: int, N: int):
        from onnx import helper

        level = {"accuracy_level": self.accuracy_level} if self.accuracy_level else {}
        return helper.make_node(
            "MatMulNBits",
            [x, tensors[0].name, tensors[1].name],
            outputs,
            name=name + "_nbits",
            domain="com.microsoft",
            K=K,
            N=N,
            bits=self.bits,
            block_size=self.block_size,
            **level,
        )


@dataclass(frozen=True)
class RowsForm:
    suffix = ".w8a8"
    label = "w8a8"
    stack_axes = (1, 0)  # codes [K, N] stack along N (axis 1), scales [N] along their only axis

    def quantise(self, w: np.ndarray, transposed: bool) -> tuple[np.ndarray, np.ndarray, int, int]:
        from dflash_cli.ortcompile.rows_product import quantize_columns

        codes, scales = quantize_columns(w, transposed)
        K, N = codes.shape
        return codes, scales, K, N

    def node(self, x: str, outputs: list[str], name: str, tensors, K: int, N: int):
        from dflash_cli.ortcompile.rows_product import rows_node

        return rows_node(x, outputs, name + "_rows", tensors[0].name, tensors[1].name)


def quantize_rows(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`quantize_kn` of w.T for w [N, K]: large weights as two halves of N on two threads (the quantiser
    releases the GIL: 1.07 s instead of 1.57 s for a 151936 x 1024 lm_head here). Each output row is
    quantised on its own, so the halves concatenate to exactly the whole."""
    N = w.shape[0]
    if N < 2 * SPLIT_ROWS:
        return quantize_kn(transposed(w), bits, block_size)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        parts = (w[: N // 2], w[N // 2 :])
        halves = list(pool.map(lambda part: quantize_kn(transposed(part), bits, block_size), parts))
    return np.concatenate([h[0] for h in halves]), np.concatenate([h[1] for h in halves])


def quantize_kn(kn: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Runtime's own block quantiser (symmetric): packed [N, blocks, blob], scales [N, blocks]."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    K, N = kn.shape
    k_blocks = (K + block_size - 1) // block_size
    if K % block_size:
        kn = np.pad(kn, ((0, k_blocks * block_size - K), (0, 0)))
    blob = block_size * bits // 8
    packed = np.zeros((N, k_blocks, blob), dtype=np.uint8)
    scales = np.zeros((N, k_blocks), dtype=kn.dtype)
    zero_points = np.zeros((N, (k_blocks * bits + 7) // 8), dtype=np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, kn, scales, zero_points, block_size, N, K, True)
    return packed, scales

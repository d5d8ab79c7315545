"""Projection operands: every layout and chunking computes the same linear layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minengine.checkpoint.weight_layout import chunk_count, product, projection_operand


@pytest.mark.parametrize(
    "shapes",
    [
        [(96, 32)],  # wide: streamed rows, copied transposed
        [(32, 96)],  # tall: dot products over a view
        [(32, 32)],  # square
        [(48, 16), (16, 16), (16, 16)],  # q, k, v of unequal sizes, fused
        [(40, 16), (40, 16)],  # gate, up
    ],
)
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 5])
def test_operand_computes_the_stacked_linear_layer(shapes, chunks, rows):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) for shape in shapes]
    if sum(w.shape[0] for w in weights) % chunks:
        pytest.skip("chunks must divide the output size")
    x = torch.randn(rows, shapes[0][1], generator=g)
    bias = torch.randn(sum(w.shape[0] for w in weights), generator=g)
    reference = F.linear(x, torch.cat(weights), bias)
    operand = projection_operand(*weights, chunks=chunks)
    assert operand.shape == (chunks, shapes[0][1], sum(w.shape[0] for w in weights) // chunks)
    assert torch.allclose(product(operand, bias)(x), reference, atol=1e-5)
    # The chunks, side by side, are the columns of the output in order.
    assert torch.allclose(torch.cat(list(product(operand, bias).chunks(x)), dim=1), reference, atol=1e-5)


def test_operand_owns_its_memory():
    w = torch.randn(8, 32)
    for operand in (projection_operand(w, chunks=2), projection_operand(w.t().contiguous(), chunks=2)):
        assert operand.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_chunk_count_divides_the_output():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert chunk_count(96, torch.device("cpu")) == 4
        assert chunk_count(90, torch.device("cpu")) == 3
        assert chunk_count(97, torch.device("cpu")) == 1
        assert chunk_count(96, torch.device("meta")) == 1  # not a CPU: one chunk
    finally:
        torch.set_num_threads(threads)

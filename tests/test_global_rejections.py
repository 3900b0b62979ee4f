"""Global SPMD rejects the wrong versions of the equivalence programs, each with its SpmdTypeError."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _global_programs import DTYPE, full_spec, shard
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode

import spmd_types as spmd

I, P, R, S, V = spmd.I, spmd.P, spmd.R, spmd.S, spmd.V


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DTYPE)


# ---------------------------------------------------------------------------
# the wrong versions of these programs are rejected in global SPMD


def _wrong_programs():
    """(name, mesh axes, program(mk), message): ``mk(shape, types, pspec=None)`` makes a typed input."""

    def row_parallel_plain_linear(mk):
        h = F.gelu(F.linear(mk((8, 16), {"tp": R}), mk((32, 16), {"tp": S(0)})))
        F.linear(h, mk((16, 32), {"tp": S(1)})) + 1.0  # a pending sum used before anything claimed it

    def softmax_over_sharded_dim(mk):
        h = F.linear(mk((8, 16), {"tp": R}), mk((32, 16), {"tp": S(0)}))
        torch.softmax(h, -1)

    def bias_before_all_reduce(mk):
        y = spmd.linear(mk((8, 32), {"tp": S(1)}), mk((16, 32), {"tp": S(1)}), out_partial_axes="tp")
        y + mk((16,), {"tp": R})  # the bias would be added once per rank

    def sp_forgot_all_gather(mk):
        h = F.layer_norm(mk((8, 2, 16), {"tp": S(0)}), (16,))
        F.linear(h, mk((32, 16), {"tp": S(0)}))  # tp would shard both the sequence and the features

    def sp_layer_norm_over_sharded_hidden(mk):
        h = mk((8, 2, 16), {"tp": S(2)})
        F.layer_norm(h, h.shape[-1:])  # local sizes (the statistics would be per shard)

    def sp_residual_with_partial(mk):
        o = spmd.linear(mk((8, 2, 32), {"tp": S(2)}), mk((16, 32), {"tp": S(1)}), out_partial_axes="tp")
        mk((8, 2, 16), {"tp": S(0)}) + o  # forgot the reduce_scatter

    def attention_sequence_sharded_keys(mk):
        q = mk((2, 4, 8, 4), {"tp": S(2)})
        F.scaled_dot_product_attention(q, mk((2, 4, 8, 4), {"tp": S(2)}), mk((2, 4, 8, 4), {"tp": S(2)}))

    def attention_heads_sharded_only_in_q(mk):
        F.scaled_dot_product_attention(mk((2, 4, 6, 4), {"tp": S(1)}), mk((2, 4, 6, 4), {"tp": R}),
                                       mk((2, 4, 6, 4), {"tp": R}))

    def attention_merge_heads_without_transpose(mk):
        o = F.scaled_dot_product_attention(*(mk((2, 8, 6, 4), {"tp": S(1)}) for _ in range(3)))
        merged = o.reshape(2, 6, -1)  # heads are not the major dim of what it merges: tp lands on the sequence
        spmd.linear(merged, mk((16, 32), {"tp": S(1)}), out_partial_axes="tp")

    def out_projection_plain_linear(mk):
        torch.relu(F.linear(mk((2, 6, 32), {"tp": S(2)}), mk((16, 32), {"tp": S(1)})))  # unclaimed pending sum

    def loss_mean_over_sharded_batch(mk):
        F.cross_entropy(mk((8, 5), {"dp": S(0)}), mk((8,), {"dp": S(0)}, dtype=torch.long))

    def loss_plain_sum_over_sharded_batch(mk):
        F.cross_entropy(mk((8, 5), {"dp": S(0)}), mk((8,), {"dp": S(0)}, dtype=torch.long), reduction="none").sum() / 8

    def loss_class_sharded(mk):  # targets < 2 so the local op can run (see the xfail below)
        F.cross_entropy(mk((8, 8), {"dp": S(1)}), mk((8,), {"dp": R}, dtype=torch.long) % 2, reduction="none")

    def backward_from_replicated_loss(mk):
        w = mk((4,), {"dp": R}, grad=True)
        total = spmd.sum(mk((8, 4), {"dp": S(0)}) * w, out_partial_axes="dp")
        spmd.all_reduce(total, "dp", src=P, dst=R).backward()

    def gather_with_varying_src(mk):
        spmd.all_gather(mk((8, 4), {"dp": S(0)}), "dp", src=V, dst=R)

    def partial_times_partial(mk):
        a = spmd.sum(mk((8, 4), {"dp": S(0)}), 0, out_partial_axes="dp")
        a * a

    return [
        ("row_parallel_plain_linear", ("tp",), row_parallel_plain_linear, "sums over a sharded dim"),
        ("softmax_over_sharded_dim", ("tp",), softmax_over_sharded_dim, "mixes values along dim 1"),
        ("bias_before_all_reduce", ("tp",), bias_before_all_reduce, "A pending sum (P) can only be added"),
        ("sp_forgot_all_gather", ("tp",), sp_forgot_all_gather, "a mesh axis can shard only one dim"),
        ("sp_layer_norm_over_sharded_hidden", ("tp",), sp_layer_norm_over_sharded_hidden, "normalizes over dim 2"),
        ("sp_residual_with_partial", ("tp",), sp_residual_with_partial, "A pending sum (P) can only be added"),
        ("attention_sequence_sharded_keys", ("tp",), attention_sequence_sharded_keys, "the whole key sequence"),
        ("attention_heads_sharded_only_in_q", ("tp",), attention_heads_sharded_only_in_q,
         "shard their batch and head dims the same way"),
        ("attention_merge_heads_without_transpose", ("tp",), attention_merge_heads_without_transpose,
         "index 'k' is sharded on no axis in input but on 'tp' in weight"),
        ("out_projection_plain_linear", ("tp",), out_projection_plain_linear, "out_partial_axes='tp'"),
        ("loss_mean_over_sharded_batch", ("dp",), loss_mean_over_sharded_batch, "reduces only this rank's items"),
        ("loss_plain_sum_over_sharded_batch", ("dp",), loss_plain_sum_over_sharded_batch,
         "sums over a sharded dim"),
        ("loss_class_sharded", ("dp",), loss_class_sharded, "class-sharded cross-entropy"),
        ("backward_from_replicated_loss", ("dp",), backward_from_replicated_loss, "from a Replicate"),
        ("gather_with_varying_src", ("dp",), gather_with_varying_src, "has no global meaning"),
        ("partial_times_partial", ("dp",), partial_times_partial, "Partial"),
    ]


WRONG = _wrong_programs()


@pytest.mark.parametrize("name, axes, program, message", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_program_is_rejected(name, axes, program, message):
    mesh = fake_mesh((4,), axes)
    with LocalTensorMode(4) as lm, spmd.set_current_mesh(mesh), spmd.typecheck(local=False):
        def mk(shape, types, pspec=None, dtype=DTYPE, grad=False):
            sp = _spec_for(types, pspec, len(shape), axes)
            full = torch.randint(0, 5, shape) if dtype == torch.long else randn(*shape)
            lt = lm.rank_map(lambda r: shard(full, sp, mesh, r))
            if grad:
                lt.requires_grad_()
            return spmd.assert_type(lt, types, partition_spec=pspec)

        with pytest.raises(spmd.SpmdTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            program(mk)


def _spec_for(types, pspec, ndim, axes):
    return full_spec(types, pspec, ndim, axes)

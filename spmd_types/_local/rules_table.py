"""The typing-rules table for ordinary (non-communicating) torch ops, as data.

Each row classifies a family of ops by how they act on their tensor
arguments (seed 003, "Local SPMD"):

* ``NONLINEAR``: op(R..)->R, op(I..)->I, op(V..)->V, op(R, V)->V; P is rejected.
* ``LINEAR``: linear in the listed arguments *jointly* (a sum of terms), so
  P in every term gives P (``P + P -> P``, ``cat(P, P) -> P``, ``p.view() -> P``).
* ``MULTILINEAR``: linear in each listed argument *separately* (a product),
  so one P factor times R factors gives P (``P * R -> P``), never ``P * P``.
* ``PASSTHROUGH``: no value semantics (detach, requires_grad_): the type is kept.
* ``FACTORY``: ``*_like`` constructors: a fresh constant that keeps the
  input's type, except that a constant is never a pending sum (P -> R)
  unless it is zero.
* ``NEW``: ``x.new_zeros(size)`` and the other ``Tensor.new_*``: a tensor of
  its own shape that takes only dtype and device from ``x``: a constant, the
  same on every rank, R on every axis (as the published API has it).
* ``METADATA``: returns no tensor (shape, dtype, numel): not checked.

``terms`` spells the op's algebra: a sum of products of parameters. Every
parameter not in ``terms`` (and not ``ignored``) is a non-linear argument: it
may never be P, and must be R (or a constant) when the result is P.
An op missing from this table is treated as ``NONLINEAR``.

Two fields make linearity depend on an argument's value: ``linear_if_zero``
(the op is linear only when that argument is 0) and ``linear_if`` (only when
that argument is one of the listed values; a missing argument counts as None).
``zero_buffer`` names the tensor an op writes values into: when it holds only
zeros and carries no gradient, it is the identity of the sum, and the result
takes the type of the values written (``_checker/zero_buffers.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["RuleKind", "Row", "ROWS", "FOREACH_FORMS", "FUSED_OPTIMIZERS"]


class RuleKind(enum.Enum):
    NONLINEAR = "non-linear"
    LINEAR = "linear"
    MULTILINEAR = "multilinear"
    PASSTHROUGH = "passthrough"
    FACTORY = "factory"
    NEW = "new constant"
    METADATA = "metadata"


@dataclass(frozen=True)
class Row:
    """One family of ops sharing one rule."""

    names: tuple[str, ...]
    kind: RuleKind
    reason: str
    params: tuple[str, ...] = ("input", "other")
    terms: tuple[tuple[str, ...], ...] = ()
    ignored: tuple[str, ...] = ()
    linear_if_zero: str | None = None
    linear_if: tuple[str, tuple[object, ...]] | None = None
    zero_buffer: str | None = None


def op_variants(*bases: str, inplace: bool = True, torch_ns: bool = True, method: bool = True) -> tuple[str, ...]:
    """Spell the usual variants of each op: torch.X, Tensor.X and Tensor.X_.

    Generated names start with ``?``: a variant torch does not have is skipped.
    Names written out in full must exist.
    """
    out: list[str] = []
    for b in bases:
        if torch_ns:
            out.append(f"?torch.{b}")
        if method:
            out.append(f"?Tensor.{b}")
        if inplace:
            out.append(f"?Tensor.{b}_")
    return tuple(out)


_fam = op_variants
NL = RuleKind.NONLINEAR
LIN = RuleKind.LINEAR
ML = RuleKind.MULTILINEAR
UNARY = (("input",),)
# The rule of the rows that write values into a tensor (their zero_buffer), in the docs' words.
_INTO_ZEROS = (
    "into a buffer of zeros that carries no gradient (torch.zeros, zeros_like, new_zeros) the result is the "
    "values alone, so where the ordinary rule would refuse, it takes their type (P stays P, V stays V, R stays R, "
    "I stays I) whatever the buffer's; a plain buffer written in place becomes typed (unless another tensor shares "
    "its storage), a typed one keeps its type (an in-place op never changes it); a buffer that is not all zeros "
    "keeps the ordinary rule"
)
SUM2 = (("input",), ("other",))
PROD2 = (("input", "other"),)

ROWS: tuple[Row, ...] = (
    # ---- arithmetic -------------------------------------------------------
    Row(_fam("add", "sub", "subtract") + ("Tensor.__add__", "Tensor.__radd__", "Tensor.__iadd__",
        "Tensor.__sub__", "Tensor.__rsub__", "Tensor.__isub__", "torch.rsub"),
        LIN, "a sum distributes over the pending sum: (sum a) + (sum b) = sum (a + b)", terms=SUM2),
    Row(_fam("mul", "multiply") + ("Tensor.__mul__", "Tensor.__rmul__", "Tensor.__imul__"),
        ML, "a product is linear in each factor, not in both: (sum a) * (sum b) != sum (a * b)", terms=PROD2),
    Row(_fam("div", "divide", "true_divide") + ("Tensor.__truediv__", "Tensor.__itruediv__", "Tensor.__div__"),
        LIN, "x / y is linear in x only; the divisor is non-linear", terms=UNARY),
    Row(("Tensor.__rtruediv__", "Tensor.__rdiv__"),
        LIN, "y / x (reflected) is linear in y only; the divisor x is non-linear", terms=(("other",),)),
    Row(_fam("neg", "negative", "positive") + ("Tensor.__neg__", "Tensor.__pos__"),
        LIN, "negation is linear", terms=UNARY),
    Row(_fam("floor_divide", "remainder", "fmod", "pow", "float_power", "square", "abs", "sign", "sgn",
             "reciprocal", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
             "sin", "cos", "tan", "tanh", "sigmoid", "erf", "erfc", "floor", "ceil", "round", "trunc",
             "frac", "clamp", "clip", "clamp_min", "clamp_max", "maximum", "minimum", "fmax", "fmin",
             "relu", "nan_to_num", "lerp", "hypot", "atan2", "logaddexp", "xlogy", "addcmul", "addcdiv")
        + ("Tensor.__floordiv__", "Tensor.__rfloordiv__", "Tensor.__ifloordiv__", "Tensor.__mod__",
           "Tensor.__rmod__", "Tensor.__pow__", "Tensor.__rpow__", "Tensor.__ipow__", "Tensor.__abs__"),
        NL, "a non-linear function of its inputs does not distribute over a pending sum"),
    # ---- comparisons and logic -------------------------------------------
    Row(_fam("eq", "ne", "lt", "le", "gt", "ge", "greater", "less", "isclose", "logical_and",
             "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
             "bitwise_not", "isnan", "isinf", "isfinite", "isneginf", "isposinf")
        + ("torch.equal", "torch.allclose", "Tensor.allclose", "Tensor.equal",
           "Tensor.__eq__", "Tensor.__ne__", "Tensor.__lt__", "Tensor.__le__", "Tensor.__gt__",
           "Tensor.__ge__", "Tensor.__and__", "Tensor.__or__", "Tensor.__xor__", "Tensor.__invert__",
           "Tensor.__rand__", "Tensor.__ror__", "Tensor.__rxor__", "Tensor.__iand__", "Tensor.__ior__",
           "Tensor.__ixor__", "Tensor.__bool__"),
        NL, "a comparison of pending sums needs their totals"),
    Row(("Tensor.item", "Tensor.tolist", "Tensor.numpy", "Tensor.__float__", "Tensor.__int__",
         "Tensor.__index__", "Tensor.__complex__"),
        NL, "reading a value out of a pending sum would read one rank's share of it"),
    # ---- matrix products --------------------------------------------------
    Row(_fam("matmul", "mm", "bmm", "mv", "dot", "vdot", "outer", "ger", "inner", "kron", inplace=False)
        + ("Tensor.__matmul__", "Tensor.__rmatmul__", "torch.tensordot"),
        ML, "a matrix product is linear in each operand separately", terms=PROD2),
    Row(("Tensor.__iter__",), LIN, "iterating yields the rows: selecting elements is linear", terms=UNARY),
    Row(("torch.einsum",), ML, "an einsum is linear in each operand separately",
        params=("equation", "*operands"), terms=(("*operands",),)),
    Row(("F.linear",), ML, "x @ w.T + b: linear in x and in w separately; the bias is a separate term",
        params=("input", "weight", "bias"), terms=(("input", "weight"), ("bias",))),
    Row(("F.bilinear",), ML, "x1 @ W @ x2 + b: linear in x1, W and x2 separately; the bias is a separate term",
        params=("input1", "input2", "weight", "bias"), terms=(("input1", "weight", "input2"), ("bias",))),
    Row(_fam("addmm", "addbmm", "baddbmm", "addmv", "addr"),
        ML, "beta * b + a1 @ a2: the bias term plus a product linear in each factor (one product; its factors' "
        "keyword names differ per op: mat1/mat2, mat/vec, vec1/vec2, batch1/batch2)",
        params=("input", "mat1", "mat2"),
        terms=(("input",), ("mat1", "mat2"), ("mat", "vec"), ("vec1", "vec2"), ("batch1", "batch2"))),
    # ---- reductions -------------------------------------------------------
    Row(_fam("sum", "mean", "cumsum", "trace", "diff", inplace=False) + ("Tensor.cumsum_",),
        LIN, "a sum or mean of a pending sum is the pending sum of the local sums", terms=UNARY),
    Row(_fam("amax", "amin", "max", "min", "aminmax", "prod", "cumprod", "std", "var", "std_mean",
             "var_mean", "norm", "logsumexp", "argmax", "argmin", "median", "nanmean", "nansum",
             "topk", "sort", "argsort", "any", "all", "count_nonzero", "cummax", "cummin", "logcumsumexp",
             inplace=False) + ("torch.linalg.vector_norm", "torch.linalg.norm", "torch.linalg.matrix_norm"),
        NL, "max, norms and other non-linear reductions need the totals, not the local values"),
    # ---- shape, view and indexing ----------------------------------------
    Row(_fam("view", "reshape", "permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis",
             "t", "contiguous", "expand", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow",
             "select", "repeat", "tile", "roll", "flip", "fliplr", "flipud", "rot90", "diagonal",
             "diag", "diag_embed", "tril", "triu", "clone", "split", "chunk", "unbind", "tensor_split",
             "hsplit", "vsplit", "dsplit", "split_with_sizes", "unfold", "ravel", "squeeze_copy",
             "broadcast_to", "repeat_interleave", "as_strided", "real", "imag", "view_as_real",
             "view_as_complex", "conj", "resolve_conj", "resolve_neg", "atleast_1d", "atleast_2d",
             "atleast_3d", "zero")
        + ("Tensor.T", "Tensor.mT", "Tensor.H", "Tensor.mH"),
        LIN, "moving, copying or selecting elements is linear", terms=UNARY),
    Row(("Tensor.__getitem__",), LIN, "selecting elements is linear in the data; an index tensor is non-linear",
        params=("input", "index"), terms=UNARY),
    Row(("Tensor.view_as", "Tensor.reshape_as", "Tensor.expand_as", "Tensor.type_as"),
        LIN, "linear in the input; the other tensor only gives a shape or dtype",
        terms=UNARY, ignored=("other",)),
    Row(("Tensor.__setitem__",), LIN, "x[i] = v: the result is linear in x and v jointly; " + _INTO_ZEROS,
        params=("input", "index", "value"), terms=(("input",), ("value",)), zero_buffer="input"),
    Row(_fam("index_select", "gather", "take_along_dim", "take", inplace=False),
        LIN, "selecting by an index is linear in the data; the index is non-linear",
        params=("input", "dim", "index"), terms=UNARY),
    Row(_fam("index_add", "scatter_add"),
        LIN, "adding values at indices is linear in the destination and the values jointly (the values are "
        "spelled source or src, depending on the op); " + _INTO_ZEROS,
        params=("input", "dim", "index", "source"), terms=(("input",), ("source",), ("src",)),
        zero_buffer="input"),
    Row(_fam("index_copy", "scatter"),
        LIN, "writing values at indices is linear in the destination and the values jointly (the values are "
        "spelled source, src or value, depending on the op), and so is scatter's reduce='add'; "
        "reduce='multiply' multiplies the destination by the values, which is not linear in both; " + _INTO_ZEROS,
        params=("input", "dim", "index", "source"), terms=(("input",), ("source",), ("src",), ("value",)),
        linear_if=("reduce", (None, "add")), zero_buffer="input"),
    Row(_fam("index_put", "masked_scatter") + ("torch.index_put_",),
        LIN, "writing values at indices, or adding them (accumulate=True), is linear in the destination and the "
        "values jointly (the values are spelled source or values, depending on the op); " + _INTO_ZEROS,
        params=("input", "index", "source"), terms=(("input",), ("source",), ("values",)), zero_buffer="input"),
    Row(_fam("scatter_reduce"),
        LIN, "reduce='sum' adds values at indices, with or without the destination's own entries "
        "(include_self): linear in the destination and the values jointly; 'amax', 'amin' and 'prod' are "
        "not linear, and 'mean' is classed non-linear too (it rounds for integer dtypes); " + _INTO_ZEROS,
        params=("input", "dim", "index", "src", "reduce", "include_self"), terms=(("input",), ("src",)),
        linear_if=("reduce", ("sum",)), zero_buffer="input"),
    Row(_fam("cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
             inplace=False, method=False),
        LIN, "concatenation is linear in all its inputs jointly", params=("tensors",), terms=(("tensors",),)),
    Row(("Tensor.copy_",), LIN, "x.copy_(y) overwrites x with y: the result is linear in y",
        params=("input", "src"), terms=(("src",),), ignored=("input",)),
    Row(("torch.where",), LIN,
        "where(c, a, b) is linear in a and b jointly; the condition is non-linear",
        params=("condition", "input", "other"), terms=(("input",), ("other",))),
    Row(("Tensor.where",), LIN,
        "a.where(c, b) is linear in a and b jointly; the condition is non-linear",
        params=("input", "condition", "other"), terms=(("input",), ("other",))),
    Row(_fam("masked_fill"), LIN,
        "filling with zero is linear in the input; filling with any other value is not",
        params=("input", "mask", "value"), terms=UNARY, linear_if_zero="value"),
    Row(("F.pad",), LIN, "padding with zero is linear in the input; padding with any other value is not",
        params=("input", "pad", "mode", "value"), terms=UNARY, linear_if_zero="value"),
    # ---- dtype and device -------------------------------------------------
    Row(("Tensor.to", "Tensor.float", "Tensor.double", "Tensor.half", "Tensor.bfloat16", "Tensor.int",
         "Tensor.long", "Tensor.bool", "Tensor.type", "Tensor.cpu", "Tensor.cuda", "Tensor.pin_memory"),
        LIN, "a cast or copy is linear (up to rounding)", terms=UNARY),
    # ---- neural network functions ----------------------------------------
    Row(("F.embedding",), LIN, "a lookup is linear in the table; the indices are non-linear",
        params=("input", "weight"), terms=(("weight",),)),
    Row(("F.scaled_dot_product_attention",), LIN,
        "softmax(q k^T) v is linear in v only; q, k and the mask are non-linear",
        params=("query", "key", "value", "attn_mask"), terms=(("value",),)),
    Row(("F.layer_norm", "F.rms_norm", "F.group_norm", "F.batch_norm", "F.instance_norm",
         "F.normalize", "F.local_response_norm"),
        NL, "normalization divides by a statistic of the input"),
    Row(("F.gelu", "F.silu", "F.relu", "F.relu6", "F.elu", "F.selu", "F.celu", "F.leaky_relu",
         "F.mish", "F.softplus", "F.softsign", "F.hardtanh", "F.hardswish", "F.hardsigmoid",
         "F.logsigmoid", "F.tanhshrink", "F.softshrink", "F.hardshrink", "F.glu", "F.threshold",
         "F.sigmoid", "F.tanh", "F.relu_")
        + _fam("softmax", "log_softmax", inplace=False) + ("F.softmax", "F.log_softmax", "F.softmin"),
        NL, "an activation is a non-linear function"),
    Row(("F.dropout", "F.dropout1d", "F.dropout2d", "F.dropout3d", "F.alpha_dropout",
         "F.feature_alpha_dropout", "torch.dropout", "torch.bernoulli", "Tensor.bernoulli",
         "Tensor.bernoulli_"),
        NL, "each rank draws its own random mask, so the masked sum is not the mask of the sum"),
    Row(("F.cross_entropy", "F.nll_loss", "F.mse_loss", "F.l1_loss", "F.smooth_l1_loss", "F.huber_loss",
         "F.binary_cross_entropy", "F.binary_cross_entropy_with_logits", "F.kl_div", "F.cosine_similarity"),
        NL, "a loss is a non-linear function of its inputs", params=("input", "target", "weight")),
    # ---- type-preserving without value semantics --------------------------
    Row(("Tensor.detach", "Tensor.detach_", "Tensor.requires_grad_", "Tensor.retain_grad",
         "Tensor.share_memory_", "Tensor.data"),
        RuleKind.PASSTHROUGH, "no value semantics: the type is kept", terms=UNARY),
    # ---- factories --------------------------------------------------------
    Row(("torch.zeros_like", "torch.empty_like"),
        RuleKind.FACTORY, "a zero constant is a valid value of every type, a pending sum included",
        terms=UNARY),
    Row(("torch.ones_like", "torch.full_like", "torch.rand_like", "torch.randn_like", "torch.randint_like"),
        RuleKind.FACTORY, "a constant is the same on every rank: it keeps the input's type, but a "
        "pending sum (P) becomes R", params=("input", "fill_value"), terms=UNARY, linear_if_zero="fill_value"),
    Row(("Tensor.new_zeros", "Tensor.new_empty", "Tensor.new_ones", "Tensor.new_full", "Tensor.new_tensor"),
        RuleKind.NEW, "x.new_*(size): a new constant of its own shape (only dtype and device come from x), the same "
        "on every rank: R", params=("input",), terms=UNARY),
    # ---- metadata: no tensor result ---------------------------------------
    Row(("Tensor.size", "Tensor.dim", "Tensor.numel", "Tensor.nelement", "Tensor.stride",
         "Tensor.storage_offset", "Tensor.data_ptr", "Tensor.element_size", "Tensor.is_contiguous",
         "Tensor.is_floating_point", "Tensor.is_complex", "Tensor.__len__", "Tensor.shape", "Tensor.dtype",
         "Tensor.device", "Tensor.ndim", "Tensor.layout", "Tensor.is_leaf", "Tensor.requires_grad",
         "Tensor.grad_fn", "?Tensor.names", "Tensor.is_cuda", "Tensor.is_meta", "Tensor.is_sparse",
         "Tensor.is_quantized", "Tensor.output_nr", "Tensor._version", "Tensor.untyped_storage",
         "Tensor.__hash__", "Tensor.register_hook", "Tensor.register_post_accumulate_grad_hook",
         "Tensor.get_device", "Tensor.is_shared", "Tensor.is_pinned", "Tensor.is_inference",
         "Tensor.itemsize", "Tensor.nbytes", "Tensor.__format__", "Tensor.__dlpack_device__",
         "Tensor._is_view", "Tensor._base", "Tensor.is_nested", "Tensor.__reduce_ex__",
         "Tensor.__deepcopy__", "Tensor.storage", "Tensor._typed_storage", "Tensor.__array__",
         "Tensor.__contains__", "torch.is_tensor", "torch.is_floating_point", "torch.numel",
         "Tensor.__setstate__", "?Tensor.is_cpu", "?Tensor.is_xpu", "?Tensor.is_mps", "?Tensor.is_mtia",
         "?Tensor.is_maia", "?Tensor.is_ipu", "?Tensor.is_xla", "?Tensor.is_vulkan", "?Tensor.is_mkldnn",
         "?Tensor.is_sparse_csr", "?Tensor.retains_grad", "?Tensor.name", "?Tensor.volatile",
         "?Tensor._backward_hooks", "?Tensor._post_accumulate_grad_hooks", "?Tensor._cdata",
         "?Tensor.__cuda_array_interface__", "?Tensor.grad_dtype"),
        RuleKind.METADATA, "returns no tensor value: nothing to type"),
    Row(("Tensor.grad", "?Tensor._grad", "Tensor.grad.__set__", "?Tensor._grad.__set__", "Tensor.data.__set__",
         "Tensor.requires_grad.__set__", "?Tensor.grad_dtype.__set__", "?Tensor.retains_grad.__set__",
         "?Tensor._backward_hooks.__set__", "?Tensor.name.__set__"),
        RuleKind.METADATA, "reads or sets autograd state: a stored gradient keeps the type it was given "
        "(the backward type of its tensor's), and setting an attribute computes nothing"),
)

# ---- multi-tensor kernels ------------------------------------------------------
# torch._foreach_X(lists...) runs one op per element: element i is checked as the
# op's single-tensor form on element i of every list argument (a Python number or a
# single tensor is shared by all elements), so it gets that form's row above. The
# single form of torch._foreach_X_ is Tensor.X_ (torch.X, in place, where Tensor has
# no X_), of torch._foreach_X it is torch.X; these are the exceptions:
FOREACH_FORMS: dict[str, str] = {
    "_foreach_norm": "torch.linalg.vector_norm",
    "_foreach_max": "torch.amax",
}

# The fused optimizer kernels update every parameter in place from its gradient and
# its optimizer state: one non-linear function of all of them per parameter, whose
# result must keep the parameter's type (a P gradient gets the error naming the
# parameter and the missing gradient sync).
FUSED_OPTIMIZERS = Row(
    ("torch._fused_sgd_", "torch._fused_adam_", "torch._fused_adamw_", "?torch._fused_adagrad_"),
    NL, "an optimizer update is a non-linear function of the parameter, its gradient and its state; "
    "it writes the parameter in place, so it cannot change the parameter's type",
    params=("param", "grad", "state"),
)

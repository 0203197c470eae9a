"""Run a saved `.mlpackage` on Linux: reload it into a MIL program and interpret it with numpy.

Covers exactly the ops `coreml_export` emits (after coremltools' default passes). Each op computes
in float32 and rounds its result to the dtype the program declares for it, so fp16 storage of
activations and KV states is reproduced; accumulation is fp32 (as on Apple GPUs/ANE).
`exact_products=True` accumulates matmul/linear in float64 and rounds to float32 instead: each
element is then the same whatever the shape it is computed in, where numpy's BLAS sums in an
order that depends on the rows (one fp16 rounding flip moves a log-prob by ~2e-3), so a test can
tell padding logic from summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from converters.manifest import read_package_spec

_DTYPES = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "bool": np.bool_}


def load_program(package: str | Path):
    """The MIL program of a saved `.mlpackage`, via coremltools' milproto loader."""
    from coremltools.converters.mil.frontend.milproto.load import load

    package = Path(package)
    spec = read_package_spec(package)
    weights = package / "Data" / "com.apple.CoreML" / "weights"
    return load(spec, spec.specificationVersion, file_weights_dir=str(weights))


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in np.atleast_1d(values))


def _expand_dims(x: np.ndarray, axes) -> np.ndarray:
    rank = x.ndim + len(axes)
    for axis in sorted(a % rank for a in _ints(axes)):
        x = np.expand_dims(x, axis)
    return x


def _slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    rank = x.ndim
    stride = stride if stride is not None else [1] * rank
    begin_mask = begin_mask if begin_mask is not None else [False] * rank
    end_mask = end_mask if end_mask is not None else [False] * rank
    index = tuple(
        slice(
            None if begin_mask[d] else int(begin[d]),
            None if end_mask[d] else int(end[d]),
            int(stride[d]),
        )
        for d in range(rank)
    )
    out = x[index]
    if squeeze_mask is not None and any(squeeze_mask):
        out = out.squeeze(axis=tuple(d for d in range(rank) if squeeze_mask[d]))
    return out


def _softmax(x, axis):
    x = _f32(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _matmul(x, y, transpose_x=False, transpose_y=False):
    x, y = _f32(x), _f32(y)
    return (np.swapaxes(x, -1, -2) if transpose_x else x) @ (
        np.swapaxes(y, -1, -2) if transpose_y else y
    )


def _linear(x, weight, bias=None):
    out = _f32(x) @ _f32(weight).T
    return out if bias is None else out + _f32(bias)


def _matmul_exact(x, y, transpose_x=False, transpose_y=False):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    out = (np.swapaxes(x, -1, -2) if transpose_x else x) @ (
        np.swapaxes(y, -1, -2) if transpose_y else y
    )
    return out.astype(np.float32)


def _linear_exact(x, weight, bias=None):
    out = (np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T).astype(np.float32)
    return out if bias is None else out + _f32(bias)


_EXACT: dict[str, Callable[..., np.ndarray]] = {"matmul": _matmul_exact, "linear": _linear_exact}

_OPS: dict[str, Callable[..., np.ndarray]] = {
    "add": lambda x, y: _f32(x) + _f32(y),
    "sub": lambda x, y: _f32(x) - _f32(y),
    "mul": lambda x, y: _f32(x) * _f32(y),
    "real_div": lambda x, y: _f32(x) / _f32(y),
    "maximum": lambda x, y: np.maximum(x, y),
    "equal": lambda x, y: np.equal(x, y),
    "greater": lambda x, y: np.greater(x, y),
    "greater_equal": lambda x, y: np.greater_equal(x, y),
    "select": lambda cond, a, b: np.where(cond, a, b),
    "cast": lambda x, dtype: x.astype(_DTYPES[dtype]),
    "rsqrt": lambda x, epsilon=1e-12: 1.0 / np.sqrt(_f32(x) + np.float32(epsilon)),
    "silu": lambda x: _f32(x) / (1.0 + np.exp(-_f32(x))),
    "softmax": lambda x, axis: _softmax(x, int(axis)),
    "reduce_mean": lambda x, axes, keep_dims=False: _f32(x).mean(
        axis=_ints(axes), keepdims=bool(keep_dims)
    ),
    "reduce_max": lambda x, axes, keep_dims=False: x.max(
        axis=_ints(axes), keepdims=bool(keep_dims)
    ),
    "gather": lambda x, indices, axis=0, batch_dims=0, validate_indices=False: np.take(
        x, indices, axis=int(axis)
    ),
    "reshape": lambda x, shape: x.reshape([int(s) for s in shape]),
    "transpose": lambda x, perm: np.transpose(x, [int(p) for p in perm]),
    "expand_dims": _expand_dims,
    "slice_by_index": _slice_by_index,
    "concat": lambda values, axis, interleave=False: np.concatenate(values, axis=int(axis)),
    "matmul": _matmul,
    "linear": _linear,
}


class MilInterpreter:
    """A stateful numpy runner for one package: `predict` carries the KV states across calls."""

    def __init__(self, package_path: str | Path, exact_products: bool = False):
        self.ops = {**_OPS, **_EXACT} if exact_products else _OPS
        program = load_program(package_path)
        self.function = program.functions["main"]
        self.state: dict[str, np.ndarray] = {}
        self.reset_state()

    def reset_state(self) -> None:
        """Zero every state tensor (what `MLModel.make_state()` hands out)."""
        from coremltools.converters.mil.mil import types

        for name, var in self.function.inputs.items():
            if types.is_state(var.sym_type):
                wrapped = var.sym_type.wrapped_type()
                dtype = types.nptype_from_builtin(wrapped.get_primitive())
                self.state[name] = np.zeros(wrapped.get_shape(), dtype=dtype)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the program once on `inputs`; returns its outputs by name."""
        from coremltools.converters.mil.mil import types

        env: dict[str, np.ndarray] = {k: np.asarray(v) for k, v in inputs.items()}

        def value(var):
            if isinstance(var, (list, tuple)):
                return [value(v) for v in var]
            if var.name in env:
                return env[var.name]
            if var.val is not None:
                return var.val
            raise KeyError(f"no value for {var.name!r} (missing input?)")

        for op in self.function.operations:
            out = op.outputs[0]
            if op.op_type == "const":
                continue
            if op.op_type == "read_state":
                result = self.state[op.inputs["input"].name]
            elif op.op_type == "coreml_update_state":
                result = value(op.inputs["value"])
                self.state[op.inputs["state"].name] = result
            elif op.op_type in self.ops:
                args = {k: value(v) for k, v in op.inputs.items()}
                result = self.ops[op.op_type](**args)
            else:
                raise NotImplementedError(f"MIL op {op.op_type!r} is not interpreted")
            dtype = types.nptype_from_builtin(out.dtype)
            env[out.name] = np.asarray(result).astype(dtype, copy=False)
        return {var.name: env[var.name] for var in self.function.outputs}

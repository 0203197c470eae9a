"""The Core ML engine on Linux: `CoreMLEngine` over the project's numpy MIL interpreter.

`InterpretedModel` has the face of coremltools' `MLModel` that the engine uses
(`user_defined_metadata`, `make_state()`, `predict(inputs, state=)`), computed by
`converters.mil_interp` (each op in float32, rounded to the dtype the graph declares: fp16
weights, activations and KV states as on the device). Like Core ML it refuses a query length
that is not one of the export's enumerated shapes, so the engine's padding is checked too.
Products are accumulated exactly (float64, rounded to float32; `exact_products`), so a row's
results do not depend on the rows and padding beside it: what differs then is the engine's
doing. With float32 accumulation, numpy's BLAS sums in a row-count-dependent order and a padded
scoring chunk differs from the same prompt alone by up to ~2e-3 in a log-prob (one fp16
rounding flip; measured on the tiny qwen3 export); Core ML's own order is for a Mac to show.
What it cannot show: Core ML's own kernels, the ANE/GPU arithmetic and its speed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.manifest import read_package_spec
from converters.mil_interp import MilInterpreter
from llm_server.engines.coreml.engine import CoreMLEngine, _package_of


class InterpretedModel:
    """An exported `.mlpackage` run by the MIL interpreter, one state per `make_state()`."""

    def __init__(self, package: str | Path, exact_products: bool = True) -> None:
        self._interp = MilInterpreter(package, exact_products=exact_products)
        spec = read_package_spec(package)
        self.user_defined_metadata = dict(spec.description.metadata.userDefined)
        shapes = spec.description.input[0].type.multiArrayType.enumeratedShapes.shapes
        self.q_sizes = {int(s.shape[1]) for s in shapes}
        self.calls: list[tuple[int, int]] = []  # (rows, q) of every predict, in order

    def make_state(self) -> dict[str, np.ndarray]:
        self._interp.state = {}
        self._interp.reset_state()
        return self._interp.state

    def predict(self, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> dict:
        rows, q = inputs["input_ids"].shape
        if q not in self.q_sizes:
            raise RuntimeError(f"input_ids shape ({rows}, {q}) is not an enumerated shape")
        self.calls.append((rows, q))
        self._interp.state = state  # predict writes the updated K/V into this dict
        return self._interp.predict(inputs)


def interpreted_engine(model_path: str | Path, exact_products: bool = True) -> CoreMLEngine:
    """`CoreMLEngine` serving `model_path` (a package or a folder holding one) on any platform."""
    package = _package_of(Path(model_path))
    return CoreMLEngine(package, model=InterpretedModel(package, exact_products))

"""Per-model Prometheus gauges for a many-model daemon (labelled by model id)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llm_server.models.manager import ModelManager
from llm_server.models.memory import rss_bytes
from llm_server.models.slots import Status


class ModelsCollector(Collector):
    """Each model's status, size, rows and queue; the budget and resident memory."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "loaded": GaugeMetricFamily(
                "llm_server_model_loaded", "1 while the model is loaded", labels=["model"]
            ),
            "bytes": GaugeMetricFamily(
                "llm_server_model_bytes",
                "bytes the model counts against the budget",
                labels=["model"],
            ),
            "active": GaugeMetricFamily(
                "llm_server_model_active_requests", "requests holding the model", labels=["model"]
            ),
            "busy": GaugeMetricFamily(
                "llm_server_model_rows_busy", "rows decoding a request now", labels=["model"]
            ),
            "queued": GaugeMetricFamily(
                "llm_server_model_queue_length", "requests waiting for a row", labels=["model"]
            ),
        }
        for model_id, slot in self.manager.slots.items():
            loaded = slot.status is Status.LOADED and slot.service is not None
            stats = slot.service.scheduler.stats() if loaded else None
            families["loaded"].add_metric([model_id], 1 if loaded else 0)
            families["bytes"].add_metric([model_id], slot.counted)
            families["active"].add_metric([model_id], slot.active)
            families["busy"].add_metric([model_id], stats.rows_busy if stats else 0)
            families["queued"].add_metric([model_id], stats.queued if stats else 0)
        yield from families.values()
        held = {mid: h.as_dict() for mid, h in self.manager.budget.held().items()}
        yield held_bytes_family(held)
        yield GaugeMetricFamily(
            "llm_server_memory_budget_bytes",
            "the models' memory budget",
            value=self.manager.config.budget,
        )
        yield GaugeMetricFamily(
            "llm_server_memory_used_bytes",
            "bytes the loaded models count",
            value=self.manager.used(),
        )
        yield GaugeMetricFamily("llm_server_resident_bytes", "process RSS", value=rss_bytes())


def held_bytes_family(held: dict[str, dict[str, int]]) -> GaugeMetricFamily:
    """`llm_server_held_bytes{kind}` (with a `model` label when `held` is keyed by model
    ids): the bytes the memory budget counts, as allocated."""
    labelled = any(held)
    labels = ["model", "kind"] if labelled else ["kind"]
    family = GaugeMetricFamily(
        "llm_server_held_bytes",
        "bytes held now by kind (weights, kv, prefix_cache, total): what the budget counts",
        labels=labels,
    )
    for model_id, kinds in held.items():
        for kind, value in kinds.items():
            family.add_metric([model_id, kind] if labelled else [kind], value)
    return family

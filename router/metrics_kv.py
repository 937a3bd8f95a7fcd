"""The KV-events index and streams per engine, as Prometheus metrics read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.engines.kv_watch import KvEvents


class KvEventsCollector(Collector):
    """Per engine: the index's blocks and sync, the stream's lag, batches, gaps, replays."""

    def __init__(self, kv: KvEvents) -> None:
        self._kv = kv

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        lab = ["instance"]
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "blocks": GaugeMetricFamily(
                "kvbaton_kv_index_blocks", "Blocks the KV-events index holds per engine", labels=lab
            ),
            "sync": GaugeMetricFamily(
                "kvbaton_kv_index_in_sync",
                "1 while the engine's index follows its event stream (0: claims nothing)",
                labels=lab,
            ),
            "lag": GaugeMetricFamily(
                "kvbaton_kv_events_lag_seconds",
                "Receive time minus the engine's timestamp of its last event batch",
                labels=lab,
            ),
            "events": CounterMetricFamily(
                "kvbaton_kv_events", "KV events applied per engine", labels=lab
            ),
            "batches": CounterMetricFamily(
                "kvbaton_kv_event_batches", "KV event batches applied per engine", labels=lab
            ),
            "gaps": CounterMetricFamily(
                "kvbaton_kv_event_gaps", "Sequence gaps seen per engine's stream", labels=lab
            ),
            "replays": CounterMetricFamily(
                "kvbaton_kv_event_replayed_batches",
                "Batches applied from the engine's replay socket",
                labels=lab,
            ),
            "silent": GaugeMetricFamily(
                "kvbaton_kv_events_warning",
                "1 while the engine's KV events look wrong: nothing published while turns ran "
                "on it, or no replay answered (/status says which)",
                labels=lab,
            ),
            "rebuilds": CounterMetricFamily(
                "kvbaton_kv_index_rebuilds",
                "Index cleared: events lost for good (gap replay could not fill) or a restart",
                labels=lab,
            ),
        }
        for url, sub in self._kv.subscribers.items():
            c = sub.counts
            fams["blocks"].add_metric([url], float(sub.index.blocks))
            fams["sync"].add_metric([url], 0.0 if sub.index.stale else 1.0)
            fams["lag"].add_metric([url], c.lag)
            fams["events"].add_metric([url], float(c.events))
            fams["batches"].add_metric([url], float(c.batches))
            fams["gaps"].add_metric([url], float(c.gaps))
            fams["replays"].add_metric([url], float(c.replays))
            fams["rebuilds"].add_metric([url], float(c.rebuilds))
            fams["silent"].add_metric([url], 1.0 if sub.warning else 0.0)
        yield from fams.values()

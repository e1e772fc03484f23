"""Reading a gateway's Prometheus metrics over HTTP, the way an operator's scraper does.

For a gateway in this process, read its registry instead
(``gateway.metrics.registry.get_sample_value``): no HTTP, and no parse.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tests.support import local_http

__all__ = ["Scrape", "metric", "scrape"]

_Key = tuple[str, frozenset[tuple[str, str]]]


@dataclass(frozen=True)
class Scrape:
    """One scrape of /metrics: every sample by name and label set."""

    samples: dict[_Key, float]

    def value(self, name: str, *, default: float | None = None, **labels: str) -> float:
        """``name``'s value summed over the samples carrying ``labels`` (whatever their other
        labels, such as a call metric's ``line``). No such sample: ``default`` where given (a
        labelled series not created yet), else AssertionError."""
        wanted = set(labels.items())
        found = [value for (sample, sample_labels), value in self.samples.items()
                 if sample == name and wanted <= sample_labels]
        if not found:
            assert default is not None, f"{name}{labels or ''} not in /metrics"
            return default
        return sum(found)


def scrape(base_url: str, timeout: float = 10.0) -> Scrape:
    """GET ``base_url``/metrics and parse it with prometheus-client's own parser."""
    text = local_http.get(f"{base_url}/metrics", timeout=timeout).text
    return Scrape({(sample.name, frozenset(sample.labels.items())): sample.value
                   for family in text_string_to_metric_families(text)
                   for sample in family.samples})


def metric(base_url: str, name: str, *, default: float | None = None, **labels: str) -> float:
    """One scrape's :meth:`Scrape.value`."""
    return scrape(base_url).value(name, default=default, **labels)

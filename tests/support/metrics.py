"""Scraping /metrics as Prometheus would: the text parsed with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, text: str):
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples = {
            (s.name, frozenset(s.labels.items())): s.value for family in self.families.values() for s in family.samples
        }

    def value(self, name: str, **labels) -> float:
        """A sample's value; 0 when the series does not exist (yet)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)


def scrape(client, **extra) -> Scrape:
    response = client.get("/metrics", **extra)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return Scrape(response.content.decode())

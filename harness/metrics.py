"""Prometheus text exposition, as the router and the engines serve it on /metrics."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    key: str  # `name{labels}` as sent (label order kept)


def parse(text: str) -> list[Sample]:
    """Every sample line of a /metrics body (comments and unparsable lines skipped)."""
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        found.append(Sample(match.group(1), labels, value, match.group(1) + (match.group(2) or "")))
    return found


def matching(text: str, name: str, **labels: str) -> list[Sample]:
    """The samples of metric `name` whose labels include all of `labels`."""
    return [
        s
        for s in parse(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` with these labels (0 when there is none)."""
    return sum(s.value for s in matching(text, name, **labels))


def scrape(url: str, timeout: float = 5.0) -> str:
    """The /metrics body of the instance at url."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
        text: str = resp.read().decode()
    return text


def metric(url: str, name: str, *, timeout: float = 5.0, **labels: str) -> float:
    """Sum of a Prometheus sample on an instance's /metrics, filtered by labels."""
    return total(scrape(url, timeout), name, **labels)


def samples(url: str, timeout: float = 5.0) -> dict[str, float]:
    """An instance's /metrics as {'name{labels}': value} (label order as sent)."""
    return {s.key: s.value for s in parse(scrape(url, timeout))}

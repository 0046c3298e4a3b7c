"""One /metrics for many replicas: every replica's series with a `replica` label, and the totals
under the original names and labels (so a dashboard or `bench` written for one server reads the
sum of all of them).

Totals: counters and histograms are summed, and so are gauges, except the `*_perc` ones (averaged)
and `degraded` (the maximum). A replica that is gone (Ray replaced it) keeps its last counters
and histograms in the totals, so they never go backwards when a replica dies; what it counted
after its last scrape is lost, as it would be for Prometheus scraping it directly.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted labels


def parse(text: str) -> dict[str, tuple[str, str, dict[Key, float]]]:
    """family name -> (type, help, {sample key: value}); `_created` timestamps dropped."""
    out = {}
    for fam in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples
                   if not s.name.endswith("_created")}
        out[fam.name] = (fam.type, fam.documentation, samples)
    return out


def _cumulative(kind: str) -> bool:
    return kind in ("counter", "histogram", "summary")


class ReplicaMetrics:
    def __init__(self) -> None:
        self.last: dict[str, dict] = {}  # replica -> its last parsed scrape
        self.retired: dict[str, tuple[str, str, dict[Key, float]]] = {}  # departed replicas' cumulative samples

    def update(self, scraped: dict[str, str | None]) -> None:
        """`scraped`: every replica the ingress knows -> its /metrics text (None: its scrape failed
        this time, keep its last one). Replicas missing from it are gone: retired."""
        for gone in set(self.last) - set(scraped):
            for name, (kind, doc, samples) in self.last.pop(gone).items():
                if _cumulative(kind):
                    acc = self.retired.setdefault(name, (kind, doc, {}))[2]
                    for key, value in samples.items():
                        acc[key] = acc.get(key, 0.0) + value
        for replica, text in scraped.items():
            if text is not None:
                self.last[replica] = parse(text)

    def render(self) -> str:
        families: dict[str, tuple[str, str]] = {}
        for parsed in [*self.last.values(), self.retired]:
            for name, (kind, doc, _) in parsed.items():
                families.setdefault(name, (kind, doc))
        lines = []
        for name, (kind, doc) in families.items():
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            for replica, parsed in sorted(self.last.items()):
                for (sample, labels), value in parsed.get(name, ("", "", {}))[2].items():
                    lines.append(_line(sample, (*labels, ("replica", replica)), value))
            for (sample, labels), value in self._totals(name, kind).items():
                lines.append(_line(sample, labels, value))
        return "\n".join(lines) + "\n"

    def _totals(self, name: str, kind: str) -> dict[Key, float]:
        values: dict[Key, list[float]] = defaultdict(list)
        for parsed in self.last.values():
            for key, value in parsed.get(name, ("", "", {}))[2].items():
                values[key].append(value)
        if kind == "gauge":
            pick = max if name.endswith("degraded") else (lambda v: sum(v) / len(v)) if name.endswith("_perc") else sum
            return {key: pick(v) for key, v in values.items()}
        totals = {key: sum(v) for key, v in values.items()}
        for key, value in self.retired.get(name, ("", "", {}))[2].items():
            totals[key] = totals.get(key, 0.0) + value
        return totals


def _line(sample: str, labels, value: float) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{sample}{{{body}}} {floatToGoString(value)}" if body else f"{sample} {floatToGoString(value)}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

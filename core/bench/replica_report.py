"""`bench -v ... -v ...`: one server per variant on the same requests, one comparison report, with
what the servers counted (prefix-cache hits) and, behind Ray Serve, their replicas: how requests
and hits split between them, and a killed replica's replacement and the failures it cost."""

from __future__ import annotations

import time
from pathlib import Path

from core.bench import plots as plotting
from core.bench.report import _f, _header, _md_table, _ms, _workload_md, server_metrics_md, write_runs_json
from core.config.schema import RunConfig


def _hits(s: dict) -> str:
    pc = s.get("prefix_cache")
    return f"{pc['hit_rate'] * 100:.1f} %" if pc else "-"


def results_table(results: list[dict]) -> str:
    head = ["run", "requests", "failures", "req/s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
            "TPOT p99 (ms)", "E2E p99 (ms)", "prefix-cache hit rate", "replicas"]
    rows = []
    for r in results:
        s, rep = r["summary"], r.get("replicas") or {}
        rows.append([r["label"], s["num_requests"], s.get("failures", 0), _f(s["req_s"], 3), _f(s["output_tok_s"]),
                     _ms(s["ttft_s"].get("p50")), _ms(s["ttft_s"].get("p99")), _ms(s["tpot_s"].get("p50")),
                     _ms(s["tpot_s"].get("p99")), _ms(s["e2e_s"].get("p99")), _hits(s),
                     len(rep.get("at_end", [])) or "-"])
    return _md_table(head, rows)


def replicas_md(r: dict) -> list[str]:
    rep = r.get("replicas")
    if not rep:
        return []
    lines = [f"### `{r['label']}`: replicas (router `{rep['router']}`)", "",
             f"- at the start: {', '.join(rep['at_start'])}; at the end: {', '.join(rep['at_end'])}; "
             f"started in all: {rep['started']}"]
    kill = rep.get("kill")
    if kill and "at" in kill:
        replaced = (f"Ray's replacement {kill['replacement']} announced itself {kill['replaced_after_s']:.1f} s later"
                    if kill.get("replacement") else "no replacement announced itself within 120 s of the run's end")
        lines.append(f"- killed: replica {kill['replica']} (pid {kill['pid']}, SIGKILL); {replaced}")
    elif kill:
        lines.append(f"- kill not done: {kill.get('error')}")
    fails = rep.get("failures") or {}
    lines.append(f"- requests failed because their replica died (the ingress's count): "
                 f"{sum(fails.values()):.0f}" + (f" ({', '.join(f'{k}: {v:.0f}' for k, v in fails.items())})"
                                                  if fails else "") + f"; failed at the client: "
                 f"{r['summary'].get('failures', 0)}")
    rows = [[rid, f"{c.get('requests', 0):.0f}", f"{c.get('prefix_queries', 0):.0f}", f"{c.get('prefix_hits', 0):.0f}",
             f"{c['hit_rate'] * 100:.1f} %"] for rid, c in rep["per_replica"].items()]
    lines += ["", _md_table(["replica", "finished requests", "prompt tokens looked up", "prefix-cache hits", "hit rate"],
                            rows), "",
              "Per-replica counts are cumulative since each replica started (its warm-up included); a replica that "
              "died is gone from this table (the totals above keep its last scrape).", ""]
    return lines


def write_bench_comparison(results: list[dict], name: str, rc: RunConfig) -> Path:
    out = Path(rc.report_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    images = plotting.run_plots(results, out) if rc.plots else []
    write_runs_json(out, {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, "runs", results)
    base = results[0]
    lines = [f"# servelab bench comparison: {' vs '.join(r['label'] for r in results)}", "",
             "One server per row, started in turn on the same machine and replaying the same requests with locust. "
             "The prefix-cache hit rate is the servers' own count over the run (prompt tokens found cached / looked "
             "up, all replicas).", "", _header(base), "", "## Workload", "", _workload_md(base["workload"]), "",
             "## Results", "", results_table(results), ""]
    for r in results:
        lines += replicas_md(r)
        lines += [f"### `{r['label']}`: what the server counted", ""] + server_metrics_md(r.get("server_metrics"))[2:]
    if images:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in images] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return out

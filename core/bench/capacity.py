"""SLO capacity: goodput against offered rate, per configuration, from a sweep over the rate.

`run -m workload.rate=0.25,0.5,1 scheduler=continuous,slo` (Poisson or gamma arrivals) and
`bench -m scenario.rate_per_user=...` give one result per (configuration, rate). The SLO capacity
of a configuration is the highest rate at which at least `ATTAINMENT` of the requests met both
targets, every lower rate tested included (DistServe's definition, on a grid): the table states
the tested rate and a linear interpolation up to the first rate that missed.
"""

from __future__ import annotations

ATTAINMENT = 0.9
RATE_KEY = "workload.rate="


def offered_rate(result: dict) -> float | None:
    if "offered_rate" in result:  # a bench stage: users x rate per user
        return result["offered_rate"]
    w = result.get("config", {}).get("workload", {})
    return float(w["rate"]) if w.get("arrival") in ("poisson", "gamma") else None


def _system(label: str) -> str:
    """A result's configuration: its label without the rate it was run at."""
    return " ".join(t for t in label.split() if not t.startswith((RATE_KEY, "rate="))) or "base"


def groups(results: list[dict]) -> dict[str, list[dict]]:
    """Configuration -> its results by increasing rate; empty unless some configuration ran at two
    or more rates."""
    out: dict[str, list[dict]] = {}
    for r in results:
        if offered_rate(r) is not None:
            out.setdefault(_system(r["label"]), []).append(r)
    for rs in out.values():
        rs.sort(key=offered_rate)
    return out if any(len({offered_rate(r) for r in rs}) > 1 for rs in out.values()) else {}


def slo_capacity(points: list[tuple[float, float]], attainment: float = ATTAINMENT) -> dict:
    """points: (rate, share of requests meeting both targets), any order. Returns the capacity on the
    grid (None if even the lowest rate missed), its interpolation and the first rate that missed."""
    points = sorted(points)
    capacity, first_miss, interpolated = None, None, None
    for i, (rate, attained) in enumerate(points):
        if attained >= attainment:
            capacity = rate
            continue
        first_miss = rate
        if i > 0:
            (r0, a0), (r1, a1) = points[i - 1], points[i]
            interpolated = r0 + (r1 - r0) * (a0 - attainment) / (a0 - a1) if a0 != a1 else r0
        break
    if first_miss is None and capacity is not None:
        interpolated = capacity  # never missed on the grid: at least the highest rate tested
    return {"capacity_req_s": capacity, "interpolated_req_s": interpolated, "first_miss_req_s": first_miss,
            "attainment": attainment, "bounded": first_miss is not None}


def capacities(results: list[dict]) -> dict[str, dict]:
    """Per configuration: its capacity and the throughput it achieved at that rate."""
    out = {}
    for system, rs in groups(results).items():
        cap = slo_capacity([(offered_rate(r), r["summary"]["slo"]["attained"]) for r in rs])
        at = next((r for r in rs if offered_rate(r) == cap["capacity_req_s"]), None)
        cap["output_tok_s_at_capacity"] = at["summary"]["output_tok_s"] if at else None
        cap["goodput_req_s_at_capacity"] = at["summary"]["goodput_req_s"] if at else None
        out[system] = cap
    return out


def service_ceiling(results: list[dict]) -> dict | None:
    """What bounds every capacity in a sweep: a capacity of r needs ATTAINMENT * r requests a second
    served within the targets, so a configuration that serves no faster than the fastest run here
    cannot pass that run's served rate / ATTAINMENT, whatever it schedules. With the runs' roofline
    (the workload at the machine's measured peak) also the rate the machine could serve at best.
    A run that refused requests served a lighter workload than the one offered (a shedding scheduler
    refuses the longest prompts first), so its rate bounds nothing: only runs that refused none
    count, unless every run refused some. None when the results hold no sweep."""
    swept = [r for rs in groups(results).values() for r in rs]
    if not swept:
        return None
    whole = [r for r in swept if not r["summary"].get("rejected")]
    best = max(whole or swept, key=lambda r: r["summary"]["req_s"])
    served = best["summary"]["req_s"]
    out = {"served_req_s": served, "label": best["label"], "offered_req_s": offered_rate(best),
           "capacity_bound_req_s": served / ATTAINMENT, "roofline_req_s": None,
           "refusing_runs_left_out": len(swept) - len(whole) if whole else 0}
    # the floor of the whole workload: a run that refused requests has one of what it served only
    rates = sorted(r["workload"]["num_requests"] / f["time_s"] for r in whole
                   if r.get("workload", {}).get("num_requests")
                   and (f := (r.get("roofline") or {}).get("workload_floor")) and f.get("time_s"))
    if rates:
        out["roofline_req_s"] = rates[len(rates) // 2]
    return out


def _ceiling_markdown(results: list[dict], caps: dict[str, dict]) -> list[str]:
    c = service_ceiling(results)
    if not c:
        return []
    best_cap = max((v["capacity_req_s"] or 0.0 for v in caps.values()), default=0.0)
    left_out = c.get("refusing_runs_left_out", 0)
    which = f"any run that refused none ({left_out} that did are left out: they served a lighter load)" \
        if left_out else "any run"
    line = (f"What bounds these capacities: the fastest {which} served was {c['served_req_s']:.3g} req/s "
            f"(`{c['label']}`). A capacity of r needs {ATTAINMENT:.0%} of r served within both targets, so a "
            f"configuration serving no faster has a capacity of at most {c['capacity_bound_req_s']:.3g} req/s "
            f"whatever it schedules; " + (f"the best here, {best_cap:g} req/s, is {best_cap / c['capacity_bound_req_s']:.0%} "
                                          "of that." if best_cap else "none here met the targets at any rate tested."))
    if c["roofline_req_s"]:
        line += (f" At its roofline (every step at the measured peak) this machine would serve "
                 f"{c['roofline_req_s']:.3g} req/s of this workload: the fastest run is "
                 f"{c['served_req_s'] / c['roofline_req_s']:.0%} of it.")
    return [line, ""]


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def capacity_markdown(results: list[dict]) -> list[str]:
    by_system = groups(results)
    if not by_system:
        return []
    caps = capacities(results)
    slo = results[0]["summary"]["slo"]
    base_name = next((k for k, c in caps.items() if c["capacity_req_s"]), None)
    base = caps.get(base_name)
    lines = ["## SLO capacity", "",
             f"Targets: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s'] * 1000:.0f} ms per request. The SLO "
             f"capacity is the highest offered rate at which at least {ATTAINMENT:.0%} of the requests met both "
             "(refused requests count as missed), every lower rate tested included.", "",
             "| configuration | SLO capacity (req/s, tested) | interpolated | first rate missed | output tok/s at "
             f"capacity | capacity vs `{base_name or '-'}` |", "|---|---|---|---|---|---|"]
    for system, c in caps.items():
        ratio = f"{c['capacity_req_s'] / base['capacity_req_s']:.2f}x" if c["capacity_req_s"] and base else "-"
        lowest = min(offered_rate(r) for r in by_system[system])
        cap = c["capacity_req_s"] if c["capacity_req_s"] is not None else f"below {lowest:g} (the lowest tested)"
        interp = "-" if c["interpolated_req_s"] is None else f"{c['interpolated_req_s']:.3g}"
        tok = "-" if c["output_tok_s_at_capacity"] is None else f"{c['output_tok_s_at_capacity']:.1f}"
        lines.append(f"| {system} | {cap} | {interp}{'' if c['bounded'] else ' (not reached)'} | "
                     f"{c['first_miss_req_s'] or '-'} | {tok} | {ratio} |")
    lines += [""] + _ceiling_markdown(results, caps)
    lines += ["### Goodput against offered rate", "",
              "| configuration | offered (req/s) | served (req/s) | refused | attained | goodput (req/s) | output tok/s "
              "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for system, rs in by_system.items():
        for r in rs:
            s = r["summary"]
            lines.append(f"| {system} | {offered_rate(r):g} | {s['req_s']:.3f} | {s.get('rejected', 0)} | "
                         f"{s['slo']['attained'] * 100:.0f} % | {s['goodput_req_s']:.3f} | {s['output_tok_s']:.1f} | "
                         f"{_ms(s['ttft_s'].get('p50'))} / {_ms(s['ttft_s'].get('p99'))} | "
                         f"{_ms(s['tpot_s'].get('p50'))} / {_ms(s['tpot_s'].get('p99'))} |")
    return lines + [""]


def step_cost_markdown(summary: dict) -> list[str]:
    """The engine's online step-cost model at the end of a run, and how well it predicted."""
    sc = summary.get("step_cost")
    if not sc:
        return []
    c = sc["coefficients_s"]
    err = sc.get("relative_error") or {}
    return ["## Step-cost model (learned online)", "",
            f"step time = {c['overhead'] * 1e3:.2f} ms + {c['tokens'] * 1e3:.3f} ms per token + "
            f"{c['sampled'] * 1e3:.3f} ms per sampled row + {c['kv_read'] * 1e6:.3f} us per KV token read + "
            f"{c['attn_pairs'] * 1e9:.3f} ns per attention pair; fitted on {sc['num_steps']} steps "
            f"({sc['num_outliers']} outliers skipped)."
            + (f" Each step predicted before it ran: median error {err['p50'] * 100:.1f} %, p90 "
               f"{err['p90'] * 100:.1f} % over the last {err['n']} steps." if err else ""), ""]

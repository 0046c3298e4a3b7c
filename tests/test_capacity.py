"""SLO capacity from a rate sweep: the definition on constructed points, and `run -m` end to end."""

import json

import pytest

from core.bench.capacity import groups, slo_capacity
from core.bench.run import compare
from tests.test_bench import BASE


def test_capacity_is_the_highest_rate_before_the_first_miss():
    c = slo_capacity([(0.5, 1.0), (1.0, 0.95), (2.0, 0.7), (1.5, 0.91), (3.0, 0.95)])
    assert c["capacity_req_s"] == 1.5 and c["first_miss_req_s"] == 2.0  # 3.0 met again: noise past the knee
    assert c["interpolated_req_s"] == pytest.approx(1.5 + 0.5 * (0.91 - 0.9) / (0.91 - 0.7))
    assert slo_capacity([(1.0, 0.5), (2.0, 0.2)])["capacity_req_s"] is None
    never = slo_capacity([(1.0, 1.0), (2.0, 0.99)])
    assert never["capacity_req_s"] == 2.0 and not never["bounded"]


def test_results_group_by_configuration_without_the_rate():
    def result(label, rate):
        return {"label": label, "config": {"workload": {"arrival": "poisson", "rate": rate}}}

    rs = [result("scheduler=slo workload.rate=2", 2), result("scheduler=slo workload.rate=1", 1),
          result("scheduler=continuous workload.rate=1", 1)]
    g = groups(rs)
    assert list(g) == ["scheduler=slo", "scheduler=continuous"]
    assert [r["config"]["workload"]["rate"] for r in g["scheduler=slo"]] == [1, 2]
    assert groups([result("a", 1), result("b", 1)]) == {}  # one rate each: no curve to draw


def test_a_rate_sweep_reports_each_configurations_capacity(tiny_llama, tmp_path):
    base = BASE + [f"model.path={tiny_llama}", f"run.report_dir={tmp_path}", "workload.arrival=poisson",
                   "workload.slo_ttft_s=30", "workload.slo_tpot_s=30"]
    variants = [[f"scheduler={s}", f"workload.rate={r}"] for s in ("continuous", "slo") for r in (20, 40)]
    compare(base, variants, None, "sweep")
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    caps = report["slo_capacity"]
    assert set(caps) == {"scheduler=continuous", "scheduler=slo"}
    for run in report["runs"]:  # targets this loose are met by every request of the tiny model
        assert run["summary"]["slo"] == {"ttft_s": 30.0, "tpot_s": 30.0, "attained": 1.0}
    assert all(c["capacity_req_s"] == 40.0 and not c["bounded"] for c in caps.values())
    md = (tmp_path / "sweep" / "report.md").read_text()
    assert "## SLO capacity" in md and "| scheduler=slo | 40.0 |" in md
    assert (tmp_path / "sweep" / "slo_capacity.png").read_bytes()[:4] == b"\x89PNG"
    # the per-step records of the four runs live beside report.json, compressed, in run order
    import gzip

    steps = json.loads(gzip.open(tmp_path / "sweep" / report["steps_file"], "rt").read())
    assert len(steps) == 4 and all(s and "predicted_s" in s[-1] for s in steps)
    assert all("steps" not in run for run in report["runs"])
    assert "## Step-cost model" not in md  # a run's own report has it; the comparison shows the curves


def test_a_bench_rate_sweep_groups_its_stages_by_offered_rate():
    from core.bench.capacity import capacities

    def stage(rate, attained):
        return {"label": f"chat_longtail users=2 rate={rate:g}", "offered_rate": 2 * rate,
                "summary": {"slo": {"attained": attained}, "output_tok_s": 10.0 * rate, "goodput_req_s": rate}}

    caps = capacities([stage(0.25, 1.0), stage(0.5, 0.92), stage(1.0, 0.6)])
    assert list(caps) == ["chat_longtail users=2"]
    assert caps["chat_longtail users=2"]["capacity_req_s"] == 1.0  # 2 users x 0.5 req/s each
    assert caps["chat_longtail users=2"]["output_tok_s_at_capacity"] == 5.0


def test_the_fastest_service_in_a_sweep_bounds_every_capacity():
    from core.bench.capacity import capacity_markdown, service_ceiling

    def run(system, rate, served, attained, rejected=0, floor_s=20.0):
        return {"label": f"{system} workload.rate={rate}", "config": {"workload": {"arrival": "poisson", "rate": rate}},
                "workload": {"num_requests": 80}, "roofline": {"workload_floor": {"time_s": floor_s}},
                "summary": {"req_s": served, "rejected": rejected, "slo": {"attained": attained, "ttft_s": 3.0, "tpot_s": 0.15},
                            "output_tok_s": 100 * served, "goodput_req_s": served * attained, "ttft_s": {}, "tpot_s": {}}}

    rs = [run("a", 1, 0.98, 1.0), run("a", 2, 1.8, 0.95), run("a", 4, 2.0, 0.5),
          run("b", 1, 0.97, 1.0), run("b", 4, 2.4, 0.8, rejected=9, floor_s=10.0)]  # b's floor: what it served
    c = service_ceiling(rs)
    # b at 4 served 2.4 req/s by refusing 9 requests: a lighter load than offered, so a's 2.0 bounds
    assert c["label"] == "a workload.rate=4" and c["served_req_s"] == 2.0 and c["refusing_runs_left_out"] == 1
    assert c["capacity_bound_req_s"] == pytest.approx(2.0 / 0.9)
    assert c["roofline_req_s"] == pytest.approx(80 / 20.0)  # from the runs that refused none
    md = "\n".join(capacity_markdown(rs))
    assert "at most 2.22 req/s" in md and "the best here, 2 req/s, is 90% of that" in md
    assert "1 that did are left out" in md
    # every run refused some: they are all there is
    shed = service_ceiling([run("b", 1, 0.9, 1.0, rejected=1), run("b", 4, 2.4, 0.8, rejected=9)])
    assert shed["served_req_s"] == 2.4 and shed["refusing_runs_left_out"] == 0
    assert service_ceiling([run("a", 1, 1.0, 1.0)]) is None  # one rate: no sweep

"""The GPU check's machinery on the CPU: the kernel table at toy sizes (Triton interpreted), the
verdicts against issue 11's targets, the report. Its figures need the GPU; its code must not."""

import json

from benchmarks import gpu_check, gpu_kernels


def test_kernel_table_report_and_verdicts_on_toy_sizes(tmp_path):
    rates = {"device": "cpu (toy)", "mem_bandwidth_gbs": 10.0, "matmul_gflops": {"bf16": 100.0}, "torch": "x"}
    kernels = gpu_kernels.kernel_table(rates, lambda msg: None, small=True)
    assert not [k for k in kernels if "error" in k], kernels
    impls = {(k["case"].split(" ")[0], k["impl"]) for k in kernels}
    assert ("decode", "triton") in impls and ("prefill", "triton") in impls and ("matmul", "triton") in impls
    for k in kernels:  # every Triton row agrees with its reference
        if k["impl"] == "triton" and k["max_rel_err"] is not None:
            assert k["max_rel_err"] < 0.02, k  # bf16: about one rounding step
    runs = [{"label": "1b-batch1", "system": "servelab", "requests": 3, "output_tok_s": 650.0, "tok_s_per_stream": 655.0,
             "ttft_p50_s": 0.01, "tpot_p50_s": 0.0015, "fraction_of_roofline": 0.3, "wall_s": 4.0},
            {"label": "8b-batch1", "skipped": "time budget spent (3 s left)"}]
    verdicts = {v["target"]: v for v in gpu_check.verdicts(kernels, runs)}
    assert verdicts["1b-batch1"]["met"] and not verdicts["8b-batch1"]["met"]
    assert verdicts["8b-batch1"]["measured"] is None
    report = {"created": "now", "device": rates, "kernels": kernels, "runs": runs,
              "targets": list(verdicts.values()), "wall_s": 1.0}
    gpu_kernels.write_markdown(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| 1b-batch1 | 600 output tok/s | 650.0 | yes |" in md and "time budget spent" in md
    assert (tmp_path / "kernels.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(report)


def test_the_runs_cover_the_issues_shapes_and_the_peer():
    labels = [label for label, _ in gpu_check.engine_runs("tok")]
    assert {"1b-batch1", "1b-decode_heavy", "1b-chat_longtail", "8b-batch1"} <= set(labels)
    assert all("model.tokenizer=tok" in ov for _, ov in gpu_check.engine_runs("tok"))
    assert any("peer.cache=static" in ov for _, ov in gpu_check.engine_runs(None))


def test_every_run_composes_to_a_valid_config():
    from core.bench.run import peer_config, workload_config
    from core.config.compose import compose
    from core.engine.components import engine_config

    for label, overrides in gpu_check.engine_runs("tok"):
        cfg = compose(overrides + ["run.progress=false", "run.plots=false"])
        ec, wc = engine_config(cfg), workload_config(cfg)
        assert ec.model.load_format == "dummy" and ec.model.tokenizer == "tok", label
        assert (peer_config(cfg) is not None) == label.startswith("hf-"), label
        assert wc.num_requests >= 1

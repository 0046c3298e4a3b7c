"""The plugin core: registry, errors, listing, and a real third-party package installed by pip."""

import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from core.config import CacheConfig
from core.engine.registry import KINDS, get_registry
from core.engine.types import SamplingParams, Sequence, SequenceStatus
from core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "servelab-plugin-example"


def test_every_kind_has_its_in_repo_component():
    reg = get_registry()
    expected = {"scheduler": "static", "cache": "contiguous", "quant": "none", "decoder": "sampling", "backend": "torch",
                "attention": "torch", "peer": "hf"}
    assert set(KINDS) == set(expected)
    for kind, name in expected.items():
        comp = reg.get(kind, name)
        assert comp.source.startswith("servelab")  # through the entry point, like a third party


def test_unknown_name_is_one_line_naming_kind_value_and_choices():
    with pytest.raises(ConfigError) as e:
        get_registry().get("scheduler", "nope")
    msg = str(e.value)
    assert "\n" not in msg and "scheduler" in msg and "'nope'" in msg and "static" in msg


def test_cli_lists_plugins():
    r = subprocess.run([sys.executable, "-m", "core", "plugins"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["kind", "name", "from"]
    assert any(ln.split()[:2] == ["scheduler", "static"] and "servelab" in ln for ln in lines)
    assert any(ln.split()[:2] == ["backend", "torch"] for ln in lines)


def test_sjf_picks_shortest_jobs_and_bounds_starvation(example_plugin):
    import torch

    from core.engine.types import KVCacheSpec
    from plugins.cache.contiguous import ContiguousAllocator

    spec = KVCacheSpec(1, 1, 8, torch.float32, 256)
    alloc = ContiguousAllocator(CacheConfig(), spec, max_num_seqs=1)
    cfg = example_plugin.SJFConfig(name="sjf", max_num_seqs=1, max_wait_batches=2)
    sched = example_plugin.ShortestJobFirstScheduler(cfg, alloc)
    long = Sequence("long", [1] * 100, SamplingParams(max_tokens=50))
    sched.add(long)
    picked = []
    for i in range(4):
        sched.add(Sequence(f"short{i}", [1] * 5, SamplingParams(max_tokens=5)))
        out = sched.schedule()
        picked.append(out.scheduled[0].seq.request_id)
        sched.finish(out.scheduled[0].seq, SequenceStatus.FINISHED_LENGTH)
    # shortest first, but the long job goes once it was passed over twice
    assert picked == ["short0", "short1", "long", "short2"]


def test_third_party_package_installs_and_is_usable_by_name(tmp_path, tiny_llama):
    env_dir = tmp_path / "venv"
    # A venv over this environment (servelab and its deps visible, the editable install's finder
    # included), without its own pip, so this environment's pip and setuptools build the plugin
    # offline. Not system_site_packages: from inside a venv that is the base interpreter's, whose
    # setuptools may be too old to build a wheel.
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = str(env_dir / "bin" / "python")
    inner = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    outer = [d for d in site.getsitepackages() if Path(d).is_dir()]
    Path(inner, "outer-env.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in outer))
    source = tmp_path / "example"  # a copy, so the build leaves nothing in the repo
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-build-isolation",
                        "-q", str(source)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([py, "-m", "core", "plugins"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    row = [ln.split() for ln in r.stdout.splitlines() if ln.split()[:2] == ["scheduler", "sjf"]]
    assert row and row[0][2] == "servelab-plugin-example"
    r = subprocess.run([py, "-m", "core", "generate", "--prompt", "hello", "--max-tokens", "4", "--json",
                        "scheduler=sjf", f"model.path={tiny_llama}", "model.max_model_len=64"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    import json

    assert len(json.loads(r.stdout)["token_ids"]) == 4

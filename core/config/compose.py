"""Hydra's compose API without `@hydra.main`: overrides in, one DictConfig out.

`scheduler=sjf`, where no conf/scheduler/sjf.yaml exists, becomes `scheduler.name=sjf`, so a
third-party component is chosen by name like an in-repo one. Its section keeps the keys every
scheduler has (the base dataclass's) and whatever the command line sets (`scheduler.max_wait_batches=2`,
no `+` needed); the default component's own keys are dropped. An unknown name, or a key the plugin
does not have, is reported later, by the registry, with the names or keys that do exist.
"""

from __future__ import annotations

import dataclasses
import itertools
from importlib import resources

from omegaconf import DictConfig, open_dict

from core.config.schema import BASE_CONFIGS, COMPONENT_KINDS

OPEN_MAPS = ("server.models", "server.pools", "server.pool_slo")  # maps whose keys are the user's to name: no `+` needed


def group_options(group: str) -> set[str]:
    folder = resources.files("conf") / group
    return {p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml")} if folder.is_dir() else set()


def rewrite_component_overrides(overrides: list[str]) -> tuple[list[str], set[str]]:
    """Returns the rewritten overrides and the kinds chosen by a name that has no conf file."""
    out, by_name = [], set()
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key in COMPONENT_KINDS and value not in group_options(key) and value != "null" and "," not in value:
            by_name.add(key)
            ov = f"{key}.name={value}"
        out.append(ov)

    def forced(ov: str) -> str:
        """A component's key (even one its conf file lacks: the plugin's dataclass judges it, naming the
        valid keys) or an open map's: add it or override it."""
        key = ov.partition("=")[0]
        new_key = "." in key and key.split(".", 1)[0] in COMPONENT_KINDS or key.startswith(OPEN_MAPS)
        return f"++{ov}" if new_key and not ov.startswith(("+", "~")) else ov

    return [forced(ov) for ov in out], by_name


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    overrides, by_name = rewrite_component_overrides(list(overrides))
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    for kind in by_name:
        keep = {f.name for f in dataclasses.fields(BASE_CONFIGS[kind])}
        keep |= {ov.lstrip("+").partition("=")[0].split(".", 1)[1] for ov in overrides
                 if ov.lstrip("+").startswith(f"{kind}.")}
        with open_dict(cfg):
            for k in [k for k in cfg[kind] if k not in keep]:
                del cfg[kind][k]
    return cfg


def expand_sweeps(overrides: list[str]) -> tuple[list[str], list[list[str]]]:
    """Hydra multirun syntax: `scheduler=static,continuous` -> one variant per value (cartesian
    product over every swept key). Returns (fixed overrides, variants)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed, sweeps = [], []
    for text, ov in zip(overrides, parsed):
        if ov.is_sweep_override():
            key = ov.get_key_element()
            sweeps.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            fixed.append(text)
    return fixed, [list(combo) for combo in itertools.product(*sweeps)] if sweeps else [[]]


def is_config_error(e: Exception) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(e, (HydraException, OmegaConfBaseException))


def first_line(e: Exception) -> str:
    """Hydra's message in one line, every available option of a group included."""
    lines = str(e).splitlines()
    head = [ln.strip() for ln in lines if ln.strip()][:2]
    for i, ln in enumerate(lines):
        if ln.startswith("Available options in"):
            options = []
            for opt in lines[i + 1:]:
                if not opt.startswith((" ", "\t")) or not opt.strip():
                    break
                options.append(opt.strip())
            return f"{head[0]}; {ln.strip()} {', '.join(options)}"
    return " ".join(head)

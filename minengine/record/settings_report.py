"""Every setting in force, gathered: for the command that lists them, a run's first JSON record and
a trace's header.

Each setting is read where it is defined: the environment and the machine in `minengine.settings`,
and what only the modules acting on a setting can decide (whether the C kernels built, what the
block formats multiply by, the OpenMP policy this process chose) in those modules. The gathering
lives here, above both, because those modules import `settings` and it may not import them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minengine import omp_env, settings
from minengine.errors import Setting
from minengine.fast import cpu_kernels
from minengine.fast.panel_kernels import activations_setting, amx_setting
from minengine.fast.row_ops import row_ops_setting
from minengine.settings import Settings, SettingValue

if TYPE_CHECKING:
    import torch

    from minengine.engine.engine import Engine


def collect(
    device: torch.device | None = None, *, kv_budget: SettingValue | None = None, load_kernels: bool = True
) -> Settings:
    """Every setting now, for `device` (default: the one `auto` takes). `kv_budget` replaces the
    probed budget (an engine's, or a flag's); with `load_kernels` False the C kernels are reported
    only if this process loaded them already, so listing settings never builds them (a CUDA run)."""
    from minengine.device import resolve_device

    device = resolve_device("auto") if device is None else device
    kernels_loaded = load_kernels or cpu_kernels.library.cache_info().currsize > 0
    return Settings((
        settings.python(),
        settings.torch_build(),
        settings.cuda(),
        settings.cpu(),
        settings.cpu_capability_setting(),
        settings.cpus(),
        settings.threads(),
        omp_env.policy_setting(),
        settings.c_compiler(),
        cpu_kernels.kernels_setting(load=load_kernels),
        settings.kernels_home(),
        activations_setting() if kernels_loaded else _not_loaded("activations", "int16"),
        amx_setting() if kernels_loaded else _not_loaded("amx", "on"),
        row_ops_setting(device) if kernels_loaded else _not_loaded("row_ops", "C"),
        settings.float32_kernel(),
        settings.kv_budget(device) if kv_budget is None else kv_budget,
        settings.layout_cache(),
        settings.models_home(),
    ))  # fmt: skip


def collect_for_engine(engine: Engine, *, kv_budget_given_by: str | None = None) -> Settings:
    """The settings a loaded engine runs under: its own KV budget (given by the caller's flag
    `kv_budget_given_by`, else taken at load), its device, and the kernels only if it loaded them."""
    used = engine.pool.budget_bytes
    budget = settings.kv_budget(engine.device, used_bytes=used)
    if kv_budget_given_by is not None or engine.kv_budget_given:
        budget = budget.given(used, kv_budget_given_by or Setting.KV_BUDGET.value)
    found = collect(engine.device, kv_budget=budget, load_kernels=False)
    bound = getattr(engine.model, "ops", None)  # the reference kernels' model binds none
    if bound is not None and found["row_ops"].value is not None:  # the model's own binding, not a fresh model's
        ops = row_ops_setting(engine.device, bound)
        found = Settings(tuple(ops if s.name == "row_ops" else s for s in found.values))
    # Which arithmetic the engine's steps run (`Engine(kernels=...)`): the fast paths unless asked.
    source = settings.DEFAULT if engine.kernels == "fast" else settings.FLAG
    kernels = SettingValue("kernels", engine.kernels, "fast", source, "" if source == settings.DEFAULT else "kernels")
    return Settings((*found.values, kernels))


def _not_loaded(name: str, default: settings.Value) -> SettingValue:
    return SettingValue(name, None, default, settings.PROBE, "the C kernels were not loaded by this process")

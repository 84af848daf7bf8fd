"""``nrl plan``: each role's predicted peak memory per device for a validated config, as a table,
and the one-line refusal ``nrl config check`` gives a run that cannot fit where it will run.

Where the devices' memory is known (given with ``--device-memory``, detected on a GPU machine, or
on a machine without GPUs for a run of a local model, which then runs on this machine's CPU and
shares its memory among all its ranks), a role that does not fit is refused, naming the role,
the predicted and available memory and the knob that would make it fit. Elsewhere (a recipe for
a GPU cluster checked on a laptop) the plan is printed with the assumption it made.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nrl_core.config.topology import cluster_topology
from nrl_core.config.validate import choose_backends
from nrl_core.contracts import import_object
from nrl_core.errors import NrlError
from nrl_core.plan.layout import StateLayout
from nrl_core.plan.memory import (
    DTYPE_BYTES,
    KV_BYTES,
    EngineRole,
    GiB,
    RolePlan,
    TrainingRole,
    colocated_plan,
    engine_plan,
    micro_batch_tokens,
    training_plan,
)
from nrl_core.plan.model_shape import ModelShape

__all__ = ["Devices", "MemoryPlan", "StateLayout", "detect_devices", "plan_memory", "refusal"]

#: What a plan assumes of devices it cannot see: an 80 GiB GPU (H100, A100 80GB).
ASSUMED_DEVICE_GIB = 80


@dataclass(frozen=True)
class Devices:
    """The memory one device offers a rank, and where that figure came from. ``shared_by``: ranks
    that share it (all of a CPU run's ranks share the host's memory)."""

    memory: int | None
    source: str
    shared_by: int = 1
    kind: str = "cuda"
    here: bool = False  # the run's devices are this machine's (a local run), not a figure given or assumed


@dataclass(frozen=True)
class MemoryPlan:
    roles: tuple[RolePlan, ...]
    devices: Devices
    model: str

    def table(self) -> str:
        """The plan as a table: each role's lines, its device peak, and the host memory it keeps."""
        rows = [f"memory plan for {self.model}; devices: {self.devices.source}"]
        for role in self.roles:
            rows.append(f"  {role.role} ({role.placement})" + (f": {role.note}" if role.note else ""))
            for line in role.lines:
                where = "" if line.where == "device" else "  [host]"
                rows.append(f"    {line.what:<58} {line.bytes / GiB:9.2f} GiB{where}")
            over = self.devices.memory is None and role.device_bytes > ASSUMED_DEVICE_GIB * GiB
            rows.append(f"    {'peak per device':<58} {role.device_bytes / GiB:9.2f} GiB"
                        + (f"  (more than the assumed {ASSUMED_DEVICE_GIB} GiB: {role.knob})" if over else ""))
        return "\n".join(rows)


def detect_devices(runs_here: bool, ranks_here: int, given_gib: float | None = None) -> Devices:
    """The memory the run's devices offer: given, a GPU's here, or for a run on this machine
    without GPUs its memory shared by the run's training ranks."""
    if given_gib is not None:
        return Devices(int(given_gib * GiB), f"{given_gib:g} GiB each (given)")
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return Devices(total, f"{total / GiB:.0f} GiB each (detected: {torch.cuda.get_device_name(0)})",
                       here=runs_here)
    if runs_here:
        import psutil

        total = psutil.virtual_memory().total
        return Devices(total, f"this machine's {total / GiB:.0f} GiB, shared by its {ranks_here} training "
                              f"ranks (a run without GPUs)", shared_by=ranks_here, kind="cpu", here=True)
    return Devices(None, f"not known here; {ASSUMED_DEVICE_GIB} GiB each assumed for the table, nothing refused")


def plan_memory(config: Mapping[str, Any], pm: Any, *, device_gib: float | None = None,
                model_config: str | None = None, algorithms: Sequence[str] = ()) -> MemoryPlan:
    """The plan of a validated ``config`` (see the module docstring) for a run of ``algorithms``
    (the policy's reference copy is counted as they say; none named: counted)."""
    policy = config["policy"]
    model = model_config or policy["model_name"]
    shape = ModelShape.from_model_path(model)
    choice = choose_backends(config, pm, generation=policy.get("generation") is not None, warn=False)
    topo = cluster_topology(config, pm)
    # a local model on one node of a machine without GPUs runs here (not a cluster's login node)
    runs_here = os.path.isdir(str(policy["model_name"])) and topo.total_nodes == 1 \
        and not (config.get("cluster") or {}).get("ray_address") and not os.environ.get("RAY_ADDRESS")
    devices = detect_devices(runs_here, topo.train_per_node, device_gib)
    train = _training_role("policy", policy, choice.training, topo.train_world, devices.kind, trains=True,
                           reference=_uses_reference(config, pm, algorithms), placement=f"{topo.train_world} training ranks")
    roles = [training_plan(shape, train)]
    for name, trains in (("critic", True), ("teacher", False)):
        section = config.get(name)
        if isinstance(section, Mapping) and section.get("model_name"):
            other = ModelShape.from_model_path(section["model_name"], f"{name}.model_name") \
                if not model_config else shape
            role = _training_role(name, {**policy, **section}, choice.training, topo.train_world, devices.kind,
                                  trains=trains, reference=False, placement=f"{topo.train_world} ranks")
            roles.append(training_plan(other, role))
    generation = policy.get("generation")
    if generation is not None and choice.generation is not None:
        engine = _engine_role(policy, generation, choice.generation, topo)
        memory = devices.memory if devices.shared_by == 1 else None  # a CPU engine sizes its cache itself
        if devices.memory is None:
            memory = ASSUMED_DEVICE_GIB * GiB
        engine_role = engine_plan(shape, engine, memory)
        roles.append(engine_role)
        if topo.colocated:
            roles.append(colocated_plan(roles[0], engine_role,
                                        offload_weights=bool(generation["colocated"].get("offload_weights", True))))
    return MemoryPlan(tuple(roles), devices, str(policy["model_name"]))


def refusal(plan: MemoryPlan) -> str | None:
    """One line for the first role that does not fit its device, or None (also when the devices'
    memory is not known)."""
    devices = plan.devices
    if devices.memory is None:
        return None
    if devices.shared_by > 1:  # a CPU run: every rank, and what they keep on the host, shares the memory
        training = [r for r in plan.roles if r.role in ("policy", "critic", "teacher")]
        need = sum(r.device_bytes + r.host_bytes for r in training) * devices.shared_by
        if need > devices.memory:
            worst = max(training, key=lambda r: r.device_bytes)
            return (f"{worst.role}: predicted {need / GiB:.1f} GiB for its {devices.shared_by} ranks on this "
                    f"machine, which has {devices.memory / GiB:.1f} GiB; {_fix(worst)} (nrl plan shows the "
                    f"prediction)")
        return None
    for role in plan.roles:
        if role.device_bytes > devices.memory:
            return (f"{role.role}: predicted {role.device_bytes / GiB:.1f} GiB per device, which has "
                    f"{devices.memory / GiB:.1f} GiB; {_fix(role)} (nrl plan shows the prediction)")
    return None


def _fix(role: RolePlan) -> str:
    return role.knob or "use more devices"


def _training_role(name: str, policy: Mapping[str, Any], spec: Any, world: int, device: str, *, trains: bool,
                   reference: bool, placement: str) -> TrainingRole:
    section = policy.get(spec.config_key) or {}
    layout_fn = getattr(spec, "memory_layout", None)
    layout = import_object(layout_fn)(policy, world, device) if layout_fn else StateLayout()
    key = f"policy.{spec.config_key}" if name == "policy" else f"{name}.{spec.config_key}"
    advice = f"lower policy.{'train_micro_batch_size' if trains else 'logprob_batch_size'}"
    advice += "".join(f" or raise {key}.{k}" for k in spec.parallel_size_keys[:1] if k in section)
    return TrainingRole(name, layout, trains, micro_batch_tokens(policy, train=trains), reference=reference,
                        placement=placement if layout_fn else placement + "; the backend declares no memory layout: "
                                                                        "counted whole on every rank",
                        advice=advice)


def _engine_role(policy: Mapping[str, Any], generation: Mapping[str, Any], spec: Any, topo: Any) -> EngineRole:
    section = generation.get(spec.config_key) or {}
    precision = section.get("precision") or policy.get("precision") or "bfloat16"
    weight_bytes = DTYPE_BYTES.get(str(precision), 2)
    kv_bytes = KV_BYTES.get(str(section.get("kv_cache_dtype") or "auto"), weight_bytes)
    max_len = int(section.get("max_model_len") or policy.get("max_total_sequence_length") or 1)
    return EngineRole(tensor_parallel=topo.engine_size, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                      memory_fraction=float(section.get("gpu_memory_utilization") or 0.9), max_model_len=max_len,
                      placement=f"{topo.num_engines} engines of {topo.engine_size} ranks")


def _uses_reference(config: Mapping[str, Any], pm: Any, algorithms: Sequence[str]) -> bool:
    """Whether the policy of a run of ``algorithms`` keeps the reference weights (AlgorithmSpec's
    ``reference_policy``); when none is named, yes."""
    specs = [pm.algorithms().get(name, "algorithm") for name in algorithms]
    return not specs or any(spec.uses_reference_policy(config) for spec in specs)


def check_plan(config: Mapping[str, Any], pm: Any, *, device_gib: float | None = None,
               here_only: bool = False, algorithms: Sequence[str] = ()) -> MemoryPlan | str:
    """For ``nrl config check``: the plan, or why there is none (a model whose config is not
    here). Raises the one-line refusal when it cannot fit. ``here_only`` (``nrl train``, which has
    no way to say otherwise): refuse only a run whose devices are this machine's, not a cluster's
    measured on the driver."""
    try:
        plan = plan_memory(config, pm, device_gib=device_gib, algorithms=algorithms)
    except NrlError as exc:  # the model's config not here, a plugin's layout that does not import
        return f"no memory plan: {exc}"
    except Exception as exc:  # a plan the planner cannot make (a config it does not model) blocks no run
        if not here_only:
            raise
        return f"no memory plan: {type(exc).__name__}: {exc}"
    if here_only and not plan.devices.here:
        return plan
    problem = refusal(plan)
    if problem is not None:
        raise NrlError(f"memory: {problem}")
    return plan

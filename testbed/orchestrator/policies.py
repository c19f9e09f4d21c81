"""The policies a run compares (pure): static layouts, and policies composed of plug-ins (a dispatcher, a
planner, a balancer: testbed.orchestrator.interfaces), the built-in ones (``planner``, ``balancer``,
``orchestrrl``) defined by composition exactly as a user's (``orchestrator.policies`` in a scenario, or
``compare --policies 'mine[planner=pkg.mod:Cls,planner.threshold=1.1]'``); and the layouts a server may take.
Their settings are the scenario's ``orchestrator:`` section, typed and validated when the scenario loads
(emulation.orchestration); the plug-ins they name are resolved and their parameters validated here, before
anything starts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import yaml

from agents.engine import Layout, dense_layouts
from emulation.orchestration import POLICY_ROLES, EngineSettings, PolicySpec
from emulation.validation import SpecError, from_dict

from .interfaces import OFF, ROLES, Component

# the built-in adaptive policies, composed as a user composes one. The balancer alone runs on the static layout
# tuned for it (``start: best``): it cannot pick a layout and its placement bound does (testbed.runs.oracle);
# the tuned static's layout can leave it nothing to balance (MoE: TP8x1, one replica per server; 0.88-0.91 of
# that bound there, 0.92-0.97 on the TP1x8 its tuning picks; docs/orchestrator.md "The balancer's layout")
BUILTIN_POLICIES = {
    "planner": PolicySpec("planner", planner="forecast"),
    "balancer": PolicySpec("balancer", balancer="load-index", start="best"),
    "orchestrrl": PolicySpec("orchestrrl", planner="forecast", balancer="load-index"),
}
POLICIES = ("static-low", "static-high", *BUILTIN_POLICIES)


@dataclass(frozen=True)
class Policy:
    """``name``; ``layout``: a fixed layout (None: the planner picks it at every step); the ``planner`` and the
    ``balancer`` (resolved plug-ins: :class:`~testbed.orchestrator.interfaces.Component`; None: off);
    ``max_num_seqs``: the engines' max_num_seqs for this policy (a static configuration of the tuning grid,
    ``static-TP8x1@1024``, and every composed policy: the tuned one's; None: the scenario's
    ``orchestrator.engine.max_num_seqs``); ``dispatch``: its own dispatcher (None: the scenario's
    ``orchestrator.dispatch``); ``start``: where a planner's servers start, their weights loaded in it (the
    tuned static layout: the planner's first step keeps it unless another is predicted faster by its margin,
    as the switch oracle's bound starts from it; None: the smallest TP that fits). ``tune_start``: the layout
    (a planner's ``start``, else ``layout``) is still to be tuned for this policy (``start: best``:
    testbed.runs.experiment.Experiment.policy runs it from every feasible layout); ``start_tuning``: what that
    tuning measured, (layout name, mean step makespan s) per layout tried."""

    name: str
    layout: Layout | None
    planner: Component | None = None
    balancer: Component | None = None
    max_num_seqs: int | None = None
    dispatch: Component | None = None
    start: Layout | None = None
    tune_start: bool = False
    start_tuning: tuple = ()

    @property
    def start_layout(self) -> Layout | None:
        """The layout the servers are loaded in before the first step (None: the smallest TP that fits)."""
        return self.layout or self.start

    def engine(self, base: EngineSettings) -> EngineSettings:
        """The engine settings this policy runs with."""
        if self.max_num_seqs is None or self.max_num_seqs == base.max_num_seqs:
            return base
        return dataclasses.replace(base, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=max(base.max_num_batched_tokens, self.max_num_seqs))

    @property
    def static(self) -> bool:
        return not (self.planner or self.balancer or self.dispatch)

    @property
    def oracle_kind(self) -> str | None:
        """The oracle bound its speedup is read against (testbed.runs.oracle): ``switch`` for a planner alone,
        ``placement`` for placement alone (a balancer, a dispatcher), ``both`` for a planner with either;
        None for a static configuration."""
        if self.static:
            return None
        if self.planner:
            return "both" if (self.balancer or self.dispatch) else "switch"
        return "placement"


def feasible_layouts(cm, gpus: int, engine: EngineSettings, prompt: int, cap: int) -> list[Layout]:
    """Dense layouts whose replicas hold the weights and at least one request of the longest length."""
    out = []
    for lay in dense_layouts(gpus):
        kv = cm.kv_capacity_tokens(lay.tp, reserve=1.0 - engine.gpu_memory_utilization)
        if kv >= prompt + cap + engine.block_size:
            out.append(lay)
    return out


MAX_NUM_SEQS_LIMIT = 65536  # a static configuration's max_num_seqs (engines allocate slots for it)


def resolve_component(role: str, ref: str | None, params: Mapping | None, field: str) -> Component | None:
    """The plug-in ``ref`` names for ``role`` (dispatch, planner, balancer), its ``params`` validated; None
    for ``none`` (or no dispatch: the scenario's). SpecError naming ``field`` otherwise."""
    if ref is None or ref == OFF:
        return None
    reg = ROLES[role]
    cls = reg.resolve(ref, f"{field}.{role}")
    return Component(ref, cls, reg.params(cls, params, f"{field}.params.{role}"))


def compose(spec: PolicySpec, field: str, layout: Layout | None = None, max_num_seqs: int | None = None) -> Policy:
    """The policy ``spec`` defines, every part resolved (``field``: where it was defined, for errors).
    ``layout``/``max_num_seqs``: the tuned static configuration: a policy without a planner runs on it; one
    with a planner runs at its max_num_seqs (a planner changes layouts, not engine settings) and starts from
    its layout. Until 2026-12-06 a planner started from the smallest TP and the scenario's max_num_seqs: on
    near-uniform, whose tuned static is TP4x2@128 under the vllm-v1 engine profile, the planner and
    orchestrrl ran at 0.941 of the static they are measured against."""
    parts = {r: resolve_component(r, getattr(spec, r), spec.params.get(r), field) for r in POLICY_ROLES}
    return started(Policy(spec.name, None, parts["planner"], parts["balancer"], max_num_seqs, parts["dispatch"]),
                   layout)


def scenario_dispatch(settings) -> Component:
    """The scenario's ``orchestrator.dispatch``, resolved (every policy without its own deals with it)."""
    return resolve_component("dispatch", settings.dispatch, None, "orchestrator")


def defined_policies(settings) -> dict[str, PolicySpec]:
    """Every composed policy by name: the built-in ones and the scenario's ``orchestrator.policies`` (a name
    taken by a built-in is a SpecError)."""
    out = dict(BUILTIN_POLICIES)
    for i, p in enumerate(getattr(settings, "policies", ()) or ()):
        if p.name in out:
            raise SpecError(f"orchestrator.policies[{i}].name", f"{p.name!r} names a built-in policy")
        out[p.name] = p
    return out


def check_plugins(settings) -> None:
    """Every plug-in the scenario names resolves and its parameters are valid (SpecError naming the field):
    what ``run`` and ``compare`` check before anything starts."""
    scenario_dispatch(settings)
    for i, p in enumerate(settings.policies):
        compose(p, f"orchestrator.policies[{i}]")


def parse_policy_arg(text: str) -> PolicySpec | str:
    """One item of ``compare --policies``: a name, or ``NAME[role=ref,role.param=value,...]`` (values as YAML),
    a policy defined on the command line (SpecError naming ``--policies``)."""
    name, bracket, rest = text.partition("[")
    if not bracket:
        return text
    if not rest.endswith("]"):
        raise SpecError("--policies", f"{text!r}: a definition NAME[role=ref,...] must end with ']'")
    data: dict = {"name": name, "params": {}}
    for item in _split(rest[:-1]):
        key, eq, val = item.partition("=")
        key = key.strip()
        role, dot, param = key.partition(".")
        if eq and key == "start":
            data["start"] = val.strip()
            continue
        if not eq or role not in POLICY_ROLES:
            raise SpecError("--policies", f"{text!r}: expected role=ref, role.param=value (a role of "
                                          f"{', '.join(POLICY_ROLES)}) or start=LAYOUT, got {item!r}")
        if dot:
            data["params"].setdefault(role, {})[param] = yaml.safe_load(val)
        else:
            data[role] = val.strip()
    return from_dict(PolicySpec, data, f"--policies.{name}")


def _split(text: str) -> list[str]:
    """``text`` split at commas outside brackets and quotes."""
    out, depth, cur, quote = [], 0, "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    return [x for x in out + [cur] if x.strip()]


def split_policies(text: str) -> list[str]:
    """``compare --policies``'s items (commas inside a definition's brackets do not split; empty items dropped);
    SpecError where none is left (``--policies ,`` ran every default policy, as if the flag were not given)."""
    items = [x.strip() for x in _split(text) if x.strip()]
    if not items:
        raise SpecError("--policies", f"a comma-separated list of policy names or definitions, got {text!r}")
    return items


def make_policy(name: str | PolicySpec, layouts: list[Layout], gpus: int, tuned: Policy | None = None,
                defined: Mapping[str, PolicySpec] | None = None) -> Policy:
    """``static-low`` (the smallest TP that fits: many replicas, veRL's throughput set-up), ``static-high``
    (the largest TP: the latency set-up), ``static-TP<t>x<r>`` (any layout) and ``static-TP<t>x<r>@<n>`` (with
    ``max_num_seqs`` n), ``static-tuned`` (``tuned``: the best of the tuning grid, testbed.runs.tuning), or a
    composed policy: one of ``defined`` (default: the built-in ones, :data:`BUILTIN_POLICIES`) or a
    :class:`PolicySpec`. A composed policy without a planner runs on the tuned static configuration (or
    static-low's layout when there is none); one with a planner starts from it (:func:`compose`). A definition's
    ``start`` replaces that layout (a planner starts from it, a policy without one runs on it), at the tuned
    max_num_seqs; ``start: best`` leaves it to be tuned for the policy (``tune_start``), as the built-in
    ``balancer``'s is."""
    if not layouts:
        raise SpecError("workload", "no layout of a server holds the model and one longest response")
    low, high = layouts[0], layouts[-1]
    defined = BUILTIN_POLICIES if defined is None else defined
    spec = _composed(name, defined)
    if spec is not None:
        field = f"--policies.{spec.name}" if isinstance(name, PolicySpec) else f"policy {spec.name!r}"
        base = tuned if tuned is not None else Policy("static-low", low)
        pol = compose(spec, field, base.layout, base.max_num_seqs)
        if spec.start == START_BEST:
            pol = dataclasses.replace(pol, tune_start=True)
        elif spec.start is not None:
            try:
                start = Layout.parse(spec.start, gpus, f"{field}.start")
            except SpecError as e:
                raise SpecError(e.field, f"{e.message}, or '{START_BEST}' (the layout tuned for the policy)") from None
            if start not in layouts:
                raise SpecError(f"{field}.start", f"{spec.start}: that layout does not hold the model and the "
                                                  f"longest response")
            pol = started(pol, start)
        return pol
    if name == "static-low":
        return Policy(name, low)
    if name == "static-high":
        return Policy(name, high)
    if name == "static-tuned":
        if tuned is None:
            raise SpecError("policy", "static-tuned needs the tuning grid (orchestrrl compare computes it)")
        return dataclasses.replace(tuned, name=name)
    if name.startswith("static-"):
        text, _, mns = name[len("static-"):].partition("@")
        lay = Layout.parse(text, gpus, "policy")
        if lay not in layouts:
            raise SpecError("policy", f"{name}: that layout does not hold the model and the longest response")
        n = None
        if mns:
            if not (mns.isascii() and mns.isdigit()) or not 1 <= int(mns) <= MAX_NUM_SEQS_LIMIT:
                raise SpecError("policy", f"{name}: max_num_seqs after '@' must be an integer in "
                                          f"1..{MAX_NUM_SEQS_LIMIT}, got {mns!r}")
            n = int(mns)
        return Policy(name, lay, max_num_seqs=n)
    raise SpecError("policy", f"unknown policy {name!r} (known: {', '.join(['static-low', 'static-high', *defined])}, "
                              f"static-tuned, static-TP<t>x<r>, static-TP<t>x<r>@<max_num_seqs> or a definition "
                              f"NAME[planner=pkg.mod:Class,...])")


START_BEST = "best"  # a definition's ``start``: the layout tuned for the policy itself


def started(pol: Policy, layout: Layout) -> Policy:
    """``pol`` loaded in ``layout`` before the first step: a planner's start, or the one layout of a policy
    without a planner."""
    if pol.planner:
        return dataclasses.replace(pol, start=layout)
    return dataclasses.replace(pol, layout=layout)


def needs_tuning(name: str | PolicySpec, defined: Mapping[str, PolicySpec] | None = None) -> bool:
    """Whether the policy runs on, or starts from, the tuned static configuration (static-tuned, or any
    composed policy): the tuning grid comes first."""
    spec = _composed(name, BUILTIN_POLICIES if defined is None else defined)
    return spec is not None or name == "static-tuned"


def _composed(name: str | PolicySpec, defined: Mapping[str, PolicySpec]) -> PolicySpec | None:
    """The definition of a composed policy (given, or one of ``defined`` by name); None for a static one."""
    if isinstance(name, PolicySpec):
        return name
    return defined.get(name)

"""Invariants of the AWS deployment (``infra/*.tf``), checked on the parsed HCL.

No terraform binary and no AWS account: python-hcl2 parses the files, and each invariant is a
checker returning the problems it finds. Every checker runs twice: on the real configuration
(no problems) and on a variant with one thing broken (the problem is reported), so none of them
can pass by looking at nothing. The list is mirrored in infra/README.md ("Invariants").

Values are resolved the way Terraform would for the defaults: ``var.x`` is the variable's
default, ``local.x`` the local's value, arithmetic with floor/ceil is evaluated exactly. Whatever
cannot be resolved that way raises ``Unresolved`` (the test fails), never passes silently.
"""

from __future__ import annotations

import ast
import copy
import functools
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import hcl2
import pytest
from pydantic import SecretStr

from gateway.config import Settings
from tests.support.paths import REPO

ROOT = REPO
INFRA = ROOT / "infra"

# python-hcl2 >= 8: strings without their quotes, blocks as plain lists of dicts, no comments.
_OPTIONS = hcl2.SerializationOptions(
    strip_string_quotes=True, explicit_blocks=False, with_comments=False
)

# ECS limits (Amazon ECS developer guide, task definition parameters / target groups).
ECS_MAX_STOP_TIMEOUT_S = 120
DRAIN_GRACE_MARGIN_S = 5  # the gateway must exit before SIGKILL, not at the same instant
TARGET_GROUP_MAX_DEREGISTRATION_S = 3600
ALB_MAX_IDLE_TIMEOUT_S = 4000
MIN_HEALTH_CHECK_GRACE_S = 120
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD")


# --- loading --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def parse_hcl(text: str) -> dict[str, Any]:
    """Parse HCL text into python-hcl2's dict form (raises on a syntax error). Cached: a broken
    variant re-parses only the file it changes; callers never mutate the result."""
    return hcl2.loads(text, serialization_options=_OPTIONS)


@dataclass
class Module:
    """The blocks of one Terraform module, merged across its files."""

    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    resources: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    data: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_files: dict[tuple[str, str], str] = field(default_factory=dict)

    def of_type(self, kind: str) -> dict[str, dict[str, Any]]:
        """Resources of one type, by name."""
        return {name: body for (k, name), body in self.resources.items() if k == kind}


def load_module(texts: Mapping[str, str]) -> Module:
    """Merge the parsed files (name -> HCL text) of one module."""
    module = Module()
    for filename, text in texts.items():
        parsed = parse_hcl(text)
        for block in parsed.get("variable", []):
            module.variables.update(block)
        for block in parsed.get("locals", []):
            module.locals.update(block)
        for block in parsed.get("output", []):
            module.outputs.update(block)
        for target, section in ((module.resources, "resource"), (module.data, "data")):
            for block in parsed.get(section, []):
                for kind, named in block.items():
                    for name, body in named.items():
                        target[(kind, name)] = body
                        if section == "resource":
                            module.resource_files[(kind, name)] = filename
    return module


def infra_texts() -> dict[str, str]:
    """The deployed module: infra/*.tf (infra/sip/ is the SIP proxy's, not this module)."""
    return {path.name: path.read_text() for path in sorted(INFRA.glob("*.tf"))}


@functools.cache
def real_texts() -> dict[str, str]:
    """The deployed module's files, read once (when a test first asks, not at collection)."""
    return infra_texts()


@functools.cache
def real() -> Module:
    """The deployed module, parsed once (callers never mutate it)."""
    return load_module(real_texts())


def mutated(filename: str, old: str, new: str) -> Module:
    """The real module with one exact, unique piece of one file replaced."""
    text = real_texts()[filename]
    assert text.count(old) == 1, f"{old!r} must occur exactly once in {filename}"
    return load_module({**real_texts(), filename: text.replace(old, new)})


# --- expressions ----------------------------------------------------------------------------------


class Unresolved(ValueError):
    """An expression that cannot be resolved from literals and defaults."""


def inner(value: object) -> str | None:
    """The expression inside a ``${...}`` wrapper, or None for anything else."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return value[2:-1].strip()
    return None


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "floor": math.floor,
    "ceil": math.ceil,
    "min": min,
    "max": max,
}


def evaluate(expression: str, names: Mapping[str, object]) -> Fraction:
    """Evaluate Terraform arithmetic exactly: numbers, + - * /, parentheses, floor/ceil/min/max,
    and ``var.x`` / ``local.x`` references looked up in ``names``."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return Fraction(_BINARY[type(node.op)](walk(node.left), walk(node.right)))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            return Fraction(_FUNCTIONS[node.func.id](*(walk(arg) for arg in node.args)))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("var", "local")
        ):
            ref = f"{node.value.id}.{node.attr}"
            if ref not in names:
                raise Unresolved(f"{ref} has no value here")
            value = names[ref]
            if isinstance(value, bool) or not isinstance(value, int | float | Fraction):
                raise Unresolved(f"{ref} = {value!r} is not a number")
            return Fraction(value)
        raise Unresolved(f"not plain arithmetic: {ast.unparse(node)}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise Unresolved(f"not plain arithmetic: {expression}") from exc
    return walk(tree)


def resolve(value: object, module: Module, depth: int = 0) -> Any:
    """Resolve a parsed value for the defaults: literals, ``var.x``, ``local.x``,
    ``tostring(...)`` and arithmetic over those."""
    if depth > 20:
        raise Unresolved("reference cycle")
    expression = inner(value)
    if expression is None:
        if isinstance(value, str) and "${" in value:
            raise Unresolved(f"template {value!r}")
        return value
    if m := re.fullmatch(r"var\.(\w+)", expression):
        variable = module.variables.get(m[1])
        if variable is None or "default" not in variable:
            raise Unresolved(f"var.{m[1]} has no default")
        return variable["default"]
    if m := re.fullmatch(r"local\.(\w+)", expression):
        if m[1] not in module.locals:
            raise Unresolved(f"local.{m[1]} is not defined")
        return resolve(module.locals[m[1]], module, depth + 1)
    if m := re.fullmatch(r"tostring\((.+)\)", expression):
        resolved = resolve("${" + m[1] + "}", module, depth + 1)
        if isinstance(resolved, Fraction):
            resolved = int(resolved) if resolved.denominator == 1 else float(resolved)
        return str(resolved)
    names: dict[str, object] = {}
    for ref in set(re.findall(r"\b(?:var|local)\.\w+", expression)):
        names[ref] = resolve("${" + ref + "}", module, depth + 1)
    return evaluate(expression, names)


def number(value: object, module: Module) -> Fraction:
    """Resolve to a number or raise Unresolved."""
    resolved = resolve(value, module)
    if isinstance(resolved, bool) or not isinstance(resolved, int | float | Fraction):
        raise Unresolved(f"{value!r} resolves to {resolved!r}, not a number")
    return Fraction(resolved)


def local_refs(expression: str) -> set[str]:
    """Names of the locals an expression refers to."""
    return set(re.findall(r"\blocal\.(\w+)", expression))


def single(module: Module, kind: str) -> tuple[str, dict[str, Any]]:
    """The one resource of a type."""
    found = module.of_type(kind)
    assert len(found) == 1, f"expected one {kind}, found {sorted(found)}"
    return next(iter(found.items()))


def first(blocks: object) -> dict[str, Any]:
    """The body of a block that occurs once (python-hcl2 gives blocks as lists)."""
    return blocks[0] if isinstance(blocks, list) and blocks else {}


# --- containers -----------------------------------------------------------------------------------


def containers(module: Module) -> dict[str, dict[str, Any]]:
    """The task definition's containers (name -> HCL object). The container definitions must be
    ``jsonencode([local.a, local.b, ...])`` over HCL object locals, so they are checkable here."""
    _, task = single(module, "aws_ecs_task_definition")
    expression = inner(task.get("container_definitions")) or ""
    m = re.fullmatch(r"jsonencode\(\[\s*(local\.\w+(?:\s*,\s*local\.\w+)*)\s*,?\s*\]\)", expression)
    assert m, f"container_definitions is not jsonencode([local...]): {expression!r}"
    found = {}
    for ref in re.findall(r"local\.(\w+)", m[1]):
        container = module.locals[ref]
        assert isinstance(container, dict), f"local.{ref} is not an HCL object"
        found[container["name"]] = container
    return found


def gateway_container(module: Module) -> dict[str, Any]:
    """The container that runs the gateway."""
    return containers(module)["gateway"]


def mapping_local(module: Module, list_expression: object, what: str) -> dict[str, Any]:
    """The name -> value map behind ``[for k, v in local.x : {...}]``: local.x is a merge of
    HCL object locals (each included, conditional or not) and at most ``var.extra_environment``."""
    expression = inner(list_expression) or ""
    m = re.fullmatch(r"\[for (\w+), (\w+) in local\.(\w+) : \{.*\}\]", expression)
    assert m, f"{what} is not derived from a local map: {expression!r}"
    merged = module.locals[m[3]]
    merged_expression = inner(merged)
    if merged_expression is None:
        assert isinstance(merged, dict)
        return dict(merged)
    found: dict[str, Any] = {}
    for ref in sorted(local_refs(merged_expression)):
        part = module.locals[ref]
        assert isinstance(part, dict), f"local.{ref} in {what} is not an HCL object"
        found.update(part)
    return found


# --- the checkers ---------------------------------------------------------------------------------


def variable_problems(module: Module) -> list[str]:
    """Every variable has a non-empty description and a type."""
    problems = []
    for name, body in module.variables.items():
        description = body.get("description")
        if not isinstance(description, str) or not description.strip():
            problems.append(f"variable {name}: no description")
        if not body.get("type"):
            problems.append(f"variable {name}: no type")
    return problems


def gpu_problems(module: Module) -> list[str]:
    """The task reserves exactly one GPU, on the gateway container."""
    problems = []
    total = 0
    for name, container in containers(module).items():
        for requirement in container.get("resourceRequirements", []):
            if requirement.get("type") == "GPU":
                count = int(resolve(requirement.get("value"), module))
                total += count
                if name != "gateway":
                    problems.append(f"container {name} reserves a GPU")
    requirements = gateway_container(module).get("resourceRequirements", [])
    gateway_gpus = [r for r in requirements if r.get("type") == "GPU"]
    if len(gateway_gpus) != 1 or resolve(gateway_gpus[0].get("value"), module) != "1":
        problems.append(f"gateway container GPU requirement is {gateway_gpus}, not one GPU")
    if total != 1:
        problems.append(f"the task reserves {total} GPUs, not 1")
    return problems


def alb_idle_problems(module: Module) -> list[str]:
    """ALB idle timeout > 60 s, <= the ALB maximum, and >= the longest call."""
    albs = {n: b for n, b in module.of_type("aws_lb").items()
            if b.get("load_balancer_type", "application") == "application"}
    if len(albs) != 1:
        return [f"expected one ALB, found {sorted(albs)}"]
    (alb,) = albs.values()
    idle = number(alb.get("idle_timeout", 60), module)
    longest = number(module.variables["max_call_duration_s"].get("default"), module)
    problems = []
    if not 60 < idle <= ALB_MAX_IDLE_TIMEOUT_S:
        problems.append(f"ALB idle timeout {idle} s is not in (60, {ALB_MAX_IDLE_TIMEOUT_S}]")
    if idle < longest:
        problems.append(f"ALB idle timeout {idle} s is shorter than the longest call {longest} s")
    return problems


def health_check_problems(module: Module) -> list[str]:
    """Every target group health-checks /readyz over HTTP, so warming-up and draining tasks get
    no new traffic."""
    problems = []
    groups = module.of_type("aws_lb_target_group")
    if not groups:
        return ["no target group"]
    for name, group in groups.items():
        check = first(group.get("health_check"))
        if check.get("path") != "/readyz" or check.get("protocol", "HTTP") != "HTTP":
            problems.append(f"target group {name} health check is {check}, not HTTP /readyz")
    return problems


def deployment_options(module: Module) -> dict[str, tuple[object, object]]:
    """(minimum healthy, maximum) percent expressions per deployment strategy: literals on the
    service, or the deployment_percents map selected by var.deployment_strategy."""
    _, service = single(module, "aws_ecs_service")
    low = service.get("deployment_minimum_healthy_percent")
    high = service.get("deployment_maximum_percent")
    if inner(low) is None and inner(high) is None:
        return {"literal": (low, high)}
    for key, value in (("minimum_healthy", low), ("maximum", high)):
        pointer = module.locals.get(next(iter(local_refs(inner(value) or "")), ""), None)
        expected = f"local.deployment_percents[var.deployment_strategy].{key}"
        assert inner(pointer) == expected, f"service percent {value!r} does not select {expected}"
    strategies = module.locals["deployment_percents"]
    validation = first(module.variables["deployment_strategy"].get("validation"))
    allowed = set(re.findall(r'"([a-z_]+)"', inner(validation.get("condition")) or ""))
    assert allowed == set(strategies), f"validation allows {allowed}, map has {set(strategies)}"
    return {name: (body["minimum_healthy"], body["maximum"]) for name, body in strategies.items()}


def can_progress(tasks: int, minimum_healthy: Fraction, maximum: Fraction) -> bool:
    """Whether ECS can make a step in a rolling deployment of ``tasks`` tasks when each holds a
    whole single-GPU host: stop one first (it keeps ceil(N * min / 100) running) or start one
    first (it runs at most floor(N * max / 100))."""
    return (
        math.ceil(tasks * minimum_healthy / 100) < tasks
        or math.floor(tasks * maximum / 100) > tasks
    )


def deployment_problems(module: Module, largest_fleet: int = 12) -> list[str]:
    """No deployment strategy can deadlock on GPU ownership, for any min_replicas up to
    ``largest_fleet`` and any fleet size the autoscaler may reach from there; and the GPU
    auto-scaling group may grow to the deployment's peak task count."""
    problems = []
    for strategy, (low, high) in deployment_options(module).items():
        for min_replicas in range(1, largest_fleet + 1):
            names = {"var.min_replicas": min_replicas}
            low_pct = evaluate(inner(low) or str(low), names)
            high_pct = evaluate(inner(high) or str(high), names)
            for tasks in range(min_replicas, largest_fleet + 1):
                if not can_progress(tasks, low_pct, high_pct):
                    problems.append(
                        f"{strategy}: min {low_pct}% / max {high_pct}% deadlocks {tasks} task(s)"
                        f" (min_replicas {min_replicas})"
                    )
                    break
            if "asg_max_size" in module.locals:
                for max_replicas in range(min_replicas, largest_fleet + 1):
                    peak = math.floor(max_replicas * high_pct / 100)
                    size = evaluate(inner(module.locals["asg_max_size"]) or "", {
                        "var.max_replicas": max_replicas,
                        "local.deployment_maximum_percent": high_pct,
                    })
                    if size < peak:
                        problems.append(f"{strategy}: ASG max {size} < deployment peak {peak}")
                        break
    return problems


def circuit_breaker_problems(module: Module) -> list[str]:
    """The deployment circuit breaker is on and rolls back."""
    _, service = single(module, "aws_ecs_service")
    breaker = first(service.get("deployment_circuit_breaker"))
    if breaker.get("enable") is not True or breaker.get("rollback") is not True:
        return [f"deployment_circuit_breaker is {breaker}, not enable + rollback"]
    return []


def grace_problems(module: Module) -> list[str]:
    """The service ignores load balancer health checks long enough for model load and CUDA graph
    capture."""
    _, service = single(module, "aws_ecs_service")
    grace = number(service.get("health_check_grace_period_seconds", 0), module)
    if grace < MIN_HEALTH_CHECK_GRACE_S:
        return [f"health_check_grace_period_seconds {grace} < {MIN_HEALTH_CHECK_GRACE_S}"]
    return []


_SECRET_REF = re.compile(
    r"var\.\w+_secret_arn|aws_secretsmanager_secret\.\w+(?:\[\d+\])?\.arn|local\.\w+"
)


def secret_arn_problems(value: object, module: Module, what: str, depth: int = 0) -> list[str]:
    """``value`` refers to Secrets Manager secret ARNs only (through locals, to
    ``var.*_secret_arn`` or ``aws_secretsmanager_secret.*.arn``)."""
    expression = inner(value)
    if expression is None or depth > 10:
        return [f"{what} = {value!r} is not a reference to a Secrets Manager secret"]
    refs = re.findall(r"\b(?:var|local|aws_\w+|data)\.[\w\[\]\.]+", expression)
    problems = []
    for ref in refs:
        m = _SECRET_REF.fullmatch(ref)
        if not m:
            problems.append(f"{what} refers to {ref}, not a secret ARN")
        elif ref.startswith("local."):
            problems += secret_arn_problems(module.locals.get(ref[6:]), module, ref, depth + 1)
    return problems if refs else [f"{what} = {value!r} refers to no secret"]


def secret_problems(module: Module) -> list[str]:
    """The Twilio auth token reaches the gateway through ``secrets`` from a Secrets Manager ARN."""
    container = gateway_container(module)
    secrets = mapping_local(module, container.get("secrets"), "secrets")
    problems = []
    if "GATEWAY_TWILIO_AUTH_TOKEN" not in secrets:
        problems.append("GATEWAY_TWILIO_AUTH_TOKEN is not among the container's secrets")
    for name, arn in secrets.items():
        problems += secret_arn_problems(arn, module, name)
    return problems


def environment_problems(module: Module) -> list[str]:
    """No plain environment value is a secret, and every GATEWAY_* name is a real setting."""
    container = gateway_container(module)
    environment = mapping_local(module, container.get("environment"), "environment")
    fields = {f"GATEWAY_{name.upper()}": info for name, info in Settings.model_fields.items()}
    problems = []
    for name in environment:
        if any(word in name.upper() for word in SECRET_WORDS):
            problems.append(f"plain environment variable {name} looks like a secret")
        if name.startswith("GATEWAY_"):
            info = fields.get(name)
            if info is None:
                problems.append(f"{name} is not a gateway setting (gateway/config.py)")
            elif SecretStr in (getattr(info.annotation, "__args__", ()) or (info.annotation,)):
                problems.append(f"{name} is a secret setting but is a plain environment value")
    return problems


def secret_policy_problems(module: Module) -> list[str]:
    """The permission to read secrets is scoped to the container's secret ARNs, never "*"."""
    problems = []
    statements: list[tuple[str, dict[str, Any]]] = []
    for (kind, name), body in module.data.items():
        if kind != "aws_iam_policy_document":
            continue
        statements += [(name, s) for s in body.get("statement", [])]
        for dynamic in body.get("dynamic", []):
            if "statement" in dynamic:
                statements += [(name, c) for c in dynamic["statement"].get("content", [])]
    reading = [(n, s) for n, s in statements
               if any(str(a).startswith("secretsmanager:") for a in s.get("actions", []))]
    if not reading:
        problems.append("no policy statement grants secretsmanager:GetSecretValue")
    for name, statement in reading:
        resources = statement.get("resources")
        if isinstance(resources, list):
            items = resources
        else:
            m = re.fullmatch(r"values\(local\.(\w+)\)", inner(resources) or "")
            if not m:
                problems.append(f"policy {name}: secret resources {resources!r} not checkable")
                continue
            items = list(resolve_map(module, m[1]).values())
        for item in items:
            if item == "*" or (isinstance(item, str) and "*" in item and inner(item) is None):
                problems.append(f"policy {name}: secret access on {item!r}")
            else:
                problems += [f"policy {name}: {p}" for p in
                             secret_arn_problems(item, module, "resource")]
    return problems


def resolve_map(module: Module, name: str) -> dict[str, Any]:
    """A map local: an HCL object, or a merge of HCL object locals."""
    value = module.locals[name]
    if isinstance(value, dict):
        return value
    found: dict[str, Any] = {}
    for ref in sorted(local_refs(inner(value) or "")):
        part = module.locals[ref]
        assert isinstance(part, dict), f"local.{ref} is not an HCL object"
        found.update(part)
    return found


def _conditional_on_sip(body: dict[str, Any]) -> bool:
    switch = inner(body.get("count")) or inner(body.get("for_each")) or ""
    return "var.sip_enabled" in switch


def nlb_problems(module: Module) -> list[str]:
    """The SIP NLB and everything about it exist only with sip_enabled, and carry UDP."""
    problems = []
    for (kind, name), body in module.resources.items():
        is_nlb = kind == "aws_lb" and body.get("load_balancer_type") == "network"
        is_udp_rule = (kind.startswith("aws_vpc_security_group_")
                       and str(body.get("ip_protocol")).lower() == "udp")
        in_nlb_file = module.resource_files.get((kind, name)) == "nlb.tf"
        if (is_nlb or is_udp_rule or in_nlb_file) and not _conditional_on_sip(body):
            problems.append(f"{kind}.{name} is not conditional on var.sip_enabled")
    nlbs = [name for name, body in module.of_type("aws_lb").items()
            if body.get("load_balancer_type") == "network"]
    if not nlbs:
        problems.append("no network load balancer for SIP")
    for name, listener in module.of_type("aws_lb_listener").items():
        if any(f"aws_lb.{n}" in str(listener.get("load_balancer_arn")) for n in nlbs):
            if listener.get("protocol") != "UDP":
                problems.append(f"NLB listener {name} is {listener.get('protocol')}, not UDP")
    for name, group in module.of_type("aws_lb_target_group").items():
        if _conditional_on_sip(group) and group.get("protocol") != "UDP":
            problems.append(f"SIP target group {name} is {group.get('protocol')}, not UDP")
    return problems


def twilio_routes() -> set[str]:
    """POST routes of gateway/twilio/routes.py, with the router prefix."""
    source = (ROOT / "gateway" / "twilio" / "routes.py").read_text()
    prefix = re.search(r'APIRouter\(prefix="([^"]+)"\)', source)
    posts = re.findall(r'@router\.post\("([^"]+)"\)', source)
    return {(prefix[1] if prefix else "") + path for path in posts}


def webhook_output_problems(module: Module) -> list[str]:
    """An output gives the https:// voice webhook URL to paste into Twilio, on a real route."""
    routes = twilio_routes()
    for body in module.outputs.values():
        value = body.get("value")
        if not isinstance(value, str):
            continue
        m = re.fullmatch(r"\$\{local\.(\w+)\}(/\S+)", value)
        if not m:
            continue
        base = module.locals.get(m[1])
        if isinstance(base, str) and base.startswith("https://") and m[2] == "/twilio/voice":
            if m[2] in routes:
                return []
            return [f"{m[2]} is not a route of gateway/twilio/routes.py ({sorted(routes)})"]
    return ["no output gives https://.../twilio/voice"]


def drain_problems(module: Module) -> list[str]:
    """stopTimeout <= 120 s, the gateway's drain grace fits inside it; the ALB target group drains
    for the drain window (within the target group maximum), the SIP one for no longer."""
    container = gateway_container(module)
    problems = []
    stop = number(container.get("stopTimeout", 30), module)
    if stop > ECS_MAX_STOP_TIMEOUT_S:
        problems.append(f"stopTimeout {stop} s > the ECS maximum {ECS_MAX_STOP_TIMEOUT_S} s")
    environment = mapping_local(module, container.get("environment"), "environment")
    if "GATEWAY_DRAIN_GRACE_S" not in environment:
        problems.append("GATEWAY_DRAIN_GRACE_S is not set")
    else:
        grace = Fraction(resolve(environment["GATEWAY_DRAIN_GRACE_S"], module))
        if grace + DRAIN_GRACE_MARGIN_S > stop:
            problems.append(f"drain grace {grace} s does not fit in stopTimeout {stop} s")
    window = number(module.variables["drain_window_s"].get("default"), module)
    if not 0 <= window <= TARGET_GROUP_MAX_DEREGISTRATION_S:
        problems.append(f"drain window {window} s is outside the target group range")
    for name, group in module.of_type("aws_lb_target_group").items():
        delay = group.get("deregistration_delay", 300)
        if group.get("protocol") in ("HTTP", "HTTPS"):
            # The ALB's: active WebSocket calls continue this long on a leaving task.
            if inner(delay) != "var.drain_window_s":
                problems.append(f"target group {name} deregistration_delay {delay!r} "
                                "is not var.drain_window_s")
        elif number(delay, module) > window:
            # The SIP NLB's: it keeps sending a pinned flow's INVITEs to the leaving task.
            problems.append(f"target group {name} deregistration_delay {delay!r} exceeds the "
                            "drain window")
    return problems


def scaling_metric_problems(module: Module) -> list[str]:
    """The scaling policy reads metrics the gateway really exports, which the sidecar scrapes
    from the gateway's port and publishes."""
    source = (ROOT / "gateway" / "metrics.py").read_text()
    metrics = module.locals.get("scaling_metrics", {})
    problems = []
    if not metrics:
        problems.append("no scaling metrics")
    for role, name in metrics.items():
        if f'"{name}"' not in source:
            problems.append(f"{role} metric {name} is not exported by gateway/metrics.py")
    scrape = module.locals["prometheus_scrape_config"]["scrape_configs"][0]
    target = scrape["static_configs"][0]["targets"][0]
    if target != "127.0.0.1:${var.container_port}" or scrape.get("metrics_path") != "/metrics":
        problems.append(f"the sidecar scrapes {target}{scrape.get('metrics_path')}")
    _, policy = single(module, "aws_appautoscaling_policy")
    spec = first(first(policy["target_tracking_scaling_policy_configuration"])
                 .get("customized_metric_specification"))
    used = {first(first(m.get("metric_stat")).get("metric")).get("metric_name")
            for m in spec.get("metrics", []) if m.get("metric_stat")}
    expected = {f"${{local.scaling_metrics.{role}}}" for role in metrics}
    if used != expected:
        problems.append(f"the scaling policy reads {used}, not {expected}")
    return problems


def security_group_problems(module: Module) -> list[str]:
    """The gateway's TCP port is open to load balancer security groups only; UDP only to the
    trunk's CIDRs; nothing else reaches the hosts."""
    problems = []
    for name, rule in module.of_type("aws_vpc_security_group_ingress_rule").items():
        if "aws_security_group.gpu_hosts" not in str(rule.get("security_group_id")):
            continue
        protocol = str(rule.get("ip_protocol")).lower()
        if protocol == "tcp":
            if "cidr_ipv4" in rule or "aws_security_group." not in str(
                rule.get("referenced_security_group_id")
            ):
                problems.append(f"{name}: TCP to the hosts from {rule.get('cidr_ipv4')}")
        elif protocol == "udp":
            sources = inner(rule.get("for_each")) or ""
            if rule.get("cidr_ipv4") != "${each.value}" or not re.search(
                r"var\.sip_trunk_cidrs|local\.rtp_source_cidrs", sources
            ):
                problems.append(f"{name}: UDP to the hosts not limited to the trunk's CIDRs")
        else:
            problems.append(f"{name}: protocol {protocol} into the hosts")
    return problems


CHECKERS: dict[str, Callable[[Module], list[str]]] = {
    "variables": variable_problems,
    "gpu_reservation": gpu_problems,
    "alb_idle": alb_idle_problems,
    "health_check": health_check_problems,
    "deployment": deployment_problems,
    "circuit_breaker": circuit_breaker_problems,
    "grace": grace_problems,
    "secrets": secret_problems,
    "environment": environment_problems,
    "secret_policy": secret_policy_problems,
    "nlb": nlb_problems,
    "webhook_output": webhook_output_problems,
    "drain": drain_problems,
    "scaling_metric": scaling_metric_problems,
    "security_groups": security_group_problems,
}

def with_default(variable: str, value: object) -> Module:
    """The real module with one variable's default changed."""
    module = copy.deepcopy(real())
    assert "default" in module.variables[variable]
    module.variables[variable]["default"] = value
    return module


# One broken variant per checker, built from the real module.
BROKEN: dict[str, Callable[[], Module]] = {
    "variables": lambda: mutated(
        "variables.tf", '  description = "EC2 type of the GPU hosts.', "  #"
    ),
    "gpu_reservation": lambda: mutated(
        "ecs.tf", '[{ type = "GPU", value = "1" }]', '[{ type = "GPU", value = "2" }]'
    ),
    "alb_idle": lambda: with_default("alb_idle_timeout_s", 1800),
    "health_check": lambda: mutated(
        "alb.tf", 'path                = "/readyz"', 'path = "/healthz"'
    ),
    "deployment": lambda: mutated(
        "ecs.tf",
        "minimum_healthy = floor(100 * (var.min_replicas - 1) / var.min_replicas)",
        "minimum_healthy = 50",
    ),
    "circuit_breaker": lambda: mutated("ecs.tf", "rollback = true", "rollback = false"),
    "grace": lambda: with_default("health_check_grace_s", 60),
    "secrets": lambda: mutated(
        "secrets.tf",
        "GATEWAY_TWILIO_AUTH_TOKEN = local.twilio_auth_token_secret_arn",
        "GATEWAY_TWILIO_AUTH_TOKEN = var.model_id",
    ),
    "environment": lambda: mutated(
        "ecs.tf",
        '    GATEWAY_LOG_FORMAT    = "json"\n',
        '    GATEWAY_LOG_FORMAT    = "json"\n    GATEWAY_TWILIO_AUTH_TOKEN = "x"\n',
    ),
    "secret_policy": lambda: mutated(
        "iam.tf", "resources = values(local.container_secrets)", 'resources = ["*"]'
    ),
    "nlb": lambda: mutated(
        "nlb.tf",
        'resource "aws_lb" "sip" {\n  count = var.sip_enabled ? 1 : 0\n',
        'resource "aws_lb" "sip" {\n',
    ),
    "webhook_output": lambda: mutated(
        "outputs.tf", '"${local.public_url}/twilio/voice"', '"${local.public_url}/voice"'
    ),
    "drain": lambda: mutated("ecs.tf", "stop_timeout_s = 120", "stop_timeout_s = 100"),
    "scaling_metric": lambda: mutated(
        "autoscaling.tf", 'calls = "gateway_calls_active"', 'calls = "gateway_active_calls"'
    ),
    "security_groups": lambda: mutated(
        "security_groups.tf",
        "  referenced_security_group_id = aws_security_group.alb.id\n}",
        '  cidr_ipv4 = "0.0.0.0/0"\n}',
    ),
}


# --- tests ----------------------------------------------------------------------------------------


def test_every_tf_file_parses() -> None:
    files = sorted(INFRA.rglob("*.tf"))
    assert {p.name for p in files} >= {
        "versions.tf", "variables.tf", "outputs.tf", "ecr.tf", "ecs.tf", "alb.tf", "nlb.tf",
        "autoscaling.tf", "secrets.tf", "iam.tf", "logs.tf",
    }
    for path in files:
        assert isinstance(parse_hcl(path.read_text()), dict), path
    with pytest.raises(Exception):  # noqa: B017 - lark's error types differ between versions
        parse_hcl('resource "aws_lb" "alb" {\n  name = \n')


@pytest.mark.parametrize("check", sorted(CHECKERS))
def test_invariant_holds(check: str) -> None:
    assert CHECKERS[check](real()) == []


@pytest.mark.parametrize("check", sorted(CHECKERS))
def test_invariant_rejects_a_broken_variant(check: str) -> None:
    assert CHECKERS[check](BROKEN[check]()) != [], f"{check} accepted its broken variant"


def test_deployment_checker_rejects_the_reference_deadlock() -> None:
    """min 100 / max 100 with one GPU per host (the stalled rollout) and the subtler max 150,
    which deadlocks a single replica (floor(1.5) = 1)."""
    service = 'deployment_minimum_healthy_percent = local.deployment_minimum_healthy_percent\n'
    service += '  deployment_maximum_percent         = local.deployment_maximum_percent'
    for low, high in ((100, 100), (100, 150), (50, 100)):
        broken = mutated("ecs.tf", service, f"deployment_minimum_healthy_percent = {low}\n"
                         f"  deployment_maximum_percent = {high}")
        assert any("deadlocks 1 task(s)" in p for p in deployment_problems(broken)), (low, high)
    assert deployment_problems(mutated("ecs.tf", service, "deployment_minimum_healthy_percent = 0"
                                       "\n  deployment_maximum_percent = 100")) == []


def test_deployment_checker_rejects_an_asg_too_small_for_the_surge() -> None:
    broken = mutated(
        "capacity.tf",
        "asg_max_size = floor(var.max_replicas * local.deployment_maximum_percent / 100)",
        "asg_max_size = var.max_replicas",
    )
    assert any("ASG max" in p for p in deployment_problems(broken))


def test_nlb_checker_rejects_tcp_sip() -> None:
    broken = mutated("nlb.tf", '  port              = local.sip_port\n  protocol          = "UDP"',
                     '  port              = local.sip_port\n  protocol          = "TCP"')
    assert any("not UDP" in p for p in nlb_problems(broken))


def test_environment_checker_rejects_a_misspelt_setting_and_secret_settings() -> None:
    typo = mutated("ecs.tf", "GATEWAY_LOG_FORMAT    =", "GATEWAY_LOGFORMAT     =")
    assert environment_problems(typo) == ["GATEWAY_LOGFORMAT is not a gateway setting "
                                          "(gateway/config.py)"]
    users = mutated("ecs.tf", '    GATEWAY_SIP_ALLOW = join(",", var.sip_trunk_cidrs)\n',
                    '    GATEWAY_SIP_ALLOW = join(",", var.sip_trunk_cidrs)\n'
                    '    GATEWAY_SIP_USERS = "alice:pw"\n')
    assert any("secret setting" in p for p in environment_problems(users))


def test_drain_checker_rejects_a_grace_longer_than_the_stop_timeout() -> None:
    assert drain_problems(with_default("drain_grace_s", 115)) == []
    broken = with_default("drain_grace_s", 118)
    assert any("does not fit" in p for p in drain_problems(broken))
    assert any("exceeds the drain window" in p
               for p in drain_problems(with_default("sip_deregistration_delay_s", 1200)))
    assert any("outside the target group range" in p
               for p in drain_problems(with_default("drain_window_s", 4000)))


def test_sip_resources_default_off_and_secret_arn_only_in_secrets() -> None:
    assert real().variables["sip_enabled"]["default"] is False
    text = "\n".join(real_texts().values())
    # The token's value never appears in Terraform (state would hold it): no secret version.
    assert "aws_secretsmanager_secret_version" not in text


def test_evaluator_is_exact_and_refuses_anything_but_arithmetic() -> None:
    assert evaluate("floor(100 * (var.n - 1) / var.n)", {"var.n": 3}) == 66
    assert evaluate("100 + ceil(100 / var.n)", {"var.n": 3}) == 134
    assert evaluate("ceil(3 * 67 / 100)", {}) == 3
    for bad in ("__import__('os')", "var.n if var.n else 1", "var.missing + 1", "[1][0]"):
        with pytest.raises(Unresolved):
            evaluate(bad, {"var.n": 1})


def test_resolver_follows_variables_locals_and_tostring() -> None:
    assert resolve("${tostring(var.drain_grace_s)}", real()) == "110"
    assert resolve("${local.stop_timeout_s}", real()) == 120
    assert resolve("${floor(var.max_replicas * 3 / 2)}", real()) == 6
    with pytest.raises(Unresolved):
        resolve("${var.certificate_arn}", real())  # required: no default
    with pytest.raises(Unresolved):
        resolve("${aws_lb.alb.dns_name}", real())

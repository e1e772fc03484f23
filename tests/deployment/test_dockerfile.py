"""The production Dockerfile and .dockerignore, checked without a Docker engine.

The Dockerfile is parsed by ``dockerfile-parse`` (containerbuildsystem's parser: line
continuations, ``ARG``/``ENV`` scoping per stage, global ``ARG`` before ``FROM``) and the build
context is computed by docker-py's own ``.dockerignore`` matcher (``docker.utils.build``, a port of
moby's). Each check is a function over the parsed file returning the problems it finds, empty when
there are none. Every check runs on the real files (no problems) and on a deliberately broken
variant of them (the expected problem), so none of them can pass by not looking.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import tempfile
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

import pytest
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser
from pydantic import SecretStr

from gateway.config import Settings
from tests.support.paths import REPO

REPO = REPO
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
RUN_SH = REPO / "run.sh"

#: Model load + CUDA graph capture + the warm-up generation take well over a minute on a cold
#: GPU; a shorter start period lets Docker call a healthy, still-loading gateway unhealthy.
MIN_HEALTH_START_PERIOD_S = 120.0
#: RFC 3261's default SIP port (README "SIP trunks and PBXs" binds 0.0.0.0:5060).
SIP_PORT = 5060
#: ENV/ARG names that would bake a credential into the image (its history keeps ARG values too).
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|AUTH|CREDENTIAL|PRIVATE|(^|_)(API_?)?KEY(_|$)", re.I)
#: Anything in the context matching these would ship .venv (GBs), git history, caches or secrets.
MUST_STAY_OUT = (
    ".venv/bin/python",
    ".git/HEAD",
    ".pytest_cache/v/cache/nodeids",
    ".mypy_cache/3.11/gateway.data.json",
    ".ruff_cache/CACHEDIR.TAG",
    ".hypothesis/examples/0/1",
    "gateway/__pycache__/app.cpython-311.pyc",
    "tests/__pycache__/test_x.cpython-311.pyc",
    "qwen3_tts_ivr_gateway.egg-info/PKG-INFO",
    ".env",
)


# --- the parsed Dockerfile -----------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One instruction, continuations joined, with the ARG/ENV values in scope at it."""

    kind: str
    value: str
    line: int
    args: Mapping[str, str]
    envs: Mapping[str, str]
    declared: Mapping[str, str]  # what this ARG/ENV line itself declares

    def expand(self, text: str | None = None) -> str:
        """``$NAME`` / ``${NAME}`` replaced by the in-scope ENV, else ARG, default."""
        scope = {**self.args, **self.envs}

        def value(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            return scope.get(name, match.group(0))

        return re.sub(r"\$(?:\{(\w+)\}|(\w+))", value, self.value if text is None else text)

    def flags(self) -> tuple[dict[str, str], list[str]]:
        """``--name=value`` flags and the remaining words (COPY, HEALTHCHECK, FROM)."""
        flags: dict[str, str] = {}
        words = self.expand().split()
        while words and words[0].startswith("--"):
            name, _, val = words.pop(0)[2:].partition("=")
            flags[name] = val
        return flags, words


@dataclass
class Stage:
    """One ``FROM`` and its instructions."""

    index: int
    base: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, *kinds: str) -> list[Instruction]:
        return [i for i in self.instructions if i.kind in kinds]

    def last(self, kind: str) -> Instruction | None:
        found = self.of(kind)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    """A parsed Dockerfile: its stages in order and its global ARG defaults."""

    stages: list[Stage]
    global_args: dict[str, str]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, ref: str) -> Stage | None:
        """The earlier stage ``FROM``/``--from`` names (by alias or index), else None."""
        for stage in self.stages:
            if stage.name == ref.lower() or str(stage.index) == ref:
                return stage
        return None

    def chain(self, stage: Stage) -> list[Stage]:
        """``stage`` and the stages it is built FROM, nearest first."""
        out = [stage]
        while (parent := self.stage(out[-1].base)) is not None and parent.index < out[-1].index:
            out.append(parent)
        return out

    def env(self, stage: Stage) -> dict[str, str]:
        """ENV in effect at the end of ``stage``, inherited through stage bases."""
        merged: dict[str, str] = {}
        for ancestor in reversed(self.chain(stage)):
            if ancestor.instructions:
                merged.update(ancestor.instructions[-1].envs)
        return merged

    def inherited(self, stage: Stage, kind: str) -> Instruction | None:
        """The last ``kind`` instruction in effect for ``stage`` (CMD, USER... inherit)."""
        for ancestor in self.chain(stage):
            if (found := ancestor.last(kind)) is not None:
                return found
        return None

    def descends_from(self, stage: Stage, ancestor: Stage) -> bool:
        return ancestor in self.chain(stage)


def parse(text: str) -> Dockerfile:
    """Parse Dockerfile text into stages (dockerfile-parse does the lexing and scoping)."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for item, context in zip(parser.structure, parser.context_structure, strict=True):
        kind = item["instruction"].upper()
        if kind == "COMMENT":
            continue
        instruction = Instruction(
            kind=kind, value=item["value"], line=item["startline"] + 1,
            args=dict(context.args), envs=dict(context.envs),
            declared={**context.line_args, **context.line_envs},
        )
        if kind == "FROM":
            words = [w for w in item["value"].split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)),
                          words[0])
            name = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(len(stages), base, name, instruction.line))
        elif not stages:
            global_args.update(instruction.declared)
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(stages, global_args)


def exec_form(instruction: Instruction | None) -> list[str] | None:
    """The argv of an exec-form (JSON array) CMD/ENTRYPOINT/HEALTHCHECK CMD, else None."""
    if instruction is None:
        return None
    text = instruction.value
    if instruction.kind == "HEALTHCHECK":
        text = re.split(r"\bCMD\b", text, maxsplit=1)[-1]
    try:
        argv = json.loads(text.strip())
    except ValueError:
        return None
    ok = isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv if ok else None


def option(words: Sequence[str], name: str) -> str | None:
    """The value after ``name`` (``--x v`` or ``--x=v``) in a shell-split command."""
    for index, word in enumerate(words):
        if word == name and index + 1 < len(words):
            return words[index + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def norm(path: str) -> str:
    return str(PurePosixPath(path)).rstrip("/") or "/"


def within(path: str, directory: str) -> bool:
    path, directory = norm(path), norm(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def seconds(duration: str) -> float:
    """A Docker (Go) duration such as ``180s``, ``3m``, ``1m30s`` in seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(float(n) * units[u] for n, u in parts)


def copies_from(df: Dockerfile, stage: Stage) -> list[tuple[Stage, str, str, dict[str, str]]]:
    """``COPY --from=<earlier stage>`` in ``stage``: (source stage, source, dest, flags)."""
    out = []
    for copy in stage.of("COPY"):
        flags, words = copy.flags()
        source = df.stage(flags.get("from", ""))
        if source is not None and len(words) == 2:
            out.append((source, words[0], words[1], flags))
    return out


# --- checks: each returns the problems it finds --------------------------------------------------

Check = Callable[[Dockerfile], list[str]]


def check_pinned_bases(df: Dockerfile) -> list[str]:
    """Every external ``FROM`` is pinned: an ``@sha256:`` digest or an exact X.Y.Z version tag."""
    problems = []
    for stage in df.stages:
        parent = df.stage(stage.base)
        if parent is not None and parent.index < stage.index:
            continue  # built on an earlier stage of this file
        ref = stage.base
        if ref == "scratch" or re.search(r"@sha256:[0-9a-f]{64}$", ref):
            continue
        name, _, tag = ref.rpartition(":")
        if not name or "/" in tag:
            problems.append(f"line {stage.line}: FROM {ref} has no tag (that is :latest)")
        elif tag == "latest" or not re.search(r"\d+\.\d+\.\d+", tag):
            problems.append(f"line {stage.line}: FROM {ref} is not an exact version or a digest")
    return problems


def check_runtime_user(df: Dockerfile) -> list[str]:
    """The final stage runs as a non-root user, set before its CMD/ENTRYPOINT."""
    user = df.inherited(df.final, "USER")
    if user is None:
        return ["the final stage has no USER: the gateway would run as root"]
    problems = []
    name = user.expand().split(":")[0]
    if name in ("root", "0", ""):
        problems.append(f"line {user.line}: USER {user.value} is root")
    for kind in ("CMD", "ENTRYPOINT"):
        start = df.final.last(kind)
        if start is not None and user.line > start.line:
            problems.append(f"line {user.line}: USER comes after {kind} (line {start.line})")
    return problems


def check_healthcheck(df: Dockerfile) -> list[str]:
    """A HEALTHCHECK on /healthz with a start period long enough for model load and warm-up."""
    health = df.inherited(df.final, "HEALTHCHECK")
    if health is None or health.value.strip().upper() == "NONE":
        return ["the final stage has no HEALTHCHECK"]
    problems = []
    if "/healthz" not in health.value:
        problems.append(f"line {health.line}: HEALTHCHECK does not request /healthz")
    if exec_form(health) is None:
        problems.append(f"line {health.line}: HEALTHCHECK CMD is not exec form")
    flags, _ = health.flags()
    start = seconds(flags.get("start-period", "0s"))
    if start < MIN_HEALTH_START_PERIOD_S:
        problems.append(f"line {health.line}: start period {start:.0f} s is shorter than "
                        f"{MIN_HEALTH_START_PERIOD_S:.0f} s (model load + CUDA graph capture)")
    return problems


def check_start_command(df: Dockerfile) -> list[str]:
    """Exec-form ENTRYPOINT/CMD running ``gateway serve``, and SIGTERM as the stop signal."""
    problems = []
    argv: list[str] = []
    for kind in ("ENTRYPOINT", "CMD"):
        instruction = df.inherited(df.final, kind)
        if instruction is None:
            continue
        words = exec_form(instruction)
        if words is None:
            problems.append(f"line {instruction.line}: {kind} is shell form: SIGTERM would reach "
                            "/bin/sh, not the gateway")
            continue
        argv += words
    if len(argv) < 2 or PurePosixPath(argv[0]).name != "gateway" or argv[1] != "serve":
        problems.append(f"the container runs {argv!r}, not `gateway serve`")
    stop = df.inherited(df.final, "STOPSIGNAL")
    if stop is None or stop.value.strip().upper() not in ("SIGTERM", "TERM", "15"):
        problems.append("STOPSIGNAL is not SIGTERM (the gateway drains on SIGTERM)")
    return problems


def _download(df: Dockerfile) -> tuple[Stage, Instruction, list[str]] | None:
    for stage in df.stages:
        for run in stage.of("RUN"):
            words = shlex.split(run.expand())
            for index, word in enumerate(words[:-1]):
                if word in ("hf", "huggingface-cli") and words[index + 1] == "download":
                    return stage, run, words
    return None


def check_baked_model(df: Dockerfile) -> list[str]:
    """MODEL_ID is a build arg, downloaded in a RUN, copied into the image at GATEWAY_MODEL."""
    model_id = df.global_args.get("MODEL_ID") or next(
        (i.declared["MODEL_ID"] for s in df.stages for i in s.of("ARG")
         if i.declared.get("MODEL_ID")), "")
    if not model_id:
        return ["no MODEL_ID build arg with a default"]
    found = _download(df)
    if found is None:
        return ["no RUN downloads the model (hf download / huggingface-cli download)"]
    stage, run, words = found
    problems = []
    if model_id not in words:
        problems.append(f"line {run.line}: the download does not fetch MODEL_ID ({model_id})")
    local_dir = option(words, "--local-dir")
    gateway_model = df.env(df.final).get("GATEWAY_MODEL")
    if local_dir is None:
        problems.append(f"line {run.line}: the download has no --local-dir")
    elif gateway_model is None or norm(gateway_model) != norm(local_dir):
        problems.append(f"GATEWAY_MODEL={gateway_model} is not the baked path {local_dir}: "
                        "start-up would download the model")
    elif not any(df.descends_from(src, stage) and within(local_dir, path) and path == dest
                 for src, path, dest, _ in copies_from(df, df.final)):
        problems.append(f"the final stage does not COPY {local_dir} from stage {stage.name}")
    return problems


def _render(df: Dockerfile) -> tuple[Stage, Instruction] | None:
    for stage in df.stages:
        for run in stage.of("RUN"):
            if "PROMPT_SCRIPTS" in run.value and re.search(r"gateway\s+script\s+render",
                                                            run.value):
                return stage, run
    return None


def check_prerendered_prompts(df: Dockerfile, repo: Path = REPO) -> list[str]:
    """PROMPT_SCRIPTS are rendered at build time, into GATEWAY_CACHE_DIR, with GATEWAY_MODEL."""
    env = df.env(df.final)
    found = _render(df)
    if found is None:
        return ["no RUN renders $PROMPT_SCRIPTS with `gateway script render`"]
    stage, run = found
    problems = []
    words = shlex.split(run.expand().replace(";", " ; "))
    scripts = run.args.get("PROMPT_SCRIPTS", "").split()
    for script in scripts:
        if not (repo / script).is_file():
            problems.append(f"PROMPT_SCRIPTS names {script}, which is not in the repository")
    cache_dir = option(words, "--cache-dir")
    if cache_dir is None or norm(cache_dir) != norm(env.get("GATEWAY_CACHE_DIR", "")):
        problems.append(f"line {run.line}: rendered into {cache_dir}, but GATEWAY_CACHE_DIR="
                        f"{env.get('GATEWAY_CACHE_DIR')}")
    model = option(words, "--model")
    if model is None or norm(model) != norm(env.get("GATEWAY_MODEL", "")):
        problems.append(f"line {run.line}: rendered with --model {model}, but GATEWAY_MODEL="
                        f"{env.get('GATEWAY_MODEL')} (the cache key holds the model fingerprint)")
    if option(words, "--device") != "cpu":
        problems.append(f"line {run.line}: render without --device cpu (a build has no GPU)")
    rendered_dtype = next((w.split("=", 1)[1] for w in words if w.startswith("GATEWAY_DTYPE=")),
                          "auto")
    if rendered_dtype == "auto" or rendered_dtype != env.get("GATEWAY_DTYPE", "auto"):
        # auto is float32 on the build's CPU and bfloat16 on the GPU: other audio, other keys.
        problems.append(f"line {run.line}: rendered with GATEWAY_DTYPE={rendered_dtype}, but "
                        f"GATEWAY_DTYPE={env.get('GATEWAY_DTYPE', 'auto')} at run time (the "
                        "cache key holds the dtype)")
    script = env.get("GATEWAY_SCRIPT", "")
    if not any(script.endswith("/" + s.removeprefix("./")) for s in scripts):
        problems.append(f"GATEWAY_SCRIPT={script} is not among PROMPT_SCRIPTS {scripts}")
    user_instruction = df.inherited(df.final, "USER")
    user = user_instruction.expand().split(":")[0] if user_instruction else "root"
    copied = [(src, path, flags) for src, path, _, flags in copies_from(df, df.final)
              if df.descends_from(src, stage) and cache_dir and within(cache_dir, path)]
    if not copied:
        problems.append(f"the final stage does not COPY the rendered cache from stage {stage.name}")
    elif copied[-1][2].get("chown", "").split(":")[0] != user:
        problems.append(f"the prompt cache is not owned by the runtime user {user}: the "
                        "cache writes its files 0600, so root-owned ones are unreadable")
    return problems


def check_writable_dirs(df: Dockerfile) -> list[str]:
    """GATEWAY_VOICES_DIR exists and belongs to the runtime user (``gateway voices add``)."""
    env = df.env(df.final)
    user = df.inherited(df.final, "USER")
    voices = env.get("GATEWAY_VOICES_DIR")
    if voices is None or user is None:
        return ["GATEWAY_VOICES_DIR or USER is not set in the final stage"]
    uid = user.expand().split(":")[0]
    for run in df.final.of("RUN"):
        text = run.expand()
        if voices in text.split() and (re.search(rf"install\s.*-o\s+{uid}\b", text)
                                       or re.search(rf"chown\s.*\b{uid}\b", text)):
            return []
    return [f"no RUN creates {voices} owned by {uid}"]


def check_no_secrets(df: Dockerfile) -> list[str]:
    """No ENV/ARG that would bake a credential into the image or its history."""
    secret_settings = {
        f"GATEWAY_{name.upper()}"
        for name, info in Settings.model_fields.items()
        if info.annotation is SecretStr or SecretStr in typing.get_args(info.annotation)
    }
    declared = [(name, "global ARG") for name in df.global_args]
    for stage in df.stages:
        declared += [(name, f"line {i.line}")
                     for i in stage.of("ARG", "ENV") for name in i.declared]
    return [f"{where}: {name} looks like a secret; it must come from the environment at run time"
            for name, where in declared if name in secret_settings or SECRET_NAME.search(name)]


def check_torch_pair(df: Dockerfile, run_sh: str | None = None) -> list[str]:
    """The torch/torchaudio pins equal run.sh's TORCH_PAIR, and a RUN pip-installs them."""
    run_sh = RUN_SH.read_text() if run_sh is None else run_sh
    match = re.search(r"^TORCH_PAIR=\((.*)\)\s*$", run_sh, re.M)
    if match is None:
        return ["run.sh has no TORCH_PAIR=(...)"]
    wanted = set(shlex.split(match.group(1)))
    pin = re.compile(r"(?<![\w-])(torch|torchaudio)==([\w.+!-]+)")
    found: set[str] = set()
    installed = False
    for stage in df.stages:
        for i in stage.of("RUN", "ARG", "ENV"):
            text = i.expand()
            pins = {f"{m.group(1)}=={m.group(2)}" for m in pin.finditer(text)}
            found |= pins
            installed |= i.kind == "RUN" and "pip install" in text and wanted <= pins
    problems = []
    if found != wanted:
        problems.append(f"Dockerfile pins {sorted(found)}, run.sh's TORCH_PAIR is {sorted(wanted)}")
    if not installed:
        problems.append("no RUN pip-installs run.sh's TORCH_PAIR")
    return problems


def check_python_and_packages(df: Dockerfile) -> list[str]:
    """Unbuffered, no bytecode writes; pip and apt leave no caches; sox is in the runtime image."""
    env = df.env(df.final)
    problems = [f"{name} is not 1 in the final stage" for name in
                ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE") if env.get(name) != "1"]
    for stage in df.stages:
        for run in stage.of("RUN"):
            text = run.expand()
            if "pip install" in text and "--no-cache-dir" not in text and \
                    df.env(stage).get("PIP_NO_CACHE_DIR") != "1":
                problems.append(f"line {run.line}: pip install keeps its cache")
            if "apt-get install" in text and "rm -rf /var/lib/apt/lists" not in text:
                problems.append(f"line {run.line}: apt-get install leaves the package lists")
    apt = [run.expand() for stage in df.chain(df.final) for run in stage.of("RUN")
           if "apt-get install" in run.value]
    if not any(re.search(r"\bsox\b", text) for text in apt):
        problems.append("sox is not installed in the runtime image (qwen_tts shells out to it)")
    return problems


def check_settings_and_ports(df: Dockerfile) -> list[str]:
    """GATEWAY_* ENV names are real settings; EXPOSE covers HTTP, SIP and the RTP range."""
    fields = Settings.model_fields
    problems = []
    for stage in df.stages:
        for i in stage.of("ENV"):
            for name in i.declared:
                if name.startswith("GATEWAY_") and name[8:].lower() not in fields:
                    problems.append(f"line {i.line}: {name} is no setting in gateway/config.py")
    env = df.env(df.final)
    port = env.get("GATEWAY_PORT", str(fields["port"].default))
    rtp = env.get("GATEWAY_RTP_PORTS", fields["rtp_ports"].default)
    exposed = {word if "/" in word else word + "/tcp"
               for i in df.final.of("EXPOSE") for word in i.expand().split()}
    for wanted in (f"{port}/tcp", f"{SIP_PORT}/udp", f"{rtp}/udp"):
        if wanted not in exposed:
            problems.append(f"EXPOSE lacks {wanted}")
    return problems


# --- the build context ---------------------------------------------------------------------------


def dockerignore_patterns(text: str) -> list[str]:
    """Patterns as docker-py reads .dockerignore (docker/api/build.py: no blanks, no comments)."""
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def build_context(root: Path, patterns: Sequence[str]) -> set[str]:
    """Paths (files and directories, relative) that `docker build root` sends."""
    return set(exclude_paths(str(root), list(patterns), dockerfile="Dockerfile"))


def check_copy_sources(df: Dockerfile, context: set[str], repo: Path = REPO) -> list[str]:
    """Every COPY/ADD source exists in the repository and survives .dockerignore."""
    problems = []
    for stage in df.stages:
        for copy in stage.of("COPY", "ADD"):
            flags, words = copy.flags()
            if "from" in flags:
                continue
            text = " ".join(words)
            sources = json.loads(text)[:-1] if text.startswith("[") else words[:-1]
            for source in sources:
                path = norm(source.removeprefix("./"))
                if any(c in path for c in "*?["):
                    hits = [p for p in context if fnmatchcase(p, path)]
                else:
                    hits = [path] if path in context else []
                    if not (repo / path).exists():
                        problems.append(f"line {copy.line}: COPY {source}: not in the repository")
                        continue
                files = [p for p in context if any(within(p, h) for h in hits)
                         and (repo / p).is_file()]
                if not files:
                    problems.append(f"line {copy.line}: COPY {source}: excluded by .dockerignore")
    return problems


def check_dockerignore(patterns: Sequence[str]) -> list[str]:
    """Nothing of MUST_STAY_OUT reaches the context (on a tree that has all of them)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for relative in (*MUST_STAY_OUT, "pyproject.toml", "gateway/app.py"):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text("x")
        context = build_context(root, patterns)
    return [f"{path} is sent to the builder" for path in MUST_STAY_OUT if path in context]


# --- tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def context() -> set[str]:
    return build_context(REPO, dockerignore_patterns(DOCKERIGNORE.read_text()))


def check_cuda_variant(df: Dockerfile) -> list[str]:
    """The base image's CUDA, the torch wheels' CUDA and the driver the image's label states
    agree: PyPI's torch wheels are CUDA 13 builds; a PyTorch index names its variant (cu126);
    the driver is NVIDIA's minimum for that CUDA major (gateway.tts.device.MIN_DRIVER)."""
    from gateway.tts.device import MIN_DRIVER

    args = df.global_args
    base = df.stages[0].base
    found = re.search(r"nvidia/cuda:(\d+)\.", base)
    if found is None:
        return [f"the base image {base} is not an nvidia/cuda image"]
    base_major = int(found.group(1))
    index = args.get("TORCH_INDEX_URL", "")
    variant = re.search(r"/cu(\d+?)(\d)$", index.rstrip("/"))
    wheel_major = int(variant.group(1)) if variant else (13 if not index else None)
    problems = []
    if wheel_major != base_major:
        problems.append(f"torch wheels from {index or 'PyPI'} are CUDA {wheel_major} builds, the "
                        f"base image {base} is CUDA {base_major}")
    driver = args.get("CUDA_DRIVER_MIN", "")
    if driver != str(MIN_DRIVER.get(base_major)):
        problems.append(f"CUDA_DRIVER_MIN={driver}, but CUDA {base_major} builds need driver "
                        f">= {MIN_DRIVER.get(base_major)}")
    label = df.final.last("LABEL")
    if label is None or "cuda-driver-min=\"$CUDA_DRIVER_MIN\"" not in label.value:
        problems.append("the runtime image does not label the driver it needs")
    return problems


CHECKS: dict[str, Check] = {
    "cuda_variant": check_cuda_variant,
    "pinned_bases": check_pinned_bases,
    "runtime_user": check_runtime_user,
    "healthcheck": check_healthcheck,
    "start_command": check_start_command,
    "baked_model": check_baked_model,
    "prerendered_prompts": check_prerendered_prompts,
    "writable_dirs": check_writable_dirs,
    "no_secrets": check_no_secrets,
    "torch_pair": check_torch_pair,
    "python_and_packages": check_python_and_packages,
    "settings_and_ports": check_settings_and_ports,
}


@dataclass(frozen=True)
class Variant:
    """A broken Dockerfile derived from the real one, and the problem its check must report."""

    check: str
    id: str
    edits: tuple[tuple[str, str], ...]  # (text in the real Dockerfile, its replacement)
    expected: str

    def apply(self, text: str) -> str:
        for old, new in self.edits:
            assert old in text, f"{self.check}-{self.id} no longer applies: {old!r} is gone"
            text = text.replace(old, new, 1)
        return text


def V(check: str, id: str, old: str, new: str, expected: str) -> Variant:
    return Variant(check, id, ((old, new),), expected)


BASE = "nvidia/cuda:13.0.2-base-ubuntu24.04"
USER = "USER 10001:10001\n"
VARIANTS = [
    V("cuda_variant", "cuda12_base_pypi_wheels", BASE, "nvidia/cuda:12.6.3-base-ubuntu24.04",
      "CUDA 13 builds, the base image"),
    Variant("cuda_variant", "cuda12_driver_580",
            ((BASE, "nvidia/cuda:12.6.3-base-ubuntu24.04"),
             ("ARG TORCH_INDEX_URL=\n",
              "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126\n")),
            "CUDA 12 builds need driver >= 525"),
    V("cuda_variant", "driver_too_low", "ARG CUDA_DRIVER_MIN=580", "ARG CUDA_DRIVER_MIN=550",
      "need driver >= 580"),
    V("cuda_variant", "unlabelled",
      ' \\\n      io.qwen3-tts-ivr-gateway.cuda-driver-min="$CUDA_DRIVER_MIN"', "",
      "does not label"),
    V("pinned_bases", "latest", BASE, "nvidia/cuda:latest", "not an exact version"),
    V("pinned_bases", "untagged", BASE, "nvidia/cuda", "no tag"),
    V("pinned_bases", "minor_only", BASE, "nvidia/cuda:13.0-base-ubuntu24.04",
      "not an exact version"),
    V("runtime_user", "root", USER, "USER root\n", "is root"),
    V("runtime_user", "uid0", USER, "USER 0:0\n", "is root"),
    V("runtime_user", "missing", USER, "", "no USER"),
    Variant("runtime_user", "after_cmd",
            ((USER, ""), ('CMD ["serve"]', 'CMD ["serve"]\n' + USER)), "after CMD"),
    V("healthcheck", "readyz", "/healthz'", "/readyz'", "does not request /healthz"),
    V("healthcheck", "short_start", "--start-period=180s", "--start-period=30s", "shorter than"),
    V("healthcheck", "none", "HEALTHCHECK --interval", "# HEALTHCHECK --interval",
      "no HEALTHCHECK"),
    V("start_command", "shell_form", 'ENTRYPOINT ["/opt/venv/bin/gateway"]',
      "ENTRYPOINT /opt/venv/bin/gateway", "shell form"),
    V("start_command", "other_command", 'CMD ["serve"]', 'CMD ["say", "hi"]',
      "not `gateway serve`"),
    V("start_command", "sigkill", "STOPSIGNAL SIGTERM", "STOPSIGNAL SIGKILL", "not SIGTERM"),
    V("baked_model", "hub_id_at_run_time", "GATEWAY_MODEL=/models/$MODEL_ID",
      "GATEWAY_MODEL=$MODEL_ID", "start-up would download"),
    V("baked_model", "no_download", 'RUN hf download "$MODEL_ID"', 'RUN echo "$MODEL_ID"',
      "no RUN downloads"),
    V("baked_model", "not_copied", "COPY --from=weights /models /models\nCOPY --from=prompts",
      "COPY --from=prompts", "does not COPY"),
    V("prerendered_prompts", "other_cache_dir",
      "--device cpu --cache-dir /var/cache/gateway/prompts",
      "--device cpu --cache-dir /tmp/prompts", "GATEWAY_CACHE_DIR"),
    V("prerendered_prompts", "other_model", '--model "/models/$MODEL_ID"', "--model tiny",
      "fingerprint"),
    V("prerendered_prompts", "on_gpu", "--device cpu", "--device cuda", "--device cpu"),
    V("prerendered_prompts", "cpu_dtype", "HF_HUB_OFFLINE=1 GATEWAY_DTYPE=bfloat16 gateway",
      "HF_HUB_OFFLINE=1 gateway", "holds the dtype"),
    V("prerendered_prompts", "runtime_dtype", "    GATEWAY_DTYPE=bfloat16 \\\n", "",
      "holds the dtype"),
    V("prerendered_prompts", "missing_script", 'PROMPT_SCRIPTS="prompts/demo.yaml"',
      'PROMPT_SCRIPTS="prompts/nope.yaml"', "not in the repository"),
    V("prerendered_prompts", "other_runtime_script", "ARG SCRIPT=prompts/demo.yaml",
      "ARG SCRIPT=prompts/other.yaml", "not among PROMPT_SCRIPTS"),
    V("prerendered_prompts", "no_render", "gateway script render", "gateway script validate",
      "no RUN renders"),
    V("prerendered_prompts", "cache_root_owned", "COPY --from=prompts --chown=10001:10001",
      "COPY --from=prompts", "not owned by the runtime user"),
    V("writable_dirs", "root_owned_voices", "install -d -o 10001 -g 10001", "install -d",
      "owned by 10001"),
    V("no_secrets", "twilio_token", "ENV GATEWAY_MODEL=",
      "ENV GATEWAY_TWILIO_AUTH_TOKEN=0123456789abcdef \\\n    GATEWAY_MODEL=",
      "GATEWAY_TWILIO_AUTH_TOKEN looks like a secret"),
    V("no_secrets", "sip_users", "ENV GATEWAY_MODEL=",
      "ENV GATEWAY_SIP_USERS=alice:pw \\\n    GATEWAY_MODEL=", "GATEWAY_SIP_USERS"),
    V("no_secrets", "hf_token_arg", "ARG MODEL_REVISION=main",
      "ARG MODEL_REVISION=main\nARG HF_TOKEN", "HF_TOKEN"),
    V("torch_pair", "drifted", "torch==2.14.1 torchaudio==2.11.1",
      "torch==2.13.0 torchaudio==2.11.1", "TORCH_PAIR is"),
    Variant("torch_pair", "not_installed",
            (("RUN pip install --no-cache-dir ${TORCH_INDEX_URL", "RUN echo ${TORCH_INDEX_URL"),
             ("requirements.txt $TORCH_PAIR", "requirements.txt")), "no RUN pip-installs"),
    V("python_and_packages", "buffered", "PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=0",
      "PYTHONUNBUFFERED"),
    V("python_and_packages", "apt_lists",
      "python3 sox ca-certificates \\\n    && rm -rf /var/lib/apt/lists/*",
      "python3 sox ca-certificates", "package lists"),
    V("python_and_packages", "no_sox", "python3 sox ca-certificates", "python3 ca-certificates",
      "sox is not installed"),
    Variant("python_and_packages", "pip_cache",
            (("PIP_NO_CACHE_DIR=1", "PIP_NO_CACHE_DIR=0"),
             ("pip install --no-cache-dir ${TORCH_INDEX_URL", "pip install ${TORCH_INDEX_URL")),
            "keeps its cache"),
    V("settings_and_ports", "typo", "GATEWAY_CACHE_DIR=", "GATEWAY_CACHEDIR=", "no setting"),
    V("settings_and_ports", "no_rtp", "5060/udp 20000-20999/udp", "5060/udp",
      "EXPOSE lacks 20000-20999/udp"),
]


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_dockerfile_passes(name: str, dockerfile_text: str) -> None:
    assert CHECKS[name](parse(dockerfile_text)) == []


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v.check}-{v.id}")
def test_check_rejects_bad_variant(variant: Variant, dockerfile_text: str) -> None:
    problems = CHECKS[variant.check](parse(variant.apply(dockerfile_text)))
    assert any(variant.expected in p for p in problems), problems


def test_every_check_has_a_bad_variant() -> None:
    assert {v.check for v in VARIANTS} == set(CHECKS)


def test_torch_pair_follows_run_sh(dockerfile_text: str) -> None:
    """The check reads run.sh: moving run.sh's pair alone makes the Dockerfile wrong."""
    run_sh = RUN_SH.read_text()
    moved = run_sh.replace('"torch==2.14.1"', '"torch==2.14.2"', 1)
    assert moved != run_sh
    assert check_torch_pair(parse(dockerfile_text), run_sh) == []
    assert check_torch_pair(parse(dockerfile_text), moved)


def test_copy_sources_are_in_the_context(dockerfile_text: str, context: set[str]) -> None:
    df = parse(dockerfile_text)
    assert check_copy_sources(df, context) == []
    for old, new, expected in (
        ("COPY gateway ./gateway", "COPY tests ./tests", "excluded by .dockerignore"),
        ("COPY README.md ./", "COPY README.rst ./", "not in the repository"),
    ):
        assert old in dockerfile_text
        problems = check_copy_sources(parse(dockerfile_text.replace(old, new, 1)), context)
        assert any(expected in p for p in problems), problems


def test_context_is_small(context: set[str]) -> None:
    """What the real checkout sends: no .venv, .git or caches (they exist here after run.sh)."""
    leaked = sorted(p for p in context
                    if p.split("/")[0] in {".venv", ".git", "tests", "bench", ".hypothesis"}
                    or "__pycache__" in p)
    assert leaked == []
    assert {"pyproject.toml", "README.md", "gateway/app.py", "prompts/demo.yaml"} <= context


def test_dockerignore_keeps_out_venv_git_and_caches() -> None:
    assert check_dockerignore(dockerignore_patterns(DOCKERIGNORE.read_text())) == []
    # A denylist that forgot .venv and the caches ships them.
    problems = check_dockerignore([".git", "**/__pycache__"])
    assert ".venv/bin/python is sent to the builder" in problems
    assert ".pytest_cache/v/cache/nodeids is sent to the builder" in problems
    assert ".env is sent to the builder" in problems
    assert ".git/HEAD is sent to the builder" not in problems


def test_parser_scopes_args_per_stage() -> None:
    """The parsing the checks rely on: a global ARG reaches a stage only when re-declared there."""
    df = parse("ARG M=a/b\nFROM x:1.2.3 AS one\nENV P=/m/$M\n"
               "FROM one AS two\nARG M\nENV Q=/m/$M\nUSER 1\nCMD [\"gateway\", \"serve\"]\n")
    assert df.env(df.stages[0]) == {"P": "/m/"}
    assert df.env(df.final) == {"P": "/m/", "Q": "/m/a/b"}
    assert [s.name for s in df.chain(df.final)] == ["two", "one"]
    assert exec_form(df.inherited(df.final, "CMD")) == ["gateway", "serve"]
    assert seconds("1m30s") == 90.0
    with pytest.raises(ValueError):
        seconds("90")


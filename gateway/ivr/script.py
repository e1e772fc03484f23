"""IVR scripts: the YAML authors write, loaded into typed objects and validated.

A script is one YAML file (see ``prompts/demo.yaml``)::

    name: Acme customer service
    voice: {speaker: ryan, language: English}   # or {clone: acme-anna}
    start: welcome
    error: sorry                 # where a failed webhook or speech goes (optional)
    prompts:                     # named sentences, reusable, cached when they have no {variables}
      hello: Thank you for calling Acme.
    nodes:
      welcome:
        say: hello               # prompt names or literal sentences, one or a list
        next: menu
      menu:
        gather:
          prompt: Press 1 for your balance, or 2 for an agent.
          digits: 1
          branch: {"1": balance, "2": agent}
          fallback: agent        # after the retries run out
      ...

Every node may say or play something first, then does exactly one of: ``gather`` (DTMF, which
branches), ``webhook`` (then ``next``), ``transfer``, ``hangup`` or ``next``.

Errors are reported as ``file:line:column: message`` in plain English, all at once: YAML syntax,
schema (unknown or missing fields, wrong types), and logic (unknown node or prompt references,
unreachable nodes, a gather with no way out, variables nothing can set, unsupported language or
speaker, text too long for one utterance, duplicate names).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.asr.base import Vocabulary
from gateway.asr.grammar import SpeechGrammar, language_code, language_name
from gateway.errors import GatewayError, GrammarError
from gateway.ivr.conditions import Condition, ConditionError, compile_condition
from gateway.ivr.hours import HoursError, Schedule
from gateway.text import (
    Lexicon,
    LexiconEntry,
    LexiconError,
    Reader,
    Reading,
    slot_problems,
)
from gateway.text.lexicon import compile_entry
from gateway.text.sayas import say_as
from gateway.text.template import MAX_VALUE_CHARS, Slot
from gateway.text.template import parse as parse_template
from gateway.text.template import slots as template_slots

#: Longest sentence spoken as one utterance (~25 s of speech). Longer text should be split into
#: several sentences so the caller can barge in between them and a failure loses less.
MAX_SENTENCE_CHARS = 400

#: The published Qwen3-TTS CustomVoice speakers and languages (validation without a model).
SPEAKERS = ("aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu", "vivian")
LANGUAGES = ("Auto", "Chinese", "English", "French", "German", "Italian", "Japanese", "Korean",
             "Portuguese", "Russian", "Spanish")

#: Variables every call has (``language``: the language the call speaks now).
BUILTIN_VARIABLES = frozenset({"caller", "called", "call_id", "language"})
#: Variables a script cannot set (they come from the call).
CALL_VARIABLES = frozenset({"caller", "called", "call_id"})


def canonical_language(name: str, languages: Iterable[str] = LANGUAGES) -> str:
    """``spanish`` -> ``Spanish`` (the model's spelling); unknown names are kept as written."""
    for known in languages:
        if known.lower() == name.lower():
            return known
    return name

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PHONE = re.compile(r"^\+[1-9][0-9]{6,14}$")
_SIP_URI = re.compile(r"^sips?:[^@\s]+@[^\s]+$")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


class ScriptError(GatewayError):
    """A script failed to load or validate; ``diagnostics`` holds every problem found."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.file, d.line, d.column, d.message))
        super().__init__("\n".join(str(d) for d in self.diagnostics))


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One problem, where it is, in words an author understands."""

    file: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


# --- YAML with positions ----------------------------------------------------------------------


class _Map(dict[str, Any]):
    """A YAML mapping that remembers where each key and value is (1-based line, column)."""

    key_pos: dict[str, tuple[int, int]]
    value_pos: dict[str, tuple[int, int]]
    #: YAML scalar style of each value (None plain, '"' or "'" quoted, '|' or '>' block).
    value_style: dict[str, str | None]
    pos: tuple[int, int]


class _Seq(list[Any]):
    """A YAML sequence that remembers where each item is."""

    item_pos: list[tuple[int, int]]
    #: YAML scalar style of each item (as :attr:`_Map.value_style`).
    item_style: list[str | None]
    pos: tuple[int, int]


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


class _Loader(yaml.SafeLoader):
    """SafeLoader that records positions and reports duplicate keys instead of dropping them."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[tuple[int, int], str, tuple[int, int]]] = []


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> _Map:
    result = _Map()
    result.key_pos, result.value_pos, result.value_style = {}, {}, {}
    result.pos = _mark(node)
    loader.flatten_mapping(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        key = str(key) if not isinstance(key, str) else key
        if key in result:
            loader.duplicates.append((_mark(key_node), key, result.key_pos[key]))
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_pos[key] = _mark(key_node)
        result.value_pos[key] = _mark(value_node)
        result.value_style[key] = (value_node.style if isinstance(value_node, yaml.ScalarNode)
                                   else None)
    return result


def _construct_seq(loader: _Loader, node: yaml.SequenceNode) -> _Seq:
    result = _Seq(loader.construct_object(child, deep=True) for child in node.value)
    result.item_pos, result.pos = [_mark(child) for child in node.value], _mark(node)
    result.item_style = [child.style if isinstance(child, yaml.ScalarNode) else None
                         for child in node.value]
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


def _position(tree: Any, loc: Iterable[str | int]) -> tuple[int, int]:
    """Deepest known position along ``loc`` in the loaded tree (for schema errors)."""
    pos = getattr(tree, "pos", (1, 1))
    node = tree
    for part in loc:
        if isinstance(node, _Map) and isinstance(part, str) and part in node:
            pos = node.value_pos[part]
            node = node[part]
        elif isinstance(node, _Map) and isinstance(part, str):
            return pos
        elif isinstance(node, _Seq) and isinstance(part, int) and 0 <= part < len(node):
            pos = node.item_pos[part]
            node = node[part]
        else:
            continue
    return pos


def _text_position(tree: Any, path: Iterable[str | int], offset: int) -> tuple[int, int]:
    """Position of character ``offset`` of the one-line scalar at ``path`` (a condition's
    error points at the very character; a block scalar's at its first line)."""
    parts = list(path)
    line, column = _position(tree, parts)
    parent: Any = tree
    for part in parts[:-1]:
        if isinstance(parent, (_Map, _Seq)):
            try:
                parent = parent[part]  # type: ignore[index]
            except (KeyError, IndexError, TypeError):
                return line, column
    last = parts[-1] if parts else None
    style = None
    if isinstance(parent, _Map) and isinstance(last, str):
        style = parent.value_style.get(last)
    elif isinstance(parent, _Seq) and isinstance(last, int) and 0 <= last < len(parent):
        style = parent.item_style[last]
    if style in ("|", ">"):
        return line + 1, column
    return line, column + offset + (1 if style in ('"', "'") else 0)


def _key_position(tree: Any, path: Iterable[str | int]) -> tuple[int, int]:
    """Position of the *key* at the end of ``path`` (where a name is defined)."""
    parts = list(path)
    parent: Any = tree
    for part in parts[:-1]:
        if isinstance(parent, _Map) and isinstance(part, str) and part in parent:
            parent = parent[part]
        elif isinstance(parent, _Seq) and isinstance(part, int) and 0 <= part < len(parent):
            parent = parent[part]
    last = parts[-1] if parts else None
    if isinstance(parent, _Map) and isinstance(last, str) and last in parent.key_pos:
        return parent.key_pos[last]
    return _position(tree, parts)


def read_yaml(text: str, label: str, *, what: str = "a script",
              loader: type[_Loader] = _Loader) -> tuple[Any, list[Diagnostic]]:
    """The YAML tree of ``text`` with every node's position, and a diagnostic per duplicate key.

    A syntax error (or nesting deep enough to exhaust PyYAML's recursion) raises
    :class:`ScriptError` at once, located; ``what`` names the document in that message. Script,
    case and lines files all load through here, so their errors read alike.
    """
    reader = loader(text)
    try:
        tree = reader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        problem = getattr(exc, "problem", None) or str(exc)
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None:
            problem += (f" ({context} that starts at line {context_mark.line + 1}, "
                        f"column {context_mark.column + 1})")
        diagnostic = Diagnostic(label, where[0], where[1], f"YAML syntax: {problem}")
        raise ScriptError([diagnostic]) from None
    except RecursionError:
        # PyYAML composes and constructs recursively: a few hundred levels of [[[...]]] would
        # otherwise escape as a traceback instead of a diagnostic.
        raise ScriptError([Diagnostic(label, 1, 1, f"YAML nested too deeply: {what} is a few "
                                                   "levels of mappings and lists")]) from None
    finally:
        reader.dispose()
    duplicates = [
        Diagnostic(label, pos[0], pos[1],
                   f"'{key}' is defined twice (first at line {first[0]}); names must be unique")
        for pos, key, first in reader.duplicates
    ]
    return tree, duplicates


def position(tree: Any, path: Iterable[str | int]) -> tuple[int, int]:
    """Where the value at ``path`` of a :func:`read_yaml` tree is (1-based line, column)."""
    return _position(tree, path)


def key_position(tree: Any, path: Iterable[str | int]) -> tuple[int, int]:
    """Where the key ending ``path`` of a :func:`read_yaml` tree is (a name's definition)."""
    return _key_position(tree, path)


# --- the schema -------------------------------------------------------------------------------


def _seconds(value: Any) -> Any:
    """``5``, ``5s``, ``1.5 s``, ``500ms`` -> seconds as a float."""
    if isinstance(value, bool):
        raise ValueError(f"'{value}' is not a duration: write 5s, 1.5s or 500ms")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            number = float(match.group(1))
            return number / 1000 if match.group(2) == "ms" else number
    raise ValueError(f"'{value}' is not a duration: write 5s, 1.5s or 500ms")


Seconds = Annotated[float, BeforeValidator(_seconds), Field(gt=0, le=600)]


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (str, dict)) else value


class Sentence(BaseModel):
    """A literal sentence that may opt in to caching after its first live render."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    text: str
    cache: bool = False
    #: Always spoken in this language, whatever the call's ("Para español, oprima 8.").
    language: str | None = None


SayItem = str | Sentence
SayList = Annotated[list[SayItem], BeforeValidator(_as_list)]


class ScriptVoice(BaseModel):
    """A script's ``voice:`` setting, who speaks: a CustomVoice speaker, or a registered cloned
    voice (by name). What the engine is handed is a :class:`gateway.speech.SpeechVoice`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    speaker: str | None = None
    clone: str | None = None
    language: str = "English"
    style: str | None = None
    #: Sampling seed for cached prompts: re-renders are reproducible.
    seed: int = 0

    @model_validator(mode="after")
    def _one_kind(self) -> ScriptVoice:
        if (self.speaker is None) == (self.clone is None):
            raise ValueError("give exactly one of 'speaker' (a built-in voice) or 'clone' "
                             "(a voice registered with `gateway voices add`)")
        return self


class VoiceChange(BaseModel):
    """A node's ``voice:``: who speaks from this node on (only the fields given change)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    speaker: str | None = None
    clone: str | None = None
    language: str | None = None
    style: str | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> VoiceChange:
        if self.speaker is not None and self.clone is not None:
            raise ValueError("give 'speaker' or 'clone', not both")
        if all(getattr(self, f) is None for f in type(self).model_fields):
            raise ValueError("'voice' changes nothing: give a speaker, clone, language, "
                             "style or seed")
        return self


def _set_values(value: Any) -> Any:
    """``set:`` values as text, the way a webhook's are (true -> "yes")."""
    if not isinstance(value, dict):
        return value
    out: dict[Any, Any] = {}
    for key, item in value.items():
        if isinstance(item, bool):
            item = "yes" if item else "no"
        elif isinstance(item, (int, float)):
            item = str(item)
        out[key] = item
    return out


def _speech(value: Any) -> Any:
    """``speech:`` as ``{node: [phrases]}`` (a lone phrase becomes a list), or ``digits``."""
    if value is None or value == "digits":
        return value
    if not isinstance(value, dict) or not value:
        raise ValueError("'speech' is the phrases that choose each node ({agent: [agent, "
                         "representative]}) or 'digits' (the digit string said aloud)")
    out: dict[str, list[str]] = {}
    for target, phrases in value.items():
        phrases = [phrases] if isinstance(phrases, str) else phrases
        if not isinstance(phrases, list) or not phrases or \
                not all(isinstance(p, str) for p in phrases):
            raise ValueError(f"speech for '{target}' must be a phrase or a list of phrases")
        out[str(target)] = list(phrases)
    return out


#: What callers may say in a gather: phrases per node, or the digit string (``digits``).
SpeechSpec = Annotated[dict[str, list[str]] | Literal["digits"] | None,
                       BeforeValidator(_speech)]


class Gather(BaseModel):
    """Collect DTMF digits (and, with ``speech``, what the caller says), with retries, then
    branch."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: SayList = Field(default_factory=list)
    digits: int | None = Field(None, ge=1, le=32)
    terminator: Literal["#", "*"] | None = None
    timeout: Seconds = 5.0
    inter_digit_timeout: Seconds = 3.0
    retries: int = Field(2, ge=0, le=10)
    retry_prompt: SayList = Field(default_factory=list)
    store: str = "digits"
    #: Keep the keys out of the call's trace (card numbers, PINs): logged as '*'.
    private: bool = False
    branch: dict[str, str] = Field(default_factory=dict)
    fallback: str | None = None
    #: Phrases per node the caller may say instead of pressing keys, or ``digits``: the digit
    #: string said aloud ("four one seven...") fills ``store`` as the keys would.
    speech: SpeechSpec = None
    #: The language the phrases are in (default: the script's); while the call speaks another
    #: language this gather takes keys only.
    speech_language: str | None = None
    #: Longest a caller may speak in one turn; then what they said so far is recognised.
    max_speech: Seconds = 10.0
    #: Silence after speech that ends the turn once what was said is a complete answer (a
    #: phrase, all the digits)... (VoiceXML 2.0 ``completetimeout``, section 6.3.2)
    complete_timeout: Seconds = 0.2
    #: ...and when it is not (yet): a caller pausing between digit groups keeps their turn.
    #: (``incompletetimeout``)
    incomplete_timeout: Seconds = 1.0

    @field_validator("store")
    @classmethod
    def _store_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"'{value}' is not a variable name (letters, digits, underscore)")
        return value

    @model_validator(mode="after")
    def _ends(self) -> Gather:
        if self.digits is None and self.terminator is None:
            raise ValueError("say how input ends: 'digits' (how many) and/or 'terminator' (# or *)")
        for key in self.branch:
            if key != "default" and not re.fullmatch(r"[0-9*#A-D]+", key):
                raise ValueError(f"branch key '{key}' is not a keypad sequence (or 'default')")
        if self.speech == "digits" and self.digits is None:
            raise ValueError("'speech: digits' needs 'digits': how many digits the caller says")
        if self.speech is None and self.speech_language is not None:
            raise ValueError("'speech_language' without 'speech' means nothing")
        return self

    def grammar(self, language: str) -> SpeechGrammar:
        """What this gather listens for, in ``language`` (GrammarError when it cannot be)."""
        if self.speech == "digits":
            return SpeechGrammar.build({}, digits=self.digits, language=language)
        assert isinstance(self.speech, dict)
        return SpeechGrammar.build(self.speech, language=language)


class Webhook(BaseModel):
    """POST the call's variables to the company's backend; merge the JSON it returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    url: str
    timeout: Seconds = 3.0
    send: list[str] | None = None
    sets: list[str] = Field(default_factory=list)
    on_error: str | None = None

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        value = expand_env(value)
        if not re.match(r"^https?://[^\s/]+", value):
            raise ValueError(f"'{value}' is not an http:// or https:// URL")
        return value


def _interruptible(value: Any) -> Any:
    """``<ConversationRelay interruptible>``: none, dtmf, speech or any (true/false: any/none)."""
    if isinstance(value, bool):
        return "any" if value else "none"
    return value.lower() if isinstance(value, str) else value


#: What may cut the bot off: nothing, keys, speech, or either (ConversationRelay's values).
Interruptible = Annotated[Literal["none", "dtmf", "speech", "any"],
                          BeforeValidator(_interruptible)]


def _hints(value: Any) -> Any:
    """``hints``: a list of phrases, or ConversationRelay's comma-separated string."""
    if isinstance(value, str):
        return [hint.strip() for hint in value.split(",") if hint.strip()]
    return value


def _bot_url(value: str) -> str:
    """``wss://`` (certificates checked), or ``ws://`` to this machine only (a bot under
    development): a caller's words never cross a network in clear text."""
    import ipaddress
    from urllib.parse import urlsplit

    value = expand_env(value)
    parts = urlsplit(value)
    if parts.scheme not in ("wss", "ws") or not parts.hostname:
        raise ValueError(f"'{value}' is not a wss:// URL")
    if parts.scheme == "ws":
        host = parts.hostname
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"'{value}': ws:// carries the caller's words in clear text; use "
                             "wss:// (ws:// is for a bot on this machine: localhost, 127.0.0.1)")
    return value


class Bot(BaseModel):
    """Hand the call to the company's bot over a ConversationRelay-compatible WebSocket
    (:mod:`gateway.bot`); the script goes on at ``next`` when the bot sends ``end``.

    Options follow ``<ConversationRelay>``'s where they mean the same (their camelCase names
    are accepted too): ``welcome_greeting``, ``welcome_greeting_interruptible``,
    ``interruptible``, ``preemptible``, ``dtmf_detection``, ``hints``, ``language``; the voice
    is the node's ``voice:`` (or the call's)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    url: Annotated[str, BeforeValidator(lambda v: _bot_url(v) if isinstance(v, str) else v)]
    #: Said while the gateway connects to the bot (rendered once, cached, like a prompt).
    welcome_greeting: str | None = Field(None, alias="welcomeGreeting")
    welcome_greeting_interruptible: Interruptible = Field(
        "any", alias="welcomeGreetingInterruptible")
    #: What cuts the bot off by default (a ``text`` or ``play`` may say otherwise).
    interruptible: Interruptible = "any"
    #: Whether the bot's answers by default give way to its next one.
    preemptible: bool = False
    #: Send the caller's keys to the bot (``dtmf`` messages).
    dtmf_detection: bool = Field(False, alias="dtmfDetection")
    #: Words and phrases the recogniser should expect (names, products).
    hints: Annotated[list[str], BeforeValidator(_hints)] = Field(default_factory=list)
    #: The conversation's language: a BCP 47 tag (``es-MX``) or a name (``Spanish``); default
    #: the call's.
    language: str | None = None
    #: ``customParameters`` of ``setup`` (values may use the call's ``{variables}``).
    parameters: dict[str, str] = Field(default_factory=dict)
    #: ``stream``: the bot's words reach the voice as they arrive; ``sentence``: a sentence at a
    #: time, once it is complete; ``auto``: stream, but sentences for a cloned voice (its
    #: prompt holds the whole text).
    text_mode: Literal["auto", "stream", "sentence"] = "auto"
    #: How long the bot may take to start answering the caller, or to send its next token.
    timeout: Seconds = 10.0
    connect_timeout: Seconds = 5.0
    #: The caller's silence that ends their turn (then their words go to the bot).
    end_of_speech: Seconds = 0.8
    max_speech: Seconds = 30.0
    #: Script prompts the bot may ``play`` by name (rendered ahead, from the cache).
    prompts: list[str] = Field(default_factory=list)
    #: Variables the bot's ``end`` may set (the keys of its ``handoffData`` object the script
    #: reads; ``handoff_data`` is the handoff data as sent).
    sets: list[str] = Field(default_factory=list)
    on_error: str | None = None

    @field_validator("parameters")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _NAME.match(key):
                raise ValueError(f"'{key}' is not a parameter name (letters, digits, underscore)")
        return value


class Case(BaseModel):
    """One case of a ``branch``: ``{if: CONDITION, goto: NODE}``, or the last, ``{else: NODE}``.

    Conditions are :mod:`gateway.ivr.conditions` expressions over the call's variables."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    when: str | None = Field(None, alias="if")
    goto: str | None = None
    otherwise: str | None = Field(None, alias="else")

    @model_validator(mode="after")
    def _shape(self) -> Case:
        if self.otherwise is not None:
            if self.when is not None or self.goto is not None:
                raise ValueError("'else' stands alone: '- else: NODE'")
        elif self.when is None or self.goto is None:
            raise ValueError("a case is '- if: CONDITION' with 'goto: NODE' (or '- else: NODE')")
        return self

    @property
    def target(self) -> str:
        target = self.otherwise if self.otherwise is not None else self.goto
        assert target is not None
        return target

    @property
    def condition(self) -> Condition | None:
        """The parsed test (None for ``else``); the loader has checked that it parses."""
        return compile_condition(self.when) if self.when is not None else None


Cases = Annotated[list[Case], Field(min_length=1)]

#: A day's hours: "08:00-18:00", "08:00-12:00, 13:00-17:00", a list of ranges, or "closed".
DayHours = str | list[str]


class Holiday(BaseModel):
    """A date with hours of its own (a date alone in ``holidays`` is closed all day)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    date: date
    hours: DayHours = "closed"


class Hours(BaseModel):
    """Open or closed now, by a weekly schedule in a named time zone (see :mod:`.hours`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    timezone: str
    weekly: dict[str, DayHours]
    holidays: list[date | Holiday] = Field(default_factory=list)
    open: str
    closed: str

    def holiday_hours(self) -> list[tuple[date, DayHours]]:
        return [(h, "closed") if isinstance(h, date) else (h.date, h.hours)
                for h in self.holidays]

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The compiled schedule (the loader has checked that it compiles)."""
        return Schedule.compile(self.timezone, self.weekly, self.holiday_hours())


@dataclass(frozen=True)
class Edge:
    """One way out of a node, for reachability, the flow graph and the script tester."""

    target: str
    #: What takes this way, in the author's words ("1", 'balance > 500', "no answer", ...).
    label: str
    #: next | key | speech | fallback | error | case | else | open | closed
    kind: str
    #: Where the target is written in the YAML (under the node).
    path: tuple[str | int, ...]


class Node(BaseModel):
    """One step of the call flow."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    #: Variables set on arrival (``language`` changes the call's language).
    assign: Annotated[dict[str, str], BeforeValidator(_set_values)] | None = Field(
        None, alias="set")
    #: Who speaks from this node on.
    voice: VoiceChange | None = None
    say: SayList | None = None
    play: str | None = None
    barge_in: bool = True
    gather: Gather | None = None
    webhook: Webhook | None = None
    #: Hand the call to a bot until it sends ``end`` (then ``next``).
    bot: Bot | None = None
    transfer: str | None = None
    hangup: bool | None = None
    #: Conditions on the call's variables, tried in order (see :class:`Case`).
    branch: Cases | None = None
    #: Open or closed by the clock (see :class:`Hours`).
    hours: Hours | None = None
    next: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> Node:
        if self.say is not None and self.play is not None:
            raise ValueError("a node says or plays, not both: split it into two nodes")
        steps = [name for name in STEPS if getattr(self, name) not in (None, False)]
        if self.hangup is False:
            raise ValueError("'hangup: false' means nothing; remove it or use 'next'")
        if len(steps) > 1:
            raise ValueError(f"a node does one thing after speaking; this one has "
                             f"{' and '.join(steps)}: split it into nodes")
        if steps and steps[0] not in ("webhook", "bot") and self.next is not None:
            raise ValueError(f"'next' has no effect after '{steps[0]}'")
        if not steps and self.next is None:
            raise ValueError("this node does not say where the call goes: add 'next', "
                             f"{', '.join(repr(s) for s in STEPS[:-1])} or 'hangup: true'")
        if self.webhook is not None and self.next is None:
            raise ValueError("a webhook node needs 'next' (where to go when it succeeds)")
        if self.bot is not None and self.next is None:
            raise ValueError("a bot node needs 'next' (where the call goes when the bot ends)")
        if self.transfer is not None and not (
            _PHONE.match(self.transfer) or _SIP_URI.match(self.transfer)
        ):
            raise ValueError(f"transfer target '{self.transfer}' is neither an E.164 phone "
                             "number (+15551234567) nor a SIP URI (sip:agent@pbx.example.com)")
        return self

    def voice_after(self, voice: ScriptVoice, languages: Iterable[str] = LANGUAGES) -> ScriptVoice:
        """The call's voice once this node's ``voice`` and ``set: {language}`` apply."""
        update: dict[str, Any] = {}
        change = self.voice
        if change is not None:
            if change.speaker is not None:
                update.update(speaker=change.speaker, clone=None)
            if change.clone is not None:
                update.update(clone=change.clone, speaker=None)
            for field in ("language", "style", "seed"):
                if getattr(change, field) is not None:
                    update[field] = getattr(change, field)
        if self.assign is not None and "language" in self.assign:
            update["language"] = self.assign["language"]
        if self.bot is not None and self.bot.language is not None:
            # The bot's conversation (and its greeting) is in its language.
            update["language"] = bot_language(self.bot.language, languages) or \
                self.bot.language
        if "language" in update:
            update["language"] = canonical_language(update["language"], languages)
        return voice.model_copy(update=update) if update else voice

    def edges(self) -> list[Edge]:
        """Every way out of this node, in the order the runner tries them."""
        out: list[Edge] = []
        if self.gather is not None:
            for key, target in self.gather.branch.items():
                out.append(Edge(target, "any other key" if key == "default" else key, "key",
                                ("gather", "branch", key)))
            if isinstance(self.gather.speech, dict):
                for target, phrases in self.gather.speech.items():
                    out.append(Edge(target, " / ".join(f'"{p}"' for p in phrases), "speech",
                                    ("gather", "speech", target)))
            if self.gather.fallback is not None:
                out.append(Edge(self.gather.fallback, "no answer", "fallback",
                                ("gather", "fallback")))
        if self.branch is not None:
            for i, case in enumerate(self.branch):
                if case.when is not None:
                    out.append(Edge(case.target, case.when, "case", ("branch", i, "goto")))
                else:
                    out.append(Edge(case.target, "else", "else", ("branch", i, "else")))
        if self.hours is not None:
            out.append(Edge(self.hours.open, "open", "open", ("hours", "open")))
            out.append(Edge(self.hours.closed, "closed", "closed", ("hours", "closed")))
        if self.next is not None:
            out.append(Edge(self.next, "", "next", ("next",)))
        if self.webhook is not None and self.webhook.on_error is not None:
            out.append(Edge(self.webhook.on_error, "error", "error", ("webhook", "on_error")))
        if self.bot is not None and self.bot.on_error is not None:
            out.append(Edge(self.bot.on_error, "error", "error", ("bot", "on_error")))
        return out

    def dead_cases(self) -> dict[int, str]:
        """Cases of this node's ``branch`` that can never be chosen, with the reason."""
        dead: dict[int, str] = {}
        seen: dict[str, int] = {}
        always: int | None = None
        for i, case in enumerate(self.branch or []):
            try:
                condition = case.condition
            except ConditionError:
                continue  # the loader reports it where it is
            if always is not None:
                dead[i] = f"case {always + 1} always holds, so nothing after it is chosen"
                continue
            if condition is None:
                continue
            if not condition.variables:
                if condition.evaluate({}):
                    always = i
                else:
                    dead[i] = "its test reads no variable and never holds"
                    continue
            earlier = seen.setdefault(condition.canonical, i)
            if earlier != i:
                dead[i] = f"case {earlier + 1} already tests the same thing"
        return dead


#: What a node does after speaking (exactly one, or 'next').
STEPS = ("gather", "webhook", "bot", "transfer", "branch", "hours", "hangup")


class Script(BaseModel):
    """A whole IVR."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    voice: ScriptVoice
    start: str
    error: str | None = None
    variables: dict[str, str] = Field(default_factory=dict)
    prompts: dict[str, str] = Field(default_factory=dict)
    #: Language -> prompt name -> text: what a prompt says when the call speaks that language.
    translations: dict[str, dict[str, str]] = Field(default_factory=dict)
    nodes: dict[str, Node]
    #: How the script's data is written and what untyped text is read as (a line of the lines
    #: file may override it field by field): :class:`gateway.text.Reading`.
    reading: Reading | None = None
    #: How the script says its names (:mod:`gateway.text.lexicon`).
    lexicon: list[LexiconEntry] = Field(default_factory=list)

    #: Where the script came from (set by the loader; not part of the YAML).
    path: Path | None = Field(None, exclude=True)
    _grammars: dict[str, SpeechGrammar] = PrivateAttr(default_factory=dict)

    def reader(self) -> Reader:
        """How this script reads its sentences on a line of its own (``GATEWAY_SCRIPT``, the
        script tester): its own ``reading`` and ``lexicon`` (a lines file's line adds its own,
        :meth:`gateway.ivr.lines.Line.reader`)."""
        return script_reader(self)

    # --- the flow -------------------------------------------------------------------------

    def successors(self, name: str) -> list[str]:
        """Nodes a call can go to from ``name`` (cases that can never hold left out)."""
        node = self.nodes[name]
        dead = node.dead_cases() if node.branch is not None else {}
        return [edge.target for edge in node.edges()
                if edge.target in self.nodes
                and not (edge.kind in ("case", "else") and edge.path[1] in dead)]

    # --- what is heard ---------------------------------------------------------------------

    def speech_language(self, gather: Gather) -> str:
        """The language a speech gather's phrases are in (its own, else the script's)."""
        return canonical_language(gather.speech_language or self.voice.language)

    def speech_grammar(self, node: str) -> SpeechGrammar | None:
        """What the gather of ``node`` listens for (None: keys only); built once."""
        gather = self.nodes[node].gather
        if gather is None or gather.speech is None:
            return None
        grammar = self._grammars.get(node)
        if grammar is None:
            grammar = gather.grammar(self.speech_language(gather))
            self._grammars[node] = grammar
        return grammar

    def bot_nodes(self) -> list[str]:
        """Nodes that hand the call to a bot (they listen to the caller's words too)."""
        return [name for name, node in self.nodes.items() if node.bot is not None]

    def speech_gathers(self) -> list[str]:
        """Nodes whose gather listens for speech."""
        return [name for name, node in self.nodes.items()
                if node.gather is not None and node.gather.speech is not None]

    # --- what speaks ----------------------------------------------------------------------

    def is_prompt_ref(self, item: SayItem) -> bool:
        return isinstance(item, str) and item in self.prompts

    def sentence(self, item: SayItem, language: str | None = None) -> str:
        """The text an item stands for in ``language`` (default: the script's): a prompt's
        text or its translation, or the literal sentence."""
        if isinstance(item, Sentence):
            return item.text
        if item in self.prompts and language is not None:
            translated = self.translation(language).get(item)
            if translated is not None:
                return translated
        return self.prompts.get(item, item)

    def translation(self, language: str) -> dict[str, str]:
        """The prompts translated into ``language`` (empty for the script's own language)."""
        if language.lower() == self.voice.language.lower():
            return {}
        for name, texts in self.translations.items():
            if name.lower() == language.lower():
                return texts
        return {}

    def spoken_voice(self, item: SayItem, voice: ScriptVoice) -> ScriptVoice:
        """The voice ``item`` is spoken with when the call's voice is ``voice``."""
        if isinstance(item, Sentence) and item.language is not None:
            language = canonical_language(item.language)
            if language != voice.language:
                return voice.model_copy(update={"language": language})
        return voice

    def voice_states(self) -> dict[str, list[ScriptVoice]]:
        """For each reachable node, every voice it may speak with (after its own ``voice`` and
        ``set: {language}``): the call's voice is a fact of the path, found by following the
        flow from ``start``. The error node may be reached from any node."""
        arriving: dict[str, list[ScriptVoice]] = {}

        def add(name: str, voice: ScriptVoice) -> bool:
            seen = arriving.setdefault(name, [])
            if voice in seen:
                return False
            seen.append(voice)
            return True

        queue: deque[str] = deque()
        if self.start in self.nodes:
            add(self.start, self.voice)
            queue.append(self.start)
        while True:
            while queue:
                name = queue.popleft()
                node = self.nodes[name]
                for voice in list(arriving[name]):
                    after = node.voice_after(voice)
                    queue.extend(t for t in self.successors(name) if add(t, after))
            if self.error not in self.nodes:
                break
            error = self.error
            grew = [add(error, self.nodes[name].voice_after(voice))
                    for name, voices in list(arriving.items()) for voice in list(voices)]
            if not any(grew):
                break
            queue.append(error)
        states: dict[str, list[ScriptVoice]] = {}
        for name, voices in arriving.items():
            for voice in voices:
                after = self.nodes[name].voice_after(voice)
                if after not in states.setdefault(name, []):
                    states[name].append(after)
        return states

    def static_renders(self) -> list[tuple[str, ScriptVoice]]:
        """Every sentence without variables with each voice it may be spoken in: rendered
        once, served from the cache."""
        found: dict[tuple[str, ScriptVoice], None] = {}
        states = self.voice_states()
        for name, item in self.say_items():
            for call_voice in states.get(name, []):
                voice = self.spoken_voice(item, call_voice)
                text = self.sentence(item, voice.language)
                if not template_variables(text):
                    found.setdefault((text, voice), None)
        return list(found)

    def static_sentences(self) -> list[str]:
        """Every sentence without variables (in any of the script's languages)."""
        return list(dict.fromkeys(text for text, _ in self.static_renders()))

    def languages_spoken(self) -> list[str]:
        """Every language some sentence of the script may be spoken in."""
        found: dict[str, None] = {}
        states = self.voice_states()
        for name, item in self.say_items():
            for voice in states.get(name, []):
                found.setdefault(self.spoken_voice(item, voice).language, None)
        return list(found)

    def say_items(self) -> Iterator[tuple[str, SayItem]]:
        """``(node name, item)`` for everything any node may say."""
        for path, item in _say_item_paths(self):
            yield str(path[1]), item


# --- templates --------------------------------------------------------------------------------


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: str) -> str:
    """``${NAME}`` / ``${NAME:-default}`` from the environment (backend URLs per deployment)."""
    import os

    def replace(match: re.Match[str]) -> str:
        found = os.environ.get(match.group(1))
        if found is None:
            if match.group(2) is None:
                raise ValueError(f"environment variable {match.group(1)} is not set")
            return match.group(2)
        return found

    return _ENV.sub(replace, value)


def template_variables(text: str) -> list[str]:
    """Names used as ``{name}`` or ``{name:type}`` in ``text`` (raises ValueError on malformed
    braces; the syntax is :mod:`gateway.text.template`'s)."""
    return [part.name for part in parse_template(text) if isinstance(part, Slot) and part.name]


def render(text: str, variables: dict[str, str]) -> str:
    """Fill ``{name}`` placeholders (a say-as slot with its value as written). Values are
    inserted as plain text, never re-interpreted, and at most :data:`MAX_VALUE_CHARS` of each:
    a caller's ``From`` arrives from the transport unchecked, and a sentence is generated live
    (an engine slot busy for its whole length). What the engine says is
    :meth:`gateway.text.Reader.sentence`'s."""
    out = []
    for part in parse_template(text):
        if isinstance(part, str):
            out.append(part)
        elif part.literal is not None:
            out.append(part.literal)
        else:
            out.append(str(variables.get(part.name or "", ""))[:MAX_VALUE_CHARS])
    return "".join(out)


def script_reader(script: Script, reading: Reading | None = None,
                  lexicon: Iterable[LexiconEntry] = ()) -> Reader:
    """How ``script`` reads on a line whose own ``reading`` and ``lexicon`` are given: the
    line's reading over the script's, the line's lexicon entries before the script's (the
    line's say it first)."""
    merged = reading.over(script.reading) if reading is not None else script.reading
    return _reader(script.voice.language, merged, (*lexicon, *script.lexicon))


@functools.lru_cache(maxsize=256)
def _reader(language: str, reading: Reading | None,
            lexicon: tuple[LexiconEntry, ...]) -> Reader:
    # Readers compile their lexicon: one per distinct setting, however many calls ask.
    return Reader(language, reading, Lexicon(lexicon))


# --- loading and validation -------------------------------------------------------------------


def load_script(
    path: str | Path,
    *,
    voice_exists: Callable[[str], bool] | None = None,
    speakers: Iterable[str] = SPEAKERS,
    languages: Iterable[str] = LANGUAGES,
    vocabulary: Vocabulary | None = None,
) -> Script:
    """Load and validate ``path``; raise :class:`ScriptError` listing every problem.

    Speech gathers are checked against ``vocabulary``: the configured recogniser's languages
    and dictionary (default: the built-in one's, :data:`gateway.asr.sphinx.VOCABULARY`)."""
    path = Path(path)
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScriptError(
            [Diagnostic(label, 1, 1, f"cannot read the script: {exc.strerror}")]
        ) from None
    except UnicodeDecodeError:
        raise ScriptError([Diagnostic(label, 1, 1, "the script is not UTF-8 text")]) from None
    return parse_script(text, label, base_dir=path.parent, voice_exists=voice_exists,
                        speakers=speakers, languages=languages, vocabulary=vocabulary)


def parse_script(
    text: str,
    label: str = "<script>",
    *,
    base_dir: Path | None = None,
    voice_exists: Callable[[str], bool] | None = None,
    speakers: Iterable[str] = SPEAKERS,
    languages: Iterable[str] = LANGUAGES,
    vocabulary: Vocabulary | None = None,
) -> Script:
    """Parse and validate script ``text`` (``label`` names it in messages; ``vocabulary`` as
    in :func:`load_script`)."""
    problems: list[Diagnostic] = []

    def report(pos: tuple[int, int], message: str) -> None:
        problems.append(Diagnostic(label, pos[0], pos[1], message))

    tree, duplicates = read_yaml(text, label, what="a script")
    problems.extend(duplicates)
    if not isinstance(tree, _Map):
        report((1, 1), "a script is a mapping with name, voice, start, prompts and nodes")
        raise ScriptError(problems)

    try:
        script = Script.model_validate(tree)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            loc = [part for part in error["loc"] if not _is_union_tag(part)]
            where = (_key_position(tree, loc) if error.get("type") == "extra_forbidden"
                     else _position(tree, loc))
            report(where, _schema_message(loc, error))
        raise ScriptError(problems) from None

    _check_logic(script, tree, report, base_dir, voice_exists, set(speakers), set(languages))
    if script.speech_gathers():
        if vocabulary is None:
            from gateway.asr.sphinx import VOCABULARY

            vocabulary = VOCABULARY
        _check_speech(script, tree, report, vocabulary)
    if problems:
        raise ScriptError(problems)
    return script.model_copy(update={"path": base_dir / Path(label).name if base_dir else None})


def _is_union_tag(part: Any) -> bool:
    # pydantic names union members in locations ("str", "Sentence", "list[...]"): not YAML keys.
    return isinstance(part, str) and (part in ("str", "Sentence") or part.startswith("list["))


def _schema_message(loc: list[Any], error: Any) -> str:
    where = ".".join(str(p) for p in loc) or "the script"
    kind = error.get("type", "")
    if kind == "missing":
        return f"'{loc[-1]}' is required here ({where})"
    if kind == "extra_forbidden":
        return f"unknown field '{loc[-1]}' ({where}): check the spelling"
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {message}"


def _check_logic(
    script: Script,
    tree: _Map,
    report: Callable[[tuple[int, int], str], None],
    base_dir: Path | None,
    voice_exists: Callable[[str], bool] | None,
    speakers: set[str],
    languages: set[str],
) -> None:
    nodes = script.nodes
    node_list = ", ".join(sorted(nodes)) or "none"

    def pos(*path: str | int) -> tuple[int, int]:
        return _position(tree, path)

    #: Edges to nodes that do not exist, and the node each most likely meant (a close spelling).
    #: Reachability follows the meant node, so one mistyped name is one error, not one more for
    #: every node behind it; translations are not reported unused while any edge dangles.
    dangling: dict[str, str | None] = {}

    def check_node_ref(target: str | None, path: tuple[str | int, ...], what: str) -> None:
        if target is not None and target not in nodes:
            close = difflib.get_close_matches(target, list(nodes), n=1, cutoff=0.8)
            dangling[target] = close[0] if close else None
            hint = f"; did you mean '{close[0]}'?" if close else ""
            report(pos(*path), f"{what} '{target}', which is not a node (nodes: {node_list}"
                               f"{hint})")

    # voice
    voice = script.voice
    if voice.speaker is not None and voice.speaker.lower() not in speakers:
        report(pos("voice", "speaker"), f"speaker '{voice.speaker}' is not a built-in voice "
                                        f"(one of: {', '.join(sorted(speakers))})")
    if voice.clone is not None and voice_exists is not None and not voice_exists(voice.clone):
        report(pos("voice", "clone"), f"cloned voice '{voice.clone}' is not registered: add it "
                                      f"with `gateway voices add {voice.clone} REF.wav --text ...`")
    if voice.language.lower() not in {lang.lower() for lang in languages}:
        report(pos("voice", "language"), f"language '{voice.language}' is not supported "
                                         f"(one of: {', '.join(sorted(languages))})")

    # references
    check_node_ref(script.start, ("start",), "the call starts at")
    check_node_ref(script.error, ("error",), "errors go to")
    for name, node in nodes.items():
        base = ("nodes", name)
        check_node_ref(node.next, (*base, "next"), f"node '{name}' goes next to")
        if node.gather is not None:
            g = node.gather
            for digits, target in g.branch.items():
                check_node_ref(target, (*base, "gather", "branch", digits),
                               f"node '{name}' sends '{digits}' to")
                where = _key_position(tree, (*base, "gather", "branch", digits))
                if digits == "default":
                    continue
                if g.digits is not None and len(digits) > g.digits:
                    report(where, f"node '{name}' key '{digits}' is unreachable: the gather "
                                  f"stops after {g.digits} digit{'s' if g.digits > 1 else ''}")
                elif g.terminator is not None and g.terminator in digits:
                    report(where, f"node '{name}' key '{digits}' is unreachable: "
                                  f"'{g.terminator}' ends the input, it is never part of it")
            check_node_ref(g.fallback, (*base, "gather", "fallback"),
                           f"node '{name}' falls back to")
            for target in g.speech if isinstance(g.speech, dict) else ():
                check_node_ref(target, (*base, "gather", "speech", target),
                               f"node '{name}' sends speech to")
            if g.fallback is None and script.error is None:
                report(pos(*base, "gather"), f"node '{name}' gathers digits with no way out when "
                                             "the caller never answers: add 'fallback: <node>'")
            if not g.branch and not isinstance(g.speech, dict):
                report(pos(*base, "gather"), f"node '{name}' gathers digits but has no 'branch' "
                                             "saying where each answer goes")
        if node.webhook is not None:
            check_node_ref(node.webhook.on_error, (*base, "webhook", "on_error"),
                           f"node '{name}' goes on error to")
            if node.webhook.on_error is None and script.error is None:
                report(pos(*base, "webhook"), f"node '{name}' calls a webhook with nowhere to go "
                                              "if it fails: add 'on_error: <node>'")
        if node.bot is not None:
            _check_bot(name, node.bot, script, tree, report, check_node_ref, languages)
        if node.branch is not None:
            dead = node.dead_cases()
            if node.branch[-1].otherwise is None:
                report(_key_position(tree, (*base, "branch")),
                       f"node '{name}' branches without '- else: NODE' as its last case (where "
                       "the call goes when no test holds)")
            for i, case in enumerate(node.branch):
                field = "if" if case.when is not None else "else"
                if case.otherwise is not None and i != len(node.branch) - 1:
                    report(pos(*base, "branch", i, "else"),
                           f"node '{name}' case {i + 1}: 'else' must be the last case (the "
                           "cases after it could never be chosen)")
                if case.when is not None:
                    try:
                        compile_condition(case.when)
                    except ConditionError as exc:
                        report(_text_position(tree, (*base, "branch", i, "if"), exc.offset),
                               f"node '{name}' case {i + 1}: {exc.message}")
                        continue
                if i in dead:
                    report(pos(*base, "branch", i, field),
                           f"node '{name}' case {i + 1} is unreachable: {dead[i]}")
                check_node_ref(case.target, (*base, "branch", i,
                                             "goto" if case.when is not None else "else"),
                               f"node '{name}' case {i + 1} goes to")
        if node.hours is not None:
            _check_hours(name, node.hours, tree, base, report)
            for field in ("open", "closed"):
                check_node_ref(getattr(node.hours, field), (*base, "hours", field),
                               f"node '{name}' goes when {field} to")
        if node.play is not None and base_dir is not None:
            wav = (base_dir / node.play).resolve()
            if not wav.is_file():
                report(pos(*base, "play"), f"node '{name}' plays '{node.play}', which does not "
                                           f"exist (looked in {base_dir})")

    # reachability
    reachable: set[str] = set()
    queue: deque[str | None] = deque(n if n is None else dangling.get(n, n)
                                     for n in (script.start, script.error))
    while queue:
        current = queue.popleft()
        if current is None or current in reachable or current not in nodes:
            continue
        reachable.add(current)
        node = nodes[current]
        dead = node.dead_cases() if node.branch is not None else {}
        queue.extend(dangling.get(edge.target, edge.target) for edge in node.edges()
                     if not (edge.kind in ("case", "else") and edge.path[1] in dead))
    for name in nodes:
        if name not in reachable:
            report(_key_position(tree, ("nodes", name)),
                   f"node '{name}' is unreachable: nothing leads to it from '{script.start}'")

    # prompts, sentences and variables
    settable = set(BUILTIN_VARIABLES) | set(script.variables)
    for node in nodes.values():
        if node.gather is not None:
            settable.add(node.gather.store)
        if node.webhook is not None:
            settable.update(node.webhook.sets)
        if node.bot is not None:
            settable.update(node.bot.sets)
        settable.update(node.assign or {})
    _check_languages(script, tree, report, voice_exists, speakers, languages, settable,
                     flow_known=not dangling)
    for name, node in nodes.items():
        for i, case in enumerate(node.branch or []):
            if case.when is None:
                continue
            try:
                condition = compile_condition(case.when)
            except ConditionError:
                continue  # reported above
            for variable, offset in condition.variables.items():
                if variable not in settable:
                    report(_text_position(tree, ("nodes", name, "branch", i, "if"), offset),
                           f"node '{name}' case {i + 1} tests variable '{variable}', which "
                           f"nothing sets ({_SETTERS})")
    for prompt_name, text in script.prompts.items():
        _check_sentence(text, pos("prompts", prompt_name), settable, report)
    used_prompts: set[str] = set()
    for path, item in _say_item_paths(script):
        if isinstance(item, str) and item in script.prompts:
            used_prompts.add(item)
        elif isinstance(item, str) and _NAME.match(item) and " " not in item:
            report(pos(*path), f"'{item}' is not a prompt name (prompts: "
                               f"{', '.join(sorted(script.prompts)) or 'none'}); "
                               "write a sentence, or define the prompt")
        else:
            _check_sentence(script.sentence(item), pos(*path), settable, report)
        if isinstance(item, Sentence) and item.language is not None:
            _check_language(item.language, _position(tree, (*path, "language")), languages,
                            report)
    for language, texts in script.translations.items():
        for prompt_name, text in texts.items():
            if prompt_name in script.prompts:
                _check_sentence(text, pos("translations", language, prompt_name), settable,
                                report)
    for prompt_name in script.prompts:
        if prompt_name not in used_prompts:
            report(_key_position(tree, ("prompts", prompt_name)),
                   f"prompt '{prompt_name}' is never used")
    for name, node in nodes.items():
        for key, value in (node.bot.parameters if node.bot is not None else {}).items():
            try:
                used = template_variables(value)
            except ValueError as exc:
                report(pos("nodes", name, "bot", "parameters", key), str(exc))
                continue
            for variable in used:
                if variable not in settable:
                    report(pos("nodes", name, "bot", "parameters", key),
                           f"variable '{{{variable}}}' is used but nothing sets it ({_SETTERS})")
    for name, node in nodes.items():
        if node.webhook is not None and node.webhook.send:
            for variable in node.webhook.send:
                if variable not in settable:
                    report(pos("nodes", name, "webhook", "send"),
                           f"node '{name}' sends variable '{variable}', which nothing sets")
    _check_reading(script, tree, report, languages)


def _check_bot(name: str, bot: Bot, script: Script, tree: _Map,
               report: Callable[[tuple[int, int], str], None],
               check_node_ref: Callable[[str | None, tuple[str | int, ...], str], None],
               languages: set[str]) -> None:
    """A bot node: where its errors go, the prompts it may play, its language."""
    base = ("nodes", name, "bot")
    check_node_ref(bot.on_error, (*base, "on_error"), f"node '{name}' goes on error to")
    if bot.on_error is None and script.error is None:
        report(_position(tree, base), f"node '{name}' hands the call to a bot with nowhere to "
                                      "go if it fails (unreachable, silent, gone): add "
                                      "'on_error: <node>'")
    for i, prompt in enumerate(bot.prompts):
        if prompt not in script.prompts:
            report(_position(tree, (*base, "prompts", i)),
                   f"node '{name}' lets its bot play '{prompt}', which is not a prompt "
                   f"(prompts: {', '.join(sorted(script.prompts)) or 'none'})")
    if bot.language is not None and bot_language(bot.language, languages) is None:
        report(_position(tree, (*base, "language")),
               f"language '{bot.language}' is not one the voice speaks (a BCP 47 tag such as "
               f"en-US, or one of: {', '.join(sorted(languages))})")


def bot_language(value: str, languages: Iterable[str] = LANGUAGES) -> str | None:
    """A bot's language as the voice names it: ``es-MX`` / ``Spanish`` -> ``Spanish`` (None:
    not a language the voice speaks)."""
    known = {known.lower(): known for known in languages}
    if value.lower() in known:
        return known[value.lower()]
    code = language_code(value)
    name = language_name(code) if code is not None else None
    return known.get(name.lower()) if name is not None else None


def _check_speech(script: Script, tree: _Map, report: Callable[[tuple[int, int], str], None],
                  vocabulary: Vocabulary) -> None:
    """Speech gathers: a language the recogniser knows, words its dictionary has, phrases that
    choose one node each."""
    known = ", ".join(sorted(language_name(c) for c in vocabulary.languages)) or "none"
    for name in script.speech_gathers():
        gather = script.nodes[name].gather
        assert gather is not None
        base = ("nodes", name, "gather")
        language = script.speech_language(gather)
        code = language_code(language)
        if code is None or code not in vocabulary.languages:
            where = (_position(tree, (*base, "speech_language")) if gather.speech_language
                     else _key_position(tree, (*base, "speech")))
            report(where, f"node '{name}' listens for speech in {language}, which the speech "
                          f"recogniser does not know (it knows {known}): a speech gather in "
                          f"{language} needs a recogniser configured for it")
            continue
        if isinstance(gather.speech, dict):
            for target, phrases in gather.speech.items():
                listed = isinstance(_node_at(tree, (*base, "speech", target)), list)
                for i, phrase in enumerate(phrases):
                    path = (*base, "speech", target, *((i,) if listed else ()))
                    for unknown in vocabulary.unknown_words([phrase]):
                        report(_text_position(tree, path, unknown.offset),
                               f"node '{name}' speech for '{target}': {unknown}")
        try:
            script.speech_grammar(name)
        except GrammarError as exc:
            for problem in exc.problems:
                report(_key_position(tree, (*base, "speech")), f"node '{name}' speech: {problem}")


def _node_at(tree: Any, path: Iterable[str | int]) -> Any:
    """The loaded YAML value at ``path`` (None where the path leads nowhere)."""
    node = tree
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _check_language(language: str, where: tuple[int, int], languages: set[str],
                    report: Callable[[tuple[int, int], str], None]) -> bool:
    if language.lower() in {known.lower() for known in languages}:
        return True
    report(where, f"language '{language}' is not supported (one of: "
                  f"{', '.join(sorted(languages))})")
    return False


def _check_languages(
    script: Script,
    tree: _Map,
    report: Callable[[tuple[int, int], str], None],
    voice_exists: Callable[[str], bool] | None,
    speakers: set[str],
    languages: set[str],
    settable: set[str],
    flow_known: bool = True,
) -> None:
    """Languages and voices: what ``set``/``voice`` change, and what each sentence is spoken in
    (a prompt needs a translation for every language a node may say it in). Without
    ``flow_known`` (an edge to a missing node) translations are not reported unused."""

    def pos(*path: str | int) -> tuple[int, int]:
        return _position(tree, path)

    for name, node in script.nodes.items():
        base = ("nodes", name)
        for variable, value in (node.assign or {}).items():
            where = pos(*base, "set", variable)
            if not _NAME.match(variable):
                report(_key_position(tree, (*base, "set", variable)),
                       f"'{variable}' is not a variable name (letters, digits, underscore)")
            elif variable in CALL_VARIABLES:
                report(_key_position(tree, (*base, "set", variable)),
                       f"node '{name}' sets '{variable}', which comes from the call and "
                       "cannot be set")
            elif variable == "language":
                _check_language(value, where, languages, report)
            else:
                try:
                    used = template_variables(value)
                except ValueError as exc:
                    report(where, str(exc))
                    continue
                for missing in [v for v in used if v not in settable]:
                    report(where, f"variable '{{{missing}}}' is used but nothing sets it "
                                  f"({_SETTERS})")
        change = node.voice
        if change is not None:
            if change.speaker is not None and change.speaker.lower() not in speakers:
                report(pos(*base, "voice", "speaker"),
                       f"speaker '{change.speaker}' is not a built-in voice "
                       f"(one of: {', '.join(sorted(speakers))})")
            if (change.clone is not None and voice_exists is not None
                    and not voice_exists(change.clone)):
                report(pos(*base, "voice", "clone"),
                       f"cloned voice '{change.clone}' is not registered: add it with "
                       f"`gateway voices add {change.clone} REF.wav --text ...`")
            if change.language is not None:
                _check_language(change.language, pos(*base, "voice", "language"), languages,
                                report)
        if node.webhook is not None:
            for variable in node.webhook.sets:
                if variable in BUILTIN_VARIABLES:
                    report(pos(*base, "webhook", "sets"),
                           f"node '{name}' lets its webhook set '{variable}', which "
                           + ("changes only with 'set: {language: ...}'" if variable ==
                              "language" else "comes from the call"))
        if node.bot is not None:
            for variable in node.bot.sets:
                if variable in BUILTIN_VARIABLES or not _NAME.match(variable):
                    report(pos(*base, "bot", "sets"),
                           f"node '{name}' lets its bot set '{variable}', which "
                           + ("is not a variable name" if not _NAME.match(variable)
                              else "comes from the call"))

    supported = {language.lower() for language in languages}
    spoken: set[str] = set()
    #: (language, prompt) pairs some node says.
    said: set[tuple[str, str]] = set()
    for language, texts in script.translations.items():
        where = _key_position(tree, ("translations", language))
        if not _check_language(language, where, languages, report):
            continue
        if language.lower() == script.voice.language.lower():
            report(where, f"translations into {language}, the script's own language: its "
                          "texts are the prompts themselves")
        for prompt_name in texts:
            if prompt_name not in script.prompts:
                report(_key_position(tree, ("translations", language, prompt_name)),
                       f"'{prompt_name}' translates no prompt (prompts: "
                       f"{', '.join(sorted(script.prompts)) or 'none'})")

    states = script.voice_states()
    for path, item in _say_item_paths(script):
        name = str(path[1])
        voices = [script.spoken_voice(item, v) for v in states.get(name, [])]
        # Unsupported languages are reported where they are set.
        node_languages = list(dict.fromkeys(v.language for v in voices
                                            if v.language.lower() in supported))
        spoken.update(lang.lower() for lang in node_languages)
        if script.is_prompt_ref(item):
            assert isinstance(item, str)
            for language in node_languages:
                said.add((language.lower(), item))
                if language.lower() == script.voice.language.lower():
                    continue
                if item not in script.translation(language):
                    report(pos(*path), f"node '{name}' says prompt '{item}' in {language}, "
                                       f"but translations.{language} has no '{item}'")
        elif len(node_languages) > 1 and not (isinstance(item, Sentence) and item.language):
            report(pos(*path), f"node '{name}' may speak {' or '.join(node_languages)}, but "
                               "this sentence has one text: make it a prompt with "
                               "translations, or give it a language")
    for language, texts in script.translations.items():
        if not flow_known or language.lower() not in supported or \
                language.lower() == script.voice.language.lower():
            continue
        if language.lower() not in spoken:
            report(_key_position(tree, ("translations", language)),
                   f"translations into {language} are never used: no node speaks {language} "
                   "(change the call's language with 'set: {language: ...}')")
            continue
        for prompt_name in texts:
            if prompt_name in script.prompts and (language.lower(), prompt_name) not in said:
                report(_key_position(tree, ("translations", language, prompt_name)),
                       f"the {language} '{prompt_name}' is never said: no node says "
                       f"'{prompt_name}' while the call speaks {language}")


#: What the call's own variables hold, and the say-as types that can read it.
_CALL_VARIABLE_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "caller": ("the caller's number", ("telephone", "digits", "characters")),
    "called": ("the number the caller dialled", ("telephone", "digits", "characters")),
    "call_id": ("the call's id", ("characters",)),
    "language": ("the name of the call's language", ()),
}


def _check_reading(script: Script, tree: _Map, report: Callable[[tuple[int, int], str], None],
                   languages: set[str]) -> None:
    """The lexicon, and every say-as slot: a known type, one the libraries can say in each
    language the sentence is spoken in, and a value it can read where the value is known
    (a quoted literal, a call variable, a fixed value from 'variables' or 'set')."""
    good = [entry for i, entry in enumerate(script.lexicon)
            if check_lexicon_entry(entry, ("lexicon", i), tree, report, languages)]
    # The slots are checked with the entries that compile (the others are reported above).
    reader = _reader(script.voice.language, script.reading, tuple(good))
    fixed: dict[str, list[tuple[str, str]]] = {}
    for variable, value in script.variables.items():
        fixed.setdefault(variable, []).append(("'variables' gives", value))
    for name, node in script.nodes.items():
        for variable, value in (node.assign or {}).items():
            try:
                parts = parse_template(value)
            except ValueError:
                continue  # reported where 'set' is checked
            typed = [p for p in parts if isinstance(p, Slot) and p.kind is not None]
            if typed:
                report(_text_position(tree, ("nodes", name, "set", variable), typed[0].kind_at),
                       f"node '{name}' sets '{variable}' with '{typed[0].source}': say-as "
                       "types are for sentences a caller hears, a variable holds the value "
                       "as written")
            elif not any(isinstance(p, Slot) for p in parts):
                fixed.setdefault(variable, []).append((f"node '{name}' sets", value))

    def check(text: str, path: tuple[str | int, ...], spoken_in: list[str]) -> None:
        try:
            slots = template_slots(text)
        except ValueError:
            return  # reported with the sentence
        for slot in slots:
            if slot.kind is None:
                continue
            where = _text_position(tree, path, slot.kind_at)
            problems = slot_problems(slot, spoken_in, reader)
            for problem in problems:
                report(where, problem)
            if problems or slot.name is None:
                continue
            known = _CALL_VARIABLE_KINDS.get(slot.name)
            if known is not None and slot.kind not in known[1]:
                what, allowed = known
                report(where, f"'{slot.source}' cannot apply: '{slot.name}' is {what}, "
                              + (f"read as {' or '.join(allowed)}" if allowed
                                 else "which no say-as type reads"))
                continue
            for origin, value in fixed.get(slot.name, []):
                if not value.strip():
                    continue
                for name in dict.fromkeys(spoken_in):
                    lang = reader.language(name)
                    if lang is None:
                        continue
                    try:
                        say_as(slot.kind, value, lang, reader.conventions)
                    except GatewayError:
                        report(where, f"'{slot.source}' cannot apply: {origin} '{slot.name}' "
                                      f"the value {value!r}, which is not a {slot.kind}")
                    break

    home = script.voice.language
    for prompt_name, text in script.prompts.items():
        check(text, ("prompts", prompt_name), [home])
    for language, texts in script.translations.items():
        for prompt_name, text in texts.items():
            check(text, ("translations", language, prompt_name), [language])
    states = script.voice_states()
    for path, item in _say_item_paths(script):
        if script.is_prompt_ref(item):
            continue
        node_name = str(path[1])
        spoken = [script.spoken_voice(item, voice).language
                  for voice in states.get(node_name, [])]
        if isinstance(item, Sentence):
            check(item.text, (*path, "text"), spoken or [home])
        else:
            check(item, path, spoken or [home])


def check_lexicon_entry(entry: LexiconEntry, path: tuple[str | int, ...], tree: Any,
                        report: Callable[[tuple[int, int], str], None],
                        languages: Iterable[str]) -> bool:
    """Report a lexicon entry that does not compile, located at the very character (a script's
    and a lines file's entries alike); True when it compiles."""
    try:
        compile_entry(entry)
    except LexiconError as exc:
        report(_text_position(tree, (*path, exc.field), exc.offset), f"lexicon: {exc.message}")
        return False
    if entry.language is not None:
        _check_language(entry.language, _position(tree, (*path, "language")),
                        set(languages), report)
    return True


def _check_hours(name: str, hours: Hours, tree: _Map, base: tuple[str, ...],
                 report: Callable[[tuple[int, int], str], None]) -> None:
    try:
        Schedule.compile(hours.timezone, hours.weekly, hours.holiday_hours())
    except HoursError as exc:
        where = _position(tree, (*base, "hours"))
        if exc.key == hours.timezone:
            where = _position(tree, (*base, "hours", "timezone"))
        elif exc.key in hours.weekly:
            where = _key_position(tree, (*base, "hours", "weekly", exc.key))
        else:
            for i, (day, _) in enumerate(hours.holiday_hours()):
                if day.isoformat() == exc.key:
                    where = _position(tree, (*base, "hours", "holidays", i))
        report(where, f"node '{name}' hours: {exc.message}")


#: How a variable gets a value, for messages about one that nothing sets.
_SETTERS = "a gather's 'store', a webhook's 'sets', a node's 'set', or 'variables'"


def _say_item_paths(script: Script) -> Iterator[tuple[tuple[str | int, ...], SayItem]]:
    for name, node in script.nodes.items():
        for i, item in enumerate(node.say or []):
            yield ("nodes", name, "say", i), item
        if node.gather is not None:
            for field in ("prompt", "retry_prompt"):
                for i, item in enumerate(getattr(node.gather, field)):
                    yield ("nodes", name, "gather", field, i), item
        if node.bot is not None:
            # A bot's greeting is a sentence like any other (rendered ahead when static), and
            # so are the prompts it may play by name.
            if node.bot.welcome_greeting is not None:
                yield ("nodes", name, "bot", "welcome_greeting"), node.bot.welcome_greeting
            for i, prompt in enumerate(node.bot.prompts):
                if prompt in script.prompts:  # (one that is not is reported where it is)
                    yield ("nodes", name, "bot", "prompts", i), prompt


def _check_sentence(
    text: str,
    where: tuple[int, int],
    settable: set[str],
    report: Callable[[tuple[int, int], str], None],
) -> None:
    if not text.strip():
        report(where, "empty sentence")
        return
    if len(text) > MAX_SENTENCE_CHARS:
        report(where, f"sentence of {len(text)} characters is too long for one utterance "
                      f"(max {MAX_SENTENCE_CHARS}): split it into several")
    try:
        names = template_variables(text)
    except ValueError as exc:
        report(where, str(exc))
        return
    for variable in names:
        if variable not in settable:
            report(where, f"variable '{{{variable}}}' is used but nothing sets it ({_SETTERS})")

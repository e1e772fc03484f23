"""Speech grammars: normalising phrases, synonyms, digits, matching, the compiled forms."""

from __future__ import annotations

import math
import pickle
import re

import pytest

from gateway.asr.grammar import SpeechGrammar, language_code, match, phrase_words, tokenize
from gateway.asr.sphinx import _jsgf, _open_lm
from gateway.errors import GrammarError

MENU = {"agent": ["agent", "Representative", "operator"],
        "balance": ["account balance", "my balance"],
        "support": "Tech-Support!"}


def test_tokenize_normalises_and_keeps_offsets() -> None:
    assert [(t.word, t.offset) for t in tokenize("  Tech-Support, please!")] == [
        ("tech", 2), ("support", 7), ("please", 16)]
    assert phrase_words("That's right") == ("that's", "right")
    assert phrase_words("'quoted' words") == ("quoted", "words")
    assert phrase_words("press 1") == ("press", "1")
    assert phrase_words("!!!") == ()


def test_build_keeps_branches_and_synonyms() -> None:
    g = SpeechGrammar.build(MENU)
    assert g.branches == (("agent", ("agent", "Representative", "operator")),
                          ("balance", ("account balance", "my balance")),
                          ("support", ("Tech-Support!",)))
    assert g.phrases[("representative",)] == ("agent", "Representative")
    assert g.phrases[("tech", "support")] == ("support", "Tech-Support!")
    assert g.digits is None
    assert g.language == "en"
    assert {"agent", "representative", "account", "balance", "please"} <= g.words()


@pytest.mark.parametrize(
    ("phrases", "digits", "needle"),
    [
        ({}, None, "needs phrases, digits, or both"),
        ({"a": ["agent"], "b": ["Agent!"]}, None, "is in branches 'a' and 'b'"),
        ({"a": []}, None, "has no phrases"),
        ({"a": ["..."]}, None, "has no words"),
        ({"a": ["one two"]}, 6, "is spoken digits"),
        ({}, 0, "digits must be between 1 and 32"),
        ({}, 33, "digits must be between 1 and 32"),
        ({"a": [" ".join(["word"] * 13)]}, None, "has 13 words"),
    ],
)
def test_bad_grammars_are_rejected_with_every_problem(
    phrases: dict[str, list[str]], digits: int | None, needle: str
) -> None:
    with pytest.raises(GrammarError) as exc:
        SpeechGrammar.build(phrases, digits=digits)
    assert any(needle in p for p in exc.value.problems), exc.value.problems


def test_grammar_error_lists_all_problems_and_survives_pickling() -> None:
    with pytest.raises(GrammarError) as exc:
        SpeechGrammar.build({"a": ["agent"], "b": ["agent"], "c": []})
    assert len(exc.value.problems) == 2
    again = pickle.loads(pickle.dumps(exc.value))
    assert again.problems == exc.value.problems


def test_language_codes() -> None:
    assert language_code("English") == "en"
    assert language_code("en-US") == "en"
    assert language_code("en_gb") == "en"
    assert language_code("German") == "de"
    assert language_code("Auto") is None
    assert SpeechGrammar.build({"a": "agent"}, language="Spanish").language == "es"
    with pytest.raises(GrammarError, match="name it"):
        SpeechGrammar.build({"a": "agent"}, language="Auto")


def test_key_is_stable_and_content_addressed_and_pickle_keeps_the_index() -> None:
    g = SpeechGrammar.build(MENU)
    assert g.key() == SpeechGrammar.build(MENU).key()
    assert g.key() != SpeechGrammar.build(MENU, digits=6).key()
    assert g.key() != SpeechGrammar.build({**MENU, "agent": ["agent"]}).key()
    copy = pickle.loads(pickle.dumps(g))
    assert copy == g
    assert copy.phrases == g.phrases


def test_match_allows_fillers_only_at_the_edges() -> None:
    g = SpeechGrammar.build(MENU)
    m = match(g, ["uh", "agent", "please"])
    assert m is not None
    assert (m.branch, m.phrase, m.span) == ("agent", "agent", (1, 2))
    assert match(g, ["my", "balance"]) is not None
    assert match(g, ["account", "uh", "balance"]) is None
    assert match(g, ["agent", "billing"]) is None
    assert match(g, ["the"]) is None
    assert match(g, []) is None
    # A phrase that itself starts with a filler word still matches whole.
    main = SpeechGrammar.build({"menu": ["the main menu"]})
    hit = match(main, ["the", "main", "menu"])
    assert hit is not None and hit.span == (0, 3)


def test_match_digits_needs_exactly_the_length() -> None:
    g = SpeechGrammar.build({"agent": ["agent"]}, digits=6)
    m = match(g, "four one seven oh two nine".split())
    assert m is not None and m.digits == "417029" and m.branch is None
    assert match(g, "zero zero one two three four please".split()).digits == "001234"  # type: ignore[union-attr]
    assert match(g, "four one seven two nine".split()) is None
    assert match(g, "four one seven oh two nine one".split()) is None
    assert match(g, "four one seven the two nine".split()) is None
    assert match(g, ["agent"]).branch == "agent"  # type: ignore[union-attr]


def test_jsgf_has_every_phrase_optional_please_and_n_digit_slots() -> None:
    text = _jsgf(SpeechGrammar.build(MENU, digits=4))
    assert text.startswith("#JSGF V1.0;")
    for phrase in ("agent", "representative", "account balance", "tech support"):
        assert phrase in text
    assert "[ please ]" in text
    assert len(re.findall(r"\( eight \| five \| four \| nine \| oh \| one \| seven \| six \| "
                          r"three \| two \| zero \)", text)) == 4


def _arpa(text: str) -> tuple[dict[str, tuple[float, float]], dict[tuple[str, str], float]]:
    uni: dict[str, tuple[float, float]] = {}
    bi: dict[tuple[str, str], float] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("\\"):
            section = line
            continue
        parts = line.split()
        if section == "\\1-grams:" and parts:
            uni[parts[1]] = (float(parts[0]), float(parts[2]) if len(parts) > 2 else 0.0)
        elif section == "\\2-grams:" and parts:
            bi[(parts[1], parts[2])] = float(parts[0])
    return uni, bi


@pytest.mark.parametrize("compound", [True, False])
@pytest.mark.parametrize("digits", [None, 6])
def test_open_pass_language_model_is_a_normalised_bigram(digits: int | None,
                                                         compound: bool) -> None:
    """Every context's explicit bigrams plus its backed-off unigrams sum to one (ARPA backoff)."""
    uni, bi = _arpa(_open_lm(SpeechGrammar.build(MENU, digits=digits), 0.999, 300,
                             compound=compound))
    assert len(uni) > 300
    for context in {h for h, _ in bi}:
        explicit = {w: 10 ** p for (h, w), p in bi.items() if h == context}
        backoff = 10 ** uni[context][1]
        total = sum(explicit.values()) + backoff * sum(
            10 ** p for w, (p, _) in uni.items() if w not in explicit and w != "<s>")
        assert math.isclose(total, 1.0, rel_tol=1e-4), (context, total)
    phrase_starts = sum(10 ** p for (h, w), p in bi.items() if h == "<s>")
    assert math.isclose(phrase_starts, 0.999, rel_tol=1e-4)
    if compound:
        # A multi-word phrase is one word, reached from the start; the polite words follow it.
        assert ("<s>", "account_balance") in bi and ("account", "balance") not in bi
        assert ("account_balance", "please") in bi
    else:
        assert ("account", "balance") in bi
    assert ("agent", "please") in bi
    if digits:
        assert ("four", "seven") in bi

"""Text normalisation benchmark: what reading a sentence costs on a caller's turn.

Run from the repository root::

    python bench/text.py [--rounds 21] [--repeat 200]

Every sentence a call speaks now goes through :meth:`gateway.text.Reader.sentence` (say-as
types, the lexicon, the free-text normaliser) before the prompt cache's lookup or the engine,
on the event loop. This measures that cost per sentence, warm (after :meth:`Reader.warm`, as a
gateway is once it is ready), against the baseline the runner paid before:
:func:`gateway.ivr.script.render` (the template filled in with the values as written), in the
same process, the two alternating within each round; each cell is the median over rounds.

Sentences: a cached prompt with no values (the per-turn cached path), the demo's balance
sentence (three typed values, a different caller's each time from a seeded pool of ten
thousand), the greeter's read-back in ``numbers`` and ``full`` modes, a
line with a five-entry lexicon, and a 400-character sentence (the longest one utterance may
be) full of amounts, dates, times and phone numbers in ``full`` mode.

The last line is machine-readable:
``RESULT reader/render cost, demo balance sentence = X.XXx (Y us per sentence)``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    from gateway.ivr.script import load_script, render
    from gateway.text import LexiconEntry, Reader, Reading
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gateway.ivr.script import load_script, render
    from gateway.text import LexiconEntry, Reader, Reading

ROOT = Path(__file__).resolve().parents[1]
VALUES = {"first_name": "Dana", "account_number": "004512", "balance": "456.10",
          "due_date": "2026-03-03"}
LONG = ("Your payment of $1,234.56 was received on 12/15/2026 at 3:30 PM. The next one, "
        "$99.10, is due 2027-01-15. Questions? Call +1 555 010 0199 ext. 12 or (555) 010-0200 "
        "between 9:00 AM and 17:30, Monday to Friday. Your account 004512 has 3 open items; "
        "order 1234567 ships on the 3rd. Save 15% with autopay. Thank you for choosing Acme!")
LEXICON = [
    LexiconEntry(text="Acme", say="Ack-mee"),
    LexiconEntry(text="kWh", say="kilowatt hours", ignore_case=True),
    LexiconEntry(pattern=r"\bSt\.(?= [A-Z])", say="Street"),
    LexiconEntry(pattern=r"\bRte (\d+)", say=r"Route \1"),
    LexiconEntry(text="Ave", say="Avenue"),
]


def _mean_us(fn: Callable[[], object], repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1e6 * (time.perf_counter() - t0) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    script = load_script(ROOT / "prompts" / "demo.yaml")
    demo = script.reader()
    numbers = Reader("English", Reading(free_text="numbers"))
    full = Reader("English", Reading(free_text="full"))
    lexicon = Reader("English", Reading(free_text="numbers"), LEXICON)
    for reader in (demo, numbers, full, lexicon):
        reader.warm(["English", "Spanish"])
    welcome = script.sentence("welcome")
    balance = script.sentence("balance")
    spanish = script.sentence("balance", "Spanish")
    street = "Acme Energy, 12 Main St. Springfield, Rte 66: 1,234 kWh this month."

    # Each caller's values differ (a balance, a date, an account): a seeded pool of them, so
    # the memoised number words are hit as often as real traffic would hit them, not always.
    rng = random.Random(args.seed)
    pool = [{"first_name": "Dana", "account_number": f"{rng.randrange(10**6):06d}",
             "balance": f"{rng.randrange(-5000, 500000) / 100:.2f}",
             "due_date": f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"}
            for _ in range(10_000)]
    values = itertools.cycle(pool)

    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("cached prompt, no values (off)", lambda: demo.sentence(welcome, VALUES, "English"),
         lambda: render(welcome, VALUES)),
        ("demo balance, 3 typed values", lambda: demo.sentence(balance, next(values), "English"),
         lambda: render(balance, next(values))),
        ("demo balance in Spanish", lambda: demo.sentence(spanish, next(values), "Spanish"),
         lambda: render(spanish, next(values))),
        ("greeter read-back, numbers", lambda: numbers.sentence("You pressed 5.", {}, "English"),
         lambda: render("You pressed 5.", {})),
        ("greeter read-back, full", lambda: full.sentence("You pressed 5.", {}, "English"),
         lambda: render("You pressed 5.", {})),
        ("5-entry lexicon + numbers", lambda: lexicon.sentence(street, {}, "English"),
         lambda: render(street, {})),
        (f"{len(LONG)} chars, full", lambda: full.sentence(LONG, {}, "English"),
         lambda: render(LONG, {})),
    ]
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, *_ in cases}
    for round_ in range(args.rounds):
        for name, ours, base in cases:
            pair = [(ours, results[name][0]), (base, results[name][1])]
            for fn, sink in pair if round_ % 2 == 0 else reversed(pair):
                sink.append(_mean_us(fn, args.repeat))

    print(f"text normalisation per sentence ({platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, {args.rounds} rounds x {args.repeat})")
    print(f"{'sentence':34} {'reader us':>10} {'render us':>10} {'ratio':>7}")
    for name, *_ in cases:
        ours, base = (statistics.median(v) for v in results[name])
        print(f"{name:34} {ours:10.1f} {base:10.2f} {ours / base:6.1f}x")
    print("spoken:", full.sentence(LONG, {}, "English").spoken)
    ours, base = (statistics.median(v) for v in results["demo balance, 3 typed values"])
    print(f"RESULT reader/render cost, demo balance sentence = {ours / base:.2f}x "
          f"({ours:.0f} us per sentence)")


if __name__ == "__main__":
    main()

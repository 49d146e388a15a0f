"""Synthetic chat corpus for the embedded demo (`dspark-ds demo`).

The corpus is built so that a ~1M-parameter target learns it in minutes on a CPU, yet
sampling at T = 1 still matters:

- Low entropy given context: answers follow templates, entities map to fixed facts
  (country -> capital, word -> translation), code bodies follow the function asked for.
- Real branch points: an opener, a phrasing of the answer, a story name, a function
  body... are drawn with unequal weights, so greedy and sampled decoding differ.
- Choice-dependent continuations: every alternative is several tokens long and starts
  with a distinctive word, so once its first token is drawn the rest is determined by
  the previous token. This is exactly where a parallel drafter's independent marginals
  go wrong ("suffix decay") and a Markov head, which sees the previous draft token,
  does not.

Rows use the OpenAI `messages` layout: an optional system turn, one user turn, one
assistant turn. Held-out rows carry the prompt only (no assistant turn) and come from an
independent random stream; the prompts are templated, so a held-out prompt text may also
occur in training (its sampled answer will not be the same). Everything is a pure function of the seed: row `i` of a split
is drawn from its own RNG, so a larger corpus extends a smaller one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

Row = dict[str, list[dict[str, str]]]
Choice = str | tuple[str, float]

# Bump when the generator changes, so caches keyed on the corpus are invalidated.
CORPUS_VERSION = 1


def _pick(rng: random.Random, options: Sequence[Choice]) -> str:
    """One option; an option may be `(text, weight)`, plain strings weigh 1."""
    texts = [o[0] if isinstance(o, tuple) else o for o in options]
    weights = [o[1] if isinstance(o, tuple) else 1.0 for o in options]
    return rng.choices(texts, weights=weights, k=1)[0]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


# ---------------------------------------------------------------------------
# Shared style: system prompts, openers, closers.

_SYSTEMS: list[tuple[str | None, float]] = [
    (None, 5),
    ("You are a helpful assistant.", 4),
    ("You are a helpful assistant. Keep your answers brief.", 1),
]
_BRIEF_MARKER = "brief"

_OPENERS: list[Choice] = [
    ("Sure! ", 4),
    ("Of course. ", 3),
    ("Great question! ", 2),
    ("Happy to help. ", 2),
    ("", 3),
]
_CLOSERS: list[Choice] = [
    (" Let me know if you have any other questions.", 3),
    (" I hope this helps!", 3),
    (" Feel free to ask me anything else.", 2),
    (" Have a wonderful day!", 1),
    ("", 3),
]


def _style(rng: random.Random, brief: bool) -> tuple[str, str]:
    """(opener, closer); a brief system prompt removes both, which the target must learn."""
    if brief:
        return "", ""
    return _pick(rng, _OPENERS), _pick(rng, _CLOSERS)


# ---------------------------------------------------------------------------
# Family: capitals (entity lookup, multi-token city names, three answer phrasings).

_CAPITALS: list[tuple[str, str, tuple[str, str]]] = [
    ("France", "Paris", ("art museums", "small cafes")),
    ("Japan", "Tokyo", ("busy train stations", "cherry blossoms")),
    ("Italy", "Rome", ("ancient ruins", "fresh pasta")),
    ("Spain", "Madrid", ("royal palace", "late dinners")),
    ("Germany", "Berlin", ("long history", "green parks")),
    ("Canada", "Ottawa", ("frozen canal", "parliament buildings")),
    ("Egypt", "Cairo", ("great pyramids", "busy markets")),
    ("Kenya", "Nairobi", ("national park", "coffee farms")),
    ("Peru", "Lima", ("old churches", "ocean views")),
    ("Argentina", "Buenos Aires", ("tango music", "wide avenues")),
    ("India", "New Delhi", ("grand monuments", "spicy street food")),
    ("Mexico", "Mexico City", ("colorful murals", "floating gardens")),
    ("Malaysia", "Kuala Lumpur", ("twin towers", "night markets")),
    ("Ethiopia", "Addis Ababa", ("coffee ceremonies", "mountain air")),
    ("Australia", "Canberra", ("quiet lake", "national museums")),
    ("Norway", "Oslo", ("deep fjords", "wooden boats")),
    ("Greece", "Athens", ("ancient temples", "sunny hills")),
    ("Thailand", "Bangkok", ("golden temples", "floating markets")),
    ("Portugal", "Lisbon", ("yellow trams", "steep streets")),
    ("Ireland", "Dublin", ("old libraries", "friendly pubs")),
    ("Vietnam", "Hanoi", ("quiet lakes", "noodle soup")),
    ("South Korea", "Seoul", ("royal palaces", "modern music")),
    ("New Zealand", "Wellington", ("windy harbor", "film studios")),
    ("the United Kingdom", "London", ("red buses", "old bridges")),
    ("Sri Lanka", "Sri Jayawardenepura Kotte", ("calm lakes", "old temples")),
    ("Poland", "Warsaw", ("old town square", "rebuilt castle")),
    ("Turkey", "Ankara", ("old citadel", "wide boulevards")),
]


def _capitals(rng: random.Random, brief: bool) -> tuple[str, str]:
    country, city, features = rng.choice(_CAPITALS)
    user = _pick(
        rng,
        [
            f"What is the capital of {country}?",
            f"Which city is the capital of {country}?",
            f"Tell me the capital of {country}.",
            f"Do you know the capital of {country}?",
        ],
    )
    opener, closer = _style(rng, brief)
    answer = _pick(
        rng,
        [
            (f"The capital of {country} is {city}.", 5),
            (f"{city} is the capital of {country}.", 3),
            (f"{_cap(country)}'s capital city is {city}.", 2),
        ],
    )
    fact = ""
    if not brief:
        feature = rng.choice(features)
        fact = _pick(
            rng,
            [
                (f" It is known for its {feature}.", 3),
                (f" The city is famous for its {feature}.", 2),
                (f" Many visitors come for its {feature}.", 1),
            ],
        )
    return user, opener + answer + fact + closer


# ---------------------------------------------------------------------------
# Family: arithmetic word problems (copying names and numbers, a small sum table).

_PEOPLE: list[tuple[str, str]] = [
    ("Tom", "he"),
    ("Anna", "she"),
    ("Maria", "she"),
    ("Sam", "he"),
    ("Lily", "she"),
    ("Ben", "he"),
    ("Omar", "he"),
    ("Priya", "she"),
]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "shells"]
_GAINS = ["buys {b} more", "finds {b} more", "gets {b} more from a friend"]
_LOSSES = ["gives {b} to a friend", "loses {b}", "eats {b}"]


def _arithmetic(rng: random.Random, brief: bool) -> tuple[str, str]:
    name, he = rng.choice(_PEOPLE)
    items = rng.choice(_ITEMS)
    add = rng.random() < 0.6
    # NOTE: small operands keep the fact table small (25 sums, 28 differences): a ~1M-param
    # target trained for minutes memorises it; with operands up to 9 it only copied them.
    if add:
        a, b = rng.randint(1, 5), rng.randint(1, 5)
        c, op, verb = a + b, "+", "add"
        event = rng.choice(_GAINS).format(b=b)
    else:
        a = rng.randint(2, 8)
        b = rng.randint(1, a - 1)
        c, op, verb = a - b, "-", "subtract"
        event = rng.choice(_LOSSES).format(b=b)
    question = _pick(rng, [f"How many {items} does {name} have now?", "How many are there now?"])
    user = f"{name} has {a} {items}. {_cap(he)} {event}. {question}"
    if brief:
        return user, f"{a} {op} {b} = {c}. The answer is {c}."
    answer = _pick(
        rng,
        [
            (
                f"Let's solve it step by step.\n{name} has {a} {items} at first.\n"
                f"Then {he} {event}, so we {verb}: {a} {op} {b} = {c}.\nThe answer is {c}.",
                4,
            ),
            (f"We start with {a} {items}.\n{a} {op} {b} = {c}.\nSo {name} has {c} {items} now.", 3),
            (f"{a} {op} {b} = {c}, so {name} has {c} {items}.", 2),
        ],
    )
    return user, answer


# ---------------------------------------------------------------------------
# Family: code (templated Python functions; the body's names follow the chosen args).

# (task phrase, function names, argument tuples, bodies using {0}/{1}, docstring, what it returns)
_FUNCTIONS: list[tuple[str, list[str], list[tuple[str, ...]], list[str], str, str]] = [
    (
        "adds two numbers",
        ["add", "add_numbers"],
        [("a", "b"), ("x", "y")],
        ["return {0} + {1}", "result = {0} + {1}\n    return result"],
        "Return the sum of two numbers.",
        "the sum",
    ),
    (
        "multiplies two numbers",
        ["multiply", "product"],
        [("a", "b"), ("x", "y")],
        ["return {0} * {1}", "result = {0} * {1}\n    return result"],
        "Return the product of two numbers.",
        "the product",
    ),
    (
        "returns the larger of two numbers",
        ["larger", "max_of_two"],
        [("a", "b"), ("x", "y")],
        ["return max({0}, {1})", "if {0} > {1}:\n        return {0}\n    return {1}"],
        "Return the larger number.",
        "the larger value",
    ),
    (
        "squares a number",
        ["square", "squared"],
        [("x",), ("n",)],
        ["return {0} * {0}", "return {0} ** 2"],
        "Return the square of a number.",
        "the square",
    ),
    (
        "checks if a number is even",
        ["is_even", "even"],
        [("n",), ("number",)],
        ["return {0} % 2 == 0", "if {0} % 2 == 0:\n        return True\n    return False"],
        "Return True if the number is even.",
        "True for even numbers",
    ),
    (
        "reverses a string",
        ["reverse", "reverse_string"],
        [("s",), ("text",)],
        ["return {0}[::-1]", 'return "".join(reversed({0}))'],
        "Return the string backwards.",
        "the reversed string",
    ),
    (
        "sums a list of numbers",
        ["total", "sum_list"],
        [("nums",), ("values",)],
        ["return sum({0})", "total = 0\n    for v in {0}:\n        total += v\n    return total"],
        "Return the sum of a list.",
        "the total",
    ),
    (
        "counts the items in a list",
        ["count", "count_items"],
        [("items",), ("xs",)],
        ["return len({0})", "count = 0\n    for _ in {0}:\n        count += 1\n    return count"],
        "Return how many items there are.",
        "the number of items",
    ),
    (
        "greets a person by name",
        ["greet", "say_hello"],
        [("name",), ("person",)],
        ['return "Hello, " + {0} + "!"', 'return f"Hello, {{{0}}}!"'],
        "Return a friendly greeting.",
        "a greeting",
    ),
]


def _code(rng: random.Random, brief: bool) -> tuple[str, str]:
    task, names, arg_sets, bodies, doc, returns = rng.choice(_FUNCTIONS)
    user = _pick(
        rng,
        [
            f"Write a Python function that {task}.",
            f"Can you write a function that {task}?",
            f"Show me a Python function that {task}.",
        ],
    )
    fname = _pick(rng, [(names[0], 2), (names[1], 1)])
    args = _pick(rng, [(", ".join(arg_sets[0]), 2), (", ".join(arg_sets[1]), 1)]).split(", ")
    body = _pick(rng, [(bodies[0], 3), (bodies[1], 2)]).format(*args)
    docline = f'    """{doc}"""\n' if rng.random() < 0.4 else ""
    block = f"```python\ndef {fname}({', '.join(args)}):\n{docline}    {body}\n```"
    if brief:
        return user, block
    opener, closer = _style(rng, brief)
    intro = _pick(
        rng,
        [
            ("Here is a simple version:\n", 3),
            ("Here is one way to write it:\n", 2),
            ("This function does the job:\n", 1),
        ],
    )
    explain = _pick(
        rng,
        [
            (f"\nThe function {fname} returns {returns}.", 3),
            (f"\nCalling {fname} gives you {returns}.", 2),
            ("", 2),
        ],
    )
    return user, opener + intro + block + explain + closer


# ---------------------------------------------------------------------------
# Family: short stories (multi-token names reused later, branchy multi-token phrases).

_ANIMALS = ["cat", "dog", "rabbit", "fox", "owl", "turtle", "mouse", "bear", "duck", "frog"]
_ADJECTIVES = ["little", "brave", "curious", "sleepy", "clever", "shy"]
_STORY_NAMES: list[Choice] = [
    ("Pip", 3),
    ("Luna", 3),
    ("Daisy", 2),
    ("Captain Whiskers", 2),
    ("Mister Button", 2),
    ("Old Barnaby", 1),
]
_PLACES: list[Choice] = [
    ("in a cozy burrow under an old oak tree", 3),
    ("near a quiet pond at the edge of the forest", 2),
    ("in a small house by the sea", 2),
    ("on a farm in the green hills", 1),
]
_HABITS: list[Choice] = [
    ("went for a long walk", 3),
    ("looked for something good to eat", 2),
    ("sang a happy song", 2),
    ("played with the other animals", 1),
]
_EVENTS: list[Choice] = [
    ("found a shiny stone in the tall grass", 3),
    ("met a lost little bird who could not fly home", 2),
    ("heard strange music coming from the hills", 2),
    ("saw dark clouds and a storm rolling in", 1),
]
_ENDINGS: list[Choice] = [
    ("From that day on, {name} was never lonely again.", 3),
    ("In the end, {name} learned that friends make everything better.", 2),
    ("And {name} smiled all the way home.", 2),
]


def _story(rng: random.Random, brief: bool) -> tuple[str, str]:
    animal = rng.choice(_ANIMALS)
    adjective = rng.choice(_ADJECTIVES)
    user = _pick(
        rng,
        [
            f"Tell me a short story about a {animal}.",
            f"Write a tiny story about a {adjective} {animal}.",
            f"Can you tell me a bedtime story about a {animal}?",
        ],
    )
    name = _pick(rng, _STORY_NAMES)
    first = f"Once upon a time, there was a {adjective} {animal} named {name}."
    if brief:
        ending = _pick(rng, _ENDINGS).format(name=name)
        return user, f"{first} {ending}"
    story = (
        f"{first} {name} lived {_pick(rng, _PLACES)}. "
        f"Every morning, {name} {_pick(rng, _HABITS)}. "
        f"One day, {name} {_pick(rng, _EVENTS)}. "
        f"{_pick(rng, _ENDINGS).format(name=name)}"
    )
    if rng.random() < 0.3:
        story += " The end."
    return user, story


# ---------------------------------------------------------------------------
# Family: recipes (numbered steps, each with alternative phrasings).

_RECIPES: list[tuple[str, list[list[Choice]]]] = [
    (
        "a cup of tea",
        [
            [("Boil some fresh water.", 2), ("Heat water in a kettle.", 1)],
            [("Put a tea bag in a cup.", 2), ("Place the tea leaves in a pot.", 1)],
            [
                ("Pour the hot water and wait three minutes.", 2),
                ("Let it steep for a few minutes.", 1),
            ],
        ],
    ),
    (
        "pancakes",
        [
            [
                ("Mix flour, milk and eggs in a bowl.", 2),
                ("Whisk the eggs, milk and flour together.", 1),
            ],
            [("Heat a pan with a little butter.", 2), ("Warm a greased pan over medium heat.", 1)],
            [("Cook each side until golden.", 2), ("Flip them when bubbles appear.", 1)],
        ],
    ),
    (
        "scrambled eggs",
        [
            [("Crack two eggs into a bowl.", 2), ("Beat the eggs with a fork.", 1)],
            [("Melt butter in a pan.", 2), ("Heat a pan over low heat.", 1)],
            [
                ("Stir the eggs slowly until they set.", 2),
                ("Keep stirring until soft and creamy.", 1),
            ],
        ],
    ),
    (
        "a fruit salad",
        [
            [("Wash the fruit well.", 2), ("Rinse all the fruit with cold water.", 1)],
            [
                ("Cut the fruit into small pieces.", 2),
                ("Chop everything into bite sized cubes.", 1),
            ],
            [("Mix it all in a large bowl.", 2), ("Toss the pieces with a little honey.", 1)],
        ],
    ),
    (
        "lemonade",
        [
            [("Squeeze four lemons.", 2), ("Juice a few fresh lemons.", 1)],
            [("Add sugar and cold water.", 2), ("Stir in water and a spoon of sugar.", 1)],
            [("Serve it over ice.", 2), ("Chill it in the fridge before serving.", 1)],
        ],
    ),
]


def _recipe(rng: random.Random, brief: bool) -> tuple[str, str]:
    dish, steps = rng.choice(_RECIPES)
    user = _pick(rng, [f"How do I make {dish}?", f"Give me a recipe for {dish}."])
    lines = "\n".join(f"{i}. {_pick(rng, options)}" for i, options in enumerate(steps, 1))
    if brief:
        return user, lines
    opener, closer = _style(rng, brief)
    intro = _pick(
        rng,
        [
            (f"To make {dish}, follow these steps:\n", 3),
            ("Here is what to do:\n", 2),
            (f"Making {dish} is easy:\n", 1),
        ],
    )
    outro = _pick(rng, [(f"\nEnjoy your {dish}!", 2), ("\nEnjoy!", 1), ("", 1)])
    return user, opener + intro + lines + outro + closer


# ---------------------------------------------------------------------------
# Family: translation (word lookup, three phrasings that place the answer differently).

_WORDS: list[tuple[str, str, str]] = [
    ("hello", "hola", "bonjour"),
    ("thank you", "gracias", "merci"),
    ("cat", "gato", "chat"),
    ("dog", "perro", "chien"),
    ("water", "agua", "eau"),
    ("house", "casa", "maison"),
    ("book", "libro", "livre"),
    ("friend", "amigo", "ami"),
    ("good night", "buenas noches", "bonne nuit"),
    ("apple", "manzana", "pomme"),
]


def _translate(rng: random.Random, brief: bool) -> tuple[str, str]:
    word, spanish, french = rng.choice(_WORDS)
    language, target = rng.choice([("Spanish", spanish), ("French", french)])
    user = _pick(
        rng,
        [f'Translate "{word}" into {language}.', f'How do you say "{word}" in {language}?'],
    )
    opener, closer = _style(rng, brief)
    answer = _pick(
        rng,
        [
            (f'"{_cap(word)}" in {language} is "{target}".', 3),
            (f'In {language}, you say "{target}".', 2),
            (f'The {language} word for "{word}" is "{target}".', 2),
        ],
    )
    return user, opener + answer + closer


# ---------------------------------------------------------------------------
# Family: small talk (short, high-branching replies).

_SMALL_TALK: list[tuple[list[str], list[Choice]]] = [
    (
        ["Hi!", "Hello there.", "Good morning!", "Hey, how is it going?"],
        [
            ("Hello! How can I help you today?", 3),
            ("Hi there! What can I do for you?", 2),
            ("Good to see you! What would you like to talk about?", 1),
        ],
    ),
    (
        ["How are you today?", "How are you doing?"],
        [
            ("I am doing well, thank you for asking! How can I help you?", 3),
            ("I'm great, thanks! What can I do for you today?", 2),
        ],
    ),
    (
        ["Thank you!", "Thanks a lot.", "Thanks for your help."],
        [
            ("You're welcome!", 3),
            ("You are very welcome. Happy to help!", 2),
            ("Anytime! Let me know if you need anything else.", 1),
        ],
    ),
    (
        ["Who are you?", "What can you do?"],
        [
            ("I am a small assistant. I can answer questions, write code and tell stories.", 2),
            ("I'm a helpful assistant. Ask me about capitals, math, code or recipes.", 1),
        ],
    ),
]


def _small_talk(rng: random.Random, brief: bool) -> tuple[str, str]:
    prompts, replies = rng.choice(_SMALL_TALK)
    return rng.choice(prompts), _pick(rng, replies)


_FAMILIES: list[tuple[Callable[[random.Random, bool], tuple[str, str]], float]] = [
    (_capitals, 3),
    (_arithmetic, 3),
    (_code, 4),
    (_story, 3),
    (_recipe, 2),
    (_translate, 2),
    (_small_talk, 1),
]


def make_row(rng: random.Random) -> Row:
    """One conversation: optional system, user, assistant."""
    system = rng.choices([s for s, _ in _SYSTEMS], weights=[w for _, w in _SYSTEMS], k=1)[0]
    family = rng.choices([f for f, _ in _FAMILIES], weights=[w for _, w in _FAMILIES], k=1)[0]
    brief = system is not None and _BRIEF_MARKER in system
    user, assistant = family(rng, brief)
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def make_corpus(seed: int, num_train: int, num_heldout: int) -> tuple[list[Row], list[Row]]:
    """`(train_rows, heldout_rows)`, a pure function of the arguments.

    Train rows are full conversations. Held-out rows are prompts only (the assistant turn
    removed), drawn from an independent stream with the same mix of families.
    """
    if num_train < 1 or num_heldout < 0:
        raise ValueError(
            f"make_corpus: need num_train >= 1 and num_heldout >= 0, "
            f"got num_train={num_train}, num_heldout={num_heldout}"
        )
    # NOTE: string seeds go through sha512 in `random.Random`, so rows do not depend on
    # PYTHONHASHSEED and row i is the same whatever num_train is.
    train = [make_row(random.Random(f"{seed}/train/{i}")) for i in range(num_train)]
    heldout = []
    for i in range(num_heldout):
        row = make_row(random.Random(f"{seed}/heldout/{i}"))
        heldout.append({"messages": [m for m in row["messages"] if m["role"] != "assistant"]})
    return train, heldout


def write_jsonl(rows: Sequence[Row], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_corpus(
    out_dir: str | Path, seed: int, num_train: int, num_heldout: int
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `heldout.jsonl` under `out_dir`; returns both paths."""
    train, heldout = make_corpus(seed, num_train, num_heldout)
    out_dir = Path(out_dir)
    return write_jsonl(train, out_dir / "train.jsonl"), write_jsonl(
        heldout, out_dir / "heldout.jsonl"
    )

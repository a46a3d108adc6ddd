"""The built-in training prompts: the target's own requests plus task templates.

Drafters learn what the target says after the prompts they are trained on, and
heads trained on one narrow kind of prompt transfer poorly to others, so the
default set is broad and needs no outside file:

* **Magpie** requests: the chat model is given only the start of a user turn
  (the chat template up to where the user's text goes) and samples what a
  user might ask (Xu et al. 2024, "Magpie").
* **Templated** requests over varied task types, covering the kinds of
  requests in Spec-Bench's six categories (multi-turn chat tasks: writing,
  roleplay, reasoning, coding, extraction, explanations; translation;
  summarization; question answering; math word problems; retrieval-style
  passages + question) without using any benchmark prompt. Summarization,
  extraction and retrieval prompts embed **passages** the target writes
  itself first.

Every templated prompt is a pure function of (seed, index), so a larger data
set extends a smaller one and cached generations stay valid.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

_MARKER = "\u2063USER-TEXT\u2063"  # an invisible separator; never in a real template

TOPICS = (
    "the water cycle",
    "volcanoes",
    "the history of the printing press",
    "honeybees",
    "black holes",
    "the Roman Empire",
    "electric cars",
    "coral reefs",
    "the invention of the telephone",
    "sleep",
    "climate change",
    "the human immune system",
    "the stock market",
    "renewable energy",
    "jazz music",
    "the Great Wall of China",
    "machine learning",
    "the French Revolution",
    "vaccines",
    "rainforests",
    "the Moon landing",
    "coffee",
    "earthquakes",
    "the Olympic Games",
    "recycling",
    "photosynthesis",
    "the internet",
    "ancient Egypt",
    "antibiotics",
    "tea ceremonies in Japan",
    "the Industrial Revolution",
    "social media",
    "the Amazon river",
    "chess",
    "solar panels",
    "the Renaissance",
    "dinosaurs",
    "urban gardening",
    "the printing of money",
    "wind turbines",
    "the Silk Road",
    "marathon running",
    "quantum computers",
    "the history of football",
    "desert ecosystems",
    "smartphones",
    "bread baking",
    "the Cold War",
    "penguins",
    "the human brain",
    "space telescopes",
    "public libraries",
    "volunteering",
    "electric guitars",
    "the Mediterranean diet",
    "glaciers",
    "the history of cinema",
    "cybersecurity",
    "migratory birds",
    "3D printing",
    "the Maya civilization",
    "nuclear power",
    "remote work",
    "classical music",
    "ocean tides",
    "the metric system",
    "wildfires",
    "the immune response to allergies",
)

PERSON_NAMES = (
    "Anna",
    "Ben",
    "Carlos",
    "Dana",
    "Elif",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kofi",
    "Lena",
    "Marta",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tariq",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
)

WRITING_FORMS = (
    "a short story",
    "a poem",
    "a travel blog post",
    "a persuasive essay",
    "a product description",
    "an email to a colleague",
    "a speech for a school event",
    "a diary entry",
    "a news report",
    "a dialogue between two friends",
    "a letter to a city council",
    "a short motivational message",
    "a restaurant review",
    "the opening paragraph of a novel",
    "a social media post",
)

ROLES = (
    ("a pirate captain", "What treasure are you looking for?"),
    ("a medieval knight", "How do you prepare for a tournament?"),
    ("a famous chef", "What should I cook for a dinner party?"),
    ("a tour guide in Rome", "What should I see first?"),
    ("a detective", "Who do you think took the missing painting?"),
    ("a personal fitness coach", "How can I start exercising regularly?"),
    ("an astronaut on the space station", "What does a normal day look like?"),
    ("a wise old librarian", "Which book should I read next?"),
    ("a startup founder", "Why should I invest in your company?"),
    ("a kindergarten teacher", "How do plants grow?"),
)

CODING_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a text file",
    "sorts a list of dictionaries by a key",
    "merges two sorted lists",
    "finds the largest element of an array",
    "removes duplicates from a list",
    "checks if a string is a palindrome",
    "converts Celsius to Fahrenheit",
    "computes the factorial of a number",
    "finds the most common word in a sentence",
    "validates an email address",
    "implements binary search",
    "flattens a nested list",
    "computes the average of a list of numbers",
    "reads a CSV file and prints its rows",
    "implements a simple stack class",
)

LANGUAGES = ("Python", "JavaScript", "C++", "Java", "Go", "Rust")

EXPLAIN_STYLES = (
    "Explain {topic} in simple terms.",
    "What is the most important thing to know about {topic}?",
    "Explain {topic} to a high school student.",
    "What are the main advantages and disadvantages of {topic}?",
    "How has {topic} changed over the last hundred years?",
    "Give me three interesting facts about {topic}.",
    "Why does {topic} matter for everyday life?",
    "Describe the history of {topic} briefly.",
)

QUESTIONS = (
    "What is {topic}?",
    "How does {topic} work?",
    "Why is {topic} important?",
    "Who first studied {topic}?",
    "Where can I learn more about {topic}?",
    "When did people start paying attention to {topic}?",
    "What are common misconceptions about {topic}?",
)

# Sentence parts for source texts of translation requests (grammatical in every combination).
GERMAN_SUBJECTS = (
    "Die Regierung",
    "Der Bürgermeister",
    "Ein junger Forscher",
    "Die Firma",
    "Meine Nachbarin",
    "Der Verein",
    "Die Lehrerin",
    "Ein Sprecher der Polizei",
    "Die Universität",
    "Der Künstler",
)
GERMAN_PREDICATES = (
    "plant neue Investitionen in erneuerbare Energien",
    "hat am Montag einen Bericht veröffentlicht",
    "möchte die Innenstadt für Radfahrer sicherer machen",
    "sucht dringend neue Mitarbeiter",
    "hat eine überraschende Entdeckung gemacht",
    "lehnt den Vorschlag der Opposition ab",
    "eröffnet nächste Woche eine Ausstellung",
    "kritisiert die hohen Mieten in der Stadt",
    "will im kommenden Jahr mehr Geld für Schulen ausgeben",
    "hat den Preis für ihr Lebenswerk erhalten",
)
GERMAN_ADJUNCTS = (
    "",
    " , obwohl viele Bürger skeptisch sind",
    " , wie die Zeitung berichtet",
    " , nachdem die Kosten gestiegen sind",
    " in Berlin",
    " trotz der schwierigen Lage",
)
ENGLISH_SENTENCES = (
    "The train to the airport leaves every twenty minutes.",
    "Could you tell me where the nearest pharmacy is?",
    "Our team finished the project two days ahead of schedule.",
    "The museum is closed on Mondays and public holidays.",
    "She has been learning to play the piano since she was six.",
    "Please send me the report before the meeting tomorrow.",
    "The weather forecast predicts heavy rain for the weekend.",
    "He forgot his umbrella at the restaurant last night.",
)
TARGET_LANGUAGES = ("French", "German", "Spanish", "Italian")

PASSAGE_REQUESTS = (
    "Write a short news article about {topic}.",
    "Write an encyclopedia entry about {topic}.",
    "Write a blog post about {topic}.",
    "Write a short report about recent developments in {topic}.",
)
SUMMARY_REQUESTS = (
    "Summarize: {passage}",
    "Summarize the following text in a few sentences.\n\n{passage}",
    "Give a one-paragraph summary of this article:\n{passage}",
    "{passage}\n\nTL;DR:",
)
EXTRACTION_REQUESTS = (
    "List the key facts in the following text as bullet points.\n\n{passage}",
    "Extract every name, place and number mentioned in this text:\n{passage}",
    "Read the text below and write three questions it answers.\n\n{passage}",
)
RAG_QUESTIONS = (
    "Based on the passages above, what is the most important point about {topic}?",
    "Using only the information above, explain {topic} in two sentences.",
    "According to the text, why is {topic} important?",
)

MATH_TEMPLATES = (
    "{a_name} has {a} apples. {a_name} buys {b} more and gives {c} to {b_name}. How many apples does "
    "{a_name} have now?",
    "A shop sells pens for ${p} each. {a_name} buys {a} pens and pays with a ${bill} bill. How much change "
    "does {a_name} get?",
    "{a_name} reads {a} pages every day. How many days does it take to finish a book of {n} pages?",
    "A train travels at {s} km per hour for {h} hours, then at {t} km per hour for {g} hours. How far does it "
    "travel in total?",
    "{a_name} earns ${w} per hour and works {h} hours a day for {d} days. How much does {a_name} earn?",
    "There are {a} students in a class. {pct}% of them play football. How many students do not play football?",
    "{a_name} is {age} years old. {b_name} is {b} years older than {a_name}. How old will {b_name} be in {c} "
    "years?",
    "A recipe needs {b} eggs for {c} people. How many eggs are needed for {n} people?",
    "{a_name} saves ${a} every week. After how many weeks will {a_name} have at least ${n}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
)

REASONING_TEMPLATES = (
    "{a_name} is taller than {b_name}, and {b_name} is taller than {c_name}. Who is the shortest?",
    "If it takes {a} machines {a} minutes to make {a} widgets, how long would it take {n} machines to make {n} "
    "widgets?",
    "{a_name} has {a} sisters. Each sister has {b} brothers. How many brothers does {a_name} have, if "
    "{a_name} is a boy?",
    "In a race, {a_name} finished before {b_name} but after {c_name}. Who won among the three?",
    "A farmer has {a} sheep. All but {b} run away. How many sheep are left?",
)


@dataclass(frozen=True)
class PromptSpec:
    """One templated request; ``passage`` is the index of the model-written passage it embeds, if any."""

    category: str
    text: str
    passage: int | None = None
    passage_count: int = 0


def pre_query_prefix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template rendered up to where a user's text would start (Magpie's pre-query template)."""
    if not tokenizer.chat_template:
        raise ValueError(
            "Magpie prompts need a chat model (a tokenizer with a chat template); set "
            "train.data.magpie_prompts=0 or give prompts with train.data.path=FILE.jsonl"
        )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    return rendered[: rendered.index(_MARKER)]


def passage_request(seed: int, index: int) -> str:
    """The request that makes the target write passage ``index``."""
    rng = random.Random(f"passage-{seed}-{index}")
    return rng.choice(PASSAGE_REQUESTS).format(topic=TOPICS[index % len(TOPICS)])


def templated_prompt(seed: int, index: int, passages: int) -> PromptSpec:
    """Templated request ``index``; categories take turns, fillers are drawn from (seed, index)."""
    rng = random.Random(f"templated-{seed}-{index}")
    category = CATEGORIES[index % len(CATEGORIES)]
    topic = rng.choice(TOPICS)
    names = rng.sample(PERSON_NAMES, 3)
    numbers = {
        "a": rng.randint(3, 60),
        "b": rng.randint(2, 30),
        "c": rng.randint(1, 12),
        "n": rng.randint(60, 400),
        "p": rng.randint(2, 9),
        "bill": rng.choice((20, 50, 100)),
        "s": rng.randint(40, 160),
        "t": rng.randint(40, 160),
        "h": rng.randint(2, 9),
        "g": rng.randint(1, 5),
        "w": rng.randint(8, 40),
        "d": rng.randint(3, 20),
        "pct": rng.choice((10, 20, 25, 40, 50, 75)),
        "age": rng.randint(6, 50),
    }
    fill = {"topic": topic, "a_name": names[0], "b_name": names[1], "c_name": names[2], **numbers}
    if category in PASSAGE_CATEGORIES:
        if passages < 1:
            raise ValueError(
                f"templated {category} prompts embed passages the target writes; set train.data.passages >= 1"
            )
        first = rng.randrange(passages)
        if category == "summarization":
            return PromptSpec(category, rng.choice(SUMMARY_REQUESTS), first, 1)
        if category == "extraction":
            return PromptSpec(category, rng.choice(EXTRACTION_REQUESTS), first, 1)
        # rag: two passages, then a question about the first one's topic
        return PromptSpec(category, rng.choice(RAG_QUESTIONS), first, 2)
    if category == "writing":
        text = f"Write {rng.choice(WRITING_FORMS)} about {topic}."
    elif category == "roleplay":
        role, question = rng.choice(ROLES)
        text = f"Pretend you are {role} and stay in character. {question}"
    elif category == "coding":
        text = f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODING_TASKS)}."
    elif category == "explanation":
        text = rng.choice(EXPLAIN_STYLES).format(topic=topic)
    elif category == "qa":
        text = rng.choice(QUESTIONS).format(topic=topic)
    elif category == "math":
        text = rng.choice(MATH_TEMPLATES).format(**fill)
    elif category == "reasoning":
        text = rng.choice(REASONING_TEMPLATES).format(**fill)
    elif rng.random() < 0.6:  # translation, mostly German -> English
        german = (
            rng.choice(GERMAN_SUBJECTS) + " " + rng.choice(GERMAN_PREDICATES) + rng.choice(GERMAN_ADJUNCTS)
        )
        text = f"Translate German to English: {german} ."
    else:
        sentence = rng.choice(ENGLISH_SENTENCES)
        text = f"Translate the following sentence into {rng.choice(TARGET_LANGUAGES)}: {sentence}"
    return PromptSpec(category, text)


def fill_passages(spec: PromptSpec, passage_texts: list[str]) -> str:
    """The final text of a passage-based prompt, given the passages the target wrote."""
    if spec.passage is None:
        return spec.text
    chosen = [passage_texts[(spec.passage + i) % len(passage_texts)] for i in range(spec.passage_count)]
    if spec.category != "rag":
        return spec.text.format(passage=chosen[0])
    topic = TOPICS[spec.passage % len(TOPICS)]  # passage i is about TOPICS[i] (see passage_request)
    return "\n\n".join(chosen) + "\n\n" + spec.text.format(topic=topic)


PASSAGE_CATEGORIES = ("summarization", "extraction", "rag")
CATEGORIES = (
    "writing", "qa", "math", "summarization", "translation", "rag",
    "roleplay", "explanation", "coding", "extraction", "reasoning",
)  # fmt: skip

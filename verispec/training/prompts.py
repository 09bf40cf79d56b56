"""Training prompts for self-distillation, generated from templates (never the Spec-Bench questions).

The target answers these prompts and its own answers become the drafters' training data. The mix
covers the kinds of work Spec-Bench measures (conversation, translation, summarization, QA, maths,
questions over a passage) without using its text: topics, sentences and numbers are ours, and
passages are the docstrings of Python's standard library, which every machine has offline.
"""

from __future__ import annotations

import importlib
import inspect
import random

TOPICS = """volcanoes; the water cycle; photosynthesis; black holes; the Roman Empire; the printing press;
machine learning; compound interest; the French Revolution; honeybees; climate change; vaccines;
the human heart; electric cars; the Great Wall of China; coffee; jazz music; chess openings; the moon
landing; plate tectonics; recycling; sleep; the stock market; rainforests; the Renaissance;
earthquakes; DNA; the internet; solar panels; ancient Egypt; marathon training; baking bread;
public libraries; the Olympic Games; octopuses; glaciers; the immune system; democracy; inflation;
3D printing; the Silk Road; coral reefs; meditation; the periodic table; bicycles; submarines;
migration of birds; the Industrial Revolution; video games; nuclear energy; tea ceremonies;
the Amazon river; time zones; vitamins; dinosaurs; bridges; the violin; the human brain;
wind turbines; cryptography; penguins; pyramids; the speed of light; composting; elections;
origami; satellites; the Moon's phases; antibiotics; rain; Shakespeare; gardening; robots;
the Pacific Ocean; deserts; trains; museums; cheese making; hurricanes; the alphabet; mountains;
friendship; job interviews; budgeting; learning a language; public speaking; remote work;
first aid; camping; photography; volunteering; moving to a new city; writing a resume""".split(";")
TOPICS = [t.strip() for t in TOPICS]

CONVERSATION = [
    "Explain {t} to a ten-year-old.", "Write a short blog post about {t}.",
    "What are three surprising facts about {t}?", "Give me a short history of {t}.",
    "Write a poem about {t}.", "What are the pros and cons of {t}?",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Pretend you are a tour guide and describe {t} to visitors.",
    "Write an email to a friend telling them what you learned about {t}.",
    "List five questions a student might ask about {t}, and answer each briefly.",
    "Describe {t} in exactly three paragraphs.", "Write a short story that involves {t}.",
    "How would you explain {t} to someone from the year 1500?",
    "Compare {t} and {u}: how are they alike and how are they different?",
    "Give me a step-by-step plan to learn about {t} in one week.",
    "Write a dialogue between two friends discussing {t}.",
    "What is the most common misconception about {t}? Explain why it is wrong.",
    "Summarize the main ideas of {t} in a bulleted list.",
]
SENTENCES = [
    "The weather is beautiful today and we are going to the park.",
    "My grandmother bakes bread every Sunday morning.", "Where is the nearest train station?",
    "The meeting has been moved to Thursday afternoon.", "I would like a cup of tea with milk, please.",
    "The children are playing football in the garden.", "This book was written more than a century ago.",
    "Please close the window before you leave the room.", "We visited the museum during our holiday.",
    "The restaurant on the corner serves excellent soup.", "He forgot his umbrella at the office again.",
    "The new bridge will open to traffic next spring.", "She has been learning the piano for five years.",
    "Our flight was delayed because of the storm.", "The library is closed on public holidays.",
    "Der Hund schläft neben dem warmen Ofen.", "Wir haben gestern einen langen Spaziergang gemacht.",
    "Le marché ouvre tôt le samedi matin.", "Je voudrais réserver une table pour deux personnes.",
    "El tren sale a las ocho de la mañana.", "Mi hermano vive en una ciudad cerca del mar.",
    "Das Museum ist montags geschlossen.", "Nous avons planté des tomates dans le jardin.",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "English", "Portuguese"]
QA = [
    "What is {t}?", "Why is {t} important?", "How does {t} work?", "Who first studied {t}?",
    "Where can I learn more about {t}?", "What is the difference between {t} and {u}?",
    "In one sentence, what is {t}?", "Is {t} dangerous? Answer briefly.",
]
MATH = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost? Explain your steps.",
    "Tom has {a} apples and gives away {b}. Then he buys {c} more. How many apples does he have?",
    "A train travels at {a} km per hour for {b} hours. How far does it go? Show your reasoning.",
    "What is {a} times {b}, plus {c}? Work it out step by step.",
    "A class has {a} students. If {b} percent of them walk to school, how many walk?",
    "Solve for x: {a}x + {b} = {c}. Show each step.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If a book costs {a} dollars and is discounted by {b} percent, what is the new price?",
    "Sara reads {a} pages a day. How many days does she need for a book of {c} pages?",
]


def _passages(rng: random.Random, count: int) -> list[str]:
    """Prose paragraphs from the docstrings of standard-library modules and their functions."""
    found: list[str] = []
    for name in ["json", "random", "statistics", "collections", "pathlib", "datetime", "csv",
                 "textwrap", "itertools", "functools", "heapq", "bisect", "fractions", "decimal",
                 "string", "shutil", "tempfile", "argparse", "logging", "calendar", "difflib",
                 "zipfile", "gzip", "sqlite3", "email", "http.client", "urllib.parse", "uuid",
                 "hashlib", "threading", "queue", "subprocess", "socket", "unittest", "doctest"]:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in [module, *[v for _, v in inspect.getmembers(module) if callable(v)]]:
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if 200 <= len(para) <= 1200 and ">>>" not in para:
                    found.append(para)
    rng.shuffle(found)
    return found[:count]


def make_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` varied user prompts, the same for the same seed."""
    rng = random.Random(seed)
    passages = _passages(rng, count)
    prompts: dict[str, None] = {}  # ordered and without repeats
    while len(prompts) < count:
        t, u = rng.sample(TOPICS, 2)
        kind = rng.random()
        if kind < 0.4:
            prompts.setdefault(rng.choice(CONVERSATION).format(t=t, u=u))
        elif kind < 0.52:
            n = rng.randint(1, 3)
            text = " ".join(rng.sample(SENTENCES, n))
            prompts.setdefault(f"Translate into {rng.choice(LANGUAGES)}: \"{text}\"")
        elif kind < 0.64 and passages:
            prompts.setdefault(rng.choice([
                "Summarize the following text in two sentences:\n\n{p}",
                "Write a one-paragraph summary of this passage:\n{p}",
                "{p}\n\nSummarize the passage above."]).format(p=rng.choice(passages)))
        elif kind < 0.76:
            prompts.setdefault(rng.choice(QA).format(t=t, u=u))
        elif kind < 0.88:
            a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(50, 400)
            prompts.setdefault(rng.choice(MATH).format(a=a, b=b, c=c))
        elif passages:
            prompts.setdefault(rng.choice([
                "Read the text and answer the question.\n\nText: {p}\n\nQuestion: What is the main "
                "purpose described in the text?",
                "Context: {p}\n\nUsing only the context, explain what it says in simple words.",
                "{p}\n\nBased on the passage, list the key points."]).format(p=rng.choice(passages)))
    return list(prompts)

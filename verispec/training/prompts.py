"""Training prompts for self-distillation, generated from templates (never the Spec-Bench questions).

The target answers these prompts and its own answers become the drafters' training data. The mix
covers the kinds of work chat users ask for and Spec-Bench measures (writing, roleplay, reasoning,
maths, coding, extraction, STEM and humanities questions, short factual questions, translation,
summarization, questions over retrieved passages) without using its text: topics, sentences,
people and numbers are ours; passages are the docstrings of Python's standard library and code
snippets its source, which every machine has offline.
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass

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


ROLES = ["a pirate captain", "a detective in 1920s London", "a medieval knight", "a friendly robot",
         "a customer service agent", "a strict but fair teacher", "a famous chef", "a travel agent",
         "an astronaut on the space station", "a personal fitness coach", "a museum curator",
         "a sports commentator", "a wise old wizard", "a startup founder pitching to investors",
         "a doctor talking to a nervous patient", "a librarian", "a tour guide in Rome",
         "a job interviewer", "a news reporter at the scene", "a park ranger"]
SITUATIONS = ["Greet me and ask how you can help.", "Tell me about your day.",
              "Explain what you do to a group of children.", "Give me advice about {t}.",
              "Describe the biggest challenge you have faced.", "Convince me to try {t}.",
              "Answer my question: what do you think about {t}?", "Introduce yourself in a few sentences.",
              "Tell me a story from your work.", "Describe your ideal weekend."]
WRITING = ["Write a formal email to your manager asking for a day off next Friday.",
           "Write a product description for a {adj} {item}.",
           "Write a cover letter for a job as a {job}.", "Write a haiku about {t}.",
           "Write a short speech for a friend's wedding.", "Write a review of a {adj} {item}.",
           "Write a catchy slogan and a short advertisement for a {adj} {item}.",
           "Draft a polite complaint letter about a {adj} {item} that broke after a week.",
           "Write a thank-you note to a {job} who helped you.",
           "Write the opening paragraph of a mystery novel set in {place}.",
           "Write a limerick about a {job}.", "Write a motivational message for students before exams.",
           "Write a travel blog post about a weekend in {place}.",
           "Write a short newsletter announcing a new {item} at our store."]
ADJECTIVES = ["cheap", "luxury", "eco-friendly", "smart", "portable", "handmade", "waterproof",
              "vintage", "lightweight", "solar-powered"]
ITEMS = ["backpack", "coffee maker", "bicycle", "phone", "desk lamp", "pair of running shoes",
         "blender", "tent", "watch", "keyboard", "water bottle", "chair"]
JOBS = ["software engineer", "nurse", "teacher", "data analyst", "graphic designer", "chef",
        "marketing manager", "electrician", "librarian", "accountant", "pilot", "barista"]
PLACES = ["Paris", "Tokyo", "a small mountain village", "New York", "Cairo", "a seaside town",
          "Berlin", "Buenos Aires", "an island in the Pacific", "Lisbon", "Istanbul", "Kyoto"]
NAMES = ["Anna", "Ben", "Carlos", "Dina", "Eric", "Fatima", "George", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Marco", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
FIELDS = {"physics": ["entropy", "momentum", "quantum entanglement", "relativity", "friction",
                      "electromagnetic waves"],
          "chemistry": ["chemical bonds", "pH", "catalysts", "oxidation", "isotopes"],
          "biology": ["natural selection", "cell division", "enzymes", "ecosystems", "genes"],
          "computer science": ["recursion", "hash tables", "Big O notation", "operating systems",
                               "neural networks", "databases"],
          "economics": ["supply and demand", "opportunity cost", "monopolies", "interest rates",
                        "trade deficits"],
          "history": ["the Cold War", "feudalism", "the Renaissance", "colonialism",
                      "the Industrial Revolution"],
          "philosophy": ["utilitarianism", "free will", "stoicism", "the social contract",
                         "existentialism"],
          "literature": ["symbolism", "the hero's journey", "unreliable narrators", "satire",
                         "tragedy"],
          "psychology": ["cognitive dissonance", "memory", "motivation", "habits", "confirmation bias"]}
ACADEMIC = ["Explain the concept of {c} in {f}.", "What is {c}, and why does it matter in {f}?",
            "Give an example of {c} from everyday life and explain it.",
            "How has our understanding of {c} changed over time?",
            "Write a short lesson plan to teach {c} to high school students.",
            "What are the main arguments for and against {c}?",
            "Describe {c} and relate it to {t}."]
FACTS = ["who invented the telephone", "when did the first world war end", "what is the capital of "
         "australia", "how many bones are in the human body", "who painted the mona lisa",
         "what is the largest planet in the solar system", "who wrote pride and prejudice",
         "when was the printing press invented", "what is the boiling point of water",
         "how long is the great wall of china", "who was the first person on the moon",
         "what language is spoken in brazil", "how many players are on a football team",
         "what is the tallest mountain in the world", "who discovered penicillin",
         "where is the eiffel tower", "what is the longest river in africa",
         "when did the berlin wall fall", "who composed the four seasons", "what does dna stand for",
         "how far is the moon from the earth", "what is the smallest country in the world",
         "who developed the theory of evolution", "what is the currency of japan",
         "when did the titanic sink", "who is known as the father of computers",
         "what is the hardest natural substance", "how many continents are there",
         "what gas do plants absorb", "who wrote romeo and juliet"]
GERMAN = ["Die Regierung hat am Montag neue Maßnahmen gegen die steigenden Preise angekündigt.",
          "Nach dem Spiel feierten die Fans bis spät in die Nacht auf dem Marktplatz.",
          "Das Unternehmen plant, im nächsten Jahr hundert neue Mitarbeiter einzustellen.",
          "Die Polizei sucht nach Zeugen, die den Unfall auf der Autobahn beobachtet haben.",
          "Viele Menschen arbeiten seit der Pandemie teilweise von zu Hause aus.",
          "Der Bürgermeister eröffnete gestern die neue Schule im Stadtzentrum.",
          "Wegen des starken Regens wurden mehrere Straßen gesperrt.",
          "Die Forscher haben eine neue Art von Frosch im Regenwald entdeckt.",
          "Im Sommer kommen viele Touristen in die kleine Stadt am See.",
          "Die Verhandlungen zwischen den beiden Ländern sollen nächste Woche fortgesetzt werden.",
          "Der Zug nach München hatte heute Morgen eine Stunde Verspätung.",
          "Das Konzert wurde wegen einer Erkrankung des Sängers abgesagt.",
          "Die Preise für Energie sind im letzten Winter stark gestiegen.",
          "Eine Mehrheit der Bürger unterstützt den Bau der neuen Brücke.",
          "Die Mannschaft gewann das Finale mit zwei zu eins.",
          "Er hat sein ganzes Leben in diesem kleinen Dorf verbracht.",
          "Die Ausstellung zeigt Gemälde aus dem neunzehnten Jahrhundert.",
          "Ich habe vergessen, meine Schlüssel mitzunehmen.",
          "Kinder sollten jeden Tag mindestens eine Stunde draußen spielen.",
          "Die neue Software soll die Arbeit der Ärzte erleichtern."]
CODING = ["reverses a string", "checks whether a word is a palindrome", "returns the n-th Fibonacci "
          "number", "counts the vowels in a sentence", "merges two sorted lists", "performs binary "
          "search on a sorted list", "removes duplicates from a list while keeping the order",
          "finds the largest number in a list without using max", "checks whether a number is prime",
          "converts Celsius to Fahrenheit", "counts how often each word appears in a text",
          "flattens a nested list", "returns the factorial of a number", "validates an email address",
          "sorts a list of dictionaries by a key", "computes the average of a list of numbers",
          "finds the longest common prefix of a list of strings", "transposes a matrix",
          "reads a CSV file and prints each row", "checks whether two strings are anagrams"]
LANGS = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust"]
CODE_ASKS = ["Explain what this code does:\n\n```python\n{s}\n```",
             "Review this function and suggest improvements:\n\n```python\n{s}\n```",
             "Write unit tests for this function:\n\n```python\n{s}\n```",
             "Add comments to this code:\n\n```python\n{s}\n```"]
REASONING = ["{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
             "If {a} is older than {b} and {c} is younger than {b}, who is the oldest?",
             "What comes next in the sequence {x}, {y}, {z}, ...? Explain the pattern.",
             "{a} has {n} brothers. Each brother has one sister. How many children are in the family?",
             "A bat and a ball cost {p} dollars in total. The bat costs {q} dollars more than the "
             "ball. How much does the ball cost?",
             "{a}, {b} and {c} each have a different pet: a cat, a dog and a fish. {a} does not have "
             "the dog, and {b} has the fish. Who has which pet?",
             "If all roses are flowers and some flowers fade quickly, can we say that some roses "
             "fade quickly? Explain.",
             "You have {n} boxes. One is heavier than the others. What is the smallest number of "
             "weighings on a balance to find it?"]
MATH_MORE = ["{a1} buys {x} notebooks at {p} dollars each and a pen for {q} dollars. She pays with a "
             "{bill}-dollar bill. How much change does she get?",
             "A farmer has {x} cows. Each cow gives {p} liters of milk a day. How much milk does he "
             "get in {n} days?",
             "{a1} earns {p} dollars an hour and works {x} hours a week. How much does {a1} earn in "
             "{n} weeks?",
             "A recipe needs {n} eggs for {x} cookies. How many eggs are needed for {y} cookies?",
             "A car uses {n} liters of fuel per 100 km. How much fuel does it need for {z} km?",
             "What is {p} percent of {z}?", "Convert {z} minutes into hours and minutes.",
             "A tank holds {z} liters and is filled at {x} liters per minute. How long does it take?",
             "{a1} saved {p} dollars in January and twice as much in February. How much in total?",
             "The sum of two numbers is {z} and their difference is {x}. What are the numbers?"]


# Standard-library modules the prompts quote: functions' source as code to explain or review,
# docstrings as passages to summarize or answer from.
SNIPPET_MODULES = ("textwrap", "string", "heapq", "bisect", "statistics", "fractions", "colorsys",
                   "fnmatch", "shlex", "difflib", "calendar", "html", "base64", "glob", "keyword")
PASSAGE_MODULES = ("json", "random", "statistics", "collections", "pathlib", "datetime", "csv",
                   "textwrap", "itertools", "functools", "heapq", "bisect", "fractions", "decimal",
                   "string", "shutil", "tempfile", "argparse", "logging", "calendar", "difflib",
                   "zipfile", "gzip", "sqlite3", "email", "http.client", "urllib.parse", "uuid",
                   "hashlib", "threading", "queue", "subprocess", "socket", "unittest", "doctest")


def _records(rng: random.Random) -> str:
    """A made-up business text (email, receipt, meeting notes) to extract fields from."""
    name, other = rng.sample(NAMES, 2)
    item, job, place = rng.choice(ITEMS), rng.choice(JOBS), rng.choice(PLACES)
    day, month = rng.randint(1, 28), rng.choice(["March", "June", "September", "November"])
    amount, count = rng.randint(12, 900), rng.randint(2, 20)
    return rng.choice([
        f"Hi {other}, I ordered {count} units of the {item} on {month} {day} for a total of "
        f"${amount}. They have not arrived yet. Could you check the order? Thanks, {name}",
        f"Meeting notes ({month} {day}): {name} ({job}) presented the plan for the office in "
        f"{place}. {other} will prepare a budget of ${amount} by next week. {count} people attended.",
        f"Receipt - Store in {place}\n{count} x {item} @ ${amount / count:.2f}\nTotal: ${amount}\n"
        f"Cashier: {name}\nDate: {month} {day}",
        f"{name} is a {job} from {place}. She joined the company in {month} and leads a team of "
        f"{count}. Her manager, {other}, approved a bonus of ${amount}."])


def _snippets() -> list[str]:
    """Short functions from the standard library's source, as code to explain or review."""
    found = []
    for name in SNIPPET_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, value in inspect.getmembers(module, inspect.isfunction):
            try:
                source = inspect.getsource(value)
            except (OSError, TypeError):
                continue
            if 4 <= source.count("\n") <= 25:
                found.append(source.rstrip())
    return found


def _passages(rng: random.Random, count: int) -> list[str]:
    """Prose paragraphs from the docstrings of standard-library modules and their functions."""
    found: list[str] = []
    for name in PASSAGE_MODULES:
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


@dataclass(frozen=True)
class Material:
    """What a prompt family draws on: the seeded generator every choice comes from, passages to
    summarize or answer from, and code snippets to explain."""

    rng: random.Random
    passages: list[str]
    snippets: list[str]


def _numbers(rng: random.Random) -> dict:
    """The numbers a maths prompt's template names."""
    x, y = rng.randint(2, 9), rng.randint(2, 12)
    return {"a": rng.randint(2, 90), "b": rng.randint(2, 40), "c": rng.randint(50, 400),
            "x": x, "y": y * x, "z": rng.randint(60, 990), "p": rng.randint(2, 30),
            "q": rng.randint(1, 9), "n": rng.randint(2, 8), "bill": rng.choice([20, 50, 100]),
            "a1": rng.choice(NAMES)}


def _conversation(m: Material, t: str, u: str) -> str:
    return m.rng.choice(CONVERSATION).format(t=t, u=u)


def _writing(m: Material, t: str, u: str) -> str:
    rng = m.rng
    return rng.choice(WRITING).format(t=t, adj=rng.choice(ADJECTIVES), item=rng.choice(ITEMS),
                                      job=rng.choice(JOBS), place=rng.choice(PLACES))


def _roleplay(m: Material, t: str, u: str) -> str:
    return f"Pretend you are {m.rng.choice(ROLES)}. " + m.rng.choice(SITUATIONS).format(t=t)


def _reasoning(m: Material, t: str, u: str) -> str:
    rng = m.rng
    a, b, c = rng.sample(NAMES, 3)
    start, step = rng.randint(1, 9), rng.randint(2, 5)
    x, y, z = (start, start * step, start * step * step) if rng.random() < 0.5 else (
        start, start + step, start + 2 * step)
    bat = rng.randint(2, 6)
    return rng.choice(REASONING).format(a=a, b=b, c=c, x=x, y=y, z=z, n=rng.randint(2, 12),
                                        p=f"{bat}.10", q=bat)


def _math(m: Material, t: str, u: str) -> str:
    return m.rng.choice(MATH + MATH_MORE).format(**_numbers(m.rng))


def _coding(m: Material, t: str, u: str) -> str:
    rng = m.rng
    if m.snippets and rng.random() < 0.35:
        return rng.choice(CODE_ASKS).format(s=rng.choice(m.snippets))
    return f"Write a {rng.choice(LANGS)} function that {rng.choice(CODING)}."


def _extraction(m: Material, t: str, u: str) -> str:
    ask = m.rng.choice(["Extract every name, date and amount from the text below as JSON.",
                        "List the people mentioned in this text and their roles.",
                        "From the text below, extract the key facts as a bulleted list.",
                        "Fill in a table with the columns who, what, when and how much from "
                        "this text."])
    return f"{ask}\n\n{_records(m.rng)}"


def _academic(m: Material, t: str, u: str) -> str:
    field = m.rng.choice(sorted(FIELDS))
    return m.rng.choice(ACADEMIC).format(c=m.rng.choice(FIELDS[field]), f=field, t=t)


def _short_qa(m: Material, t: str, u: str) -> str:
    if m.rng.random() < 0.6:
        return m.rng.choice(FACTS)
    return m.rng.choice(QA).format(t=t, u=u)


def _translation(m: Material, t: str, u: str) -> str:
    rng = m.rng
    if rng.random() < 0.6:
        text = " ".join(rng.sample(GERMAN, rng.randint(1, 4)))
        return rng.choice(["Translate German to English: {s}", "Translate into English: \"{s}\"",
                           "What does this German text mean in English?\n\n{s}"]).format(s=text)
    text = " ".join(rng.sample(SENTENCES, rng.randint(1, 3)))
    return f"Translate into {rng.choice(LANGUAGES)}: \"{text}\""


def _summary(m: Material, t: str, u: str) -> str:
    text = "\n\n".join(m.rng.sample(m.passages, m.rng.randint(1, 3)))
    return m.rng.choice(["Summarize the following text in two sentences:\n\n{p}",
                         "Write a one-paragraph summary of this passage:\n{p}",
                         "{p}\n\nSummarize the passage above.",
                         "Give a short summary (at most 50 words) of the text below.\n\n{p}"]
                        ).format(p=text)


def _retrieval(m: Material, t: str, u: str) -> str:
    chosen = m.rng.sample(m.passages, m.rng.randint(1, 4))
    docs = "\n\n".join(f"Document [{i + 1}]: {p}" for i, p in enumerate(chosen))
    return m.rng.choice([
        "Answer the question using the documents.\n\n{d}\n\nQuestion: What is the main purpose "
        "described in the documents?",
        "Context: {d}\n\nUsing only the context, explain what it says in simple words.",
        "{d}\n\nBased on the documents, list the key points.",
        "{d}\n\nWhich document is most useful for someone new to programming, and why?"]
    ).format(d=docs)


# Prompt families and their weights in the mix; the passage families only where passages exist.
FAMILIES = [(_conversation, 12), (_writing, 10), (_roleplay, 6), (_reasoning, 6), (_math, 12),
            (_coding, 9), (_extraction, 5), (_academic, 9), (_short_qa, 10), (_translation, 10)]
PASSAGE_FAMILIES = [(_summary, 6), (_retrieval, 5)]


def make_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` varied user prompts, the same for the same seed."""
    rng = random.Random(seed)
    material = Material(rng, _passages(rng, count), _snippets())
    makers, weights = zip(*(FAMILIES + (PASSAGE_FAMILIES if material.passages else [])))
    prompts: dict[str, None] = {}  # ordered and without repeats
    while len(prompts) < count:
        t, u = rng.sample(TOPICS, 2)
        prompts.setdefault(rng.choices(makers, weights)[0](material, t, u))
    return list(prompts)

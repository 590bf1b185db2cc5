"""Training prompts for the draft: built from the Python standard library and templates.

Why: the draft must imitate the target on both chat answers (MT-Bench-like) and raw code
completion (HumanEval-like) without ever seeing those benchmarks. Variety matters more
than volume of any one kind (the first trial overfit on ~2.3k prompts), so prompts mix
many kinds and random fillers. Everything is deterministic given the seed.

Each prompt is a dict {"kind": str, "chat": bool, "text": str}; chat prompts are user
messages (the chat template is applied later), raw prompts are fed as-is.
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig
import textwrap
from pathlib import Path

# --------------------------------------------------------------------------- stdlib code

def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")]
        for f in filenames:
            if f.endswith(".py"):
                out.append(Path(dirpath) / f)
    return sorted(out)


def _harvest(files: list[Path]) -> tuple[list[dict], list[str], list[str]]:
    """Return (functions with docstrings, code chunks, docstring paragraphs)."""
    funcs, chunks, paras = [], [], []
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except Exception:
            continue
        lines = src.splitlines()
        mod = path.stem
        mdoc = ast.get_docstring(tree)
        if mdoc:
            paras += [p.strip() for p in mdoc.split("\n\n") if 80 < len(p.strip()) < 900]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=False)
                if not doc or node.body is None:
                    continue
                start = node.lineno - 1 - len(node.decorator_list)
                first = node.body[0]
                header = "\n".join(lines[start:first.end_lineno])
                if len(header) > 2500:
                    continue
                body = "\n".join(lines[start:node.end_lineno])
                funcs.append({"module": mod, "name": node.name, "header": textwrap.dedent(header),
                              "body": textwrap.dedent(body)[:3000], "doc": ast.get_docstring(node) or "",
                              "is_class": isinstance(node, ast.ClassDef)})
                for p in (ast.get_docstring(node) or "").split("\n\n"):
                    if 100 < len(p.strip()) < 900:
                        paras.append(p.strip())
        for i in range(0, max(1, len(lines) - 10), 40):
            chunks.append("\n".join(lines[i:i + 60]))
    return funcs, chunks, paras


# --------------------------------------------------------------------------- fillers

TOPICS = """the water cycle; black holes; photosynthesis; the French Revolution; machine learning; climate change;
the immune system; blockchain; the Roman Empire; jazz music; quantum computing; volcanoes; the stock market;
renewable energy; the human brain; ancient Egypt; coral reefs; electric cars; the printing press; vaccines;
the Silk Road; plate tectonics; inflation; social media; the Renaissance; honeybees; the internet; sleep;
meditation; the Cold War; DNA; recycling; space exploration; the Olympic Games; coffee; chess; origami;
public transport; urban gardening; the theory of evolution; supply and demand; opera; glaciers; tea ceremonies;
antibiotics; 3D printing; the Industrial Revolution; rainforests; cryptography; the moon landing; bread baking;
minimalism; remote work; the Great Wall of China; Shakespeare; impressionist painting; democracy; nutrition;
marathon training; volunteering; time management; the periodic table; gravity; the Amazon river; tides;
classical mechanics; probability; linear algebra; compilers; operating systems; databases; networking protocols;
the history of mathematics; mythology; film noir; hip hop; architecture; sustainable fashion; birdwatching;
camping; personal finance; negotiation; public speaking; learning a new language; photography; astronomy;
the Mediterranean diet; earthquakes; hurricanes; artificial intelligence ethics; robotics; the human heart;
the history of medicine; microbes; wind turbines; nuclear fission; the economy of Japan; Viking explorers;
the Maya civilization; the Beatles; football tactics; tennis; gardening; cats; dogs; whales; dinosaurs""".replace("\n", " ").split("; ")
AUDIENCES = ["a five-year-old", "a high school student", "a university student", "a software engineer", "my grandmother",
             "a business executive", "a complete beginner", "an expert", "a tourist", "a new employee", "a teenager", "a nurse"]
PEOPLE = ["my manager", "a customer", "my landlord", "a professor", "a colleague", "my neighbour", "a hiring manager",
          "the city council", "a friend I haven't seen in years", "a supplier", "my team", "a journalist", "a client"]
REASONS = ["asking for a deadline extension", "complaining about a late delivery", "thanking them for their help",
           "proposing a new project", "declining an invitation politely", "requesting a meeting", "apologizing for a mistake",
           "announcing a product launch", "asking for feedback", "following up on an interview", "reporting a bug",
           "requesting a refund", "inviting them to a party", "introducing myself"]
FORMS = ["poem", "haiku", "limerick", "short story", "blog post", "speech", "news article", "song", "dialogue",
         "product description", "advertisement", "letter", "diary entry", "tweet", "movie plot summary", "fairy tale", "essay"]
STYLES = ["funny", "formal", "persuasive", "sad", "optimistic", "mysterious", "simple", "poetic", "sarcastic", "dramatic",
          "concise", "enthusiastic", "academic", "friendly"]
ROLES = ["a pirate captain", "Sherlock Holmes", "a medieval knight", "a travel guide in Rome", "a personal fitness coach",
         "a chef", "a detective", "an astronaut on Mars", "a job interviewer", "a history teacher", "a customer support agent",
         "a wise old wizard", "a sports commentator", "a doctor", "a startup founder", "Albert Einstein", "a poet", "a robot"]
THINGS = ["apples", "books", "pencils", "marbles", "cookies", "tickets", "stamps", "coins", "shirts", "eggs", "chairs", "boxes"]
NAMES = ["Alice", "Bob", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam", "Mia", "Noah"]
LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL", "Bash", "C++", "TypeScript"]
CODE_TASKS = """reverse a linked list; check whether a string is a palindrome; find the n-th Fibonacci number; merge two sorted lists;
count word frequencies in a text; find duplicates in a list; compute the greatest common divisor; parse a CSV file;
validate an email address; implement binary search; flatten a nested list; compute the median of a list; rotate a matrix;
remove vowels from a string; convert Roman numerals to integers; find the longest common prefix; implement a stack;
implement a queue with two stacks; check balanced parentheses; compute prime numbers up to n; sort a dictionary by value;
read a JSON file and print its keys; compute the factorial recursively; find the second largest number; transpose a matrix;
convert Celsius to Fahrenheit; count the vowels in a string; compute the sum of digits; check if two strings are anagrams;
find the maximum subarray sum; implement bubble sort; implement quicksort; compute the power set; generate permutations;
chunk a list into pieces of size n; compute a moving average; deduplicate while preserving order; run-length encode a string;
find the intersection of two lists; compute the Levenshtein distance; implement an LRU cache; validate a sudoku board;
count islands in a grid; compute the area of a polygon; convert a number to binary; find the mode of a list; capitalize each word""".replace("\n", " ").split("; ")

CHAT_TEMPLATES = [
    "Explain {topic} to {aud}.", "What is {topic}? Keep it short.", "Give me {n} interesting facts about {topic}.",
    "Write a {style} {form} about {topic}.", "Write a {form} about {topic}.", "Compose an email to {person} {reason}.",
    "Write a short email to {person} {reason}. Keep it under 100 words.", "Pretend you are {role}. {q}",
    "Act as {role} and describe your typical day.", "What are the pros and cons of {topic}?",
    "Compare {topic} and {topic2}.", "How are {topic} and {topic2} related?", "Give me {n} tips for {activity}.",
    "Create a {n}-day plan for {activity}.", "Summarize the history of {topic} in a few sentences.",
    "Why is {topic} important?", "What are common misconceptions about {topic}?", "Describe {topic} using an analogy.",
    "Write a {n}-question quiz about {topic} with answers.", "Draft a tweet announcing a new book about {topic}.",
    "What would happen if {topic} disappeared tomorrow?", "List {n} questions a student might ask about {topic}.",
    "Write the opening paragraph of a novel set in a world shaped by {topic}.", "Suggest {n} names for a company about {topic}.",
    "How can I learn about {topic} on my own?", "Write a {style} product review of a {thing}.",
    "What should I consider before {activity}?", "Give a step-by-step guide to {activity}.", "{q}",
    "Describe a vivid scene at {place}.", "Write a travel blog post about a trip to {place}.",
    "Which is better for a beginner: {lang} or {lang2}? Explain.", "Explain the difference between a list and a tuple in {lang}.",
    "Write a {lang} function to {code_task}.", "How do I {code_task} in {lang}?", "Write {lang} code to {code_task} and explain it.",
    "Explain the time complexity of an algorithm to {code_task}.", "Write a Python function to {code_task}.",
    "Write a Python function to {code_task}. Include a docstring and an example.",
]
ACTIVITIES = ["running a marathon", "starting a business", "learning to cook", "moving to a new city", "adopting a dog",
              "learning the guitar", "writing a novel", "saving money", "studying for exams", "planting a vegetable garden",
              "preparing for a job interview", "buying a used car", "hiking in the mountains", "learning to code",
              "organizing a wedding", "improving sleep", "reducing stress", "starting a podcast", "traveling on a budget"]
PLACES = ["a night market in Taipei", "Hawaii", "the Swiss Alps", "a busy train station", "an old library", "Iceland",
          "a desert oasis", "Kyoto in autumn", "a fishing village", "a space station", "New York City", "the Sahara",
          "a medieval castle", "Patagonia", "a jazz club in New Orleans", "the Great Barrier Reef", "Marrakesh"]
QUESTIONS = ["What is the meaning of life?", "How do airplanes stay in the air?", "Why is the sky blue?",
             "How does a refrigerator work?", "Can you explain how credit cards work?", "Is it better to rent or buy a house?",
             "How do I make friends as an adult?", "What makes a good leader?", "How do vaccines train the immune system?",
             "Why do we dream?", "What is the best way to learn math?", "How does the internet work?",
             "What causes the seasons?", "How do I deal with procrastination?", "What is a good morning routine?"]


# Second data round (mix="chat"): MT-Bench's eight categories (writing, role-play, reasoning,
# math, coding, extraction, STEM, humanities) in shapes the first round lacked: multi-part
# instructions, constraints, data to extract from, puzzles. None is an MT-Bench question.
CONSTRAINTS = ["Keep it under 150 words.", "Use bullet points.", "Answer in exactly three sentences.",
               "Use a friendly tone.", "Include at least one example.", "End with a question for the reader.",
               "Avoid technical jargon.", "Write it as a numbered list.", "Use a formal tone.", "Be concise.",
               "Include a title.", "Explain your reasoning step by step.", "Format the answer as a table.",
               "Use simple words a child would understand.", "Include a short summary at the end."]
FOLLOW_UPS = ["Then summarize your answer in one sentence.", "Then give it a title.",
              "Then list three key points.", "Then rewrite the first sentence to be more engaging.",
              "Then explain which part was hardest to write.", "Then suggest a follow-up question."]
PROCESSES = ["how a bill becomes a law", "how rain forms", "how the heart pumps blood", "how a star is born",
             "how coffee is roasted", "how a search engine ranks pages", "how paper is recycled", "how bread rises",
             "how a solar panel produces electricity", "how antibodies fight an infection", "how mountains form",
             "how a compiler turns source code into machine code", "how a bank decides on a loan",
             "how glass is made", "how a rocket reaches orbit", "how memories are stored in the brain"]
DOMAINS = ["education", "healthcare", "the economy", "the environment", "politics", "art", "science",
           "family life", "small businesses", "cities", "agriculture", "sports", "journalism", "tourism"]
FIGURES = ["Marie Curie", "Leonardo da Vinci", "Nelson Mandela", "Isaac Newton", "Cleopatra", "Confucius",
           "Ada Lovelace", "Mahatma Gandhi", "Charles Darwin", "Frida Kahlo", "Galileo Galilei", "Queen Victoria"]
STEM_HUM_TEMPLATES = [
    "Describe {process}.", "Explain {process}, step by step.", "What role did {figure} play in history?",
    "Discuss the impact of {topic} on {domain}.", "How has {topic} changed {domain} over the last century?",
    "What can {domain} learn from {topic}?", "Design a simple experiment to learn more about {topic}.",
    "What are the main arguments for and against {topic} in {domain}?", "Imagine a conversation between {figure} and {figure2} about {topic}.",
    "How would {figure} have reacted to {topic}?", "What ethical questions does {topic} raise for {domain}?",
    "Explain the science behind {topic} with one everyday example.",
    "Write a persuasive essay arguing that {topic} matters for {domain}.", "Write a short lesson plan about {topic} for {aud}.",
]
CITIES = ["Lisbon", "Nairobi", "Oslo", "Lima", "Seoul", "Toronto", "Cairo", "Hanoi", "Dublin", "Quito", "Perth", "Krakow"]


def _extract_prompt(r: random.Random) -> str:
    people = [(n, r.randint(19, 70), r.choice(CITIES), r.choice(["engineer", "teacher", "nurse", "chef", "artist", "pilot"]))
              for n in r.sample(NAMES, r.randint(3, 5))]
    rows = [", ".join(map(str, p)) for p in people]
    items = [f"{t}: ${r.randint(2, 90)}.{r.randint(0, 99):02d}" for t in r.sample(THINGS + ["lamps", "pens", "mugs"], 4)]
    text = r.choice([
        "Here is a list of people (name, age, city, job):\n" + "\n".join(rows) + "\n\n" + r.choice([
            "Who is the oldest, and where do they live?", "Return the data as a JSON list of objects.",
            "Sort them by age and write one sentence about each.", "How many of them are older than 40?",
            "Write a short paragraph introducing these people."]),
        "A shop lists these prices:\n" + "\n".join(items) + "\n\n" + r.choice([
            "What is the total cost of one of each?", "Which item is the most expensive?",
            "Format this as a markdown table.", "If everything is 20% off, what are the new prices?"]),
        "Extract the names, ages and cities from this text: " + " ".join(
            f"{name} is {age} and lives in {city}." for name, age, city, _ in people),
    ])
    return text


def _reasoning_prompt(r: random.Random) -> str:
    a, b, c = r.sample(NAMES, 3)
    n, m = r.randint(2, 9), r.randint(2, 9)
    start, step = r.randint(1, 9), r.randint(2, 5)
    return r.choice([
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
        f"{a} is older than {b}. {c} is younger than {b}. Is {a} older than {c}?",
        f"What comes next in the sequence {start}, {start * step}, {start * step ** 2}, {start * step ** 3}? Why?",
        f"If {n} workers build a wall in {m} days, how long would {n * 2} workers take? Explain your reasoning.",
        f"I have {n} red socks and {m} blue socks in a drawer. How many must I take out in the dark to be sure of a matching pair?",
        f"{a} says: \"{b} is lying.\" {b} says: \"{c} is lying.\" {c} says: \"{a} and {b} are both lying.\" Who is telling the truth?",
        f"A clock shows {r.randint(1, 12)}:{r.choice(['00', '15', '30', '45'])}. What is the angle between the hands?",
        f"There are {n + m} people in a room and everyone shakes hands with everyone else once. How many handshakes are there?",
        f"{a} walks {n} km north, then {m} km east. How far is {a} from the starting point?",
        f"If all {r.choice(THINGS)} are blue and some blue things are heavy, are some {r.choice(THINGS)} heavy? Explain.",
    ])


def _math_prompt(r: random.Random) -> str:
    a, b, c = r.randint(2, 90), r.randint(2, 40), r.randint(2, 12)
    n1, n2, th = r.choice(NAMES), r.choice(NAMES), r.choice(THINGS)
    return r.choice([
        f"{n1} has {a} {th}. {n2} gives {n1} {b} more, and then {n1} shares them equally among {c} friends. How many does each friend get?",
        f"What is {a} times {b} plus {c}? Show your steps.",
        f"Solve for x: {c}x + {b} = {a}.",
        f"A rectangle has sides {a} cm and {b} cm. What are its area and perimeter?",
        f"If a train travels {a * 3} km in {c} hours, what is its average speed?",
        f"{n1} buys {c} {th} at ${b} each and pays with ${c * b + a}. How much change does {n1} get?",
        f"What is {a}% of {b * 10}?", f"Is {a * b + 1} a prime number? Explain.",
        f"Find the sum of all integers from 1 to {a * 10}.", f"Convert {a * b} minutes into hours and minutes.",
        f"The average of {c} numbers is {a}. One more number, {b}, is added. What is the new average?",
        f"A triangle has vertices at (0, 0), ({a}, 0) and (0, {b}). What is its area?",
        f"If I roll two fair dice, what is the probability that the sum is {r.randint(2, 12)}?",
        f"What is the derivative of {c}x^{r.randint(2, 5)} + {b}x?",
    ])


# --------------------------------------------------------------------------- assembly

MIXES = {  # (weight, kind)
    "default": [(14, "raw_func_doc"), (6, "raw_code_chunk"), (3, "raw_class"), (2, "raw_typed_stub"),
                (22, "chat_template"), (6, "chat_math"), (8, "chat_write_func"), (5, "chat_explain_code"),
                (4, "chat_docpara"), (3, "chat_api_question"), (2, "chat_fix_or_test")],
    # second round: MT-Bench-like chat first, with some code so HumanEval is not forgotten
    "chat": [(5, "raw_func_doc"), (1, "raw_code_chunk"), (1, "raw_typed_stub"),
             (14, "chat_template"), (10, "chat_constrained"), (7, "chat_multi"), (12, "chat_stem_hum"),
             (7, "chat_extract"), (7, "chat_reasoning"), (5, "chat_math"), (4, "chat_write_func"),
             (2, "chat_explain_code"), (3, "chat_docpara")],
}


def build_prompts(n: int, seed: int = 0, mix: str = "default") -> list[dict]:
    """Return n varied prompts (raw code completions and chat user messages) of one mix."""
    r = random.Random(seed)
    funcs, chunks, paras = _harvest(_stdlib_files())
    fn_only = [f for f in funcs if not f["is_class"]]
    out: list[dict] = []

    def fill(t: str) -> str:
        t1, t2 = r.sample(TOPICS, 2)
        l1, l2 = r.sample(LANGS, 2)
        f1, f2 = r.sample(FIGURES, 2) if mix != "default" else ("", "")  # the default mix's draws stay as they were
        return t.format(topic=t1, topic2=t2, aud=r.choice(AUDIENCES), n=r.randint(3, 7), style=r.choice(STYLES),
                        form=r.choice(FORMS), person=r.choice(PEOPLE), reason=r.choice(REASONS), role=r.choice(ROLES),
                        q=r.choice(QUESTIONS), activity=r.choice(ACTIVITIES), thing=r.choice(THINGS[:-1] + ["laptop", "blender", "bicycle", "phone"]),
                        place=r.choice(PLACES), lang=l1, lang2=l2, code_task=r.choice(CODE_TASKS),
                        process=r.choice(PROCESSES), domain=r.choice(DOMAINS), figure=f1, figure2=f2)

    kinds = MIXES[mix]
    weights = [w for w, _ in kinds]
    for _ in range(n):
        kind = r.choices([k for _, k in kinds], weights)[0]
        chat = kind.startswith("chat")
        if kind == "raw_func_doc":
            f = r.choice(fn_only)
            pre = r.choice(["", "", f"import {f['module']}\n\n\n", "from typing import List, Optional\n\n\n", "import math\n\n\n"])
            text = pre + f["header"] + "\n"
        elif kind == "raw_code_chunk":
            c = r.choice(chunks).splitlines()
            text = "\n".join(c[: r.randint(4, 40)]) + "\n"
        elif kind == "raw_class":
            f = r.choice([x for x in funcs if x["is_class"]] or funcs)
            text = f["header"] + "\n"
        elif kind == "raw_typed_stub":
            task = r.choice(CODE_TASKS)
            name = "_".join(task.split()[:3]).replace(",", "").replace("-", "_").lower()
            text = (f"from typing import List\n\n\ndef {name}(data: List[int]) -> List[int]:\n"
                    f"    \"\"\" {task[0].upper() + task[1:]}.\n    >>> {name}([{r.randint(1, 9)}, {r.randint(1, 9)}, {r.randint(1, 9)}])\n")
        elif kind == "chat_template":
            text = fill(r.choice(CHAT_TEMPLATES))
        elif kind == "chat_constrained":
            text = fill(r.choice(CHAT_TEMPLATES + STEM_HUM_TEMPLATES)) + " " + r.choice(CONSTRAINTS)
        elif kind == "chat_multi":
            text = fill(r.choice(CHAT_TEMPLATES)) + " " + r.choice(FOLLOW_UPS)
        elif kind == "chat_stem_hum":
            text = fill(r.choice(STEM_HUM_TEMPLATES))
        elif kind == "chat_extract":
            text = _extract_prompt(r)
        elif kind == "chat_reasoning":
            text = _reasoning_prompt(r)
        elif kind == "chat_math":
            text = _math_prompt(r)
        elif kind == "chat_write_func":
            f = r.choice(fn_only)
            summ = f["doc"].split("\n\n")[0].replace("\n", " ")[:400]
            text = r.choice([f"Write a Python function `{f['name']}` that does the following: {summ}",
                             f"Implement this in Python:\n{summ}",
                             f"How would I write a function that does this? {summ}",
                             f"Write Python code for: {summ}\nUse only the standard library."])
        elif kind == "chat_explain_code":
            f = r.choice(funcs)
            text = r.choice(["Explain what this code does:\n\n", "What does this Python code do?\n```python\n",
                             "Can you review this code and suggest improvements?\n\n", "Add comments to this code:\n\n"]) + f["body"][:1500]
        elif kind == "chat_docpara":
            p = r.choice(paras)
            text = r.choice(["Summarize this in one sentence:\n\n", "Rewrite this for a beginner:\n\n",
                             "Turn this into a bullet list:\n\n", "What is the main idea of this text?\n\n",
                             "Translate this into plain English:\n\n"]) + p
        elif kind == "chat_api_question":
            f = r.choice(fn_only)
            text = r.choice([f"What does `{f['module']}.{f['name']}` do in Python?",
                             f"How do I use the {f['module']} module in Python? Give an example.",
                             f"Show an example of using {f['name']} from the {f['module']} module."])
        else:  # chat_fix_or_test
            f = r.choice(fn_only)
            text = r.choice(["Write unit tests for this function:\n\n", "Add type hints to this function:\n\n",
                             "Is there a bug in this function?\n\n"]) + f["body"][:1200]
        out.append({"kind": kind, "chat": chat, "text": text})
    return out


if __name__ == "__main__":
    ps = build_prompts(20, seed=1)
    for p in ps:
        print("=====", p["kind"]); print(p["text"][:400])

"""The demo's fine-tuning task: name the topic of a short list of words, in a fixed answer format.

    user:      Which topic are these words about: week timeout seconds
    assistant: Topic: time.

Why this task: the base (pretrained on docstring prose) answers such a prompt with prose, so the
change is visible in one sample, and a person checks an answer at a glance. The answer depends on
the prompt's words as a bag. LoRA on the 3.5M-parameter base learns the answer format within ~20
steps of 16 chats and the labels only after a plateau (held-out accuracy of the label 1/3 until
about step 40, all 24 right from about step 90 at lr 5e-3): that is why the demo takes 100 steps.
Word-order tasks (say the last word, reverse the list) need copying circuits that such runs did not
build (tried: the format was learned, the words were not). Lists are drawn with
`random.Random(seed)`; no held-out list occurs in training, and every topic appears in both splits.
"""

from __future__ import annotations

import random

# Words that occur in the docstring corpus, grouped by what they are about.
TOPICS = {
    "time": "second seconds time timeout times week month wait until clock date day hour year".split(),
    "files": "file files path open read archive stream buffer directory lines write close mode".split(),
    "numbers": "number numbers integer zero negative numeric exponent sign decimal float digits "
               "fraction".split(),
}


def task_prompt(words: list[str]) -> str:
    return "Which topic are these words about: " + " ".join(words)


def task_answer(topic: str) -> str:
    return f"Topic: {topic}."


def task_records(topics: dict[str, list[str]] = TOPICS, n_train: int = 320, n_eval: int = 24, seed: int = 0):
    """Train chats with 1-3 turns and one-turn held-out chats; each list has 3-5 words of one topic."""
    rng = random.Random(seed)
    names = sorted(topics)
    seen, items = set(), []
    while len(items) < 3 * n_train + n_eval:
        topic = names[len(items) % len(names)]
        ws = tuple(rng.sample(topics[topic], rng.randint(3, 5)))
        if ws not in seen:
            seen.add(ws)
            items.append((topic, list(ws)))
    held_out, items = items[:n_eval], items[n_eval:]   # topics take turns, so any 3 show 3 topics
    rng.shuffle(items)

    def turn(topic, ws):
        return [{"role": "user", "content": task_prompt(ws)}, {"role": "assistant", "content": task_answer(topic)}]

    train = []
    for _ in range(n_train):
        msgs = []
        for _ in range(rng.randint(1, 3)):
            msgs += turn(*items.pop())
        train.append({"messages": msgs})
    return train, [{"messages": turn(*it)} for it in held_out]

"""A reward with variance on random weights (wiring checks only): the response length modulo 3."""


def length_mod3(completion: str, answer: str, **row) -> float:
    return float(len(completion) % 3)

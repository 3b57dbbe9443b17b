"""Deterministic synthetic corpora for the embedded demo study (no network, seconds to make).

Three generators, each `generate(split, n_rows, seed) -> list[dict]`, seeded by a numpy
Generator on (dataset seed, split index) so every split has its own stream:

* `reorder` (translation, `{"src", "tgt"}`): English-like subject-verb-object sentences of 3-9
  words mapped word by word through a fixed lexicon (some words give two target words) and
  reordered by position: subject-object-verb, and inside each noun phrase the noun moves in
  front of its adjectives, which come out in reverse order. A bag of source words does not
  tell which noun is the subject or which adjective goes with which noun, so a model without
  positional information cannot produce the order.
* `digest` (summarization, `{"article", "highlights", "id"}`): articles of 4-8 templated news
  sentences; exactly two carry the marker word "officially", and the highlights are the
  subject + verb + object of those two sentences (marker, adjectives and adjuncts removed),
  joined with "\\n". The marked sentences sit anywhere, so lead-3 is beatable but overlaps.
* `grammar` (lm, `{"sentence"}`): sentences of 4-20 words from a small probabilistic grammar
  with number agreement, prepositional phrases, adverbs, embedded clauses and coordination
  (250 word types), lowercase and space-separated like PTB.
"""
from __future__ import annotations

import numpy as np

from ..study.config import SPLITS

GENERATOR_FIELDS = {
    "reorder": {"src": "src", "tgt": "tgt"},
    "digest": {"src": "article", "tgt": "highlights", "id": "id"},
    "grammar": {"text": "sentence"},
}


def _rng(seed: int, split: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), SPLITS.index(split) if split in SPLITS else 99, 7919])


def _pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


# --------------------------------------------------------------------------- reorder

REORDER_LEXICON = {
    "det": {"the": "de", "a": "en"},
    "adj": {"big": "gros", "small": "pik", "red": "rodo", "blue": "bula", "old": "vey",
            "young": "jun", "happy": "feli", "sad": "trist", "fast": "snel", "green": "verd"},
    "noun": {"dog": "hun", "cat": "kato", "bird": "fogel", "fish": "pesk", "horse": "ka val",
             "man": "om", "woman": "fem", "child": "mal kin", "farmer": "agri kol", "king": "rej",
             "queen": "rej ina", "girl": "pika", "boy": "puer", "fox": "vulp", "wolf": "lupo",
             "bear": "urso"},
    "verb": {"sees": "vid", "likes": "ama", "chases": "cas ta", "finds": "trov", "helps": "aju da",
             "calls": "vok", "feeds": "nut ri", "follows": "seg", "hears": "aud", "meets": "ren kon"},
}
_ADJ_COUNT_P = (0.4, 0.35, 0.25)


def _reorder_np(rng):
    det = _pick(rng, list(REORDER_LEXICON["det"])) if rng.random() < 0.8 else None
    n_adj = int(rng.choice(3, p=_ADJ_COUNT_P))
    adjs = [str(a) for a in rng.choice(list(REORDER_LEXICON["adj"]), size=n_adj, replace=False)]
    noun = _pick(rng, list(REORDER_LEXICON["noun"]))
    return det, adjs, noun


def _translate_np(det, adjs, noun) -> list[str]:
    lex = REORDER_LEXICON
    out = [lex["det"][det]] if det else []
    out.append(lex["noun"][noun])
    out += [lex["adj"][a] for a in reversed(adjs)]
    return out


def reorder_row(rng) -> dict:
    subj, obj = _reorder_np(rng), _reorder_np(rng)
    verb = _pick(rng, list(REORDER_LEXICON["verb"]))
    src = [w for w in (subj[0], *subj[1], subj[2]) if w] + [verb] + [w for w in (obj[0], *obj[1], obj[2]) if w]
    tgt = _translate_np(*subj) + _translate_np(*obj) + [REORDER_LEXICON["verb"][verb]]
    return {"src": " ".join(src), "tgt": " ".join(tgt)}


def word_by_word(src: str) -> str:
    """The source mapped through the lexicon without reordering (to show reordering is needed)."""
    flat = {k: v for group in REORDER_LEXICON.values() for k, v in group.items()}
    return " ".join(flat[w] for w in src.split())


# --------------------------------------------------------------------------- digest

_SUBJECTS = ["minister", "council", "company", "police", "mayor", "union", "court", "school", "team",
             "bank", "hospital", "museum", "airline", "university", "committee", "charity", "club",
             "governor", "agency", "board"]
_VERBS = ["approved", "rejected", "announced", "delayed", "reviewed", "funded", "criticised", "praised",
          "cancelled", "launched", "defended", "questioned", "expanded", "paused", "welcomed"]
_OBJECTS = ["budget", "plan", "project", "report", "deal", "law", "bridge", "festival", "contract",
            "merger", "strike", "policy", "study", "programme", "election", "tour", "appeal", "ban",
            "tax", "stadium"]
_ADJECTIVES = ["new", "local", "annual", "controversial", "small", "large", "national", "costly",
               "popular", "final"]
_TAILS = [["on", "monday"], ["on", "friday"], ["last", "week"], ["in", "the", "city"], ["after", "a", "long", "debate"],
          ["for", "the", "region"], ["despite", "strong", "protests"], ["without", "any", "comment"],
          ["earlier", "this", "year"], ["in", "a", "statement"], ["at", "a", "press", "conference"],
          ["yesterday"], ["again"], ["behind", "closed", "doors"], ["to", "general", "surprise"]]
MARKER = "officially"


def _digest_sentence(rng, marked: bool):
    subj, verb, obj = _pick(rng, _SUBJECTS), _pick(rng, _VERBS), _pick(rng, _OBJECTS)
    words = ["the", subj] + ([MARKER] if marked else []) + [verb, "the"]
    if rng.random() < 0.5:
        words.append(_pick(rng, _ADJECTIVES))
    words.append(obj)
    # 6-12 words before the final full stop.
    room = 12 - len(words)
    tails = [t for t in _TAILS if len(t) <= room]
    words += _pick(rng, tails)
    if len(words) < 6:
        words += ["today"]
    return " ".join(words) + " .", f"the {subj} {verb} the {obj} ."


def digest_row(rng, split: str, index: int) -> dict:
    n = int(rng.integers(4, 9))
    marked = set(int(i) for i in rng.choice(n, size=2, replace=False))
    sentences, highlights = [], []
    for i in range(n):
        text, summary = _digest_sentence(rng, i in marked)
        sentences.append(text)
        if i in marked:
            highlights.append(summary)
    return {"article": " ".join(sentences), "highlights": "\n".join(highlights), "id": f"digest-{split}-{index:06d}"}


# --------------------------------------------------------------------------- grammar

_G_DET = {"sg": ["a", "the", "this", "every", "one", "that"], "pl": ["the", "some", "these", "many", "two", "few"]}
_G_ADJ = ["big", "small", "old", "new", "red", "green", "quiet", "loud", "happy", "sad", "young", "tall",
          "short", "bright", "dark", "warm", "cold", "strange", "clever", "busy", "lazy", "brave", "gentle",
          "local", "foreign", "rich", "poor", "early", "late", "famous", "empty", "full",
          "simple", "modern", "ancient", "tiny", "huge", "careful"]
_G_NOUN = ["dog", "cat", "teacher", "student", "farmer", "doctor", "city", "river", "house", "car", "bird",
           "child", "friend", "worker", "driver", "painter", "garden", "market", "window", "book", "letter",
           "song", "road", "tree", "village", "horse", "engineer", "lawyer", "singer", "writer", "manager",
           "neighbor", "soldier", "farm", "factory", "bridge", "island", "mountain", "train", "boat",
           "computer", "machine", "camera", "story", "picture", "table", "door", "kitchen", "office", "school"]
_G_NOUN_PL = {"child": "children", "city": "cities", "story": "stories", "factory": "factories",
              "boat": "boats"}
_G_VT = ["see", "like", "visit", "build", "watch", "follow", "help", "find", "paint", "sell", "buy",
         "clean", "carry", "open", "remember", "describe", "love", "call", "move", "read"]
_G_VI = ["sleep", "laugh", "wait", "run", "sing", "work", "arrive", "leave", "smile", "travel", "rest", "speak"]
_G_VS = ["think", "say", "know", "believe"]
_G_PREP = ["in", "near", "under", "behind", "with", "from", "across", "beside", "without", "above"]
_G_ADV = ["quickly", "slowly", "often", "rarely", "again", "today", "quietly", "loudly", "early", "later",
          "always", "sometimes"]
_G_PRON = {"sg": ["he", "she", "it"], "pl": ["they", "we"]}
_G_CONJ = ["and", "but", "while"]


def _plural(noun: str) -> str:
    return _G_NOUN_PL.get(noun, noun + "s")


def _verb(v: str, number: str) -> str:
    if number == "pl":
        return v
    if v.endswith(("sh", "ch", "ss", "o")):
        return v + "es"
    if v.endswith("y") and v[-2] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def _g_np(rng, number: str, depth: int) -> list[str]:
    if rng.random() < 0.08:
        return [_pick(rng, _G_PRON[number])]
    words = [_pick(rng, _G_DET[number])]
    for _ in range(int(rng.choice(3, p=(0.55, 0.35, 0.10)))):
        words.append(_pick(rng, _G_ADJ))
    noun = _pick(rng, _G_NOUN)
    words.append(noun if number == "sg" else _plural(noun))
    if depth < 2 and rng.random() < 0.2:
        words += _g_pp(rng, depth + 1)
    return words


def _g_pp(rng, depth: int) -> list[str]:
    return [_pick(rng, _G_PREP)] + _g_np(rng, _pick(rng, ["sg", "pl"]), depth)


def _g_clause(rng, depth: int) -> list[str]:
    number = "sg" if rng.random() < 0.6 else "pl"
    words = _g_np(rng, number, depth)
    r = rng.random()
    if r < 0.55:
        words += [_verb(_pick(rng, _G_VT), number)] + _g_np(rng, _pick(rng, ["sg", "pl"]), depth)
    elif r < 0.85 or depth >= 2:
        words.append(_verb(_pick(rng, _G_VI), number))
        if rng.random() < 0.4:
            words.append(_pick(rng, _G_ADV))
    else:
        words += [_verb(_pick(rng, _G_VS), number), "that"] + _g_clause(rng, depth + 1)
    if depth < 2 and rng.random() < 0.25:
        words += _g_pp(rng, depth + 1)
    return words


def grammar_row(rng) -> dict:
    while True:
        words = _g_clause(rng, 0)
        if rng.random() < 0.15:
            words += [_pick(rng, _G_CONJ)] + _g_clause(rng, 1)
        if 4 <= len(words) <= 20:
            return {"sentence": " ".join(words)}


def grammar_vocabulary() -> set[str]:
    words = set(_G_ADJ) | set(_G_NOUN) | {_plural(n) for n in _G_NOUN} | set(_G_PREP) | set(_G_ADV)
    words |= {w for ws in _G_DET.values() for w in ws} | {w for ws in _G_PRON.values() for w in ws}
    words |= {_verb(v, n) for v in _G_VT + _G_VI + _G_VS for n in ("sg", "pl")} | set(_G_CONJ) | {"that"}
    return words


# --------------------------------------------------------------------------- entry point


def generate(generator: str, split: str, n_rows: int, seed: int) -> list[dict]:
    """Rows of one split, in the generator's schema (see GENERATOR_FIELDS)."""
    rng = _rng(seed, split)
    if generator == "reorder":
        return [reorder_row(rng) for _ in range(n_rows)]
    if generator == "digest":
        return [digest_row(rng, split, i) for i in range(n_rows)]
    if generator == "grammar":
        return [grammar_row(rng) for _ in range(n_rows)]
    raise ValueError(f"unknown generator {generator!r} (known: {', '.join(GENERATOR_FIELDS)})")

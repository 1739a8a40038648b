"""Sentences for the embedded corpora, for the 8 MLS languages.

Each language has a small hand-written grammar: subject noun phrases, transitive verbs,
object noun phrases (already in the object case where the language marks it: German and
Polish accusative), adverbials, and labels followed by a number ("page seven"). Numbers are
spelled by ``num2words`` over 1-20 and the tens up to 100, so each language's vocabulary stays
around 100 words: small enough for a tiny speech model to learn, large enough that a
transcript cannot be guessed from its length.

Transcripts are normalised as MLS transcripts are: lower case, no punctuation (apostrophes
inside words kept, hyphens become spaces), single spaces.

Text domains (our choice, not MLS's): a real seed model is pretrained on text that does not
cover what the federated clients read. Here every third phrase of each grammar slot (and every
third number) is *client-only* (:func:`is_client_only`: index ``i % 3 == 2``); the ``public``
domain draws only the other phrases, the ``client`` domain draws each slot from the
client-only phrases with probability ``novel_share`` (else from the public ones), and ``all``
(the default) draws uniformly from every phrase. :func:`novel_words` lists the words only the
client domain has.

Example
-------
>>> from speechbrain_fl.data.sentences import make_sentences
>>> make_sentences("english", 2, seed=0) == make_sentences("english", 2, seed=0)
True
>>> len(vocabulary("german")) < 130
True
"""

from __future__ import annotations

import re

import numpy as np
from num2words import num2words

__all__ = [
    "LANGUAGES",
    "LANGUAGE_CODES",
    "NUMBERS",
    "normalize_transcript",
    "make_sentences",
    "vocabulary",
    "novel_words",
    "is_client_only",
    "DOMAINS",
]

#: Text domains of :func:`make_sentences`.
DOMAINS = ("all", "public", "client")

#: The 8 MLS languages, as MLS names them, with their espeak-ng / num2words codes.
LANGUAGE_CODES = {
    "english": "en",
    "german": "de",
    "dutch": "nl",
    "french": "fr",
    "spanish": "es",
    "italian": "it",
    "portuguese": "pt",
    "polish": "pl",
}
LANGUAGES = tuple(LANGUAGE_CODES)
NUMBERS = tuple(range(1, 21)) + tuple(range(30, 101, 10))

# subjects, verbs, objects, adverbials, labels (each a tuple of phrases).
_GRAMMARS: dict[str, dict[str, tuple[str, ...]]] = {
    "english": {
        "subjects": ("the old man", "the young woman", "my brother", "her sister", "the small dog",
                     "the black cat", "our teacher", "the farmer", "a child", "the doctor"),
        "verbs": ("sees", "finds", "buys", "opens", "takes", "likes", "carries", "paints",
                  "brings", "sells"),
        "objects": ("the red house", "a green apple", "the old book", "a white boat",
                    "the big window", "a warm coat", "the blue car", "fresh bread",
                    "the wooden table", "a short letter"),
        "adverbials": ("today", "every morning", "in the garden", "near the river", "at night",
                       "in the city", "after dinner", "on sunday"),
        "labels": ("page", "room", "number", "chapter"),
    },
    "german": {
        "subjects": ("der alte mann", "die junge frau", "mein bruder", "ihre schwester",
                     "der kleine hund", "die schwarze katze", "unser lehrer", "der bauer",
                     "ein kind", "der arzt"),
        "verbs": ("sieht", "findet", "kauft", "öffnet", "nimmt", "mag", "trägt", "malt",
                  "bringt", "verkauft"),
        "objects": ("das rote haus", "einen grünen apfel", "das alte buch", "ein weißes boot",
                    "das große fenster", "einen warmen mantel", "den blauen wagen",
                    "frisches brot", "den hölzernen tisch", "einen kurzen brief"),
        "adverbials": ("heute", "jeden morgen", "im garten", "am fluss", "in der nacht",
                       "in der stadt", "nach dem essen", "am sonntag"),
        "labels": ("seite", "zimmer", "nummer", "kapitel"),
    },
    "dutch": {
        "subjects": ("de oude man", "de jonge vrouw", "mijn broer", "haar zus", "de kleine hond",
                     "de zwarte kat", "onze leraar", "de boer", "een kind", "de dokter"),
        "verbs": ("ziet", "vindt", "koopt", "opent", "neemt", "draagt", "schildert", "brengt",
                  "verkoopt", "zoekt"),
        "objects": ("het rode huis", "een groene appel", "het oude boek", "een witte boot",
                    "het grote raam", "een warme jas", "de blauwe auto", "vers brood",
                    "de houten tafel", "een korte brief"),
        "adverbials": ("vandaag", "elke ochtend", "in de tuin", "bij de rivier", "in de nacht",
                       "in de stad", "na het eten", "op zondag"),
        "labels": ("pagina", "kamer", "nummer", "hoofdstuk"),
    },
    "french": {
        "subjects": ("le vieil homme", "la jeune femme", "mon frère", "sa sœur", "le petit chien",
                     "le chat noir", "notre professeur", "le paysan", "un enfant", "le médecin"),
        "verbs": ("voit", "trouve", "achète", "ouvre", "prend", "aime", "porte", "peint",
                  "apporte", "vend"),
        "objects": ("la maison rouge", "une pomme verte", "le vieux livre", "un bateau blanc",
                    "la grande fenêtre", "un manteau chaud", "la voiture bleue", "du pain frais",
                    "la table en bois", "une courte lettre"),
        "adverbials": ("aujourd'hui", "chaque matin", "dans le jardin", "près de la rivière",
                       "la nuit", "en ville", "après le dîner", "le dimanche"),
        "labels": ("page", "chambre", "numéro", "chapitre"),
    },
    "spanish": {
        "subjects": ("el hombre viejo", "la mujer joven", "mi hermano", "su hermana",
                     "el perro pequeño", "el gato negro", "nuestro maestro", "el campesino",
                     "un niño", "el médico"),
        "verbs": ("ve", "encuentra", "compra", "abre", "toma", "lleva", "pinta", "trae",
                  "vende", "busca"),
        "objects": ("la casa roja", "una manzana verde", "el libro viejo", "un barco blanco",
                    "la ventana grande", "un abrigo caliente", "el coche azul", "pan fresco",
                    "la mesa de madera", "una carta corta"),
        "adverbials": ("hoy", "cada mañana", "en el jardín", "cerca del río", "por la noche",
                       "en la ciudad", "después de la cena", "el domingo"),
        "labels": ("página", "habitación", "número", "capítulo"),
    },
    "italian": {
        "subjects": ("il vecchio", "la giovane donna", "mio fratello", "sua sorella",
                     "il piccolo cane", "il gatto nero", "il nostro maestro", "il contadino",
                     "un bambino", "il medico"),
        "verbs": ("vede", "trova", "compra", "apre", "prende", "porta", "dipinge", "vende",
                  "cerca", "guarda"),
        "objects": ("la casa rossa", "una mela verde", "il vecchio libro", "una barca bianca",
                    "la grande finestra", "un cappotto caldo", "la macchina blu", "pane fresco",
                    "il tavolo di legno", "una breve lettera"),
        "adverbials": ("oggi", "ogni mattina", "nel giardino", "vicino al fiume", "di notte",
                       "in città", "dopo cena", "la domenica"),
        "labels": ("pagina", "stanza", "numero", "capitolo"),
    },
    "portuguese": {
        "subjects": ("o homem velho", "a mulher jovem", "o meu irmão", "a sua irmã",
                     "o cão pequeno", "o gato preto", "o nosso professor", "o camponês",
                     "uma criança", "o médico"),
        "verbs": ("vê", "encontra", "compra", "abre", "toma", "leva", "pinta", "traz",
                  "vende", "procura"),
        "objects": ("a casa vermelha", "uma maçã verde", "o livro velho", "um barco branco",
                    "a janela grande", "um casaco quente", "o carro azul", "pão fresco",
                    "a mesa de madeira", "uma carta curta"),
        "adverbials": ("hoje", "todas as manhãs", "no jardim", "perto do rio", "à noite",
                       "na cidade", "depois do jantar", "no domingo"),
        "labels": ("página", "quarto", "número", "capítulo"),
    },
    "polish": {
        "subjects": ("stary człowiek", "młoda kobieta", "mój brat", "jej siostra", "mały pies",
                     "czarny kot", "nasz nauczyciel", "rolnik", "dziecko", "lekarz"),
        "verbs": ("widzi", "znajduje", "kupuje", "otwiera", "bierze", "lubi", "niesie",
                  "maluje", "przynosi", "sprzedaje"),
        "objects": ("czerwony dom", "zielone jabłko", "starą książkę", "białą łódź",
                    "duże okno", "ciepły płaszcz", "niebieski samochód", "świeży chleb",
                    "drewniany stół", "krótki list"),
        "adverbials": ("dzisiaj", "każdego ranka", "w ogrodzie", "nad rzeką", "w nocy",
                       "w mieście", "po obiedzie", "w niedzielę"),
        "labels": ("strona", "pokój", "numer", "rozdział"),
    },
}  # fmt: skip

_NOT_WORD = re.compile(r"[^\w' ]+")


def normalize_transcript(text: str) -> str:
    """MLS-style normalisation: lower case, hyphens to spaces, punctuation removed.

    Example
    -------
    >>> normalize_transcript("Quatre-vingt-dix, Aujourd'hui!")
    "quatre vingt dix aujourd'hui"
    """
    text = text.lower().replace("-", " ")
    text = _NOT_WORD.sub(" ", text)
    return " ".join(word.strip("'") for word in text.split() if word.strip("'"))


def _check(language: str) -> dict[str, tuple[str, ...]]:
    if language not in _GRAMMARS:
        raise KeyError(f"unknown language {language!r}; the MLS languages are {list(LANGUAGES)}")
    return _GRAMMARS[language]


def _number(language: str, n: int) -> str:
    return normalize_transcript(num2words(n, lang=LANGUAGE_CODES[language]))


def is_client_only(index: int) -> bool:
    """True for the phrase (or number) positions held out of the public text domain.

    Every third entry of each slot (``index % 3 == 2``): 3 of 10 subjects, verbs and objects,
    2 of 8 adverbials, 1 of 4 labels, 8 of 28 numbers.

    Example
    -------
    >>> [is_client_only(i) for i in range(4)]
    [False, False, True, False]
    """
    return index % 3 == 2


def _slot(values: tuple, part: str) -> tuple:
    if part == "all":
        return tuple(values)
    novel = part == "novel"
    return tuple(v for i, v in enumerate(values) if is_client_only(i) == novel)


def make_sentences(
    language: str,
    num_sentences: int,
    *,
    seed: int,
    domain: str = "all",
    novel_share: float = 0.3,
) -> list[str]:
    """Draw ``num_sentences`` normalised sentences in ``language``, deterministically.

    Templates (probabilities): subject verb object (0.35), subject verb object adverbial
    (0.45), label number (0.1), subject verb object label number (0.1). In the ``public``
    domain every slot (and number) is drawn from the public phrases only; in the ``client``
    domain each slot is drawn from the client-only phrases with probability ``novel_share``,
    else from the public ones; ``all`` draws uniformly from every phrase.

    Arguments
    ---------
    language : str
        One of :data:`LANGUAGES` (MLS names: ``"english"``, ``"polish"``...).
    num_sentences : int
        How many sentences.
    seed : int
        Random seed.
    domain : str
        ``"all"``, ``"public"`` or ``"client"`` (see the module docstring).
    novel_share : float
        In the ``client`` domain, probability that a slot is filled with a client-only phrase.

    Returns
    -------
    list of str

    Example
    -------
    >>> novel = novel_words("english")
    >>> any(set(s.split()) & novel for s in make_sentences("english", 50, seed=0,
    ...     domain="public"))
    False
    """
    grammar = _check(language)
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if not 0.0 <= novel_share <= 1.0:
        raise ValueError(f"novel_share must be in [0, 1], got {novel_share}")
    rng = np.random.default_rng([int(seed), sorted(_GRAMMARS).index(language)])
    slots = {key: _slot(grammar[key], "all" if domain == "all" else "public") for key in grammar}
    numbers = _slot(NUMBERS, "all" if domain == "all" else "public")
    if domain == "client":
        novel = {key: _slot(grammar[key], "novel") for key in grammar}
        novel_numbers = _slot(NUMBERS, "novel")

    def pick(key):
        pool = slots[key]
        if domain == "client" and rng.random() < novel_share:
            pool = novel[key]
        return pool[int(rng.integers(len(pool)))]

    def number():
        pool = numbers
        if domain == "client" and rng.random() < novel_share:
            pool = novel_numbers
        return int(rng.choice(pool))

    out = []
    for _ in range(num_sentences):
        u = rng.random()
        svo = f"{pick('subjects')} {pick('verbs')} {pick('objects')}"
        labelled = f"{pick('labels')} {_number(language, number())}"
        if u < 0.35:
            text = svo
        elif u < 0.8:
            text = f"{svo} {pick('adverbials')}"
        elif u < 0.9:
            text = labelled
        else:
            text = f"{svo} {labelled}"
        out.append(normalize_transcript(text))
    return out


def vocabulary(language: str, *, domain: str = "all") -> set[str]:
    """Every word :func:`make_sentences` can produce for ``language`` in ``domain``.

    The ``client`` domain (with ``novel_share`` > 0) can produce every word, as ``all``.
    """
    grammar = _check(language)
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    part = "public" if domain == "public" else "all"
    words = set()
    for phrases in grammar.values():
        for phrase in _slot(phrases, part):
            words.update(normalize_transcript(phrase).split())
    for n in _slot(NUMBERS, part):
        words.update(_number(language, n).split())
    return words


def novel_words(language: str) -> set[str]:
    """Words of the client domain that the public domain never produces.

    Example
    -------
    >>> "bringt" in novel_words("german") and "der" not in novel_words("german")
    True
    """
    return vocabulary(language) - vocabulary(language, domain="public")

"""One canonical form of text for every comparison of texts (OCR targets and readings, prompt look-ups).

A prompt typed on a phone has curly quotes, a non-breaking space or a full-width letter; an OCR engine reads a
straight apostrophe or an en dash where the prompt had another form. Texts that a reader sees as the same must
compare equal, so :func:`fold_text` maps every Unicode form of whitespace, quotes, dashes and the common
full-width/compatibility punctuation to one ASCII form:

1. quote and dash variants become ``'``, ``"`` and ``-`` (:data:`QUOTE_AND_DASH`), before and after step 2;
2. NFKC compatibility normalisation (Unicode Standard Annex #15): full-width ``Ａ１！`` → ``A1!``, ligatures,
   ``…`` → ``...``, no-break and other fixed-width spaces → space;
3. invisible format characters (Unicode category ``Cf``: zero-width space and joiners, soft hyphen, BOM) are
   removed;
4. every run of Unicode whitespace becomes one space, leading and trailing whitespace is dropped;
5. :meth:`str.casefold` (Unicode case folding: ``Straße`` and ``STRASSE`` compare equal).

Punctuation itself is kept (``"Open!"`` and ``"Open"`` still differ): only its forms are unified.
"""

from __future__ import annotations

import unicodedata

#: Single quotes, double quotes and dashes of other forms, to their ASCII form.
QUOTE_AND_DASH = {
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032\u2035\u00b4\u0060\uff07\u02bc", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033\u2036\u00ab\u00bb\u301d\u301e\u301f\uff02", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d", "-"),
    "\u3002": ".",  # ideographic full stop
    "\u3001": ",",  # ideographic comma
}
_TABLE = str.maketrans(QUOTE_AND_DASH)

#: The double prime ``″`` (U+2033: inches, seconds) and the reversed double prime ``‶`` (U+2036): unit marks,
#: which :func:`quoted_text` reads as quote marks only in a prompt that has no other double-quote mark.
DOUBLE_PRIMES = frozenset("\u2033\u2036")

#: Every character that opens or closes a double-quoted span in a prompt (straight, curly, guillemets, CJK).
DOUBLE_QUOTES = frozenset(c for c, ascii_form in QUOTE_AND_DASH.items() if ascii_form == '"') - DOUBLE_PRIMES | {'"'}


def fold_text(text: str) -> str:
    """The canonical form of ``text`` (see the module docstring): ASCII quotes and dashes, NFKC, no format
    characters, single spaces, case-folded.

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"fold_text needs a str, got {type(text).__name__}")
    text = unicodedata.normalize("NFKC", text.translate(_TABLE)).translate(_TABLE)
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    return " ".join(text.split()).casefold()


def is_blank(text: str) -> bool:
    """Whether ``text`` shows nothing: empty once folded (:func:`fold_text`), i.e. only whitespace of any Unicode
    form and invisible format characters (zero-width space, BOM, soft hyphen). The one rule for an empty prompt.

    Raises:
        TypeError: ``text`` is not a string.
    """
    return not fold_text(text)


def quoted_text(prompt: str) -> str | None:
    """The text ``prompt`` quotes, as written: the span between its first opening double-quote mark of any form
    (:data:`DOUBLE_QUOTES`: straight ``"…"``, typographic ``“…”``, ``„…“``, guillemets ``«…»``, full-width
    ``＂…＂``) and the next such mark, or None when there is no such pair or the span is blank (:func:`is_blank`).

    Unit marks are not quote marks: a straight ``"`` right after a digit (``5" wide``: inches) never opens a span
    (it may close one: ``"2024"``), and the double primes (:data:`DOUBLE_PRIMES`, ``5″``) count only in a prompt
    with no other double-quote mark (one that uses them as quotes: ``″SALE″``). So
    ``a shop sign 5″ wide reading "SALE"`` and ``a 5" by 7" card reading "SALE"`` quote ``SALE``, and
    ``a 5" by 7" card`` quotes nothing.

    The one rule for "quoted text": the ``ocr`` reward scores this span, and ``flowgrpo prompts ocr`` keeps exactly
    the prompts for which it is not None.

    Raises:
        TypeError: ``prompt`` is not a string.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"quoted_text needs a str, got {type(prompt).__name__}")
    quotes = DOUBLE_QUOTES if any(c in DOUBLE_QUOTES for c in prompt) else DOUBLE_QUOTES | DOUBLE_PRIMES
    start = None
    for i, c in enumerate(prompt):
        if c not in quotes:
            continue
        if start is not None:
            span = prompt[start + 1 : i]
            return None if is_blank(span) else span
        if not (c == '"' and i > 0 and prompt[i - 1].isdigit()):  # an inch mark opens nothing
            start = i
    return None

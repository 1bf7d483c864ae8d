"""Training text for the tokenizers of ``baton make-model``: offline and deterministic.

Two parts, both fixed for every Python version:

* ``PROSE``: a few pages of plain English (and a little code, numbers and other
  scripts) written for Baton, so common words become single tokens;
* the names of characters from Unicode 3.2 (``unicodedata.ucd_3_2_0``, frozen inside
  every CPython 3) for a range of scripts, each line the character and its name, so the
  vocabulary holds accented letters, Greek, Cyrillic, kana and some CJK ideographs
  as well. Emoji are left out on purpose: they stay split over byte tokens, which is
  what tests of UTF-8-safe streaming need.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator

PROSE = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind.
A language model reads a sequence of tokens and predicts the next one. Serving such a model
well is mostly a question of memory: the weights must fit, and so must the key and value
cache that grows with every token of every request in flight.
Prefill and decode are two different kinds of work. The prompt is processed all at once, so
prefill is limited by arithmetic; each decode step produces a single token per request, so
decode is limited by how fast the weights and the cache can be read from memory.
When the two phases share one machine they get in each other's way. A long prompt arriving in
the middle of a busy decode batch makes every running request wait, and the time between
tokens jumps. Splitting the phases across separate workers lets each pool be sized and
batched for its own bottleneck, at the price of moving the cache from one to the other.
The cache is stored in fixed-size blocks. A block table maps the logical positions of a
sequence to physical blocks, the way page tables map virtual memory, so that no request
needs one long contiguous region and blocks can be shared between prompts with the same
prefix.
Hello, world! Hello again. Good morning, good afternoon, good evening and good night.
Once upon a time there was a small village at the edge of a great forest. Every morning the
baker opened her shop before sunrise, and the smell of fresh bread drifted down the narrow
streets. Children ran to school, farmers drove their carts to the market, and the old clock
in the square struck seven, eight, nine, as it had done for two hundred years.
One winter the river froze so hard that people walked across it to the next town. They
brought back stories of a traveller who had come from the mountains with a box of strange
instruments: a compass that always pointed home, a glass that showed the weather of
tomorrow, and a notebook in which every page was blank until someone asked it a question.
Recipe for a simple soup: chop two onions, three carrots and a stalk of celery. Warm some
olive oil in a heavy pot, add the vegetables and a pinch of salt, and cook them slowly for
ten minutes. Pour in one litre of stock, add a bay leaf, and simmer for half an hour. Season
with pepper, a little lemon juice, and plenty of fresh parsley before serving.
The weather today is cloudy with a chance of rain in the afternoon. Temperatures will reach
eighteen degrees, falling to nine overnight, with a light wind from the west. Tomorrow should
be sunny and warmer, although fog is likely in the valleys early in the morning.
In 1969 two astronauts walked on the Moon while a third orbited above them. The computer that
guided their landing had about 72 kilobytes of memory, yet it handled an overload alarm in the
final minutes of the descent by dropping its least important tasks and carrying on.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 24 32 42 50 64 100 128 256 512 1000 1024 2048
4096 8192 10000 65536 1000000. Prices were 3.50, 12.99 and 100.00; the ratio was 1:4, the
share 25%, and the date 2024-05-17 at 09:30.
Questions and answers. What is the capital of France? Paris. How many legs does a spider
have? Eight. Why is the sky blue? Because air scatters short wavelengths of sunlight more
than long ones. Who wrote the play about the prince of Denmark? Shakespeare.
Science asks how the world works; engineering asks how to make something that works. A bridge,
a compiler and a power grid are all built from the same habits: measure, simplify, test the
edge cases, and write down why each decision was made.
Music is organised sound. A melody moves through time, a chord stacks notes together, and
rhythm gives both a pulse. Some songs are happy, some are sad, and the best ones are both.
Gardeners know that patience matters more than effort. Seeds planted in spring become
tomatoes, beans and sunflowers by late summer, provided someone remembers to water them.
def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

import json
data = {"name": "baton", "version": 1, "tags": ["llm", "serving"], "ok": True, "none": None}
print(json.dumps(data, indent=2))
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
Français : Le petit chat dort au soleil près de la fenêtre. Où est la gare ? Merci beaucoup.
Deutsch: Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!
Español: El niño come una manzana y bebe agua. ¿Dónde está la biblioteca? ¡Qué bueno!
Português: A informação está disponível em várias línguas. Obrigado pela atenção.
Italiano: La città è bella d'estate, e il caffè è sempre più forte del previsto.
Русский: Быстрая коричневая лиса прыгает через ленивую собаку. Спасибо, до свидания.
Ελληνικά: Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.
日本語：今日はいい天気ですね。東京の桜はとてもきれいです。ありがとうございます。
中文：今天天气很好。我们一起去公园散步吧。谢谢你的帮助。
한국어: 안녕하세요. 오늘 날씨가 정말 좋네요. 감사합니다.
العربية: مرحبا بالعالم. شكرا جزيلا.
עברית: שלום עולם. תודה רבה.
हिन्दी: नमस्ते दुनिया। आपका बहुत धन्यवाद।
"""

# Blocks of the Basic Multilingual Plane whose characters (with their Unicode 3.2 names)
# join the corpus. Ideographs and Hangul syllables are sampled, not taken whole.
_UNICODE_RANGES = (
    (0x0020, 0x0250),  # ASCII, Latin-1, Latin Extended-A/B
    (0x0370, 0x0530),  # Greek, Cyrillic
    (0x0590, 0x0700),  # Hebrew, Arabic
    (0x0900, 0x0980),  # Devanagari
    (0x2000, 0x2700),  # punctuation, symbols, arrows, math, box drawing, dingbats
    (0x3000, 0x3100),  # CJK punctuation, Hiragana, Katakana
    (0x4E00, 0x5100),  # the first CJK unified ideographs
    (0xAC00, 0xAD00),  # the first Hangul syllables
)


def corpus_lines() -> Iterator[str]:
    """Every line of the training corpus, always the same lines in the same order."""
    yield from PROSE.splitlines()
    ucd = unicodedata.ucd_3_2_0
    for low, high in _UNICODE_RANGES:
        for code_point in range(low, high):
            char = chr(code_point)
            name = ucd.name(char, "")
            if name and ucd.category(char)[0] not in "CZ":  # no controls or spaces
                yield f"{char} {name.lower()}"

"""Incremental detokenization: token ids in, UTF-8-safe text deltas out, with stop strings.

Decoding one token at a time is wrong in two ways: a character can be split over
several byte-level tokens (decoding a part gives U+FFFD), and SentencePiece-style
(Metaspace) decoders drop the leading space of the *first* token they see. So each
step decodes a short window of ids twice — the already-emitted ``prefix`` window and
the same window plus the new ids — and emits the difference, only once it no longer
ends in U+FFFD (the classic prefix/read-offset algorithm of HF TGI and vLLM). The
window starts in the prompt's tail so the first generated token keeps its space. The
prefix is usually the one token the previous step emitted, whose text the tokenizer
caches (``Tokenizer.token_text``): one tokenizer call per token, not two. A window
that grows instead of sliding was measured and not used: a call's cost grows with its
ids (0.3 us for 1, 0.8 for 2, 2.9 for 16 with the test tokenizer), so two short calls
cost less than one long one.

``tokenizers.decoders.DecodeStream`` (which does accept prefill ids) was measured and
not used: when the prompt ends inside a character it emits the prompt's tail text as
output, it cannot release held-back bytes when the request ends, and it raises when a
decoder rewrites earlier text.

Stop strings are matched on the decoded text, across token boundaries; text that could
still be the beginning of a stop string is held back until it cannot be, and the stop
string itself is never emitted. Used by the router (one instance per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from workers.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context; one real token is enough for the leading-space rule,
# a few more cover a character split over the prompt's last byte-level tokens.
_NUM_CONTEXT_TOKENS = 6
# Longest UTF-8 character in tokens (4 bytes, one byte-level token each) minus one.
_MAX_INCOMPLETE_TOKENS = 3


class DetokenizerDelta(NamedTuple):
    """What one ``step`` released (a NamedTuple: one per token, built in half a frozen
    dataclass's time)."""

    text: str
    """Newly emitted text (may be empty: held back or nothing decodable yet)."""
    stop_matched: str | None = None
    """The stop string that just matched; set on exactly one delta, then nothing follows."""


class IncrementalDetokenizer:
    """Streaming detokenizer of one request's output ids.

    Concatenating every ``step(...).text`` and ``flush()`` gives the request's output
    text: ``tokenizer.decode(output_ids)`` (for byte-level tokenizers; Metaspace ones
    additionally keep the first token's leading space), cut before the first stop
    string when one matches.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a sequence of strings, not a string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._text_parts: list[str] = []
        self._held = ""  # decoded but not emitted: could be the start of a stop string
        self._is_finished = False
        self.stop_matched: str | None = None
        """The stop string that ended the output, else None."""

        # A window of ids: ids[:read_offset] (the prefix) decoded to _prefix_text and is
        # already emitted (or is prompt context); ids[read_offset:] are not emitted yet.
        self._ids = self._context_ids(list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:]))
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    @property
    def is_finished(self) -> bool:
        """True after a stop string matched or ``flush`` ran; later steps emit nothing."""
        return self._is_finished

    def step(self, new_token_ids: Sequence[int], check_stop: bool = True) -> DetokenizerDelta:
        """Add newly generated ids; return the text they release (maybe none yet).

        ``check_stop=False`` (before ``min_tokens`` is reached) does not match stop strings
        but still holds back text that could begin one, so a stop string that straddles
        the ``min_tokens`` boundary is found once matching starts.
        """
        if self._is_finished or not new_token_ids:
            return DetokenizerDelta("")
        self._ids.extend(new_token_ids)
        return self._release(self._decode_new(final=False), final=False, check_stop=check_stop)

    def flush(self) -> str:
        """End the stream (EOS, length, abort): return every held-back character.

        Incomplete UTF-8 at the very end comes out as U+FFFD, as a full decode gives it.
        """
        if self._is_finished:
            return ""
        text = self._release(self._decode_new(final=True), final=True).text
        self._is_finished = True
        return text

    # -- decoding ---------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:  # most prefixes: the one token the last step emitted (cached)
            return self._tokenizer.token_text(ids[0], self._skip_special_tokens)
        return self._tokenizer.backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _context_ids(self, tail: list[int]) -> list[int]:
        """The prompt tail cut to start and end on whole characters.

        The tail may begin inside a character (its first bytes fell outside the window)
        and a prompt given as ids may end inside one. Either way the dangling bytes
        decode to U+FFFD, whose count can change once more tokens follow, shifting the
        offset at which new text starts; they are left out of the context.
        """
        for num_skipped in range(min(_MAX_INCOMPLETE_TOKENS, len(tail)) + 1):
            if not self._decode(tail[num_skipped:]).startswith(_REPLACEMENT_CHAR):
                tail = tail[num_skipped:]
                break
        else:
            return []
        for num_dropped in range(min(_MAX_INCOMPLETE_TOKENS, len(tail)) + 1):
            candidate = tail[: len(tail) - num_dropped]
            if not self._decode(candidate).endswith(_REPLACEMENT_CHAR):
                return candidate
        return []

    def _decode_new(self, final: bool) -> str:
        """Text of the ids since read_offset, once it ends on a whole character."""
        full_text = self._decode(self._ids)
        if len(full_text) <= len(self._prefix_text):
            return ""  # nothing yet (a partial character, or skipped special tokens)
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # the last character is (probably) still incomplete
        new_text = full_text[len(self._prefix_text) :]
        # Slide the window: the ids just emitted become the next prefix.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    # -- stop strings -----------------------------------------------------------------

    def _release(self, new_text: str, final: bool, check_stop: bool = True) -> DetokenizerDelta:
        if not self._stop:  # nothing to match or hold back
            if new_text:
                self._text_parts.append(new_text)
            return DetokenizerDelta(new_text)
        text = self._held + new_text
        match = self._find_stop(text) if check_stop else None
        if match is not None:
            stop, start = match
            self._held = ""
            self.stop_matched = stop
            self._is_finished = True
            return self._emit(text[:start], stop)
        num_held = 0 if final else self._num_stop_prefix_chars(text)
        self._held = text[len(text) - num_held :]
        return self._emit(text[: len(text) - num_held], None)

    def _emit(self, text: str, stop_matched: str | None) -> DetokenizerDelta:
        if text:
            self._text_parts.append(text)
        return DetokenizerDelta(text, stop_matched)

    def _find_stop(self, text: str) -> tuple[str, int] | None:
        """The stop string that completes first in ``text``, and where it starts.

        Ties (same end) go to the longer string, which starts earlier: it covers more.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[2], best[1])

    def _num_stop_prefix_chars(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

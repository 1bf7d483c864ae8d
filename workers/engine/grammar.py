"""Structured outputs in the engine: compiled grammars, one matcher per request, the mask.

- ``GrammarCompiler`` (one per engine): the tokenizer's vocabulary as llguidance needs it
  (built on the first constrained request: ~0.2 s for a 49k vocabulary) and an LRU of
  compiled grammars keyed by the request's ``StructuredOutput``; a request gets a copy of
  the cached matcher (microseconds) rather than a compile.
- ``GrammarMatcher`` (one per request, ``Request.grammar``): where the output stands in the
  grammar. ``Request.append_token`` advances it with every output token, whoever sampled
  it, so its state is a function of the output tokens alone. That is how it crosses
  workers: a decode worker's request (its first token from the prefill worker), a
  migrated request (``prior_output_token_ids``) and a preempted one all hold a matcher fed
  the same tokens, nothing else is carried, and disaggregated output equals aggregated.
- ``apply_grammar_masks`` (the sampler's ``process``): the disallowed tokens' logits of
  the constrained rows set to -inf, after penalties and min_tokens, before greedy argmax,
  temperature, the filters and the draw; rows without a constraint are not touched, and a
  batch without one pays one scan of its rows.

A sampled row may be ahead of its matcher: a speculative verify row (or a draft model's
row) is sampled as if the proposals before it had been generated. Its mask is computed
after feeding the matcher those pending tokens, then rolled back (``fill_mask``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from workers.protocol.structured_output import StructuredOutput, grammar_text
from workers.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from workers.engine.sampler import SamplingRow

logger = logging.getLogger(__name__)

# Error messages without the parser's state and the grammar (a schema may be private, and
# a state dump is kilobytes of log per failure).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe; owned by its request."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int) -> None:
        self._matcher = matcher
        self.mask_words = mask_words
        """int32 words of one mask row (32 tokens each)."""
        self.num_tokens = 0
        """Output tokens consumed so far (= the request's output tokens)."""

    def accept(self, token_id: int) -> bool:
        """Advance past an output token; False (and the matcher ends, in error) if the
        grammar does not allow it, which the mask rules out for sampled tokens."""
        self.num_tokens += 1
        ok = self._matcher.consume_token(token_id)
        if not ok:
            logger.warning("token %d is outside the grammar: %s", token_id, self.error)
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (or the matcher failed):
        the request finishes with "stop"."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar would accept from here (not consumed)."""
        return self._matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def fill_mask(self, out: np.ndarray, pending: Sequence[int] = ()) -> None:
        """Write the allowed-token bitmask (int32 words, bit ``t % 32`` of word ``t // 32``)
        for the position after ``pending`` tokens not yet accepted, into ``out``. Past a
        pending token the grammar refuses, the mask is the refusing position's: such a
        row is never used (the refused token cannot be accepted)."""
        num_fed = self._matcher.try_consume_tokens(list(pending)) if pending else 0
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if num_fed:
            self._matcher.rollback(num_fed)


class GrammarCompiler:
    """Compiles requests' constraints for one tokenizer; one per engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 128) -> None:
        """``vocab_size``: the model's (its logits' width), at least the tokenizer's."""
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.mask_words = (self.vocab_size + 31) // 32
        self.cache_size = cache_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        # Compiled, never advanced: each request advances a copy.
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary: the token bytes, read from the tokenizer's
        own tokenizer.json (a GGUF model's derived one included), and its EOS ids."""
        if self._ll_tokenizer is None:
            eos = sorted(self._tokenizer.eos_token_ids) or None
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
            )
        return self._ll_tokenizer

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request; ValueError naming what does not compile (the
        router checks first, ``check_structured_output``, so this is a second line)."""
        template = self._cache.get(structured)
        if template is None:
            template = self._compile(structured)
            self._cache[structured] = template
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(structured)
        return GrammarMatcher(template.deep_copy(), self.mask_words)

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        try:
            text = grammar_text(structured)
        except ValueError as exc:
            raise ValueError(f"structured output ({structured.kind}): {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, limits=_LIMITS)
        if matcher.is_error():
            raise ValueError(f"structured output ({structured.kind}): {matcher.get_error()}")
        return matcher

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def apply_grammar_masks(
    x: torch.Tensor, raw: torch.Tensor, rows: Sequence[SamplingRow]
) -> torch.Tensor:
    """``x`` [num_rows, vocab] with every constrained row's disallowed tokens at -inf.

    Returns ``x`` itself when no row has a grammar, else a new tensor (``x`` and ``raw``,
    the unprocessed logits, are not modified). A row left with no allowed token (min_tokens
    or a stop id suppressed every token the grammar allows) is masked from ``raw``
    instead: the grammar wins over those."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return x
    num_rows, vocab_size = x.shape
    words = rows[constrained[0]].grammar.mask_words  # type: ignore[union-attr]
    bits = np.empty((len(constrained), words), dtype=np.int32)
    for j, i in enumerate(constrained):
        row = rows[i]
        grammar = row.grammar
        assert grammar is not None
        grammar.fill_mask(bits[j], row.output_token_ids[grammar.num_tokens :])
    # Bit t % 32 of little-endian word t // 32 is bit t % 8 of byte t // 8. The 0/1 bytes
    # are read as bools as they are: each pass over [rows, vocab] counts (it is memory-bound).
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    allowed = torch.from_numpy(unpacked.view(np.bool_)).to(x.device)  # [num_constrained, V]
    neg_inf = torch.tensor(-math.inf, dtype=x.dtype, device=x.device)
    index = torch.tensor(constrained, device=x.device)
    if len(constrained) == num_rows:
        out = masked = torch.where(allowed, x, neg_inf)
    else:
        masked = torch.where(allowed, x[index], neg_inf)
        out = x.clone()
    # Only min_tokens suppression (of EOS and stop ids) sets logits to -inf before here.
    suppressed = [
        j
        for j, i in enumerate(constrained)
        if len(rows[i].output_token_ids) < rows[i].params.min_tokens
    ]
    if suppressed:
        candidates = torch.tensor(suppressed, device=x.device)
        dead = candidates[masked[candidates].amax(dim=1) == -math.inf]
        if len(dead):
            masked[dead] = torch.where(allowed[dead], raw[index[dead]], neg_inf)
    if len(constrained) < num_rows:
        out[index] = masked
    return out

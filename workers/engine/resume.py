"""Output tokens a request already has when it is added: it resumes, it does not start.

Two callers, one rule. A decode worker continues after the first token its prefill
worker sampled (``remote_first_token``); any worker continues a request *migrated* from a
worker that died (``prior_output_token_ids``, docs/serving.md "Request migration"). In
both, the tokens are the request's output, not its prompt: ``max_tokens`` and
``min_tokens`` count them, penalties see them as output, the seeded generator is advanced
past the draws that sampled them (``make_generator(num_sampled_steps=...)``), and the
detokenizer walks them so that a stop string or a character spanning the boundary still
completes, while the text they released (already sent by whoever sampled them) is not
emitted again. Their KV is computed like a prompt's (a prefix-cache hit included), or
arrives from the prefill worker for ``remote_first_token``. A structured-output request's
matcher is rebuilt by feeding it these tokens (``Request.append_token``): its state is a
function of the output, so nothing else crosses workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.request import Request, check_stop
from workers.text.detokenizer import IncrementalDetokenizer


def resume_outputs(
    req: Request,
    token_ids: Sequence[int],
    detok: IncrementalDetokenizer | None,
    vocab_size: int,
    max_model_len: int,
    what: str,
) -> None:
    """Append ``token_ids`` to ``req``'s output as if it had sampled them; ValueError
    (naming ``what``) for a bad id, or when one of them already ends the request: whoever
    sampled such a token finishes the request itself."""
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"{what} must be ints, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{what}: token {token_id} out of vocabulary [0, {vocab_size})")
    for token_id in token_ids:
        req.append_token(token_id)  # advances req.grammar: the matcher is rebuilt here
        if req.grammar is not None and req.grammar.error:
            raise ValueError(
                f"{what}: token {token_id} is not allowed by the request's structured output"
            )
        stop_matched = None
        if detok is not None:
            # Its text was sent by whoever sampled it; only the state after it matters.
            may_stop = req.num_output_tokens >= req.params.min_tokens
            stop_matched = detok.step([token_id], check_stop=may_stop).stop_matched
        reason, _ = check_stop(req, token_id, stop_matched, max_model_len)
        if reason is not None:
            raise ValueError(
                f"{what}: token {token_id} already ends the request ({reason.value}); "
                "the worker that sampled it finishes such a request itself"
            )

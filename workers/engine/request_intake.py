"""From ``LLMEngine.add_request``'s arguments to a ``Request`` the scheduler can take.

What a request may be asked to do is checked here, before anything is allocated: the
roles exclude each other (a prefill-only request has no remote first token; a migrated
request is recomputed, not received), the prompt leaves room to generate within
``max_model_len``, a peer prefix is whole blocks of the prompt, and the sampling
parameters fit the model. Every refusal is a ValueError naming the argument. Then the
request is built with what it starts from: its seeded generator advanced past the tokens
sampled elsewhere (a remote first token, a migrated request's output), its grammar
matcher and detokenizer fed those tokens (``workers/engine/resume.py``).

The engine keeps the parts that touch its state: the id's uniqueness against the
hand-off, the scheduler's queue and the detokenizer table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.grammar import GrammarCompiler
from workers.engine.handoff import check_peer_prefix
from workers.engine.request import Request
from workers.engine.resume import resume_outputs
from workers.engine.sampler import make_generator
from workers.protocol.sampling_params import SamplingParams
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer, encode_prompt


def check_roles(
    *,
    prefill_only: bool,
    remote_first_token: int | None,
    prior_output_token_ids: Sequence[int],
    await_first_token: bool,
) -> bool:
    """Refuse role arguments that exclude each other; returns whether the prompt's KV
    comes from another worker (a remote first token now or later)."""
    if await_first_token and (remote_first_token is not None or prior_output_token_ids):
        raise ValueError("await_first_token excludes remote_first_token and prior outputs")
    remote = remote_first_token is not None or await_first_token
    if prefill_only and remote:
        raise ValueError("prefill_only and remote_first_token exclude each other")
    if prior_output_token_ids and remote_first_token is not None:
        # The decode side would receive the prompt's KV only; a migrated request is recomputed.
        raise ValueError("prior_output_token_ids and remote_first_token exclude each other")
    return remote


def build_request(
    prompt: str | Sequence[int],
    params: SamplingParams,
    request_id: str,
    *,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    grammars: GrammarCompiler,
    detokenize: bool,
    prefill_only: bool = False,
    remote_first_token: int | None = None,
    prior_output_token_ids: Sequence[int] = (),
    peer_prefix_tokens: int = 0,
    await_first_token: bool = False,
) -> tuple[Request, IncrementalDetokenizer | None]:
    """Validate ``add_request``'s arguments (its docstring says what each means) and build
    the request and, with ``detokenize``, its detokenizer; ValueError names the problem."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    remote = check_roles(
        prefill_only=prefill_only,
        remote_first_token=remote_first_token,
        prior_output_token_ids=prior_output_token_ids,
        await_first_token=await_first_token,
    )
    params.validate_for_model(vocab_size)
    token_ids = encode_prompt(tokenizer, prompt, vocab_size)
    room = max_model_len - len(token_ids)
    if room < 1:
        raise ValueError(
            f"prompt: {len(token_ids)} tokens leave no room to generate within "
            f"max_model_len={max_model_len}"
        )
    check_peer_prefix(peer_prefix_tokens, len(token_ids), block_size, remote or None)
    if peer_prefix_tokens and params.prompt_logprobs is not None:
        raise ValueError("peer_prefix_tokens: a request with prompt_logprobs computes its prompt")
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    req = Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        params=params,
        max_tokens=max_tokens,
        eos_token_ids=frozenset() if params.ignore_eos else tokenizer.eos_token_ids,
        generator=make_generator(
            params, device, num_sampled_steps=int(remote) + len(prior_output_token_ids)
        ),
        is_prefill_only=prefill_only,
    )
    if params.structured is not None:
        req.grammar = grammars.matcher(params.structured)
    detok = None
    if detokenize:
        detok = IncrementalDetokenizer(
            tokenizer, token_ids, params.stop, params.skip_special_tokens
        )
    prior = list(prior_output_token_ids)
    req.num_peer_tokens = peer_prefix_tokens
    req.is_remote_prefill = remote
    if remote_first_token is not None:
        prior, what = [remote_first_token], "remote_first_token"
    else:
        what = "prior_output_token_ids"
    resume_outputs(req, prior, detok, vocab_size, max_model_len, what)
    return req, detok

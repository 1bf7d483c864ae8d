"""The ``baton`` subcommands that talk to a running router: ``generate --target`` and
``status`` over gRPC, ``scale`` over the HTTP admin route (imported only when one of them
runs: grpc stays out of the parser and of the offline commands)."""

from __future__ import annotations

import argparse
import sys
import time

from cluster.cli_terminal import (
    EXIT_FAILURE,
    EXIT_USAGE,
    end_line,
    print_error,
    print_generation_summary,
    read_prompt,
)


def run_generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from cluster.client import format_usage_and_timing, parse_target, stream_generate, wait_ready
    from proto.baton.v1 import inference_pb2 as pb
    from proto.baton.v1 import inference_pb2_grpc as pb_grpc

    if args.dtype is not None:
        raise ValueError("--dtype applies only with --model (the server chose its dtype)")
    target = parse_target(args.target)
    prompt = read_prompt(args.prompt)
    with grpc.insecure_channel(target) as channel:
        if args.wait is not None:
            try:
                wait_ready(channel, args.wait)
            except TimeoutError as exc:
                print_error(str(exc))
                return EXIT_FAILURE
        stream = stream_generate(
            pb_grpc.InferenceStub(channel),
            prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            disaggregation=args.disaggregation,
            return_timing=args.timing,
            speculative=False if args.no_speculative else None,
            timeout_s=args.timeout,
        )
        start = time.perf_counter()
        first_token_time: float | None = None
        num_tokens = 0
        has_text = False
        final = None
        try:
            for response in stream:
                kind = response.WhichOneof("kind")
                delta = response.delta if kind == "delta" else response.final.delta
                if delta.token_ids and first_token_time is None:
                    first_token_time = time.perf_counter()
                num_tokens += len(delta.token_ids)
                if delta.text:
                    has_text = True  # before the write: Ctrl-C may land inside it
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                if kind == "final":
                    final = response.final
        except KeyboardInterrupt:
            # Cancelling the call is how the server learns to abort the request and free
            # its KV blocks (docs/serving.md, "Ending early"); closing the channel alone
            # would be later.
            stream.cancel()
            end_line(has_text)
            raise
        except grpc.RpcError as exc:
            end_line(has_text)
            return _report_rpc_error(exc)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()

    if final is None:
        print_error(f"the stream from {target} ended without a Final")
        return EXIT_FAILURE
    # FINISH_REASON_LENGTH -> "length": the words the offline form prints.
    reason = pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    ttft_s = None if first_token_time is None else first_token_time - start
    print_generation_summary(num_tokens, reason, elapsed, ttft_s)
    if args.timing:
        print(format_usage_and_timing(final), file=sys.stderr)
    return 0


def _report_rpc_error(exc) -> int:  # exc: grpc.RpcError (grpc is imported lazily)
    code = exc.code()
    print_error(f"{code.name}: {exc.details()}")
    # A bad request is the caller's mistake, like a bad flag; everything else is run time.
    return EXIT_USAGE if code.name == "INVALID_ARGUMENT" else EXIT_FAILURE


def run_status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from cluster.client import format_status, get_status, parse_target
    from proto.baton.v1 import inference_pb2_grpc as pb_grpc

    target = parse_target(args.target)
    with grpc.insecure_channel(target) as channel:
        try:
            status = get_status(pb_grpc.InferenceStub(channel), args.timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return _report_rpc_error(exc)
            print_error(f"cannot reach a Baton router at {target} ({code.name}: {exc.details()})")
            return EXIT_FAILURE
    if args.json:
        text = json_format.MessageToJson(
            status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    else:
        text = format_status(status)
    print(text)
    return 0


def run_scale(args: argparse.Namespace) -> int:
    """``baton scale``: the router's HTTP admin route ``/admin/scale`` (router/http/admin.py):
    GET with neither ``--prefill`` nor ``--decode``, else POST the new sizes."""
    import json
    import os
    import urllib.error
    import urllib.request

    key = os.environ.get("BATON_ADMIN_KEY", "")
    if args.admin_key_file:
        with open(args.admin_key_file) as f:
            key = f.read().strip()
    if not key:
        raise ValueError("the admin key: give --admin-key-file FILE or set $BATON_ADMIN_KEY")
    base = args.target if "://" in args.target else f"http://{args.target}"
    target = {"prefill": args.prefill, "decode": args.decode}
    body = {k: v for k, v in target.items() if v is not None}
    request = urllib.request.Request(
        f"{base.rstrip('/')}/admin/scale",
        data=json.dumps(body).encode() if body else None,
        method="POST" if body else "GET",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        print_error(f"HTTP {exc.code}: {message}")
        return EXIT_USAGE if exc.code == 400 else EXIT_FAILURE
    except (urllib.error.URLError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        print_error(f"cannot reach a Baton router's HTTP API at {base} ({reason})")
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(answer, indent=2))
    elif not body:
        print(f"prefill {answer['prefill']}, decode {answer['decode']}")
    else:
        before, after = answer["before"], answer["after"]
        line = ", ".join(f"{p} {before[p]} -> {after[p]}" for p in ("prefill", "decode"))
        extra = [f"added {', '.join(answer['added'])}"] if answer["added"] else []
        extra += [f"retired {', '.join(answer['retired'])}"] if answer["retired"] else []
        if answer["migrated"]:
            extra.append(f"{answer['migrated']} requests migrated past the grace period")
        print(line + (f" ({'; '.join(extra)})" if extra else ""))
    return 0

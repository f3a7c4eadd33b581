#!/usr/bin/env python
"""Serve a model over an OpenAI-compatible HTTP API on our engine (one process, CPU or GPU).

    python tools/serve.py --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

--model takes an HF model directory or our checkpoint root. The routes are
/v1/chat/completions, /v1/completions and /v1/models (rlhf/serving/openai_api.py), served by
uvicorn; requests that arrive together are batched continuously by one engine (paged KV cache).
A program written against the ``openai`` client talks to it with
``openai.OpenAI(base_url="http://HOST:PORT/v1", api_key=KEY or "unused")``. It binds to
localhost unless --host says otherwise; with --api-key every request must send it as a Bearer
token. Greedy decoding is ``temperature=0``. docs/agents.md.
"""

from __future__ import annotations

import argparse
import sys
import threading

from rlhf.cli import HelpFormatter, UsageError, report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="an HF model directory or our checkpoint root")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed at start-up)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request "
                   "(default: none)")
    p.add_argument("--served-model-name", default=None, help="the model id /v1/models reports (default: the "
                   "--model directory's name)")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer directory (default: the model's)")
    p.add_argument("--model-name", default="actor", help="model to serve from our checkpoint")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: latest)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the model's (and KV cache's) dtype")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV cache blocks of 16 tokens (fewer: more "
                   "preemption, never a lost request)")
    p.add_argument("--cuda-graphs", action="store_true", help="on a GPU, replay decode steps (padded to static "
                   "shapes) as CUDA graphs; no effect on the CPU (docs/engine.md)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        return report("serve.py", UsageError(f"--port {args.port}: give a TCP port in [0, 65535]"))
    try:
        return serve(args)
    except UsageError as e:
        return report("serve.py", e)


def serve(args) -> int:
    """Load the model, start the engine's thread and serve until interrupted."""
    import os
    import socket

    import uvicorn

    from rlhf import platform
    from rlhf.engine import Engine, EngineConfig
    from rlhf.engine.completions import load_model_and_tokenizer
    from rlhf.engine.types import EngineConfigError
    from rlhf.serving.engine_service import EngineService
    from rlhf.serving.openai_api import OpenAIEndpoint, openai_app

    try:
        engine_cfg = EngineConfig(num_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs,
                                  cuda_graphs=args.cuda_graphs and platform.has_accelerator())
    except EngineConfigError as e:
        flag = {"num_blocks": "--kv-blocks", "max_num_seqs": "--max-num-seqs"}[e.field_name]
        raise UsageError(f"{flag}: {e}") from None
    loaded, tokenizer = load_model_and_tokenizer(args.model, "--model", args.model_name, args.iteration, args.dtype,
                                                 args.tokenizer)
    engine = Engine(loaded.model, None, loaded.config, engine_cfg)
    service = EngineService(engine)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    endpoint = OpenAIEndpoint(service, tokenizer, name, engine.max_len)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise UsageError(f"--host {args.host} --port {args.port}: cannot bind ({e.strerror})") from None
    owner = threading.Thread(target=service.serve_forever, name="engine", daemon=True)
    owner.start()
    host, port = sock.getsockname()[:2]
    print(f"serve.py: {name} on http://{host}:{port}/v1 (engine: {engine_cfg.num_blocks} KV blocks, "
          f"max_model_len {engine.max_len})", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(openai_app(endpoint, args.api_key), log_level="warning")).run(
            sockets=[sock])
    finally:
        service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

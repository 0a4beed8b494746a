"""The `bubo` command line: serve, generate, inspect (`python -m bubo` is the same)."""

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bubo import __version__
from bubo.default_model import DefaultModelMissingError, default_model_path
from bubo.dtypes import CACHE_TYPES, DTYPES
from bubo.file_listing import print_listing
from bubo.gguf.reader import GGUFError
from bubo.options import RuntimeOptions, use_options
from bubo.process_memory import configure_cpu_process

if TYPE_CHECKING:
    from bubo.engine.sampler import SamplingParams
    from bubo.server.settings import ServerSettings


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`bubo inspect FILE | head`): not an error. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (GGUFError, DefaultModelMissingError, OSError, ValueError) as error:
        # A bad file or bad flag is the user's to fix: one line, no traceback.
        print(f"bubo: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bubo", description="A pure-PyTorch runtime for GGUF language models."
    )
    parser.add_argument("--version", action="version", version=f"bubo {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="continue a prompt and print the text")
    _add_model_args(gen)
    gen.add_argument(
        "--prompt", "-p", required=True, help="prompt text; special tokens like <|im_start|> are parsed"
    )
    gen.add_argument(
        "--max-tokens", "-n", type=int, default=128, help="tokens to generate; -1 = until the context ends"
    )
    gen.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--min-p", type=float, default=0.05)
    gen.add_argument("--repeat-penalty", type=float, default=1.0)
    gen.add_argument("--repeat-last-n", type=int, default=64)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-generation tokens")
    gen.add_argument("--special", action="store_true", help="print special tokens such as <|im_end|>")
    gen.add_argument("--seed", type=int, default=None, help="the same seed gives the same text")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stats", action="store_true", help="print token counts and speed to stderr")
    _add_speculation_args(gen)
    gen.set_defaults(run=_generate)

    srv = commands.add_parser(
        "serve", help="serve the model over HTTP (OpenAI, Anthropic, llama-server APIs)"
    )
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    srv.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route; repeatable (any of "
        "the keys is taken)",
    )
    srv.add_argument(
        "--cache-isolation",
        choices=("shared", "key", "request"),
        default="shared",
        help="whose cached prompt a request may reuse: anyone's (shared, the default), those sent with "
        "the same API key (key), or none (request); other than shared, /slots hides the requests' "
        "details. See SECURITY.md",
    )
    srv.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (e.g. http://localhost:3000; '*' for any) call the API; "
        "repeatable. Without it the server sends no CORS headers",
    )
    srv.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish before their streams are ended "
        "(default 10)",
    )
    srv.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="cut a streamed answer whose client has taken none of it for this long (default 30)",
    )
    srv.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request head is not complete this long after it began (default 10)",
    )
    srv.add_argument(
        "--idle-timeout",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="close a connection that sends no request for this long (default 15)",
    )
    srv.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections held at once; past it the one silent longest is closed "
        "(default: the open-files limit, raised to its hard limit, less 64)",
    )
    srv.add_argument(
        "--served-model-name",
        "--alias",
        "-a",
        default=None,
        help="the model id clients use (default: from the file name)",
    )
    srv.add_argument(
        "--ctx-size", "-c", type=int, default=None, help="context size in tokens (default: the model's)"
    )
    srv.add_argument(
        "--debug-hooks",
        action="store_true",
        help="add /debug/prompt, /debug/cache, /debug/settings (loopback only)",
    )
    srv.add_argument(
        "--max-body-mb", type=float, default=32.0, help="largest request body in MB (default 32)"
    )
    srv.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=1,
        help="slots: requests served at once, their decode steps batched (default 1)",
    )
    srv.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="KV cache positions the slots share, in blocks (default ctx-size x parallel; fewer overcommits)",
    )
    srv.add_argument(
        "--cache-snapshots",
        type=int,
        default=16,
        help="recurrent-state snapshots a hybrid model's prompt cache keeps (default 16; 0 = off)",
    )
    srv.add_argument(
        "--cache-ram", type=float, default=2048, help="MB those snapshots may take (default 2048)"
    )
    srv.add_argument(
        "--cache-snapshot-interval",
        type=int,
        default=1024,
        help="also snapshot every N prompt tokens (default 1024; 0 = at turn ends only)",
    )
    srv.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve N replicas of the model behind Ray Serve on --host:--port, joining the running Ray "
        "cluster or starting a local one (needs `pip install 'bubo[serve]'`; see the README)",
    )
    _add_speculation_args(srv)
    srv.add_argument(
        "--tensor-parallel",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (gloo on the CPU, NCCL on CUDA: one GPU each), started here "
        "or by torchrun; rank 0 serves (default 1). One slot, no speculative decoding, no images",
    )
    srv.add_argument(
        "--mmproj",
        type=Path,
        default=None,
        metavar="FILE",
        help="vision tower (projector GGUF, as llama.cpp's --mmproj, or a checkpoint's vision weights): "
        "the model then takes images",
    )
    srv.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs in requests (never from private or loopback addresses); "
        "without it images must be sent inline (data: URLs, base64)",
    )
    srv.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="least severe log lines written (default info: one line per request, and load progress)",
    )
    srv.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text, or one JSON object a line for a log collector (default text)",
    )
    srv.add_argument("--temp", "--temperature", type=float, default=0.8, help="default temperature (0.8)")
    srv.add_argument("--top-k", type=int, default=40, help="default top-k (40; 0 = off)")
    srv.add_argument("--top-p", type=float, default=0.95, help="default top-p (0.95; 1 = off)")
    srv.add_argument("--min-p", type=float, default=0.05, help="default min-p (0.05; 0 = off)")
    srv.add_argument("--repeat-penalty", type=float, default=1.0, help="default repeat penalty (1 = off)")
    srv.add_argument("--seed", type=int, default=-1, help="default seed (-1 = random per request)")
    srv.add_argument(
        "--n-predict",
        "-n",
        type=int,
        default=-1,
        help="default token limit per request (-1 = until the context ends)",
    )
    srv.set_defaults(run=_serve)

    ins = commands.add_parser(
        "inspect", help="print a GGUF file's architecture, layer plan, metadata and tensors"
    )
    ins.add_argument(
        "file", type=Path, nargs="?", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)"
    )
    ins.add_argument("--all-metadata", action="store_true", help="print long strings and arrays whole")
    ins.set_defaults(run=_inspect)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", "-m", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)"
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    for part, short in (("k", "-ctk"), ("v", "-ctv")):
        parser.add_argument(
            f"--cache-type-{part}",
            short,
            choices=sorted(CACHE_TYPES),
            default="f16",
            help=f"KV cache storage type of the {'keys' if part == 'k' else 'values'} (default f16, as "
            "llama.cpp's: half the memory of f32, widened as attention reads it)",
        )
    parser.add_argument(
        "--threads", "-t", type=int, default=None, help="CPU threads (default: torch's choice)"
    )
    _add_runtime_args(parser)


def _add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """The fields of bubo.options.RuntimeOptions (each also set by a BUBO_* variable: see that module)."""
    group = parser.add_argument_group(
        "runtime paths (`bubo generate --stats` and `bubo serve` print the plan)"
    )
    for flag, what in (
        ("--no-compile-decode", "decode eagerly on the CPU instead of through the compiled step"),
        ("--no-cuda-graphs", "launch CUDA decode steps eagerly instead of replaying a captured graph"),
        ("--no-triton", "use the torch reference paths on CUDA instead of the Triton kernels"),
        ("--no-triton-autotune", "each Triton kernel takes its first config (a faster first start)"),
        ("--no-pack-experts", "keep CPU expert stacks as the file's blocks (less memory, slower)"),
        (
            "--no-adaptive-threads",
            "always decode on all --threads (default: on one instead while timings say "
            "a busy neighbour makes that faster)",
        ),
        (
            "--no-int8-matvec",
            "multiply quantized weights with float activations instead of int8-quantized ones "
            "(exact activations, slower; the int8 path needs AVX512-VNNI or AVX2)",
        ),
    ):
        group.add_argument(flag, action="store_true", default=None, help=what)
    group.add_argument(
        "--prefill-bf16",
        choices=("auto", "on", "off"),
        default=None,
        help="CPU prefill GEMMs in bfloat16 (auto: where the CPU has bf16 dot products; default auto)",
    )
    group.add_argument(
        "--kernel-cache",
        default=None,
        metavar="DIR|off",
        help="where compiled CPU kernels are kept between runs (default: inside inductor's cache)",
    )


def _runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    """The environment's options (bubo.options), with the flags given on the command line applied."""
    changes: dict[str, Any] = {
        field: False
        for field in (
            "compile_decode",
            "cuda_graphs",
            "triton",
            "triton_autotune",
            "pack_experts",
            "adaptive_threads",
            "int8_matvec",
        )
        if getattr(args, f"no_{field}")
    }
    if args.prefill_bf16 is not None:
        changes["prefill_bf16"] = args.prefill_bf16
    if args.kernel_cache is not None:
        changes["kernel_cache"] = args.kernel_cache
    return RuntimeOptions.from_environment().changed(**changes)


def _add_speculation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec-type",
        choices=("mtp", "ngram-simple", "none"),
        default=None,
        help="speculative decoding's drafter: the model's MTP block, or the tokens that followed the "
        "last earlier occurrence of the newest n-gram (no draft model; for text that repeats its "
        "context) (default: mtp for a model with an MTP block, else none)",
    )
    parser.add_argument(
        "--spec-draft",
        type=int,
        default=None,
        metavar="N",
        help="speculative decoding: tokens drafted per step (0 = off; default: 1 with mtp, 2 with "
        "ngram-simple)",
    )
    parser.add_argument(
        "--spec-ngram-simple-size-n",
        type=int,
        default=3,
        metavar="N",
        help="ngram-simple: how many of the newest tokens must have occurred before (default 3)",
    )
    parser.add_argument(
        "--mtp-weights",
        type=Path,
        default=None,
        metavar="PATH",
        help="Hugging Face safetensors file (a checkpoint shard) holding the mtp.* block the GGUF lacks",
    )


def _resolve_model(args: argparse.Namespace) -> Path:
    return model_file(args.model)


def model_file(path: Path | None) -> Path:
    """The GGUF file a command works on (None: the default model), worded the same way by every
    command when it is missing or is a directory."""
    path = path if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"expected a GGUF model file, got a directory: {path}")
    return path


def _prepare_process(args: argparse.Namespace) -> None:
    """Process settings that must precede importing the model code (see bubo.process_memory), and the
    runtime options."""
    if args.device.split(":")[0] == "cpu":
        configure_cpu_process()
    use_options(_runtime_options(args))


def _generate(args: argparse.Namespace) -> int:
    from bubo.engine.sampler import SamplingParams

    sampling: dict[str, Any] = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "repeat_last_n": args.repeat_last_n,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "stop": list(args.stop),
    }
    # Checked before the model loads (seconds): a mistyped value's one line should not wait for it.
    SamplingParams(**sampling).validate()
    _prepare_process(args)
    import bubo
    from bubo.engine.request import Finished, OutputDelta

    path = _resolve_model(args)
    started = time.perf_counter()
    model = bubo.load(
        path,
        device=args.device,
        dtype=args.dtype,
        cache_type=(args.cache_type_k, args.cache_type_v),
        threads=args.threads,
        progress=sys.stderr.isatty(),
        spec_type=args.spec_type,
        spec_draft=args.spec_draft,
        spec_ngram_size=args.spec_ngram_simple_size_n,
        mtp_weights=args.mtp_weights,
    )
    load_seconds = time.perf_counter() - started
    if args.stats:
        print(model.plan, file=sys.stderr)
    events = model.generate(args.prompt, stream=True, special=args.special, **sampling)
    for event in events:
        if isinstance(event, OutputDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Finished):
            sys.stdout.write("\n")
            sys.stdout.flush()
            if args.stats:
                _print_stats(event.result, load_seconds)
    return 0


def _print_stats(result: Any, load_seconds: float) -> None:
    t = result.timings
    print(
        f"load {load_seconds:.2f} s | prefill {t.prefill_tokens} tokens + first token in {t.prefill_seconds:.3f} s "
        f"({t.prefill_tokens_per_second:.1f} tok/s) | decode {t.decode_tokens} more tokens in "
        f"{t.decode_seconds:.3f} s ({t.decode_tokens_per_second:.1f} tok/s) | "
        f"finish: {result.finish_reason} ({result.stop_reason}) | seed {result.seed}"
        + (
            f" | drafted {result.draft_tokens}, accepted {result.draft_accepted}"
            if result.draft_tokens
            else ""
        ),
        file=sys.stderr,
    )


def _serve(args: argparse.Namespace) -> int:
    # The flags first: importing the server and the model code takes seconds, and a mistyped flag's
    # one line should not wait for them.
    defaults = _checked_serve_flags(args)
    _prepare_process(args)

    from bubo.server.app import serve
    from bubo.server.request_log import configure_logging
    from bubo.server.state import ServerState

    settings = _server_settings(args, defaults)
    state = ServerState(settings)
    state.preflight()
    if args.tensor_parallel > 1:
        return _serve_tensor_parallel(args, settings)
    configure_logging(args.log_level, args.log_format)
    if args.replicas is not None:
        try:
            from bubo.server.replicas.launch import serve_replicas
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in ("ray", "starlette"):
                raise
            raise ValueError(f"--replicas needs Ray Serve: pip install 'bubo[serve]' ({error})") from error
        return serve_replicas(settings, _runtime_options(args), args.replicas)
    return serve(state)


def _serve_tensor_parallel(args: argparse.Namespace, settings: "ServerSettings") -> int:
    """Rank 0 of a split model serves (bubo/server/tensor_parallel.py); a follower under torchrun
    returns once rank 0 stops it."""
    from bubo.server.app import serve
    from bubo.server.request_log import configure_logging
    from bubo.server.state import ServerState
    from bubo.server.tensor_parallel import start_ranks, stop_ranks

    rank_settings = start_ranks(settings, args.tensor_parallel)
    if rank_settings is None:  # a follower rank under torchrun, sent home by rank 0
        return 0
    state = ServerState(rank_settings)
    state.preflight()
    configure_logging(args.log_level, args.log_format)
    try:
        return serve(state)
    finally:
        stop_ranks(state)


def replicas_app(args: dict[str, str]) -> Any:
    """The application builder for a Ray Serve config file (`import_path: bubo.cli:replicas_app`): its
    `args` entry `serve` holds `bubo serve`'s flags, --replicas N among them (default 1)."""
    from bubo.server.replicas.launch import replicas_app as build

    parsed = _parser().parse_args(["serve", *shlex.split(args.get("serve", ""))])
    settings = _server_settings(parsed, _checked_serve_flags(parsed))
    return build(settings, _runtime_options(parsed), parsed.replicas or 1)


def _checked_serve_flags(args: argparse.Namespace) -> "SamplingParams":
    """Every check of `bubo serve`'s flags that needs neither the server nor the model code (a ValueError
    names the flag), and the request defaults they set."""
    from bubo.engine.sampler import SamplingParams
    from bubo.server.hosts import is_loopback

    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    _check_tensor_parallel(args)
    if args.replicas is not None and args.tensor_parallel > 1:
        raise ValueError("--replicas and --tensor-parallel don't run together yet")
    if args.debug_hooks and not is_loopback(args.host):
        raise ValueError(
            f"--debug-hooks needs a loopback --host (127.0.0.1, ::1, localhost), not {args.host}"
        )
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.ctx_size is not None and args.ctx_size < 2:
        raise ValueError(f"--ctx-size must be at least 2, got {args.ctx_size}")
    if args.parallel < 1:
        raise ValueError(f"--parallel must be at least 1, got {args.parallel}")
    if not 0 <= args.shutdown_grace <= 3600:  # also refuses NaN
        raise ValueError(f"--shutdown-grace must be 0..3600 seconds, got {args.shutdown_grace}")
    for flag in ("stream_stall_timeout", "header_timeout", "idle_timeout"):
        if not 0 < getattr(args, flag) <= 86400:  # also refuses NaN
            raise ValueError(
                f"--{flag.replace('_', '-')} must be 0..86400 seconds, got {getattr(args, flag)}"
            )
    if args.cache_isolation == "key" and not args.api_key:
        raise ValueError("--cache-isolation key needs --api-key (one per client): every request is keyless")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError(f"--max-connections must be positive, got {args.max_connections}")
    if args.kv_tokens is not None and args.kv_tokens < 1:
        raise ValueError(f"--kv-tokens must be positive, got {args.kv_tokens}")
    if args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb must be positive, got {args.max_body_mb}")
    if args.cache_snapshots < 0 or args.cache_ram < 0 or args.cache_snapshot_interval < 0:
        raise ValueError("--cache-snapshots, --cache-ram and --cache-snapshot-interval must be >= 0")
    if args.spec_draft is not None and args.spec_draft < 0:
        raise ValueError(f"--spec-draft must be >= 0 (0 = off), got {args.spec_draft}")
    if args.spec_ngram_simple_size_n < 1:
        raise ValueError(f"--spec-ngram-simple-size-n must be >= 1, got {args.spec_ngram_simple_size_n}")
    if args.n_predict == 0 or args.n_predict < -1:
        raise ValueError(f"--n-predict must be -1 or a positive integer, got {args.n_predict}")
    defaults = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=None if args.seed == -1 else args.seed,
        max_tokens=None if args.n_predict == -1 else args.n_predict,
    )
    defaults.validate()
    _resolve_model(args)
    return defaults


def _server_settings(args: argparse.Namespace, defaults: "SamplingParams") -> "ServerSettings":
    """`bubo serve`'s flags, checked by `_checked_serve_flags`, as the server's settings."""
    from bubo.engine.prompt_cache import SnapshotPolicy
    from bubo.server.settings import ServerSettings

    return ServerSettings(
        model_path=_resolve_model(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key[0] if args.api_key else None,
        more_api_keys=tuple(args.api_key[1:]),
        cache_isolation=args.cache_isolation,
        cors_origins=tuple(args.cors_origin),
        shutdown_grace=args.shutdown_grace,
        stream_stall_timeout=args.stream_stall_timeout,
        header_timeout=args.header_timeout,
        idle_timeout=args.idle_timeout,
        max_connections=args.max_connections,
        served_model_name=args.served_model_name,
        ctx_size=args.ctx_size,
        debug_hooks=args.debug_hooks,
        max_body_mb=args.max_body_mb,
        dtype=DTYPES[args.dtype],
        cache_dtypes=_cache_dtypes(args),
        device=args.device,
        threads=args.threads,
        defaults=defaults,
        parallel=args.parallel,
        kv_tokens=args.kv_tokens,
        snapshots=SnapshotPolicy(
            max_snapshots=args.cache_snapshots,
            max_bytes=int(args.cache_ram * (1 << 20)),
            interval=args.cache_snapshot_interval,
        ),
        spec_type=args.spec_type,
        spec_draft=args.spec_draft,
        spec_ngram_size=args.spec_ngram_simple_size_n,
        mtp_weights=args.mtp_weights,
        mmproj=args.mmproj,
        allow_image_urls=args.allow_image_urls,
    )


def _check_tensor_parallel(args: argparse.Namespace) -> None:
    """What a split model does not run yet: batched slots and speculative decoding read hidden states
    outside the forward passes rank 0 broadcasts, and images go through no split tower."""
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")
    if args.tensor_parallel == 1:
        return
    refused = [
        flag
        for flag, used in (
            ("--parallel", args.parallel > 1),
            ("--spec-type", args.spec_type is not None),
            ("--spec-draft", bool(args.spec_draft)),
            ("--mtp-weights", args.mtp_weights is not None),
            ("--mmproj", args.mmproj is not None),
        )
        if used
    ]
    if refused:
        raise ValueError(f"--tensor-parallel does not run with {', '.join(refused)} yet")


def _cache_dtypes(args: argparse.Namespace) -> tuple[torch.dtype, torch.dtype]:
    return CACHE_TYPES[args.cache_type_k], CACHE_TYPES[args.cache_type_v]


def _inspect(args: argparse.Namespace) -> int:
    return print_listing(model_file(args.file), args.all_metadata)

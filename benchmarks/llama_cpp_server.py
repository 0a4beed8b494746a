"""llama.cpp as the benchmarks serve it: llama-cpp-python's `Llama.create_completion` (what its own server
calls) behind a minimal `/v1/completions` endpoint that runs every request on the process's main thread.

Why not `python -m llama_cpp.server`: it runs each request's model calls on a thread of anyio's pool, and
llama.cpp's CPU backend (built with OpenMP) decoded a hybrid model there ~8x slower from the second or
third request on (~65 against ~530 tok/s on a 2-core machine, with one worker thread too; an in-process
`Llama` on one thread stayed at ~530: benchmarks/RESULTS.md, 2026-12-07). Its speed then measures that
interplay, not llama.cpp. This server keeps llama.cpp's calls on one thread, as llama.cpp's own server
does, and adds less HTTP overhead than FastAPI: if anything it flatters the peer.

Takes the request fields the benchmarks send (prompt, max_tokens, temperature, logit_bias, stream) and
answers in the OpenAI completion shape, streamed as server-sent events when asked.

    python benchmarks/llama_cpp_server.py --model FILE --port 8080 --n_threads 2 --n_ctx 2048
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


def serve(llm: Any, port: int) -> None:
    """Answer the benchmarks' requests with `llm` (a `llama_cpp.Llama`) until killed."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # a streamed answer ends when the connection closes

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the benchmarks read the answers, not a log."""

        def _json(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/v1/models":
                self.send_error(404)
                return
            self._json({"object": "list", "data": [{"id": "llama.cpp", "object": "model"}]})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bias = {int(token): value for token, value in body.get("logit_bias", {}).items()}
            request = {
                "prompt": body["prompt"],
                "max_tokens": body.get("max_tokens", 16),
                "temperature": body.get("temperature", 1.0),
                "logit_bias": bias or None,
            }
            if not body.get("stream"):
                self._json(llm.create_completion(**request))  # type: ignore[arg-type]
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in llm.create_completion(**request, stream=True):  # type: ignore[arg-type]
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n_threads", type=int, default=2)
    parser.add_argument("--n_ctx", type=int, default=2048)
    args = parser.parse_args()
    import llama_cpp  # here: `--help` works without llama-cpp-python (CI installs no llama.cpp)

    llm = llama_cpp.Llama(args.model, n_threads=args.n_threads, n_ctx=args.n_ctx, verbose=False)
    serve(llm, args.port)


if __name__ == "__main__":
    main()

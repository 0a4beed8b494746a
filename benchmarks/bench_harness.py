"""Evaluation harnesses against `bubo serve`: lm-eval (a multiple-choice task scored by log likelihood,
and a generate-until task) and guidellm (concurrent streams), all on local data written here (no
download), so a harness run checks the server end to end as the harnesses use it.

lm-eval's `local-completions` model scores each choice with /v1/completions (echo, logprobs, max_tokens
1) and counts tokens with the server's own tokenizer (its `remote` tokenizer backend: /tokenizer_info,
/tokenize, /detokenize). guidellm sends the prompts of a local JSONL file as streamed completions.

The harnesses are benchmark-only tools, never runtime dependencies; they may live in another
environment than Bubo (`--harness-python`). A harness that is not installed there is reported
skipped:

    pip install 'lm-eval==0.4.13' 'guidellm==0.8.1'
    python benchmarks/bench_harness.py                     # default model, every item
    python benchmarks/bench_harness.py --limit 4 --requests 4 --harness-python /path/to/venv/bin/python
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from servers import free_port, wait_ready  # noqa: E402

HARNESSES = ("lm_eval", "guidellm")

# (country, capital), the items of both tasks; the wrong choices of a question are other capitals.
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Russia", "Moscow"),
    ("Egypt", "Cairo"),
    ("England", "London"),
    ("China", "Beijing"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
    ("Canada", "Ottawa"),
]

MULTIPLE_CHOICE_TASK = """task: bubo_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GENERATE_TASK = """task: bubo_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_target: "{{{{capital}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
"""


def write_tasks(folder: Path) -> list[str]:
    """The two lm-eval tasks and their JSONL data in `folder`; their names."""
    with (folder / "capitals_mc.jsonl").open("w") as out:
        for i, (country, capital) in enumerate(CAPITALS):
            others = [c for _, c in CAPITALS if c != capital]
            choices = [others[i % len(others)], others[(i + 5) % len(others)], others[(i + 9) % len(others)]]
            label = i % 4
            choices.insert(label, capital)
            out.write(json.dumps({"country": country, "choices": choices, "label": label}) + "\n")
    with (folder / "capitals_gen.jsonl").open("w") as out:
        for country, capital in CAPITALS:
            out.write(json.dumps({"country": country, "capital": capital}) + "\n")
    (folder / "capitals_mc.yaml").write_text(MULTIPLE_CHOICE_TASK.format(data=folder / "capitals_mc.jsonl"))
    (folder / "capitals_gen.yaml").write_text(GENERATE_TASK.format(data=folder / "capitals_gen.jsonl"))
    return ["bubo_capitals_mc", "bubo_capitals_gen"]


def write_prompts(path: Path, count: int) -> None:
    """guidellm's data: one prompt a line, each with its output length."""
    with path.open("w") as out:
        for i in range(count):
            country = CAPITALS[i % len(CAPITALS)][0]
            out.write(
                json.dumps({"prompt": f"Write two sentences about {country}.", "output_tokens_count": 32})
                + "\n"
            )


def has_module(python: str, module: str) -> bool:
    probe = subprocess.run(
        [python, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def start_server(model: Path | None, threads: int, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "bubo", "serve", "--port", str(port), "--threads", str(threads)]
    if model is not None:
        command += ["--model", str(model)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def run_lm_eval(python: str, url: str, folder: Path, limit: int | None) -> dict[str, Any]:
    """Both tasks through lm-eval's local-completions model; accuracy, exact match and the wall time."""
    tasks = write_tasks(folder)
    model_args = (
        f"model=bubo,base_url={url}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1,timeout=300"
    )
    command = [python, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args]
    command += [
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(folder),
        "--output_path",
        str(folder / "out"),
    ]
    if limit is not None:
        command += ["--limit", str(limit)]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"lm-eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    [results_file] = sorted((folder / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    return {
        "multiple_choice_acc": results["bubo_capitals_mc"]["acc,none"],
        "generate_exact_match": results["bubo_capitals_gen"]["exact_match,none"],
        "items_per_task": limit or len(CAPITALS),
        "seconds": round(seconds, 1),
    }


def run_guidellm(python: str, url: str, folder: Path, requests: int, streams: int) -> dict[str, Any]:
    """Streamed completions from `streams` concurrent clients; latency and throughput as guidellm
    measures them (its own summary of the one benchmark it runs)."""
    data = folder / "prompts.jsonl"
    write_prompts(data, requests)
    report = folder / "guidellm.json"
    command = [
        python,
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={url},model=bubo,request_format=/v1/completions",
        "--profile",
        f"kind=concurrent,streams={streams}",
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--data",
        f"kind=json_file,path={data}",
        "--output",
        f"kind=json,path={report}",
        "--disable-progress",
    ]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False, cwd=folder)
    if proc.returncode != 0 or not report.exists():
        raise RuntimeError(
            f"guidellm failed ({proc.returncode}):\n{proc.stderr[-3000:]}{proc.stdout[-2000:]}"
        )
    return summarize_guidellm(json.loads(report.read_text()))


def summarize_guidellm(report: dict[str, Any]) -> dict[str, Any]:
    """The medians of one guidellm benchmark's successful requests."""
    [benchmark] = report["benchmarks"]
    metrics = benchmark["metrics"]

    def median(name: str) -> float:
        return round(metrics[name]["successful"]["median"], 4)

    totals = metrics["request_totals"]
    return {
        "requests_ok": totals["successful"],
        "requests_failed": totals["errored"],
        "latency_s": median("request_latency"),
        "ttft_ms": median("time_to_first_token_ms"),
        "time_per_output_token_ms": median("time_per_output_token_ms"),
        "output_tokens": median("output_token_count"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="lm-eval items per task (default: all 16)")
    parser.add_argument("--requests", type=int, default=16, help="guidellm requests")
    parser.add_argument("--streams", type=int, default=2, help="guidellm's concurrent streams")
    parser.add_argument(
        "--harness-python", default=sys.executable, help="the Python that has lm_eval and guidellm"
    )
    parser.add_argument("--harnesses", default=",".join(HARNESSES), help="which to run (default: both)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    wanted = [name.strip() for name in args.harnesses.split(",") if name.strip()]
    if set(wanted) - set(HARNESSES):
        parser.error(f"--harnesses: choose from {', '.join(HARNESSES)}")
    harnesses = {name: name in wanted and has_module(args.harness_python, name) for name in HARNESSES}
    report: dict[str, Any] = {"model": str(args.model or "default"), "threads": args.threads}
    for name, present in harnesses.items():
        if name not in wanted:
            report[name] = {"skipped": "not asked for (--harnesses)"}
        elif not present:
            report[name] = {"skipped": f"{name} is not installed for {args.harness_python}"}
    if any(harnesses.values()):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory(prefix="bubo-harness-") as tmp:
            folder = Path(tmp)
            server = start_server(args.model, args.threads, port, folder / "serve.log")
            try:
                wait_ready(url + "/ready", server, args.ready_timeout)
                if harnesses["lm_eval"]:
                    report["lm_eval"] = run_lm_eval(args.harness_python, url, folder, args.limit)
                if harnesses["guidellm"]:
                    report["guidellm"] = run_guidellm(
                        args.harness_python, url, folder, args.requests, args.streams
                    )
            finally:
                server.terminate()
                server.wait(30)
    for name in HARNESSES:
        print(f"{name}: {json.dumps(report[name])}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`opswap serve SPEC` (an OpenAI-compatible server over the serving engine) and
`opswap bench-serve URL` (the load generator that measures one), chapter 29."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from opswap.cli import render
from opswap.cli.app import app, check_outputs
from opswap.cli.options import JsonOpt, SetOpt, Spec, WeightsOpt
from opswap.errors import OpswapError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_DTYPES = ("float32", "float16", "bfloat16")


def parse_bytes(text: str, option: str = "--kv-memory") -> int:
    """'2GiB', '512MiB', '1.5GB' or a number of bytes, as bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise OpswapError(
            f"{option} takes a size such as 2GiB, 512MiB or 1.5GB (or bytes), got {text!r}."
        )
    return int(float(m.group(1)) * _UNITS[unit])


def kv_block_bytes(config: Any, block_size: int, itemsize: int, tensor_parallel: int = 1) -> int:
    """Bytes of one KV block (keys and values of every layer) for a decoder config, on
    one rank of `tensor_parallel` (each holds its share of the KV heads)."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * layers * block_size * max(1, kv_heads // tensor_parallel) * head_dim * itemsize


def check_kv_budget(
    config: Any,
    kv_memory: int,
    block_size: int,
    itemsize: int,
    max_model_len: int,
    said: str,
    tensor_parallel: int = 1,
) -> None:
    """Refuse, naming the largest --max-model-len that fits, a --kv-memory (per rank) that
    cannot hold one sequence of max_model_len tokens."""
    block = kv_block_bytes(config, block_size, itemsize, tensor_parallel)
    blocks = kv_memory // block
    fits = blocks * block_size
    if fits < max_model_len:
        more = block * -(-max_model_len // block_size)
        raise OpswapError(
            f"--kv-memory {said} holds {blocks} KV blocks of {block_size} tokens for this "
            f"model, {fits} tokens, less than one sequence of --max-model-len {max_model_len}; "
            f"use --max-model-len {fits} or less, or --kv-memory of at least {more} bytes."
            if fits
            else f"--kv-memory {said} holds no KV block of {block_size} tokens for this model "
            f"({block} bytes each); give more."
        )


def find_tokenizer(spec: str, path: Path | None) -> Any:
    """The tokenizer of --tokenizer PATH, else of an hf:DIR checkpoint that has one, else
    None (hf:TYPE models are built from configs and have none)."""
    where = str(path) if path is not None else None
    if where is None and spec.startswith("hf:"):
        d = os.path.expanduser(spec[3:])
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if os.path.isdir(d) and any(os.path.exists(os.path.join(d, n)) for n in names):
            where = d
    if where is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as e:
        raise OpswapError(f"could not load a tokenizer from {where} ({e}).") from e


def build_engine(
    model: Any,
    max_model_len: int | None,
    kv_memory: str | None,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    device: str,
    dtype: str,
    tokenizer: Any = None,
    weights: str | None = None,
    tensor_parallel: int = 1,
) -> Any:
    import torch

    from opswap.llm import LLMEngine

    if dtype not in _DTYPES:
        raise OpswapError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    device = check_tensor_parallel(tensor_parallel, device)
    torch_dtype = getattr(torch, dtype)
    config = getattr(model, "config", None)
    if max_model_len is None and config is not None:
        max_model_len = int(getattr(config, "max_position_embeddings", 2048))
    kv = None
    if kv_memory is not None:
        kv = parse_bytes(kv_memory)
        if config is not None and max_model_len is not None:
            check_kv_budget(
                config, kv, block_size, torch_dtype.itemsize, max_model_len, kv_memory,
                tensor_parallel,
            )  # fmt: skip
    return LLMEngine(
        model,
        block_size=block_size,
        kv_memory=kv,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        device=device,
        dtype=torch_dtype,
        weights=weights,
        tensor_parallel=tensor_parallel,
    )


def check_tensor_parallel(n: int, device: str) -> str:
    """The device (auto resolved) after refusing a --tensor-parallel this host cannot run:
    below 1, or more ranks than visible GPUs on CUDA (on the CPU the ranks are processes)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OpswapError(f"--device {device} needs a GPU and torch sees none; use --device cpu.")
    if n < 1:
        raise OpswapError(f"--tensor-parallel must be at least 1, got {n}.")
    seen = torch.cuda.device_count() if device.startswith("cuda") else n
    if n > seen:
        raise OpswapError(
            f"--tensor-parallel {n} needs {n} GPUs of this host and torch sees {seen}; use "
            f"--tensor-parallel {seen} or less."
        )
    return device


def check_quantize(scheme: str | None) -> None:
    """Refuse, before the model loads, a --quantize that names no weight scheme."""
    from opswap.llm.quant import SCHEMES

    if scheme is not None and scheme not in SCHEMES:
        raise OpswapError(
            f"--quantize takes {', '.join(SCHEMES)} (the projections' weights), got {scheme!r}."
        )


@app.command()
def serve(
    spec: Spec,
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    max_model_len: Annotated[
        int | None,
        typer.Option(help="Most tokens of a sequence, prompt and output (default: the model's)."),
    ] = None,
    kv_memory: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Memory for the KV cache, e.g. 2GiB (default: room for --max-num-seqs "
            "sequences of --max-model-len).",
        ),
    ] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests in one batch.")] = 8,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Most tokens in one step.")] = 512,
    max_queue: Annotated[
        int, typer.Option(help="Requests queued beyond the batch before new ones get 429.")
    ] = 64,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16.")] = "float32",
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="A local tokenizer (default: an hf:DIR checkpoint's own; without one the "
            "server takes token-id prompts only).",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="The model's name in requests (default: the spec's).")
    ] = None,
    grace: Annotated[
        float, typer.Option(help="Seconds a shutdown waits for requests in flight.")
    ] = 5.0,
    sets: SetOpt = None,
    weights: WeightsOpt = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            metavar="SCHEME",
            help="Store the projections' weights as int8, int4 or fp8 (fp8: GPUs of compute "
            "capability 8.9+); the LM head stays in --dtype.",
        ),
    ] = None,
    tensor_parallel: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Split the model's heads and MLP over N GPUs of this host (rank r on cuda:r; "
            "N processes with gloo on the CPU); --kv-memory is then per GPU.",
        ),
    ] = 1,
) -> None:
    """Serve SPEC (a Llama, Mistral or Qwen2 decoder) over an OpenAI-compatible HTTP API:
    /v1/completions, /v1/chat/completions (streamed or not), /v1/models, /health and
    Prometheus /metrics. Ctrl-C finishes or aborts what is in flight, then stops."""
    from opswap.cli.commands import _load
    from opswap.llm.server import ServerThread, build_app

    if kv_memory is not None:  # the options' errors before the model loads
        parse_bytes(kv_memory)
    check_quantize(quantize)
    if dtype not in _DTYPES:
        raise OpswapError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    check_tensor_parallel(tensor_parallel, device)
    loaded = _load(spec, sets, weights)
    model = getattr(loaded.module, "model", loaded.module)
    tok = find_tokenizer(spec, tokenizer)
    engine = build_engine(
        model,
        max_model_len,
        kv_memory,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        device,
        dtype,
        weights=quantize,
        tensor_parallel=tensor_parallel,
    )
    served = name or loaded.name
    application = build_app(engine, tok, served, max_queue=max_queue, grace_s=grace)
    server = ServerThread(application, host, port, grace)
    split = f", {tensor_parallel} ranks" if tensor_parallel > 1 else ""
    render.line(
        f"serving {spec} as {served!r} at {server.url}/v1 (max_model_len "
        f"{engine.max_model_len}, {engine.num_blocks} KV blocks of {engine.block_size} "
        f"tokens, {'text and token-id' if tok is not None else 'token-id'} prompts"
        f"{'' if quantize is None else f', {quantize} weights'}{split}); "
        "Ctrl-C stops"
    )
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again
    # with the handler it found: make SIGTERM's, like SIGINT's, an exception caught here
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()  # the other ranks, when tensor-parallel
    render.line("stopped")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@app.command("bench-serve")
def bench_serve(
    url: Annotated[
        str, typer.Argument(metavar="URL", help="The server, e.g. http://127.0.0.1:8000.")
    ],
    dataset: Annotated[str, typer.Option(help="sharegpt or synthetic.")] = "sharegpt",
    num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 200,
    request_rate: Annotated[
        float, typer.Option(help="Requests per second, Poisson arrivals (inf: all at once).")
    ] = float("inf"),
    max_concurrency: Annotated[
        int | None, typer.Option(help="Most requests in flight at once (default: no limit).")
    ] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic).")] = 128,
    output_len: Annotated[int, typer.Option(help="Output tokens (synthetic).")] = 64,
    seed: Annotated[int, typer.Option(help="Seed of the sample and the arrivals.")] = 0,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="A local tokenizer to count ShareGPT tokens and send text (default: a BPE "
            "trained on the sample; its token ids are sent).",
        ),
    ] = None,
    json_path: JsonOpt = None,
) -> None:
    """Load URL's /v1/completions with a prompt set at a request rate or concurrency and
    print requests/s, output and total tokens/s, and the mean, median and p99 of time to
    first token, time per output token, inter-token latency and end-to-end latency."""
    import asyncio
    import json

    from opswap.llm import bench_serve as bs

    check_outputs(json_path)
    if dataset not in ("sharegpt", "synthetic"):
        raise OpswapError(f"--dataset must be sharegpt or synthetic, got {dataset!r}.")
    url = url.rstrip("/").removesuffix("/v1")
    card = asyncio.run(bs.server_card(url))
    max_len = int(card.get("max_model_len") or 2048)
    vocab = int(card.get("vocab_size") or 32000)
    if dataset == "synthetic":
        if input_len + output_len > max_len:
            raise OpswapError(
                f"--input-len {input_len} + --output-len {output_len} exceeds the server's "
                f"max_model_len {max_len}."
            )
        reqs = bs.synthetic_requests(num_prompts, input_len, output_len, vocab, seed)
    else:
        tok = None
        if tokenizer is not None:
            tok = find_tokenizer("", tokenizer)
        reqs, _ = bs.sharegpt_requests(num_prompts, seed, tok, max_len, vocab)
    render.line(
        f"sending {len(reqs)} {dataset} requests to {url} ({card.get('id')}) at "
        f"{request_rate:g} requests/s"
        + (f", at most {max_concurrency} at once" if max_concurrency else "")
    )
    results, seconds = asyncio.run(
        bs.run_benchmark(url, reqs, request_rate, max_concurrency, seed, card.get("id"))
    )
    figures = bs.summarize(results, seconds)
    render_figures(figures)
    if json_path is not None:
        out = {
            "url": url,
            "model": card.get("id"),
            "dataset": dataset,
            "num_prompts": num_prompts,
            "request_rate": request_rate if request_rate != float("inf") else "inf",
            "max_concurrency": max_concurrency,
            "seed": seed,
            **figures,
            "requests": bs.result_rows(results),
        }
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        render.line(f"wrote {json_path}")


def render_figures(f: dict[str, Any]) -> None:
    """The figures of a bench-serve run as a table."""
    from rich.table import Table

    from opswap.cli import consoles

    t = Table(title="serving benchmark", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    failed = ", ".join(f"{k}: {v}" for k, v in f["failed_by_status"].items())
    rows = [
        ("completed requests", f"{f['completed']}"),
        ("failed requests", f"{f['failed']}" + (f" ({failed})" if failed else "")),
        ("duration (s)", f"{f['duration_s']:.2f}"),
        ("input / output tokens", f"{f['total_input_tokens']} / {f['total_output_tokens']}"),
        ("requests/s", f"{f['request_throughput']:.2f}"),
        ("output tokens/s", f"{f['output_throughput']:.1f}"),
        ("total tokens/s", f"{f['total_token_throughput']:.1f}"),
    ]
    for key, label in (
        ("ttft_ms", "time to first token (ms)"),
        ("tpot_ms", "time per output token (ms)"),
        ("itl_ms", "inter-token latency (ms)"),
        ("e2e_latency_ms", "end-to-end latency (ms)"),
    ):
        s = f[key]
        rows.append((label, f"{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f}"))
    for name, value in rows:
        t.add_row(name, value)
    t.caption = "latencies: mean / median / p99"
    consoles.console.print(t)

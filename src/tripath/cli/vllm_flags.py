"""``vllm serve``'s options as ``tripath serve`` takes them: every option of this table parses (a vLLM command
line never stops at an unknown option), and does what vLLM's does, changes nothing (said so), or is refused
with a message naming what tripath does instead. docs/COMPATIBILITY.md shows the table
(``python -m tripath.cli.vllm_flags`` prints it; a test checks the page against it and every row against
the parser).
"""

from __future__ import annotations

from typing import NamedTuple


class VllmOption(NamedTuple):
    """One vLLM option: how it is written, what tripath does with it, a command line that passes it
    (``example``), and whether that command line is refused (``refused``: its message names the option)."""

    option: str
    tripath: str
    example: tuple[str, ...]
    refused: bool = False


SAME = "same"
VLLM_OPTIONS: tuple[VllmOption, ...] = (
    VllmOption("`MODEL`, `--model`", "same: a local directory, a Hugging Face hub id, or a tripath preset", ()),
    VllmOption("`--host`", "same; the default binds every interface, as vLLM's", ("--host", "0.0.0.0")),
    VllmOption("`--port`", SAME, ("--port", "8001")),
    VllmOption("`--served-model-name`", SAME, ("--served-model-name", "a", "b")),
    VllmOption("`--api-key`, `VLLM_API_KEY`", "same, on every path but `--public-paths` (`TRIPATH_API_KEY` too)",
               ("--api-key", "k")),
    VllmOption("`--chat-template`", SAME, ("--chat-template", "{{ messages[0]['content'] }}")),
    VllmOption("`--response-role`", SAME, ("--response-role", "assistant")),
    VllmOption("`--generation-config`", "same: `auto`, `vllm` or a folder", ("--generation-config", "vllm")),
    VllmOption("`--dtype`", "same: `auto`, `half`, `float16`, `bfloat16`, `float`, `float32`", ("--dtype", "float")),
    VllmOption("`--max-model-len`", "same, sizes too (`32k`, `32K`)", ("--max-model-len", "4k")),
    VllmOption("`--max-num-seqs`", SAME, ("--max-num-seqs", "64")),
    VllmOption("`--max-num-batched-tokens`", SAME, ("--max-num-batched-tokens", "4096")),
    VllmOption("`--gpu-memory-utilization`", SAME, ("--gpu-memory-utilization", "0.8")),
    VllmOption("`--kv-cache-dtype`", "`auto`, `fp8` / `fp8_e4m3`; `fp8_e5m2` refused",
               ("--kv-cache-dtype", "fp8_e4m3")),
    VllmOption("`--block-size`", SAME, ("--block-size", "16")),
    VllmOption("`--enable-prefix-caching`, `--no-enable-prefix-caching`", "same (on by default)",
               ("--no-enable-prefix-caching",)),
    VllmOption("`--enable-chunked-prefill`, `--no-enable-chunked-prefill`", "same (on by default)",
               ("--enable-chunked-prefill",)),
    VllmOption("`--enforce-eager`", SAME, ("--enforce-eager",)),
    VllmOption("`--seed`", SAME, ("--seed", "1")),
    VllmOption("`-tp`, `--tensor-parallel-size`", SAME, ("--tensor-parallel-size", "1")),
    VllmOption("`-pp`, `--pipeline-parallel-size`", "1 only; more is refused (tripath shards by tensor parallelism)",
               ("--pipeline-parallel-size", "2"), refused=True),
    VllmOption("`-dp`, `--data-parallel-size`", "1 only; more is refused (one server per replica)",
               ("--data-parallel-size", "2"), refused=True),
    VllmOption("`--distributed-executor-backend`", "`mp`, `uni`; `ray` refused",
               ("--distributed-executor-backend", "mp")),
    VllmOption("`--api-server-count`", SAME, ("--api-server-count", "1")),
    VllmOption("`--revision`", SAME, ("--revision", "main")),
    VllmOption("`--download-dir`", SAME, ("--download-dir", "/tmp/hf")),
    VllmOption("`--load-format`", "`auto`, `safetensors`; others refused", ("--load-format", "safetensors")),
    VllmOption("`--tokenizer`", SAME, ("--tokenizer", "tok")),
    VllmOption("`--tokenizer-mode`", "`auto`, `hf`; others refused", ("--tokenizer-mode", "auto")),
    VllmOption("`--trust-remote-code`", "accepted; changes nothing (tripath never runs a repository's code)",
               ("--trust-remote-code",)),
    VllmOption("`--swap-space`", "accepted; changes nothing (a preempted request is recomputed)",
               ("--swap-space", "4")),
    VllmOption("`-q`, `--quantization`", "refused (weights run as stored; an fp8 KV cache: `--kv-cache-dtype fp8`)",
               ("--quantization", "awq"), refused=True),
    VllmOption("`--enable-lora`, `--lora-modules`", "refused (merge the adapter into the weights)",
               ("--lora-modules", "a=/tmp/a"), refused=True),
    VllmOption("`--max-logprobs`", "same, at most 20", ("--max-logprobs", "5")),
    VllmOption("`--enable-tokenizer-info-endpoint`", "same: `GET /tokenizer_info`",
               ("--enable-tokenizer-info-endpoint",)),
    VllmOption("`--disable-fastapi-docs`", SAME, ("--disable-fastapi-docs",)),
    VllmOption("`--uvicorn-log-level`", SAME, ("--uvicorn-log-level", "warning")),
    VllmOption("`--disable-uvicorn-access-log`, `--disable-access-log-for-endpoints`",
               "same; `/health`, `/ping`, `/metrics` lines are DEBUG by default", ("--disable-uvicorn-access-log",)),
    VllmOption("`--enable-log-requests`, `--disable-log-requests`, `--max-log-len`",
               "same (off by default; `--disable-log-requests` is the old spelling of that)",
               ("--disable-log-requests",)),
    VllmOption("`--disable-log-stats`", "same: no periodic stats line", ("--disable-log-stats",)),
    VllmOption("`--enable-auto-tool-choice`, `--tool-call-parser`",
               "same, with the parsers `hermes`, `llama3_json`, `mistral`, `pythonic`",
               ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")),
)


def markdown_table() -> str:
    """The table of docs/COMPATIBILITY.md: each option and what ``tripath serve`` does with it."""
    lines = ["| `vllm serve` option | `tripath serve` |", "|---|---|"]
    lines += [f"| {o.option} | {o.tripath} |" for o in VLLM_OPTIONS]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())

"""Structured output in the engine (xgrammar): a constraint's masks on a tiny random Hugging Face Llama with a
real BPE tokenizer — whatever the weights, every output obeys it — through sequential, overlapped and chunked
steps beside unconstrained requests, whose tokens do not change; bad constraints are named."""

import json
import re

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

from tripath.engine import LLM, SamplingParams  # noqa: E402
from tripath.engine.requests.structured_output import StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "properties": {"word": {"enum": ["fox", "dog", "server"]}, "ok": {"type": "boolean"}},
          "required": ["word", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("async_scheduling,max_num_batched_tokens", [(False, 64), (True, 64), (True, 5)])
def test_constrained_outputs_obey_and_unconstrained_neighbours_do_not_change(tiny_hf_dir, async_scheduling,
                                                                             max_num_batched_tokens):
    llm = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=64, max_model_len=256, async_scheduling=async_scheduling,
              max_num_batched_tokens=max_num_batched_tokens)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello world", "The quick"], plain, use_tqdm=False)
    constraints = [StructuredOutput(json=SCHEMA), StructuredOutput(regex=r"[a-c]{3}-\d\d"),
                   StructuredOutput(choice=("fox", "lazy dog")), StructuredOutput(json_object=True),
                   StructuredOutput(grammar='root ::= "yes" | "no"')]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_output=c)
              for i, c in enumerate(constraints)]
    outs = llm.generate(["Hello world"] + ["A prompt"] * len(constraints) + ["The quick"], [plain] + params + [plain],
                        use_tqdm=False)
    assert outs[0].output_token_ids == alone[0].output_token_ids
    assert outs[-1].output_token_ids == alone[1].output_token_ids
    schema_out, regex_out, choice_out, object_out, grammar_out = [o.outputs[0].text for o in outs[1:-1]]
    value = json.loads(schema_out)
    assert set(value) == {"word", "ok"} and value["word"] in ("fox", "dog", "server") and isinstance(value["ok"], bool)
    assert re.fullmatch(r"[a-c]{3}-\d\d", regex_out) and choice_out in ("fox", "lazy dog")
    assert grammar_out in ("yes", "no")
    if outs[4].outputs[0].finish_reason.value == "stop":
        assert isinstance(json.loads(object_out), dict)


def test_bad_constraints_are_named(tiny_hf_dir):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput(choice=())
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json="{nope")
    with pytest.raises(TypeError, match="structured_output"):
        SamplingParams(structured_output={"regex": "a"})
    llm = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=16, max_model_len=128)
    with pytest.raises(ValueError, match="could not be compiled"):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutput(regex="(unclosed")), use_tqdm=False)
    assert not llm.has_unfinished_requests()
    preset = LLM("tiny-llama", backend="torch", num_kv_blocks=16)
    with pytest.raises(ValueError, match="tokenizer"):
        preset.generate([[1, 2]], SamplingParams(structured_output=StructuredOutput(regex="a")), use_tqdm=False)


def _compiler(tokenizer, **options):
    from tripath.engine.requests.structured_output import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], **options)


def _enum_schema(i: int, n: int = 40) -> StructuredOutput:
    words = [f"s{i}-{j}-value" for j in range(n)]
    return StructuredOutput(json={"type": "object", "properties": {"w": {"enum": words}}})


def test_the_grammar_cache_keeps_the_most_recently_used_within_its_bytes(tiny_hf_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_dir)
    one = _compiler(tokenizer).compile(_enum_schema(0)).memory_size_bytes
    compiler = _compiler(tokenizer, cache_bytes=int(3.5 * one))   # room for three
    specs = [_enum_schema(i) for i in range(5)]
    first = compiler.compile(specs[0])
    for spec in specs[1:3]:
        compiler.compile(spec)
    assert compiler.compile(specs[0]) is first            # a hit, now the most recently used
    compiler.compile(specs[3])                             # evicts specs[1], the least recently used
    assert len(compiler) == 3 and compiler.cached_bytes <= compiler.cache_bytes
    assert compiler.compile(specs[0]) is first
    assert compiler.compile(specs[1]) is not None and len(compiler) == 3   # compiled again, evicting specs[2]
    for i in range(5, 60):   # many distinct schemas: the cache never grows past its bytes
        compiler.compile(_enum_schema(i))
        assert compiler.cached_bytes <= compiler.cache_bytes and len(compiler) <= 3
    none_kept = _compiler(tokenizer, cache_bytes=0)
    none_kept.compile(specs[0])
    assert len(none_kept) == 0 and none_kept.cached_bytes == 0


def test_submitted_compiles_run_off_the_callers_thread_and_share_one_future(tiny_hf_dir):
    import threading

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_dir)
    compiler = _compiler(tokenizer)
    threads = []
    compile_ = compiler._compile
    compiler._compile = lambda spec: (threads.append(threading.current_thread().name), compile_(spec))[1]
    try:
        spec = _enum_schema(1, 400)
        futures = [compiler.submit(spec) for _ in range(3)]
        assert futures[0] is futures[1] is futures[2] or all(f.done() for f in futures)
        grammar = futures[0].result(timeout=60)
        assert threads and all(name.startswith("tripath-grammar") for name in threads)
        assert compiler.submit(spec).result() is grammar       # cached: done at once
        bad = compiler.submit(StructuredOutput(regex="(unclosed"))
        with pytest.raises(ValueError, match="could not be compiled"):
            bad.result(timeout=60)
        assert len(threads) == 2   # the shared and the bad one; the cached one compiled nothing
    finally:
        compiler.close()


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error(tiny_hf_dir):
    """min_tokens past where the grammar must end leaves no allowed token: the request ends with finish reason
    ``error`` and a message naming min_tokens, the rejected token not in its output; its neighbours run on."""
    from tripath.engine.requests.request import FinishReason

    llm = LLM(tiny_hf_dir, backend="torch", num_kv_blocks=64, max_model_len=256)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["The quick"], plain, use_tqdm=False)[0]
    bad = SamplingParams(max_tokens=20, temperature=0, min_tokens=12,
                         structured_output=StructuredOutput(regex="[0-9]{3}"))
    outs = llm.generate(["The quick", "A prompt"], [plain, bad], use_tqdm=False)
    assert outs[0].output_token_ids == alone.output_token_ids
    out = outs[1]
    assert out.finish_reason is FinishReason.ERROR and out.finished
    assert "min_tokens (12)" in out.outputs[0].error and "does not allow token" in out.outputs[0].error
    assert re.fullmatch(r"[0-9]{1,3}", out.outputs[0].text), out.outputs[0].text
    blocks = llm.block_manager
    assert not llm.has_unfinished_requests() and blocks.num_free_blocks == blocks.num_usable_blocks


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_schemas_are_held_to_one_nesting_limit_as_dicts_and_as_text():
    from tripath.engine.requests.structured_output import MAX_SCHEMA_DEPTH, constraint_size

    deepest = _nested(MAX_SCHEMA_DEPTH - 1)   # each level an object; the innermost one too
    for form in (deepest, json.dumps(deepest)):
        assert StructuredOutput(json=form).kind == "json"
    for form in (_nested(MAX_SCHEMA_DEPTH), json.dumps(_nested(MAX_SCHEMA_DEPTH)), '[' * 100_000 + ']' * 100_000):
        with pytest.raises(ValueError, match=f"structured_output.json is nested deeper than {MAX_SCHEMA_DEPTH}"):
            StructuredOutput(json=form)   # the text one past Python's recursion limit: a ValueError all the same
    cycle: dict = {"type": "object"}
    cycle["properties"] = {"self": cycle}
    with pytest.raises(ValueError, match="nested deeper"):
        StructuredOutput(json=cycle)
    shared: list = []
    for _ in range(30):   # 2**30 paths through 30 lists: walked without following them all
        shared = [shared, shared]
    with pytest.raises(ValueError, match="holds more than"):
        StructuredOutput(json={"enum": shared})
    # size: the constraint's text in UTF-8 bytes
    assert StructuredOutput(json={"type": "string"}).size == len('{"type":"string"}')
    assert StructuredOutput(json='{"type": "string"}').size == 18
    assert StructuredOutput(choice=("é", "ab")).size == 4 and StructuredOutput(regex="a+").size == 2
    assert StructuredOutput(json_object=True).size == 0 == constraint_size(True)

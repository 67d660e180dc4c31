"""Structured output in the engine (xgrammar): a constraint's masks on a tiny random Hugging Face Llama with a
real BPE tokenizer — whatever the weights, every output obeys it — through sequential, overlapped and chunked
steps beside unconstrained requests, whose tokens do not change; bad constraints are named."""

import json
import re

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

from tripath.engine import LLM, SamplingParams  # noqa: E402
from tripath.engine.structured_output import StructuredOutput  # noqa: E402

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


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_schemas_are_held_to_one_nesting_limit_as_dicts_and_as_text():
    from tripath.engine.structured_output import MAX_SCHEMA_DEPTH, constraint_size

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

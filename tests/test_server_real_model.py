"""``tripath serve`` on a real instruct model (SmolLM2-135M-Instruct, CPU, float32, the torch backend) as the
clients people point at a vLLM server use it: lm-eval's loglikelihood and generate_until requests, guidellm's
streamed requests with ``continuous_usage_stats``, and the ``openai`` client with logprobs, penalties,
``logit_bias`` and the model's chat template — each checked against Hugging Face transformers or the
in-process engine on the same model."""

import json

import httpx
import pytest
import torch

from server_process import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from tripath.engine import LLM, SamplingParams  # noqa: E402

NAME = "smollm2"
QUESTION = "Question: What is the capital of France?\nAnswer:"
OPTIONS = [" Paris", " London", " Berlin", " a banana"]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    server = ServerProcess(["--model", smollm2, "--served-model-name", NAME, "--backend", "torch",
                            "--num-kv-blocks", "128", "--max-model-len", "512"], log)
    yield server
    server.close()


@pytest.fixture(scope="module")
def hf(smollm2):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    return model, tokenizer


@pytest.fixture(scope="module")
def llm(smollm2):
    """The in-process engine on the same model, as the server runs it."""
    return LLM(smollm2, backend="torch", num_kv_blocks=32, max_model_len=512)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: transformers' log_softmax of the logits at every position (fp32)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_lm_eval_loglikelihood_requests_equal_transformers(server, hf):
    """lm-eval's ``local-completions`` loglikelihood request, verbatim: token-id prompts (context +
    continuation), ``max_tokens`` 1, ``logprobs`` 1, ``echo``; it reads ``token_logprobs[ctxlen:-1]`` and
    checks greediness against ``top_logprobs``. The multiple-choice answer it picks equals transformers'."""
    model, tokenizer = hf
    context = tokenizer.encode(QUESTION)
    prompts = [context + tokenizer.encode(option) for option in OPTIONS]
    body = {"model": NAME, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    scores = []
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        reference = hf_logprobs(model, ids)
        for p in range(1, len(ids)):
            assert lp["token_logprobs"][p] == pytest.approx(float(reference[p - 1, ids[p]]), abs=1e-3)
            assert len(lp["top_logprobs"][p]) in (1, 2)
            best = tokenizer.decode([int(reference[p - 1].argmax())])
            assert lp["top_logprobs"][p][best] == pytest.approx(float(reference[p - 1].max()), abs=1e-3)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert choice["text"].startswith(QUESTION)
        scores.append(sum(lp["token_logprobs"][len(context):-1]))
        reference_score = sum(float(reference[p - 1, ids[p]]) for p in range(len(context), len(ids)))
        assert scores[-1] == pytest.approx(reference_score, abs=5e-3)
    hf_scores = [sum(float(hf_logprobs(model, ids)[p - 1, ids[p]]) for p in range(len(context), len(ids)))
                 for ids in prompts]
    assert max(range(4), key=scores.__getitem__) == max(range(4), key=hf_scores.__getitem__)
    # max_tokens 0: the prompt scored, nothing generated
    body.update(max_tokens=0, prompt=prompts[0])
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    choice = r["choices"][0]
    assert choice["token_ids"] == [] and len(choice["logprobs"]["tokens"]) == len(prompts[0])
    assert r["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"


def test_lm_eval_generate_until_and_logprobs_of_generated_tokens(server, hf):
    model, tokenizer = hf
    c = client(server)
    out = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0,
                               stop=["\n\n"], seed=1234, logprobs=3)
    choice = out.choices[0]
    ids = tokenizer.encode("The capital of France is")
    generated = choice.model_extra["token_ids"]
    assert choice.text.startswith(" Paris") and "\n\n" not in choice.text
    reference = hf_logprobs(model, ids + generated)
    for j, token in enumerate(generated):
        row = reference[len(ids) - 1 + j]
        assert choice.logprobs.token_logprobs[j] == pytest.approx(float(row[token]), abs=1e-3)
        top = {tokenizer.decode([t]): float(row[t]) for t in row.topk(3).indices.tolist()}
        for text, value in top.items():
            assert choice.logprobs.top_logprobs[j][text] == pytest.approx(value, abs=1e-3)


def test_chat_template_applied_as_transformers_and_chat_logprobs(server, hf, llm):
    model, tokenizer = hf
    messages = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]
    out = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    expected = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected.output_token_ids
    assert choice.message.content == expected.outputs[0].text
    reference = hf_logprobs(model, ids + expected.output_token_ids)
    for j, (token, item) in enumerate(zip(expected.output_token_ids, choice.logprobs.content)):
        row = reference[len(ids) - 1 + j]
        assert item.token == tokenizer.decode([token])
        assert item.logprob == pytest.approx(float(row[token]), abs=1e-3)
        assert [t.token for t in item.top_logprobs] == [tokenizer.decode([t]) for t in row.topk(2).indices.tolist()]
        assert item.bytes == list(item.token.encode())


def test_penalties_and_logit_bias_through_the_openai_client(server, llm, hf):
    _, tokenizer = hf
    prompt = "List the colours of the rainbow: red, orange,"
    params = dict(max_tokens=10, temperature=0)
    extra = dict(repetition_penalty=1.3, min_tokens=4)
    out = client(server).completions.create(model=NAME, prompt=prompt, frequency_penalty=0.5,
                                            presence_penalty=0.4, extra_body=extra, **params)
    expected = llm.generate([prompt], SamplingParams(frequency_penalty=0.5, presence_penalty=0.4, **extra, **params),
                            use_tqdm=False)[0]
    plain = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert out.choices[0].model_extra["token_ids"] == expected.output_token_ids != plain.output_token_ids
    banned = plain.output_token_ids[0]
    biased = client(server).completions.create(model=NAME, prompt=prompt, logit_bias={str(banned): -100}, **params)
    assert banned not in biased.choices[0].model_extra["token_ids"]


def test_guidellm_request_shapes(server):
    """guidellm's streamed chat and completions requests with continuous usage stats."""
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}]}),
                        ("/v1/completions", {"prompt": "Once upon a time"})):
        body = {"model": NAME, "max_tokens": 6, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **body}
        with httpx.stream("POST", server.url + route, json=body, timeout=300) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(chunk["usage"] is not None for chunk in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"enum": ["Paris", "London", "Tokyo"]}, "student": {"type": "boolean"}},
    "required": ["name", "age", "city", "student"], "additionalProperties": False}


def test_json_schema_output_validates_for_20_seeded_samples(server):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    import asyncio

    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age, city, student."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def one(seed):
        return await c.chat.completions.create(model=NAME, messages=messages, max_tokens=80, temperature=1.0,
                                               seed=seed, response_format=response_format)

    async def all_of():
        return await asyncio.gather(*(one(seed) for seed in range(20)))

    outs = asyncio.run(all_of())
    texts = [o.choices[0].message.content for o in outs]
    for text, out in zip(texts, outs):
        assert out.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1   # sampled, not one answer
    choice = client(server).completions.create(model=NAME, prompt="The capital of France is", max_tokens=10,
                                               temperature=0.9, seed=3, extra_body={"guided_choice": [" Rome", " Oslo"]})
    assert choice.choices[0].text in (" Rome", " Oslo")
    regex = client(server).completions.create(model=NAME, prompt="Call me at", max_tokens=12, temperature=0.9,
                                              seed=3, extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    assert __import__("re").fullmatch(r" \d{3}-\d{4}", regex.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="more than one output constraint"):
        client(server).completions.create(model=NAME, prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(openai.BadRequestError, match="could not be compiled"):
        client(server).completions.create(model=NAME, prompt="x", extra_body={"guided_regex": "(unclosed"})

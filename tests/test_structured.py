"""Structured output without a server: constraints, token masks, the sampler's mask, tool-call rendering and
parsing, the reasoning split; and constrained generation through the engine on the embedded model."""

import functools
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from ernie_jax import LLM
from ernie_jax.assets import EMBEDDED_MODEL_DIR
from ernie_jax.engine.request import RequestError
from ernie_jax.sampling import SamplingParams, SamplingParamsError, sample
from ernie_jax.structured import reasoning, tools
from ernie_jax.structured.guide import Guides, bitmask
from ernie_jax.structured.spec import StructuredOutputError, StructuredOutputsParams as S
from ernie_jax.tokenizer import Tokenizer
from tests.conftest import EMBEDDED_ENGINE

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
                "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def guides():
    tok = Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    return Guides(tok, tok.vocab_size + 8)  # the model may have embedding rows past the tokenizer's pieces


def allowed(mask_row: np.ndarray, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(mask_row[t // 32]) >> (t % 32)) & 1]


def drive(guides, spec: S, text: str) -> bool:
    """Feed the tokens of text to a fresh guide, each checked against its mask first; whether the grammar
    then accepts (EOS allowed or stopped)."""
    g = guides.new(spec)
    for t in guides.tokenizer.encode(text):
        mask = bitmask([g], 1, guides.vocab_size)[0]
        assert t in allowed(mask, guides.vocab_size), (text, t)
        assert g.accept(t)
    eos = guides.tokenizer.eos_token_ids[0]
    return g.finished or eos in allowed(bitmask([g], 1, guides.vocab_size)[0], guides.vocab_size)


def test_a_constraint_is_exactly_one_of_its_kinds():
    with pytest.raises(StructuredOutputError, match="exactly one of.*got json, regex"):
        S(json={}, regex="a")
    with pytest.raises(StructuredOutputError, match="got none"):
        S()
    with pytest.raises(StructuredOutputError, match="guided_json: the JSON schema is not valid JSON"):
        S(json="{not json", field="guided_json")
    with pytest.raises(StructuredOutputError, match="choice must be a non-empty list"):
        S(choice=[])
    assert S(json='{"type": "integer"}').json == {"type": "integer"}
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_masks_follow_the_grammar_and_bad_constraints_name_the_field(guides):
    V = guides.vocab_size
    g = guides.new(S(choice=["yes", "no"]))
    first = allowed(bitmask([g], 1, V)[0], V)
    assert first and all(("yes".startswith(t) or "no".startswith(t)) for t in map(guides.tokenizer.decode,
                                                                               ([x] for x in first)))
    assert all(t < guides.tokenizer.vocab_size for t in first)  # rows past the pieces are never allowed
    mask = bitmask([None, g, None], 4, V)
    assert (mask[0] == -1).all() and (mask[2:] == -1).all() and bitmask([None, None], 2, V) is None
    assert drive(guides, S(json=SCHEMA), '{"name": "Ann", "age": 31, "address": {"city": "Rome"}}')
    assert drive(guides, S(regex=r"\d{3}-[a-z]+"), "123-abc")
    assert drive(guides, S(grammar='root ::= "A" ("B" | "C")'), "AC")  # GBNF, converted to Lark
    assert drive(guides, S(grammar='start: "x"+ "y"'), "xxy")
    count = sum(guides.compile_counts)
    guides.new(S(json=SCHEMA))
    assert sum(guides.compile_counts) == count  # cached by constraint
    for spec, match in ((S(regex="[a-", field="guided_regex"), "guided_regex: the regex constraint does not compile"),
                        (S(json={"type": "strng"}, field="response_format"), "response_format: .*strng"),
                        (S(json={"$ref": "http://example.com/s.json"}), "structured_outputs: .*example.com"),
                        (S(grammar="start: nothing_here", field="guided_grammar"), "guided_grammar: .*nothing_here")):
        with pytest.raises(StructuredOutputError, match=match) as e:
            guides.compile(spec)
        assert e.value.field == spec.field


def test_the_sampler_takes_only_allowed_tokens():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 70)).astype(np.float32))
    words = np.full((3, 3), -1, np.int32)
    words[0] = 0
    words[0, 1] = 1 << 5  # row 0 may take token 37 only
    words[1] = 0
    words[1, 2] = 0b11  # row 1: tokens 64 and 65
    f = lambda *xs: jnp.asarray(np.asarray(xs))  # noqa: E731
    for temperature in (0.0, 1.0):
        tokens, lps, *_ = sample(logits, f(temperature, temperature, temperature).astype(jnp.float32),
                                 f(1.0, 1.0, 1.0).astype(jnp.float32), f(0, 0, 0).astype(jnp.int32),
                                 f(1, 2, 3).astype(jnp.uint32), f(0, 0, 0).astype(jnp.int32), allowed=jnp.asarray(words))
        assert int(tokens[0]) == 37 and int(tokens[1]) in (64, 65)
        if temperature == 0:
            assert int(tokens[2]) == int(jnp.argmax(logits[2]))  # an all-ones row is unconstrained
        # logprobs are the model's own, before the mask
        assert np.allclose(lps[0], np.asarray(logits[0] - jnp.log(jnp.sum(jnp.exp(logits[0]))))[37], atol=1e-5)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                            "unit": {"enum": ["c", "f"]}},
                           "required": ["city", "unit"]}}},
           {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_tool_calls_render_constrain_and_parse(guides):
    ts = tools.parse_tools(WEATHER)
    assert tools.resolve_choice(ts, None) == "auto" and tools.resolve_choice([], None) is None
    assert tools.resolve_choice(ts, "none") is None
    named = tools.resolve_choice(ts, {"type": "function", "function": {"name": "get_weather"}})
    assert named.name == "get_weather"
    with pytest.raises(StructuredOutputError, match="'get_wether' is not among the request's tools") as e:
        tools.resolve_choice(ts, {"type": "function", "function": {"name": "get_wether"}})
    assert e.value.field == "tool_choice"
    with pytest.raises(StructuredOutputError, match=r"tools\[0\].function.name"):
        tools.parse_tools([{"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(StructuredOutputError, match="given twice"):
        tools.parse_tools(WEATHER + WEATHER[:1])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert drive(guides, tools.constraint(ts, named, parallel=True), call)  # a named function: one call
    assert drive(guides, tools.constraint(ts, "required", parallel=True), call + "\n" + call.replace("Oslo", "Rome"))
    content, calls = tools.parse("Let me check.\n" + call)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}
    assert tools.parse("no calls here") == ("no calls here", [])
    assert tools.parse("<tool_call>\nnot json\n</tool_call>")[1] == []  # left as text, not dropped
    # streamed: the same content and calls, whatever the split of the deltas
    text = "Let me check.\n" + call + "\n" + call.replace("Oslo", "Rome")
    for step in (1, 3, 7, 50):
        parser, content, streamed = tools.StreamParser(), "", []
        for i in range(0, len(text), step):
            c, got = parser.feed(text[i:i + step])
            content, streamed = content + c, streamed + got
        c, got = parser.feed("", final=True)
        content, streamed = content + c, streamed + got
        assert content == "Let me check." and [s["index"] for s in streamed] == [0, 1]
        assert [s["function"] for s in streamed] == [c["function"] for c in tools.parse(text)[1]]
    # the conversation: tools in a system turn, calls and results as text
    rendered = tools.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]},
                             {"role": "tool", "content": "-3 C"}], ts)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n") and '"name": "get_time"' in rendered[0]["content"]
    assert rendered[2]["content"] == call and rendered[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"


def test_reasoning_is_split_from_the_answer():
    text = "<think>First, 2 + 2.</think>\n\nIt is 4."
    assert reasoning.split(text) == ("First, 2 + 2.", "It is 4.")
    assert reasoning.split("still thinking") == ("still thinking", None)
    for step in (1, 2, 5, 100):
        s, think, answer = reasoning.StreamSplitter(), "", ""
        for i in range(0, len(text), step):
            a, b = s.feed(text[i:i + step])
            think, answer = think + a, answer + b
        a, b = s.feed("", final=True)
        assert (think + a, answer + b) == ("First, 2 + 2.", "It is 4.")


# ---- through the engine, on the embedded model ------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def embedded(k: int = 0, **settings) -> LLM:
    """The embedded model at the shared engine shape (its programs come from the XLA cache of the files
    before this one in its worker group); k: MTP drafts."""
    return LLM(EMBEDDED_MODEL_DIR, **{**EMBEDDED_ENGINE, **settings},
               speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)


def ask(llm, question: str, spec: S | None, n: int = 1, temperature: float = 0.0, max_tokens: int = 80, seed=None):
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=seed, structured_outputs=spec)
    return [c.text for c in llm.chat([{"role": "user", "content": question}], sp)[0].outputs]


def check_replies(llm):
    for text in ask(llm, "Describe a person as JSON.", S(json=SCHEMA)) + \
            ask(llm, "Describe a person as JSON.", S(json=SCHEMA), n=2, temperature=1.0, seed=3):
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = llm.chat([{"role": "user", "content": "Any JSON object."}],
                   SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(json_object=True)))[0].outputs[0]
    # a free-form object may run to max_tokens inside a string (a small model rambles); it parses when it ends
    assert isinstance(json.loads(obj.text), dict) if obj.finish_reason == "stop" else obj.text.startswith("{")
    assert ask(llm, "Yes or no?", S(choice=["yes", "no", "maybe so"]), n=2, temperature=1.0, seed=1)[0] in \
        ("yes", "no", "maybe so")
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", ask(llm, "A code:", S(regex=r"[A-Z]{2}-\d{3}"))[0])


def test_constrained_replies_validate_and_bad_constraints_are_refused():
    llm = embedded()
    check_replies(llm)
    with pytest.raises(RequestError, match="guided_regex: the regex constraint does not compile") as e:
        llm.generate("x", SamplingParams(structured_outputs=S(regex="(", field="guided_regex")))
    assert e.value.param == "guided_regex"
    assert ask(llm, "Yes or no?", None, max_tokens=4)  # the engine serves on


def test_constrained_rows_decode_without_drafts_beside_speculating_ones():
    """Under MTP (k = 2) a constrained request takes one token a step (its mask needs every token before it);
    unconstrained requests in the same batches keep accepting drafts and their greedy tokens."""
    llm = embedded(2)
    before = llm.engine.spec_stats.report()["num_accepted_tokens"]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea."}])]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=prompts, sampling_params=sp)[0].outputs[0].token_ids
    both = llm.generate(prompt_token_ids=prompts * 2, sampling_params=[
        sp, SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=SCHEMA))])
    assert both[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(both[1].outputs[0].text), SCHEMA)
    assert llm.engine.spec_stats.report()["num_accepted_tokens"] > before


def test_constrained_replies_survive_preemption():
    """A pool too small for two guided requests at once: one is preempted and recomputed; its matcher keeps
    its state (the tokens already out stay), and both replies validate."""
    llm = embedded(num_gpu_blocks_override=9)
    sp = SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=SCHEMA))
    outs = llm.chat([[{"role": "user", "content": q}] for q in ("Describe a person as JSON.", "Another one?")], sp)
    assert llm.engine.stats().counters["num_preemptions"] > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_chat_answers_carry_reasoning_and_tool_calls_streamed_and_not():
    """The server's chat format with --reasoning-parser ernie45 and tools: the finished message and the
    streamed deltas carry the same reasoning_content, content and tool_calls (ids aside)."""
    import types

    from ernie_jax.engine.outputs import CompletionOutput, RequestOutput
    from ernie_jax.serve.api import _ChatFormat
    from ernie_jax.serve.protocol import ChatCompletionRequest

    text = ('<think>The user wants Oslo.</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "c"}}\n</tool_call>')
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Oslo?"}], tools=WEATHER)
    server = types.SimpleNamespace(reasoning_parser="ernie45", model_name="m")
    out = lambda t, done: RequestOutput("r", None, [1], [CompletionOutput(0, t, [], "stop" if done else None)],  # noqa: E731
                                        done)
    message, finish = _ChatFormat(server, body)._message(text, "stop")
    assert (message["reasoning_content"], message["content"], finish) == ("The user wants Oslo.", "Checking.", "tool_calls")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    fmt, deltas = _ChatFormat(server, body), []
    for i in range(0, len(text), 4):
        deltas += fmt.chunks(0, out(text[:i + 4], i + 4 >= len(text)), text[i:i + 4], [], i == 0)
    joined = {k: "".join(d["delta"].get(k) or "" for d in deltas) for k in ("reasoning_content", "content")}
    assert joined == {"reasoning_content": "The user wants Oslo.", "content": "Checking."}
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_server_flags_turn_structured_output_off_and_the_reasoning_parser_on():
    """--guided-decoding-backend off refuses constraints with a 400 naming the flag; --reasoning-parser ernie45
    answers with reasoning_content (a reply with no </think> is all reasoning, as vLLM reads it)."""
    import asyncio

    import httpx

    from ernie_jax.engine.async_engine import AsyncEngine
    from ernie_jax.serve.api import Server, create_app
    from ernie_jax.serve.metrics import ServerMetrics

    llm = embedded()
    metrics = ServerMetrics(llm.engine.stats, "m")
    engine = AsyncEngine(llm.engine, on_finish=metrics.on_finish)
    app = create_app(Server(engine, llm.tokenizer, "m", {}, metrics, structured_output=False,
                            reasoning_parser="ernie45"))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            refused = await c.post("/v1/chat/completions", json={**body, "guided_regex": "a+"})
            ok = await c.post("/v1/chat/completions", json=body)
            return refused, ok
    try:
        refused, ok = asyncio.run(run())
    finally:
        engine.shutdown()
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "guided_regex"
    assert "--guided-decoding-backend off" in refused.json()["error"]["message"]
    message = ok.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is None

"""Tools and structured answers on `graft serve`, with the real `openai` client and Qwen2.5-Coder-0.5B (its chat
template knows tools): calls come back as tool_calls, streamed as OpenAI streams them, arguments valid under the
function's schema; bad schemas and tool choices are 400s; a template that knows no tools is refused."""

from __future__ import annotations

import json

import pytest

from graft_cli.core import GraftError
from graft_cli.server.tools import HeldText, Tools, call_deltas, parse_calls
from tests.test_server import start, stop

openai = pytest.importorskip("openai")
QWEN = "qwen2.5-coder-0.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
EMAIL = {"type": "function", "function": {
    "name": "send_email", "description": "Send an email",
    "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
                   "required": ["to", "body"]}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]


def test_calls_are_parsed_from_tags_or_bare_json():
    tagged = parse_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tagged] == [("f", {"a": 1})]
    assert parse_calls('{"name": "g", "parameters": {}}')[0]["function"]["name"] == "g"
    assert parse_calls("It is sunny.") == [] and parse_calls("<tool_call>\n{oops\n</tool_call>") == []
    deltas = call_deltas(tagged)
    assert deltas[0][0]["function"] == {"name": "f", "arguments": ""} and deltas[1][0]["function"]["arguments"]


def test_a_stream_holds_back_what_may_be_a_call():
    held = HeldText(Tools((WEATHER["function"],), "auto"))
    assert held.feed("<tool") == "" and held.feed("_call>\n{") == ""
    plain = HeldText(Tools((WEATHER["function"],), "auto"))
    assert plain.feed("  ") == "" and plain.feed("Sunny") == "  Sunny" and plain.feed("!") == "!"


def test_a_template_that_knows_no_tools_is_refused():
    from transformers import AutoTokenizer

    from graft_cli.catalog.resolve import resolve_model
    from graft_cli.runtime.loading import encode

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    with pytest.raises(GraftError, match="knows no tools"):
        encode(tokenizer, ASK, tools=[WEATHER])


@pytest.fixture(scope="module")
def client():
    proc, url = start("--model", QWEN)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    assert stop(proc) == 0


def create(client, **kwargs):
    settings = {"messages": ASK, "temperature": 0, "max_tokens": 60} | kwargs
    return client.chat.completions.create(model=QWEN, **settings)


@pytest.mark.real_model
def test_required_and_named_tool_choices_call_with_valid_arguments(client):
    for choice in ("required", {"type": "function", "function": {"name": "send_email"}}):
        answer = create(client, tools=[WEATHER, EMAIL], tool_choice=choice).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        (call,) = answer.message.tool_calls
        arguments = json.loads(call.function.arguments)
        if choice == "required":
            assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
            assert arguments["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "send_email" and set(arguments) >= {"to", "body"}
    streamed = create(client, tools=[WEATHER, EMAIL], tool_choice="required", stream=True)
    chunks = list(streamed)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments_of(client)


def arguments_of(client) -> dict:
    call = create(client, tools=[WEATHER, EMAIL], tool_choice="required").choices[0].message.tool_calls[0]
    return json.loads(call.function.arguments)


@pytest.mark.real_model
def test_response_formats_and_a_cut_answer(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    answer = create(client, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert set(json.loads(answer.choices[0].message.content)) == {"city", "country"}
    assert isinstance(json.loads(create(client, response_format={"type": "json_object"}).choices[0].message.content),
                      dict)
    cut = create(client, max_tokens=6, tools=[WEATHER], tool_choice="required").choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls


@pytest.mark.real_model
def test_parallel_calls_and_a_response_format_beside_tools(client):
    both = [{"role": "user", "content": "What is the weather in Oslo and in Paris, in celsius?"}]
    answer = create(client, messages=both, tools=[WEATHER], tool_choice="required", max_tokens=80).choices[0]
    assert answer.finish_reason == "tool_calls"
    cities = [json.loads(call.function.arguments)["city"] for call in answer.message.tool_calls]
    assert cities and set(cities) <= {"Oslo", "Paris"}  # the 0.5B model calls once; the grammar takes more
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = create(client, messages=[{"role": "user", "content": "Name the capital of Norway, as JSON."}],
                  tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"schema": city}}).choices[0]
    assert text.message.tool_calls or "city" in json.loads(text.message.content)


@pytest.mark.real_model
def test_bad_tools_and_schemas_are_400s_and_the_server_goes_on(client):
    for kwargs, param in [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}),
         "response_format"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function"}]), "tools[0]"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            create(client, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param
    assert create(client, max_tokens=4).choices[0].message.content


def test_several_calls_or_the_response_format_are_what_the_grammar_takes():
    from transformers import AutoTokenizer

    from graft_cli.catalog.resolve import resolve_model
    from graft_cli.grammar import GrammarTokenizer
    from graft_cli.server.tools import structure

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(QWEN))
    grammars = GrammarTokenizer(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    answer = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": ["city"], "properties":
                                                                {"city": {"type": "string"}}}}}

    def takes(body: dict, text: str) -> bool:
        matcher = grammars.matcher(structure(body)[1])
        tokens = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

    required = {"tools": [WEATHER], "tool_choice": "required"}
    assert takes(required, one) and takes(required, f"{one}\n{one}\n") and not takes(required, '{"city": "Oslo"}')
    assert not takes({**required, "parallel_tool_calls": False}, f"{one}\n{one}")
    auto = {"tools": [WEATHER], "response_format": answer}
    assert takes(auto, one) and takes(auto, '{"city": "Oslo"}') and not takes(auto, "Sunny")
    assert structure({"tools": [WEATHER]})[1] is None  # auto without a format: free, parsed afterwards
    two = parse_calls(f"{one}\n{one}\n")
    assert [c["function"]["name"] for c in two] == ["get_weather"] * 2
    assert [delta[0]["index"] for delta in call_deltas(two)] == [0, 0, 1, 1]  # streamed as OpenAI streams them

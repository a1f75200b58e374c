"""The agents-tools workload's requests (benchmarks/agent_tools.py), built without a model: the policy gives its
tool list over to the request's tools, call turns carry their function's grammar, the history grows as an agent
framework grows it, and a template without tools gets them in the system prompt."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks import agent_tools
from benchmarks.agent_tools import FUNCTIONS, episodes, policy_without_tool_list, renders_tools, tools_in_text
from graft_cli.server.tools import Tools


def test_the_policy_keeps_its_rules_but_not_its_tool_list():
    policy = policy_without_tool_list()
    assert "## 8. Tools" in policy and "Call one tool at a time" in policy and "Answer in the customer's" in policy
    assert "`get_booking(" not in policy and '"standard" or "sport"' not in policy
    listed = agent_tools.POLICY.read_text().count("\n- `")
    assert listed == len(FUNCTIONS)  # every tool the text listed is a function of the request's tools


def test_every_tool_is_a_schema_its_call_grammar_accepts():
    names = {f["name"] for f in FUNCTIONS}
    scripted = {step["call"] for script in json.loads(agent_tools.EPISODES.read_text()) for step in script
                if "call" in step}
    assert scripted <= names
    assert all(Tools(FUNCTIONS, name, tagged, parallel=False).grammar() is not None for name in names
               for tagged in (False, True))
    report = next(f for f in FUNCTIONS if f["name"] == "report_baggage")
    assert report["parameters"]["required"] == ["code", "passenger", "tag_number", "description"]
    text = tools_in_text(FUNCTIONS)
    assert text.count('{"type": "function"') == len(FUNCTIONS) and '"arguments"' in text


def walk(native: bool) -> list:
    """Every turn of the first episode, answered by a stand-in agent: (turn, the history it was sent)."""
    episode, seen = episodes(native, 1)[0], []
    while (turn := episode.next_turn()) is not None:
        seen.append(turn)
        call = json.dumps({"name": turn.call, "arguments": {"code": "QX7K2P"}})
        episode.answered((f"<tool_call>\n{call}\n</tool_call>" if native else call) if turn.call else "Done.")
    return seen


def test_turns_are_calls_under_their_grammar_and_replies_in_free_text():
    turns = walk(native=False)
    assert [t.call for t in turns] == ["get_booking", "search_flights", None, "quote_change", None, "change_flight",
                                       None]
    assert all((t.grammar is None) == (t.call is None) for t in turns) and all(t.tools is None for t in turns)
    assert "# Tools" in turns[0].messages[0]["content"]
    last = turns[-1].messages
    assert [m["role"] for m in last[1:5]] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(last[3]["content"])["code"] == "QX7K2P"  # the booking system's answer, as written
    assert all(len(a.messages) < len(b.messages) for a, b in zip(turns, turns[1:]))  # each resends the history


def test_a_template_with_tools_gets_them_and_the_calls_as_tool_calls():
    turns = walk(native=True)
    assert all(t.tools is not None and len(t.tools) == len(FUNCTIONS) for t in turns)
    assert "# Tools" not in turns[0].messages[0]["content"]
    call = turns[-1].messages[2]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "get_booking"
    assert turns[-1].messages[3]["tool_call_id"] == call["tool_calls"][0]["id"]
    assert renders_tools(SimpleNamespace(chat_template="{% if tools %}...{% endif %}"))
    assert not renders_tools(SimpleNamespace(chat_template="{{ message['content'] }}"))


def test_the_runs_are_compared_end_to_end_over_the_hits_and_in_decoding():
    from benchmarks.prefix_cache import compared  # here: it imports torch, which the tests above do not need

    def request(wall: float, ttft: float, new: int = 10) -> dict:
        return dict(ids=[1] * new, new=new, wall=wall, ttft=ttft, cached=0, prompt=100, steps=new // 2, gained=new)

    cold, hit = 4.0, 0.1  # the first request misses in every run; a cached run's later ones hit
    done = {"ar": [request(cold + 1.0, cold)] * 3,
            "ar + prefix cache": [request(cold + 1.0, cold)] + [request(1.1, hit)] * 2,
            "graft": [request(cold + 0.5, cold)] * 3,
            "graft + prefix + response caches": [request(cold + 0.5, cold)] + [request(0.6, hit)] * 2}
    runs = {label: ("ar" if label.startswith("ar") else "graft", "cache" in label, "response" in label)
            for label in done}
    generators = {label: SimpleNamespace(close=lambda: None) for label in done}
    out = compared(runs, generators, done)
    assert out["ar"]["decode_tokens_per_s"] == 9.0 and out["graft"]["decode_tokens_per_s"] == 18.0
    assert out["graft + caches vs ar + prefix cache, hits"] == round(1.1 / 0.6, 2)
    assert out["graft + caches vs ar + prefix cache"] == round((5.0 + 2.2) / (4.5 + 1.2), 2)
    assert out["ar + prefix cache"]["ttft_miss_s"] == cold and out["ar + prefix cache"]["ttft_hit_s"] == hit
    assert out["graft"]["tau"] == 2.0 and out["identical"]

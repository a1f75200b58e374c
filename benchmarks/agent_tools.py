"""The agents workload as an agent framework sends it: the airline policy (benchmarks/agent_policy.md) with its
tools as the request's ``tools`` (JSON schemas), and multi-turn episodes whose turns are tool calls and replies
that quote the tools' results, every request resending the growing history (tau-bench's airline domain is the
model: a customer, a policy, tools over a booking system).

Each episode is a script: the customer's messages, which tool the agent calls at each step (its arguments are
the model's own, written under the call's grammar) and what the tool answers (written here, as a booking
system would). A call turn names its function (``tool_choice`` of one function, as a framework that routes its
plan step by step sends it); a reply turn sends the same tools with ``tool_choice: "auto"`` and no grammar, and
the model writes text.

A chat template that renders tools (Qwen2.5's) gets them as ``tools`` and writes calls in Hermes' tags; one that
does not (SmolLM2's: graft refuses ``tools`` for it) gets the same schemas written into the system prompt, the
way frameworks prompt a model without native tool calling, and answers a call with one bare JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graft_cli.grammar import Grammar
from graft_cli.server.tools import Tools, parse_calls, template_message

POLICY = Path(__file__).with_name("agent_policy.md")
EPISODES = Path(__file__).with_name("agent_episodes.json")
LISTED = "- `"  # how the policy's text lists a tool: those lines give way to the request's tools


def tool(name: str, summary: str, /, **params: Any) -> dict:
    """One OpenAI function: ``params`` maps an argument to its JSON type, or to a list of the values it takes."""
    properties = {key: {"type": "string", "enum": kind} if isinstance(kind, list) else {"type": kind}
                  for key, kind in params.items()}
    return {"name": name, "description": summary,
            "parameters": {"type": "object", "properties": properties, "required": list(params),
                           "additionalProperties": False}}


FUNCTIONS = (
    tool("get_booking", "The booking's passengers, flights, fare, bags, seats and payments.",
         code="string", last_name="string"),
    tool("search_flights", "Flights with seats left and their fares on that date.", origin="string",
         destination="string", date="string", cabin=["economy", "business"]),
    tool("quote_change", "The fee and the fare difference of a change of flight.", code="string",
         flight_number="string", new_flight_number="string"),
    tool("change_flight", "Makes the change, once the customer accepted its total.", code="string",
         flight_number="string", new_flight_number="string", accepted_total="number"),
    tool("cancel_booking", "Cancels every unused flight and says what is refunded.", code="string", reason="string"),
    tool("add_baggage", "Adds a checked bag.", code="string", passenger="string", flight_number="string",
         kind=["standard", "sport"], weight_kg="integer"),
    tool("add_pet", "Adds a pet, in the cabin or in the hold.", code="string", passenger="string",
         flight_number="string", species="string", weight_kg="number", cabin="boolean"),
    tool("assign_seat", "Assigns a seat.", code="string", passenger="string", flight_number="string", seat="string"),
    tool("request_assistance", "Books special assistance.", code="string", passenger="string", kind="string",
         notes="string"),
    tool("get_flight_status", "Times, delay and its reason.", flight_number="string", date="string"),
    tool("open_claim", "Opens a claim; returns its reference.", code="string", passenger="string",
         flight_number="string", kind="string", details="string"),
    tool("report_baggage", "Opens a baggage file; returns its reference.", code="string", passenger="string",
         tag_number="string", description="string"),
    tool("payment_link", "A link the customer pays through.", code="string", amount="number", purpose="string"),
    tool("transfer_to_human", "Hands the conversation over, with a summary of it.", summary="string",
         reason="string"),
)


def policy_without_tool_list() -> str:
    """The policy with the tool list of its section 8 left out (the request's ``tools`` carry it); the section's
    rules stay."""
    lines, out, listing = POLICY.read_text().splitlines(), [], False
    for line in lines:
        if line.startswith(LISTED):
            listing = True
        elif listing and not line.startswith("  "):
            listing = False
        if not listing:
            out.append(line)
    return "\n".join(out) + "\n"


def tools_in_text(functions: tuple[dict, ...]) -> str:
    """The tools written into a system prompt for a template that renders none: their schemas, one JSON object a
    line, and how to call one."""
    schemas = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return ("\n# Tools\n\nYou may call these functions. Their signatures, as JSON schemas:\n" + schemas
            + '\n\nTo call one, answer with one JSON object and nothing else: {"name": <function name>, '
            '"arguments": <its arguments as an object>}.\n')


@dataclass
class Turn:
    """One request of an episode: the messages so far, the tools as sent, and the grammar of a call turn."""

    messages: list[dict]
    tools: list[dict] | None
    grammar: Grammar | None
    call: str | None  # the function a call turn names


@dataclass
class Episode:
    """One conversation: its script, the history sent so far, and whether the template renders tools."""

    script: list[dict]
    native: bool  # the chat template renders ``tools``: they go as ``tools``, calls in Hermes' tags
    messages: list[dict] = field(default_factory=list)
    at: int = 0

    def __post_init__(self) -> None:
        system = policy_without_tool_list()
        if not self.native:
            system += tools_in_text(FUNCTIONS)
        self.messages = [{"role": "system", "content": system}]

    def next_turn(self) -> Turn | None:
        """The next request (the customer's messages before it joined the history), or None at the end."""
        while self.at < len(self.script) and "user" in self.script[self.at]:
            self.messages.append({"role": "user", "content": self.script[self.at]["user"]})
            self.at += 1
        if self.at >= len(self.script):
            return None
        name = self.script[self.at].get("call")
        grammar = None if name is None else Tools(FUNCTIONS, name, self.native, parallel=False).grammar()
        tools = [{"type": "function", "function": f} for f in FUNCTIONS] if self.native else None
        return Turn(list(self.messages), tools, grammar, name)

    def answered(self, text: str) -> None:
        """The agent's answer joins the history, and a call's result after it (as the framework would add it)."""
        step = self.script[self.at]
        self.at += 1
        calls = parse_calls(text) if "call" in step else []
        if calls and self.native:
            self.messages.append(template_message({"role": "assistant", "content": "", "tool_calls": calls}))
        else:
            self.messages.append({"role": "assistant", "content": text})
        if "call" in step:
            self.messages.append({"role": "tool", "content": json.dumps(step["result"]),
                                  **({"tool_call_id": calls[0]["id"]} if calls else {})})


def episodes(native: bool, count: int) -> list[Episode]:
    """The first ``count`` scripted episodes (benchmarks/agent_episodes.json), fresh."""
    scripts = json.loads(EPISODES.read_text())
    return [Episode(script, native) for script in scripts[:count]]


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders ``tools`` (graft refuses them for one that does not)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")

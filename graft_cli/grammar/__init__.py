"""Structured output: a JSON schema, any JSON or a regular expression compiled by llguidance, applied to every
node of a verified tree along its own path, with the tokens it forces drafted for free (docs/structured.md)."""

from graft_cli.grammar.constraint import FORCED, GrammarConstraint
from graft_cli.grammar.copied import COPIED, CopiedValues
from graft_cli.grammar.spec import (Grammar, GrammarTokenizer, any_json, json_schema, json_value, regex,
                                    tagged_json)

__all__ = ["COPIED", "CopiedValues", "FORCED", "Grammar", "GrammarConstraint", "GrammarTokenizer", "any_json",
           "json_schema", "json_value", "regex", "tagged_json"]
